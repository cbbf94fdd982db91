// The class torch.classes.fms_paged.DecoderStack (ops/layer.cpp: its checks, the operators
// decoder_stack, decoder_logits and decode_greedy): a model's blocks as one object, and the order
// of a block's weights in it.
#pragma once

#include <torch/custom_class.h>

#include <array>
#include <optional>
#include <vector>

#include "ops.h"

namespace fms_paged_ops {

// weights per layer of a stack, in this order (an undefined or empty tensor for one a family
// lacks): ln, q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, o, post_attn_ln, ff_ln, gate, up,
// down, post_ff_ln
constexpr int64_t kLayerWeights = 16;
constexpr std::array<const char*, kLayerWeights> kWeightNames = {
    "ln", "q", "k", "v", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "o", "post_attn_ln", "ff_ln", "gate",
    "up", "down", "post_ff_ln"};

// a weight's index among a layer's (kWeightNames)
enum Weight {
  kLn, kQ, kK, kV, kQBias, kKBias, kVBias, kQNorm, kKNorm, kO, kPostAttnLn, kFfLn, kGate, kUp, kDown, kPostFfLn
};

// A model's decoder blocks as the operators run them: each layer's weights, RoPE table and
// attention spec, and the model's norm / residual / activation settings; checked when made
// (ValueError naming what is wrong). It holds the weight tensors themselves, not copies: values
// written into them in place reach the next step. Each step checks that every weight still has the
// dtype, shape and layout it was made with (a `param.data = ...` that changed one: ValueError, make
// a new stack), and reads the pools, RoPE rows and slots it is given. `set_ends` adds the model's
// embedding, final norm and head (decoder_logits and decode_greedy run the whole forward).
struct DecoderStack : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;  // kLayerWeights per layer, undefined where a family has none
  std::vector<std::vector<int64_t>> shapes;  // each weight's shape when made
  std::vector<int64_t> rope_index, windows;
  std::vector<double> scales, softcaps;
  std::vector<std::optional<at::Tensor>> sinks;
  double eps, residual_multiplier;
  bool unit_offset;
  int64_t activation, width = 0, head_dim = 0;  // C, and D: the RoPE tables' width
  at::ScalarType dtype = at::kFloat;
  // the model's ends (undefined until `set_ends`): the embedding [V, C] and its scale (1: none;
  // in_dtype: rounded to the dtype first, as the model multiplies by a tensor of its dtype), the
  // final norm's weight [C], the head [V', C], and what the logits are divided by (1: nothing) and
  // soft-capped at (0: no cap): what decoder_logits adds around the blocks
  at::Tensor embedding, final_norm, head;
  std::array<std::vector<int64_t>, 3> end_shapes;
  double emb_scale = 1.0, logits_scaling = 1.0, final_softcap = 0.0;
  bool emb_scale_in_dtype = false;

  DecoderStack(std::vector<at::Tensor> weights_, int64_t head_dim_, std::vector<int64_t> rope_index_,
               std::vector<double> scales_, std::vector<int64_t> windows_, std::vector<double> softcaps_,
               const c10::List<std::optional<at::Tensor>>& sinks_, double eps_, bool unit_offset_,
               double residual_multiplier_, int64_t activation_);
  // the page-table slice of each layer where the model's pages are held per layer group
  // (fms_paged/kv/groups.py; empty: one slice): layer i's sequence s is row slices[i] * S + s of a
  // page table of num_slices * S rows, and its new tokens' slots are row slices[i] of [num_slices, M]
  std::vector<int64_t> slices;
  int64_t num_slices = 1;

  void set_ends(at::Tensor embedding_, double emb_scale_, bool in_dtype, at::Tensor final_norm_, at::Tensor head_,
                double logits_scaling_, double final_softcap_);
  void set_slices(std::vector<int64_t> slices_);
  int64_t layers() const { return (int64_t)rope_index.size(); }
  const at::Tensor* weight(int64_t i, int64_t j) const {  // null: none
    const at::Tensor& w = weights[kLayerWeights * i + j];
    return w.defined() ? &w : nullptr;
  }
};

}  // namespace fms_paged_ops
