// The operator fms_paged::decoder_stack (schema below): a model's decoder blocks, one after the
// other, for the M token rows of a step of the cpp kernel (decode rows and prefill chunks),
// computed as the Python modules compute them (fms_paged/models/llama.py LLaMABlock,
// modules/attention.py, norm.py, feedforward.py, positions.py): every intermediate
// rounded to the model's dtype where theirs is, fp32 inside. The projections run as `linear` runs
// them (the GEMV kernel for a few rows, the GEMM kernel or oneDNN's packed GEMM for more), the attention by the loaded
// kernel, the rest (norms, RoPE, ASSIGN, activations, residuals) by the rows kernel
// (kernels/rows.cpp), each on all M rows at once.
//
// The blocks' weights and attention specs are a DecoderStack (torch.classes.fms_paged.DecoderStack),
// checked once when it is made: a step passes the stack and its own tensors alone (rows, RoPE rows,
// pools, slots, page table, chunks). A decode step of a small model is a few milliseconds, and
// handing over and checking some four hundred weight tensors at every step (their Python objects
// and TensorImpls cold in the cache after the step before streamed the weights) cost a tenth of it.
//
// Beside it, fms_paged::decoder_logits runs the model's whole forward in one call where the stack
// has its ends (the embedding, final norm and head: `set_ends`): the host work around the blocks
// (the lookups, the norm and head calls, their Python) left to the model's forward had cost a
// one-request decode step ~0.25 ms; and fms_paged::decode_greedy runs several greedy decode steps
// of that forward in one call (the engine's lookahead steps).
#include <ATen/ops/add.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/div.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <c10/util/ParallelGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <tuple>
#include <vector>
#include <initializer_list>

#include "stack.h"

namespace fms_paged_ops {
namespace {
// one block's arguments for a step: its weights (null: the family has none), their data and rows,
// its RoPE table's rows, pools and spec. The data pointers and sizes are read from the tensors for
// every layer when the step starts, in one pass: read as each layer runs, every TensorImpl and
// StorageImpl was a cache miss (the layers before streamed their weights through the caches), and
// one at a time they cost a decode step ~0.1 ms
struct Layer {
  std::array<const at::Tensor*, kLayerWeights> w;  // (oneDNN's GEMM takes the tensors: prefill rows)
  std::array<const void*, kLayerWeights> p;
  std::array<int64_t, kLayerWeights> n;  // rows (a vector's length)
  std::array<int32_t, kLayerWeights> type;  // a projection held as GGUF blocks: its ggml type (block_type), else 0
  const float *cos, *sin;
  PoolPtrs pools;
  double scale, softcap;
  int64_t window;
  const std::optional<at::Tensor>* sinks;
};

// the projections: y [M, sum N] = x [M, K] (row stride x_st) @ a block's weights `which`^T, by the
// GEMV kernel for at most gemv_rows rows, else by the GEMM kernel where `linear` takes it
// (`gemm`: configured and loaded), else as `linear` computes it (oneDNN's packed GEMM, or
// at::linear); weights held as GGUF blocks (all of `which` or none: checked when the stack is
// made) by the qgemv kernel (qfn) for any number of rows
struct Mm {
  KernelFn fn, gemm;
  int e;
  int64_t gemv_rows;
  at::TensorOptions opts;
  KernelFn qfn = nullptr;
  // -> where the product [M, sum N] is: y, or (oneDNN's) the rows of `out`, which holds them
  template <class T>
  T* operator()(const void* x, int64_t M, int64_t K, int64_t x_st, std::initializer_list<Weight> which,
                const Layer& L, T* y, at::Tensor& out) const {
    if (L.type[*which.begin()]) {
      std::array<const void*, 3> ptrs;
      std::array<int64_t, 3> rows;
      std::array<int32_t, 3> types;
      int64_t i = 0;
      for (Weight j : which) ptrs[i] = L.p[j], rows[i] = L.n[j], types[i++] = L.type[j];
      run_qgemv(qfn, e, x, M, K, x_st, ptrs.data(), rows.data(), types.data(), i, y);
      return y;
    }
    if (M <= gemv_rows || gemm) {
      std::array<const void*, 3> ptrs;
      std::array<int64_t, 3> rows;
      int64_t i = 0;
      for (Weight j : which) ptrs[i] = L.p[j], rows[i++] = L.n[j];
      run_gemv(M <= gemv_rows ? fn : gemm, e, x, M, K, x_st, ptrs.data(), rows.data(), i, y);
      return y;
    }
    std::vector<at::Tensor> weights;
    for (Weight j : which) weights.push_back(*L.w[j]);
    out = linear(at::from_blob(const_cast<void*>(x), {M, K}, {x_st, 1}, opts), weights, std::nullopt);
    return static_cast<T*>(out.data_ptr());  // contiguous
  }
};

// the block on the residual stream xs [M, Cd] in place; h, y: scratch rows as wide as its widest
// projection; att: the attention's output [M, H D]
template <class T>
void run_layer(void* xs, int64_t M, int64_t Cd, int64_t D, const Layer& L, const at::Tensor& slots,
               const at::Tensor& page_table, const at::Tensor& chunks, int64_t page_size, double residual_multiplier,
               int64_t activation, KernelFn attn, const Mm& mm, const Rows<T>& rows, T* h, T* y, void* att) {
  const int64_t H = L.n[kQ] / D, Hkv = L.n[kK] / D, F = L.n[kGate];
  const int64_t width = (H + 2 * Hkv) * D;
  auto p = [&](Weight j) { return static_cast<const T*>(L.p[j]); };
  // attention: norm, q/k/v, then biases, q/k norms, RoPE and ASSIGN, attention, output projection
  // (a product lands in y, or in the tensor `out` oneDNN made, held until the next product)
  at::Tensor out;
  rows.norm(xs, M, Cd, Cd, L.p[kLn], h);
  T* qkv = mm(h, M, Cd, Cd, {kQ, kK, kV}, L, y, out);
  RowsArgs<T> a = rows.base();
  a.op = 2, a.M = M, a.x = qkv, a.x_st = width, a.q_bias = p(kQBias), a.k_bias = p(kKBias), a.v_bias = p(kVBias),
  a.q_norm = p(kQNorm), a.k_norm = p(kKNorm);
  a.cos = L.cos, a.sin = L.sin, a.slots = slots.data_ptr<int64_t>();
  if (L.pools.ks) {  // 8-bit KV pages: int8 pools, quantized as written, with their row scales
    a.k_pool8 = static_cast<int8_t*>(L.pools.k), a.v_pool8 = static_cast<int8_t*>(L.pools.v);
    a.k_scale = const_cast<float*>(L.pools.ks), a.v_scale = const_cast<float*>(L.pools.vs);
  } else {
    a.k_pool = static_cast<T*>(L.pools.k), a.v_pool = static_cast<T*>(L.pools.v);
  }
  a.pool_tokens = L.pools.pool_tokens, a.H = (int32_t)H, a.Hkv = (int32_t)Hkv, a.D = (int32_t)D;
  rows.call(a);
  if (L.pools.ks)
    run_attention<T, int8_t>(attn, qkv, width, D, M, L.pools, page_table, chunks, H, page_size, L.scale, L.window,
                             L.softcap, *L.sinks, att);
  else
    run_attention<T>(attn, qkv, width, D, M, L.pools, page_table, chunks, H, page_size, L.scale, L.window,
                     L.softcap, *L.sinks, att);
  const T* attn_out = mm(att, M, H * D, H * D, {kO}, L, h, out);
  if (L.p[kPostAttnLn]) {
    rows.norm(attn_out, M, Cd, Cd, L.p[kPostAttnLn], y);
    attn_out = y;
  }
  rows.residual(xs, attn_out, M, Cd, residual_multiplier);
  // MLP: norm, gate/up, activation times up, down projection
  rows.norm(xs, M, Cd, Cd, L.p[kFfLn], h);
  const T* gate_up = mm(h, M, Cd, Cd, {kGate, kUp}, L, y, out);
  rows.act(gate_up, M, F, activation, h);
  const T* mlp_out = mm(h, M, F, F, {kDown}, L, y, out);
  if (L.p[kPostFfLn]) {
    rows.norm(mlp_out, M, Cd, Cd, L.p[kPostFfLn], h);
    mlp_out = h;
  }
  rows.residual(xs, mlp_out, M, Cd, residual_multiplier);
}

}  // namespace

namespace {

std::string names(const std::vector<at::Tensor>& weights, int64_t i) {  // "ln (576,), q (576, 576), ..."
  std::string out;
  for (int64_t j = 0; j < kLayerWeights; ++j) {
    const at::Tensor& w = weights[kLayerWeights * i + j];
    out += std::string(j ? ", " : "") + kWeightNames[j] + " " + (w.defined() ? shape(w) : "none");
  }
  return out;
}

// ValueError naming what is wrong with layer i's weights (made into a stack of this dtype, width C
// and head dim D)
void check_weights(const DecoderStack& s, int64_t i) {
  auto w = [&](int64_t j) { return s.weight(i, j); };
  // the projections may be GGUF blocks (block_type), q/k/v alike and gate/up alike
  auto blocks = [&](int64_t j) { return w(j) && block_type(*w(j)) != 0; };
  const bool projection[kLayerWeights] = {false, true, true, true, false, false, false, false, false,
                                          true, false, false, true, true, true, false};
  TORCH_CHECK_VALUE(blocks(1) == blocks(2) && blocks(1) == blocks(3) && blocks(12) == blocks(13),
                    "DecoderStack: layer ", i, ": q, k and v must be held alike (all GGUF blocks or none), and gate ",
                    "and up alike, got ", names(s.weights, i));
  for (int64_t j = 0; j < kLayerWeights; ++j) {
    const at::Tensor* t = w(j);
    TORCH_CHECK_VALUE(!t || (projection[j] && blocks(j)) || (t->scalar_type() == s.dtype && t->is_cpu() && t->is_contiguous()),
                      "DecoderStack: layer ", i, ": every weight must be a contiguous CPU tensor of the stack's dtype ",
                      dtype_name(s.dtype), " (its ln's), got ", kWeightNames[j], " ", dtype_name(t->scalar_type()), " ",
                      shape(*t), t->is_contiguous() ? "" : " (not contiguous)", " on ", t->device());
  }
  const int64_t Cd = s.width, D = s.head_dim;
  const bool required = w(0) && w(1) && w(2) && w(3) && w(9) && w(11) && w(12) && w(13) && w(14);
  const bool biases = (w(4) != nullptr) == (w(5) != nullptr) && (w(4) != nullptr) == (w(6) != nullptr);
  const int64_t H = required && D ? w(1)->size(0) / D : 0, Hkv = required && D ? w(2)->size(0) / D : 0;
  const int64_t F = required ? w(12)->size(0) : 0;
  auto mat = [&](int64_t j, int64_t rows, int64_t cols) {
    if (blocks(j)) return w(j)->size(0) == rows && block_cols(*w(j)) == cols;
    return w(j)->dim() == 2 && w(j)->size(0) == rows && w(j)->size(1) == cols;
  };
  auto vec = [&](int64_t j, int64_t n) { return !w(j) || (w(j)->dim() == 1 && w(j)->numel() == n); };
  const bool shapes = required && biases && D > 0 && D % 2 == 0 && Hkv > 0 && mat(1, H * D, Cd) &&
                      mat(2, Hkv * D, Cd) && mat(3, Hkv * D, Cd) && mat(9, Cd, H * D) && mat(12, F, Cd) &&
                      mat(13, F, Cd) && mat(14, Cd, F) && vec(0, Cd) && vec(11, Cd) && vec(4, H * D) &&
                      vec(5, Hkv * D) && vec(6, Hkv * D) && vec(7, D) && vec(8, D) && vec(10, Cd) && vec(15, Cd);
  TORCH_CHECK_VALUE(shapes, "DecoderStack: layer ", i, ": the weights do not make one decoder block of width ", Cd,
                    " with heads of ", D, " (ln, q, k, v, o, ff_ln, gate, up and down required; q/k/v biases all or "
                    "none), got ", names(s.weights, i));
  check_variants(H, s.windows[i], s.softcaps[i], s.sinks[i]);
}

}  // namespace

DecoderStack::DecoderStack(std::vector<at::Tensor> weights_, int64_t head_dim_, std::vector<int64_t> rope_index_,
                           std::vector<double> scales_, std::vector<int64_t> windows_, std::vector<double> softcaps_,
                           const c10::List<std::optional<at::Tensor>>& sinks_, double eps_, bool unit_offset_,
                           double residual_multiplier_, int64_t activation_)
    : weights(std::move(weights_)), rope_index(std::move(rope_index_)), windows(std::move(windows_)),
      scales(std::move(scales_)), softcaps(std::move(softcaps_)), eps(eps_), residual_multiplier(residual_multiplier_),
      unit_offset(unit_offset_), activation(activation_), head_dim(head_dim_) {
  const int64_t n = (int64_t)rope_index.size();
  TORCH_CHECK_VALUE(n > 0 && (int64_t)weights.size() == kLayerWeights * n && (int64_t)scales.size() == n &&
                        (int64_t)windows.size() == n && (int64_t)softcaps.size() == n && (int64_t)sinks_.size() == n,
                    "DecoderStack: ", n, " layers (rope indices) need ", kLayerWeights * n, " weights (",
                    kLayerWeights, " per layer) and as many scales, windows, soft-caps and sinks; got ", weights.size(),
                    " weights, ", scales.size(), " scales, ", windows.size(), " windows, ", softcaps.size(),
                    " soft-caps, ", sinks_.size(), " sinks");
  TORCH_CHECK_VALUE(activation == 0 || activation == 1, "DecoderStack: activation=", activation,
                    "; expected 0 (silu) or 1 (gelu_tanh)");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(rope_index[i] >= 0, "DecoderStack: layer ", i, ": rope_index=", rope_index[i],
                      "; expected a table's index (>= 0)");
  for (at::Tensor& w : weights)
    if (w.defined() && w.numel() == 0) w = at::Tensor();  // an empty tensor: none
  const at::Tensor* ln = weight(0, 0);
  TORCH_CHECK_VALUE(ln && ln->dim() == 1 && elem_index(ln->scalar_type()) >= 0, "DecoderStack: layer 0's ln must be ",
                    "a vector [C] of ", elem_names, ", got ", names(weights, 0));
  dtype = ln->scalar_type(), width = ln->size(0);
  for (int64_t i = 0; i < n; ++i) sinks.push_back(sinks_.get(i));
  for (int64_t i = 0; i < n; ++i) check_weights(*this, i);
  for (const at::Tensor& w : weights) shapes.push_back(w.defined() ? w.sizes().vec() : std::vector<int64_t>{});
}

void DecoderStack::set_ends(at::Tensor embedding_, double emb_scale_, bool in_dtype, at::Tensor final_norm_,
                            at::Tensor head_, double logits_scaling_, double final_softcap_) {
  TORCH_CHECK_VALUE(logits_scaling_ != 0.0 && final_softcap_ >= 0.0, "DecoderStack.set_ends: logits_scaling=",
                    py_float(logits_scaling_), ", final_softcap=", py_float(final_softcap_),
                    "; expected a non-zero divisor and a cap >= 0 (0: none)");
  auto ok = [&](const at::Tensor& t, int64_t dim) {  // (the embedding and head may be GGUF blocks)
    if (dim == 2 && block_type(t)) return block_cols(t) == width;
    return t.scalar_type() == dtype && t.is_cpu() && t.is_contiguous() && t.dim() == dim && t.size(-1) == width;
  };
  TORCH_CHECK_VALUE(ok(embedding_, 2) && ok(final_norm_, 1) && ok(head_, 2), "DecoderStack.set_ends: the embedding [V, ",
                    width, "], final norm [", width, "] and head [V', ", width, "] must be contiguous CPU tensors of the ",
                    "stack's dtype ", dtype_name(dtype), ", got ", dtype_name(embedding_.scalar_type()), " ",
                    shape(embedding_), ", ", dtype_name(final_norm_.scalar_type()), " ", shape(final_norm_), " and ",
                    dtype_name(head_.scalar_type()), " ", shape(head_));
  embedding = std::move(embedding_), final_norm = std::move(final_norm_), head = std::move(head_);
  emb_scale = emb_scale_, emb_scale_in_dtype = in_dtype, logits_scaling = logits_scaling_;
  final_softcap = final_softcap_;
  end_shapes = {embedding.sizes().vec(), final_norm.sizes().vec(), head.sizes().vec()};
}

void DecoderStack::set_slices(std::vector<int64_t> slices_) {
  const int64_t n = layers();
  int64_t most = 0;
  for (int64_t g : slices_) most = std::max(most, g);
  bool ok = (int64_t)slices_.size() == n;
  for (int64_t g : slices_) ok = ok && g >= 0;
  std::vector<bool> used(most + 1, false);
  for (int64_t g : slices_) if (g >= 0) used[g] = true;
  ok = ok && std::all_of(used.begin(), used.end(), [](bool u) { return u; });
  TORCH_CHECK_VALUE(ok, "DecoderStack.set_slices: ", n, " layers need a slice each, 0..G-1 all used, got ",
                    slices_.size(), " entries");
  slices = std::move(slices_), num_slices = most + 1;
}

namespace {

// ValueError unless the stack's weights still have the dtype, shape and layout they were made with
// (each step: a `param.data = ...` may have swapped a tensor's storage since)
void check_unchanged(const DecoderStack& s) {
  for (size_t j = 0; j < s.weights.size(); ++j) {
    const at::Tensor& w = s.weights[j];
    if (!w.defined() || ((w.scalar_type() == s.dtype || block_type(w)) && w.sizes() == at::IntArrayRef(s.shapes[j]) &&
                         w.is_contiguous()))
      continue;
    const int64_t i = (int64_t)j / kLayerWeights;
    TORCH_CHECK_VALUE(false, "decoder_stack: layer ", i, "'s ", kWeightNames[j % kLayerWeights], " is now ",
                      dtype_name(w.scalar_type()), " ", shape(w), w.is_contiguous() ? "" : " (not contiguous)",
                      "; the stack was made with ", dtype_name(s.dtype), " ", shape(s.shapes[j]),
                      ": make a new DecoderStack");
  }
  const std::array<const at::Tensor*, 3> ends = {&s.embedding, &s.final_norm, &s.head};
  for (size_t j = 0; j < ends.size(); ++j) {
    const at::Tensor& w = *ends[j];
    TORCH_CHECK_VALUE(!w.defined() || ((w.scalar_type() == s.dtype || block_type(w)) &&
                                       w.sizes() == at::IntArrayRef(s.end_shapes[j]) && w.is_contiguous()),
                      "decoder_stack: the ", std::array<const char*, 3>{"embedding", "final norm", "head"}[j],
                      " is now ", dtype_name(w.scalar_type()), " ", shape(w), "; the stack's ends were set with ",
                      dtype_name(s.dtype), " ", shape(s.end_shapes[j]), ": make a new DecoderStack");
  }
}

// ValueError naming what is wrong with a step's arguments for the stack (nothing written yet)
void check_step(const DecoderStack& s, const at::Tensor& x, at::TensorList cos, at::TensorList sin,
                at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& slots, const at::Tensor& page_table,
                const at::Tensor& chunks, const std::optional<at::TensorList>& k_scales, const std::optional<at::TensorList>& v_scales) {
  const at::ScalarType dt = x.scalar_type();
  const int64_t n = s.layers();
  TORCH_CHECK_VALUE(dt == s.dtype && x.dim() == 2 && x.size(1) == s.width && x.is_cpu() && x.is_contiguous(),
                    "decoder_stack: x must be contiguous CPU rows [M, ", s.width, "] of the stack's dtype ",
                    dtype_name(s.dtype), ", got ", dtype_name(dt), " ", shape(x));
  TORCH_CHECK_VALUE((int64_t)k_pools.size() == n && (int64_t)v_pools.size() == n, "decoder_stack: ", n,
                    " layers need as many k_pools and v_pools, got ", k_pools.size(), " and ", v_pools.size());
  const int64_t M = x.size(0), D = s.head_dim;
  TORCH_CHECK_VALUE(!cos.empty() && cos.size() == sin.size(), "decoder_stack: one sin per cos table, got ", cos.size(),
                    " and ", sin.size());
  for (size_t r = 0; r < cos.size(); ++r)
    TORCH_CHECK_VALUE(cos[r].scalar_type() == at::kFloat && sin[r].scalar_type() == at::kFloat &&
                          cos[r].dim() == 2 && cos[r].size(0) == M && cos[r].size(1) == D &&
                          cos[r].sizes() == sin[r].sizes() && cos[r].is_contiguous() && sin[r].is_contiguous(),
                      "decoder_stack: RoPE table ", r, ": cos and sin must be contiguous fp32 [", M, ", ", D,
                      "], got ", dtype_name(cos[r].scalar_type()), " ", shape(cos[r]), " and ",
                      dtype_name(sin[r].scalar_type()), " ", shape(sin[r]));
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(s.rope_index[i] < (int64_t)cos.size(), "decoder_stack: layer ", i, " reads RoPE table ",
                      s.rope_index[i], " of ", cos.size());
  const int64_t G = s.num_slices;
  TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                        (G == 1 ? slots.dim() == 1 && slots.size(0) == M
                                : slots.dim() == 2 && slots.size(0) == G && slots.size(1) == M),
                    "decoder_stack: slots must be contiguous int64 ", G == 1 ? "[" : "[" + std::to_string(G) + ", ", M,
                    "] (the stack's layers hold pages in ", G, " slices), got ", shape(slots));
  TORCH_CHECK_VALUE(page_table.scalar_type() == at::kInt && page_table.is_contiguous() && page_table.dim() == 2 &&
                        page_table.size(0) % G == 0 && chunks.scalar_type() == at::kLong && chunks.dim() == 2 &&
                        chunks.size(1) == 4 && chunks.is_contiguous(),
                    "decoder_stack: an int32 page table [", G, " x seqs, pages] and int64 chunks [n, 4], contiguous, "
                    "got page table ", dtype_name(page_table.scalar_type()), " ", shape(page_table), ", chunks ",
                    shape(chunks));
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < G * M; ++m)  // every layer writes these slots: one pass for the sign, the top per layer
    TORCH_CHECK_VALUE(slot[m] >= 0, "decoder_stack: slot ", slot[m], " of row ", m % M, " is negative");
  const int64_t top = M ? *std::max_element(slot, slot + G * M) : -1;
  // 8-bit KV pages: int8 pools, with each layer's row scales [1, Hkv, NP, 1] fp32
  const bool i8 = k_scales.has_value();
  TORCH_CHECK_VALUE(i8 == v_scales.has_value() && (!i8 || ((int64_t)k_scales->size() == n &&
                                                           (int64_t)v_scales->size() == n)),
                    "decoder_stack: k_scales and v_scales, one per layer, both or neither (", n, " layers)");
  const at::ScalarType kv = i8 ? at::kChar : dt;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor &k_pool = k_pools[i], &v_pool = v_pools[i];
    const int64_t Hkv = s.weight(i, 2)->size(0) / D;
    if (i8)
      for (const at::Tensor* t : {&(*k_scales)[i], &(*v_scales)[i]})
        TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->dim() == 4 && t->size(0) == 1 &&
                              t->size(1) == Hkv && t->size(2) == k_pool.size(2) && t->size(3) == 1 &&
                              t->is_contiguous(),
                          "decoder_stack: layer ", i, ": int8 pools take contiguous fp32 scales [1, ", Hkv, ", ",
                          k_pool.size(2), ", 1], got ", dtype_name(t->scalar_type()), " ", shape(*t));
    TORCH_CHECK_VALUE(k_pool.scalar_type() == kv && v_pool.scalar_type() == kv && k_pool.dim() == 4 &&
                          k_pool.size(1) == Hkv && k_pool.size(3) == D && k_pool.sizes() == v_pool.sizes() &&
                          k_pool.is_contiguous() && v_pool.is_contiguous(),
                      "decoder_stack: layer ", i, ": pools [1, ", Hkv, ", NP, ", D, "] of x's dtype (int8 with scales), "
                      "contiguous, got ",
                      shape(k_pool), " ", dtype_name(k_pool.scalar_type()), " and ", shape(v_pool));
    const int64_t NP = k_pool.size(2);
    if (top < NP) continue;
    const int64_t m = std::find_if(slot, slot + G * M, [&](int64_t v) { return v >= NP; }) - slot;
    TORCH_CHECK_VALUE(false, "decoder_stack: slot ", slot[m], " of row ", m % M, " is outside layer ", i,
                      "'s pools' ", NP, " slots");
  }
}

}  // namespace

namespace {

// the blocks on the residual rows x [M, C], updated in place (checked: check_step)
void run_stack(const DecoderStack& s, const at::Tensor& x, at::TensorList cos, at::TensorList sin,
               at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& slots, const at::Tensor& page_table,
               const at::Tensor& chunks, int64_t page_size, const std::optional<at::TensorList>& k_scales, const std::optional<at::TensorList>& v_scales) {
  const int e = elem_index(s.dtype);
  const bool i8 = k_scales.has_value();  // 8-bit KV pages (checked: check_step)
  const KernelFn attn = i8 ? attention_i8_fn(e, s.head_dim) : attention_fn(e, s.head_dim), mm = gemv_fn(e),
                 rows_kernel = rows_fn(e), qmm = qgemv_fn(e);
  TORCH_CHECK(attn && mm && rows_kernel, "decoder_stack: no ", !attn ? "attention" : !mm ? "GEMV" : "rows",
              " kernel loaded for ", dtype_name(s.dtype), attn ? "" : " and head_dim=" + std::to_string(s.head_dim),
              " (fms_paged.native.load_attention and fms_paged.native.load_gemv load them)");
  const int64_t n = s.layers(), M = x.size(0), Cd = s.width;
  std::vector<Layer> layers(n);
  for (int64_t i = 0; i < n; ++i) {  // every layer's pointers and sizes in one pass (see Layer)
    Layer& L = layers[i];
    for (int64_t j = 0; j < kLayerWeights; ++j) {
      const at::Tensor* t = s.weight(i, j);
      L.w[j] = t, L.p[j] = t ? t->data_ptr() : nullptr, L.n[j] = t ? t->size(0) : 0;
      L.type[j] = t ? block_type(*t) : 0;
      TORCH_CHECK(!L.type[j] || qmm, "decoder_stack: layer ", i, " holds GGUF blocks and no qgemv kernel is loaded ",
                  "for ", dtype_name(s.dtype), " (fms_paged.native.load_qgemv loads it)");
    }
    const int64_t r = s.rope_index[i];
    L.cos = cos[r].data_ptr<float>(), L.sin = sin[r].data_ptr<float>(), L.pools = pool_ptrs(k_pools[i], v_pools[i]);
    if (i8) L.pools.ks = (*k_scales)[i].data_ptr<float>(), L.pools.vs = (*v_scales)[i].data_ptr<float>();
    L.scale = s.scales[i], L.softcap = s.softcaps[i], L.window = s.windows[i], L.sinks = &s.sinks[i];
  }
  // pages held per layer group: each slice's slots (a row of [G, M]) and chunks (its sequences
  // are the page table's rows g * S + seq)
  const int64_t G = s.num_slices;
  std::vector<at::Tensor> slice_slots(G), slice_chunks(G);
  for (int64_t g = 0; g < G; ++g) {
    slice_slots[g] = G == 1 ? slots : slots.select(0, g);
    slice_chunks[g] = g == 0 ? chunks : chunks.clone();
    if (g == 0) continue;
    int64_t* c = slice_chunks[g].data_ptr<int64_t>();
    const int64_t rows_per_slice = page_table.size(0) / G;
    for (int64_t r = 0; r < chunks.size(0); ++r)
      if (c[4 * r] >= 0) c[4 * r] += g * rows_per_slice;
  }
  int64_t wide = Cd;
  for (const Layer& L : layers) wide = std::max({wide, 2 * L.n[kGate], L.n[kQ] + 2 * L.n[kK]});
  // the blocks' scratch rows, kept by the calling thread from one call to the next: a prefill
  // step's are megabytes, which a fresh allocation would take from the OS (and zero) every step
  static thread_local at::Tensor scratch;
  const int64_t need = 3 * M * wide * x.element_size();
  if (!scratch.defined() || scratch.numel() < need) scratch = at::empty({need}, x.options().dtype(at::kByte));
  uint8_t* base = scratch.data_ptr<uint8_t>();
  void *h = base, *y = base + M * wide * x.element_size(), *att = base + 2 * M * wide * x.element_size();
  by_elem(e, [&](auto t) {
    using T = decltype(t);
    const Mm project{mm, linear_gemm_fn(e), e, linear_gemv_rows(e), x.options(), qmm};
    const Rows<T> rows{rows_kernel, s.eps, s.unit_offset};
    for (int64_t i = 0; i < n; ++i) {
      const int64_t g = G == 1 ? 0 : s.slices[i];
      run_layer<T>(x.data_ptr(), M, Cd, s.head_dim, layers[i], slice_slots[g], page_table, slice_chunks[g],
                   page_size, s.residual_multiplier, s.activation, attn, project, rows, static_cast<T*>(h),
                   static_cast<T*>(y), att);
    }
  });
}

}  // namespace

at::Tensor decoder_stack(const c10::intrusive_ptr<DecoderStack>& stack, const at::Tensor& x, at::TensorList cos,
                         at::TensorList sin, at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& slots,
                         const at::Tensor& page_table, const at::Tensor& chunks, int64_t page_size, const std::optional<at::TensorList>& k_scales,
                         const std::optional<at::TensorList>& v_scales) {
  const DecoderStack& s = *stack;
  check_unchanged(s);
  check_step(s, x, cos, sin, k_pools, v_pools, slots, page_table, chunks, k_scales, v_scales);
  at::Tensor out = x.clone();  // the residual stream, updated in place layer by layer
  run_stack(s, out, cos, sin, k_pools, v_pools, slots, page_table, chunks, page_size, k_scales, v_scales);
  return out;
}

// The model's whole forward on a step in one call (LLaMA.forward, where the stack has its ends):
// the embedding of tokens [B, S] (times its scale), each RoPE table's rows at positions [B, S]
// (clamped at 0), the blocks, then at the rows `logits_at` picks of the [B S] (all where None)
// the final norm and the head -> logits [B, S, V] or [K, V]. The lookups and the scale are ATen's
// operations, as the model's Python runs them; the norm and the head are the operators RMSNorm and
// Linear call on the CPU (rms_norm, linear): the logits are the other path's bit for bit. Those
// calls and their Python, each cold in the caches after the weights streamed through, are what a
// step no longer spends.
namespace {

// ValueError unless the stack has its ends, tokens and positions are int64 [B, S] alike and the
// RoPE tables pair up (op: the operator's name)
void check_forward(const char* op, const DecoderStack& s, const at::Tensor& tokens, const at::Tensor& positions,
                   at::TensorList cos_tables, at::TensorList sin_tables) {
  TORCH_CHECK_VALUE(s.head.defined(), op, ": the stack has no ends (DecoderStack.set_ends)");
  TORCH_CHECK_VALUE(tokens.scalar_type() == at::kLong && tokens.dim() == 2 && positions.scalar_type() == at::kLong &&
                        positions.sizes() == tokens.sizes(),
                    op, ": tokens and positions must be int64 [B, S] alike, got ", dtype_name(tokens.scalar_type()), " ",
                    shape(tokens), " and ", dtype_name(positions.scalar_type()), " ", shape(positions));
  TORCH_CHECK_VALUE(cos_tables.size() == sin_tables.size(), op, ": one sin table per cos table, got ",
                    cos_tables.size(), " and ", sin_tables.size());
  check_unchanged(s);
}

// decoder_logits once checked (check_forward)
at::Tensor forward_logits(const DecoderStack& s, const at::Tensor& tokens, const at::Tensor& positions,
                          at::TensorList cos_tables, at::TensorList sin_tables, at::TensorList k_pools,
                          at::TensorList v_pools, const at::Tensor& slots, const at::Tensor& page_table,
                          const at::Tensor& chunks, int64_t page_size, const std::optional<at::Tensor>& logits_at,
                          const std::optional<at::TensorList>& k_scales, const std::optional<at::TensorList>& v_scales) {
  const int64_t B = tokens.size(0), S = tokens.size(1), M = B * S;
  at::Tensor x = (block_type(s.embedding) ? block_embedding(s.embedding, tokens, s.dtype)
                                          : at::embedding(s.embedding, tokens)).view({M, s.width});  // fresh: the residual stream
  if (s.emb_scale != 1.0)
    x = s.emb_scale_in_dtype ? at::mul(x, at::scalar_tensor(s.emb_scale, x.options()))
                             : at::mul(x, at::Scalar(s.emb_scale));
  const at::Tensor pos = positions.clamp_min(0).view({M});
  const int64_t* p = pos.data_ptr<int64_t>();  // (contiguous: clamp_min's own)
  const int64_t top = M ? *std::max_element(p, p + M) : -1;
  std::vector<at::Tensor> cos, sin;
  for (size_t r = 0; r < cos_tables.size(); ++r) {
    // the tables grow on demand (fms_paged/modules/positions.py): a position past one's rows is
    // the caller's error, refused before a row is read
    TORCH_CHECK_INDEX(top < cos_tables[r].size(0) && top < sin_tables[r].size(0), "decoder_logits: position ", top,
                      " is past RoPE table ", r, "'s ", cos_tables[r].size(0),
                      " rows (grow it first: LLaMA.rope_tables(upto))");
    cos.push_back(at::index_select(cos_tables[r], 0, pos)), sin.push_back(at::index_select(sin_tables[r], 0, pos));
  }
  check_step(s, x, cos, sin, k_pools, v_pools, slots, page_table, chunks, k_scales, v_scales);
  run_stack(s, x, cos, sin, k_pools, v_pools, slots, page_table, chunks, page_size, k_scales, v_scales);
  const at::Tensor rows = logits_at ? x.index_select(0, *logits_at) : x.view({B, S, s.width});
  const at::Tensor normed = rms_norm(rows, s.final_norm, s.eps, s.unit_offset);
  at::Tensor logits = block_type(s.head) ? qlinear(normed, {s.head}, std::nullopt) : linear(normed, {s.head}, std::nullopt);
  if (s.logits_scaling != 1.0) logits = at::div(logits, at::Scalar(s.logits_scaling));  // as LLaMA.logits
  if (s.final_softcap != 0.0)
    logits = at::mul(at::tanh(at::div(logits, at::Scalar(s.final_softcap))), at::Scalar(s.final_softcap));
  return logits;
}

}  // namespace

at::Tensor decoder_logits(const c10::intrusive_ptr<DecoderStack>& stack, const at::Tensor& tokens,
                          const at::Tensor& positions, at::TensorList cos_tables, at::TensorList sin_tables,
                          at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& slots,
                          const at::Tensor& page_table, const at::Tensor& chunks, int64_t page_size,
                          const std::optional<at::Tensor>& logits_at, const std::optional<at::TensorList>& k_scales, const std::optional<at::TensorList>& v_scales) {
  check_forward("decoder_logits", *stack, tokens, positions, cos_tables, sin_tables);
  return forward_logits(*stack, tokens, positions, cos_tables, sin_tables, k_pools, v_pools, slots, page_table,
                        chunks, page_size, logits_at, k_scales, v_scales);
}

// `steps` greedy decode steps of B sequences in one call: row b is sequence seqs[b], whose last
// token tokens[b] sits at position positions[b]. Each step writes every row's key and value at its
// position's slot (its page in the page table: RESERVEd for the steps' positions before), runs the
// forward (decoder_logits) and takes each row's first largest logit (argmax, as the engine's
// greedy sampler does) as the row's next token and input -> the tokens, int64 [B, steps]. The
// engine's lookahead decode steps (`Engine(decode_steps=...)`): no return to Python, and none of
// its host work, between the steps.
//
// decode_lookup: the same tokens with prompt lookup speculation inside the call (the engine's
// speculative decoding, method "ngram", on lookahead steps; fms_paged/engine/speculative.py): at
// each step a row whose cap allows proposes the tokens that followed the last earlier occurrence
// of its last n-gram (n from n_max down to n_min, the longest that matches) in its own tokens
// (`history`, then the tokens of this call), and the forward runs its last token and the
// proposals as one chunk; the row keeps the proposals equal to the target's argmax up to the
// first that is not, then the argmax there: the tokens greedy decoding makes, several per forward
// where the proposals are right. Rejected proposals' keys and values lie at positions the next
// step writes again (a row's chunks start where its kept tokens end); a row proposes no more than
// its steps left minus one, so every write stays within positions[b] .. positions[b] + steps - 1,
// and a row's last step keeps every proposal. A step's rows (every unfinished row and the
// proposals) are at most max_rows: the decode projections' GEMV path (a larger step would take the
// GEMM path, which costs several decode steps on a small model).
namespace {

// ValueError / IndexError unless the steps' arguments fit: the shapes and dtypes, every row's
// pages held for positions p .. p + steps - 1, the RoPE tables long enough
void check_steps(const char* op, const DecoderStack& stack, const at::Tensor& tok, const at::Tensor& pos,
                 const at::Tensor& seqs, at::TensorList cos_tables, at::TensorList sin_tables,
                 const at::Tensor& page_table, int64_t page_size, int64_t steps) {
  TORCH_CHECK_VALUE(steps >= 1 && page_size > 0, op, ": steps=", steps, ", page_size=", page_size,
                    "; expected both >= 1");
  TORCH_CHECK_VALUE(tok.dim() == 2 && seqs.scalar_type() == at::kLong && seqs.dim() == 1 && seqs.size(0) == tok.size(0) &&
                        page_table.scalar_type() == at::kInt && page_table.dim() == 2 && page_table.is_contiguous(),
                    op, ": tokens, positions and seqs int64 [B] alike and an int32 page table [seqs, pages]",
                    ", contiguous, got tokens ", shape(tok), ", positions ", shape(pos), ", seqs ", dtype_name(seqs.scalar_type()), " ",
                    shape(seqs), ", page table ", dtype_name(page_table.scalar_type()), " ", shape(page_table));
  const int64_t G = stack.num_slices;  // (pages per layer group: slice g's rows are g * n_seqs + seq)
  TORCH_CHECK_VALUE(page_table.size(0) % G == 0, op, ": a page table of ", G, " slices' rows, got ",
                    shape(page_table));
  check_forward(op, stack, tok, pos, cos_tables, sin_tables);
  const int64_t B = tok.size(0), P = page_size, n_seqs = page_table.size(0) / G, pages = page_table.size(1);
  const int64_t *seq = seqs.data_ptr<int64_t>(), *first = pos.data_ptr<int64_t>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    // the logical pages of positions p .. p + steps - 1 (geometry.h, as kv/geometry.py counts them)
    const int64_t s = seq[b], p = first[b], end = fms_geometry::pages_for(p + steps, P);
    bool held = s >= 0 && s < n_seqs && p >= 0 && end <= pages;
    for (int64_t sl = 0; sl < G; ++sl)  // page 0: the null page
      for (int64_t g = fms_geometry::page_of(p, P); held && g < end; ++g)
        held = table[(sl * n_seqs + s) * pages + g] > 0;
    TORCH_CHECK_VALUE(held, op, ": row ", b, ": sequence ", s, " holds no pages for positions ", p, "..",
                      p + steps - 1, " in the page table (", n_seqs, " seqs x ", pages, " pages of ", P,
                      "): RESERVE them first");
  }
  int64_t last = -1;  // the steps' last position: every table must hold it (nothing written otherwise)
  for (int64_t b = 0; b < B; ++b) last = std::max(last, first[b] + steps - 1);
  for (size_t r = 0; r < cos_tables.size(); ++r)
    TORCH_CHECK_INDEX(last < cos_tables[r].size(0) && last < sin_tables[r].size(0), op, ": position ", last,
                      " is past RoPE table ", r, "'s ", cos_tables[r].size(0),
                      " rows (grow it first: LLaMA.rope_tables(upto))");
}

// prompt lookup: up to k tokens that followed the last earlier occurrence of the last n tokens of
// h (n from n_max down to n_min, the longest that matches) -> appended to out (none: no match)
void lookup(const std::vector<int64_t>& h, int64_t k, int64_t n_max, int64_t n_min, std::vector<int64_t>& out) {
  const int64_t L = static_cast<int64_t>(h.size());
  for (int64_t n = std::min(n_max, L - 1); n >= n_min && n >= 1; --n) {
    const int64_t* tail = h.data() + L - n;
    for (int64_t i = L - n - 1; i >= 0; --i) {  // windows h[i .. i + n), each followed by a token
      if (h[i] != tail[0] || !std::equal(tail + 1, tail + n, h.data() + i + 1)) continue;
      out.insert(out.end(), h.begin() + i + n, h.begin() + std::min(i + n + k, L));
      return;
    }
  }
}

}  // namespace

at::Tensor decode_greedy(const c10::intrusive_ptr<DecoderStack>& stack, const at::Tensor& tokens,
                         const at::Tensor& positions, const at::Tensor& seqs, at::TensorList cos_tables,
                         at::TensorList sin_tables, at::TensorList k_pools, at::TensorList v_pools,
                         const at::Tensor& page_table, int64_t page_size, int64_t steps, const std::optional<at::TensorList>& k_scales,
                         const std::optional<at::TensorList>& v_scales) {
  TORCH_CHECK_VALUE(tokens.dim() == 1 && positions.sizes() == tokens.sizes(), "decode_greedy: tokens and positions ",
                    "int64 [B] alike, got ", shape(tokens), " and ", shape(positions));
  const int64_t B = tokens.size(0), G = stack->num_slices, P = page_size;
  at::Tensor tok = tokens.contiguous().view({B, 1}), pos = positions.contiguous().view({B, 1});
  const at::Tensor seq_c = seqs.contiguous();
  check_steps("decode_greedy", *stack, tok, pos, seq_c, cos_tables, sin_tables, page_table, page_size, steps);
  const int64_t n_seqs = page_table.size(0) / G, pages = page_table.size(1);
  const int64_t *seq = seq_c.data_ptr<int64_t>(), *first = pos.data_ptr<int64_t>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  at::Tensor out = at::empty({B, steps}, tok.options());
  at::Tensor slots = G == 1 ? at::empty({B}, tok.options()) : at::empty({G, B}, tok.options());
  at::Tensor chunks = at::empty({B, 4}, tok.options());
  int64_t *slot = slots.data_ptr<int64_t>(), *chunk = chunks.data_ptr<int64_t>();
  for (int64_t j = 0; j < steps; ++j) {
    const at::Tensor at_j = at::add(pos, j);
    for (int64_t b = 0; b < B; ++b) {  // a chunk of one token per row (kv/kernels/cpp.py: CppKernel.decode)
      const int64_t p = first[b] + j;
      for (int64_t sl = 0; sl < G; ++sl)
        slot[sl * B + b] = fms_geometry::slot(table[(sl * n_seqs + seq[b]) * pages + fms_geometry::page_of(p, P)], p, P);
      chunk[4 * b] = seq[b], chunk[4 * b + 1] = p, chunk[4 * b + 2] = 1, chunk[4 * b + 3] = b;
    }
    const at::Tensor logits = forward_logits(*stack, tok, at_j, cos_tables, sin_tables, k_pools, v_pools, slots,
                                             page_table, chunks, P, std::nullopt, k_scales, v_scales);
    tok = argmax(logits.view({B, -1})).view({B, 1});
    out.select(1, j).copy_(tok.view({B}));
  }
  return out;
}

// -> (the tokens int64 [B, steps]; per row int64 [B, 4]: its steps that verified proposals, the
// tokens proposed, those kept, and the steps that rejected one; per step float64 [S, 3]: its
// unfinished rows, its rows with the proposals, its seconds), the engine's cost and acceptance
// measures (`Speculator.observe_lookup`). history: the rows' tokens one after another (row b's
// are history[offsets[b] .. offsets[b + 1]), ending with tokens[b]); caps [B]: the most tokens a
// row proposes at a step (0: none)
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_lookup(
    const c10::intrusive_ptr<DecoderStack>& stack, const at::Tensor& tokens, const at::Tensor& positions,
    const at::Tensor& seqs, at::TensorList cos_tables, at::TensorList sin_tables, at::TensorList k_pools,
    at::TensorList v_pools, const at::Tensor& page_table, int64_t page_size, int64_t steps, const at::Tensor& history,
    const at::Tensor& offsets, const at::Tensor& caps, int64_t n_max, int64_t n_min, int64_t max_rows,
    const std::optional<at::TensorList>& k_scales, const std::optional<at::TensorList>& v_scales) {
  TORCH_CHECK_VALUE(tokens.dim() == 1 && positions.sizes() == tokens.sizes(), "decode_lookup: tokens and positions ",
                    "int64 [B] alike, got ", shape(tokens), " and ", shape(positions));
  const int64_t B = tokens.size(0), G = stack->num_slices, P = page_size;
  const at::Tensor tok0 = tokens.contiguous().view({B, 1}), pos0 = positions.contiguous().view({B, 1});
  const at::Tensor seq_c = seqs.contiguous();
  check_steps("decode_lookup", *stack, tok0, pos0, seq_c, cos_tables, sin_tables, page_table, page_size, steps);
  TORCH_CHECK_VALUE(history.scalar_type() == at::kLong && history.dim() == 1 && offsets.scalar_type() == at::kLong &&
                        offsets.dim() == 1 && offsets.size(0) == B + 1 && caps.scalar_type() == at::kLong &&
                        caps.dim() == 1 && caps.size(0) == B,
                    "decode_lookup: history int64 [T], offsets int64 [B + 1] and caps int64 [B] for B = ", B,
                    " rows, got ", shape(history), ", ", shape(offsets), ", ", shape(caps));
  TORCH_CHECK_VALUE(n_min >= 1 && n_max >= n_min && max_rows >= 1, "decode_lookup: n_max=", n_max, ", n_min=", n_min,
                    ", max_rows=", max_rows, "; expected 1 <= n_min <= n_max and max_rows >= 1");
  const at::Tensor hist_c = history.contiguous(), off_c = offsets.contiguous(), cap_c = caps.contiguous();
  const int64_t *hist = hist_c.data_ptr<int64_t>(), *off = off_c.data_ptr<int64_t>(), *cap = cap_c.data_ptr<int64_t>();
  const int64_t *tok_in = tok0.data_ptr<int64_t>(), *first = pos0.data_ptr<int64_t>(), *seq = seq_c.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> own(B);  // each row's tokens: its history, then this call's
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(off[b] >= 0 && off[b] < off[b + 1] && off[b + 1] <= hist_c.size(0) && hist[off[b + 1] - 1] == tok_in[b],
                      "decode_lookup: row ", b, "'s history [", off[b], ", ", off[b + 1], ") of ", hist_c.size(0),
                      " tokens must end with its last token ", tok_in[b]);
    own[b].assign(hist + off[b], hist + off[b + 1]);
    own[b].reserve(own[b].size() + steps);
  }
  const int64_t n_tables = page_table.size(0) / G, pages = page_table.size(1);
  const int32_t* table = page_table.data_ptr<int32_t>();
  at::Tensor out = at::empty({B, steps}, tok0.options()), stats = at::zeros({B, 4}, tok0.options());
  int64_t *o = out.data_ptr<int64_t>(), *st = stats.data_ptr<int64_t>();
  std::vector<int64_t> done(B, 0), props, starts(B), counts(B);
  std::vector<double> timing;
  while (true) {
    std::vector<int64_t> rows;  // the unfinished rows
    for (int64_t b = 0; b < B; ++b)
      if (done[b] < steps) rows.push_back(b);
    if (rows.empty()) break;
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t R = static_cast<int64_t>(rows.size());
    int64_t room = max_rows - R;  // rows left for proposals this step
    props.clear();
    for (int64_t b : rows) {
      starts[b] = static_cast<int64_t>(props.size());
      const int64_t k = std::min({cap[b], steps - 1 - done[b], room});
      if (k > 0) lookup(own[b], k, n_max, n_min, props);
      counts[b] = static_cast<int64_t>(props.size()) - starts[b];
      room -= counts[b];
    }
    const int64_t M = R + static_cast<int64_t>(props.size());
    at::Tensor tok = at::empty({1, M}, tok0.options()), pos = at::empty({1, M}, tok0.options());
    at::Tensor slots = G == 1 ? at::empty({M}, tok0.options()) : at::empty({G, M}, tok0.options());
    at::Tensor chunks = at::empty({R, 4}, tok0.options());
    int64_t *t = tok.data_ptr<int64_t>(), *ps = pos.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>(),
            *chunk = chunks.data_ptr<int64_t>();
    int64_t m = 0;
    for (int64_t i = 0; i < R; ++i) {  // row b's chunk: its last token, then its proposals
      const int64_t b = rows[i], p0 = first[b] + done[b];
      chunk[4 * i] = seq[b], chunk[4 * i + 1] = p0, chunk[4 * i + 2] = 1 + counts[b], chunk[4 * i + 3] = m;
      for (int64_t j = 0; j <= counts[b]; ++j, ++m) {
        const int64_t p = p0 + j;
        t[m] = j ? props[starts[b] + j - 1] : own[b].back(), ps[m] = p;
        for (int64_t sl = 0; sl < G; ++sl)
          slot[sl * M + m] = fms_geometry::slot(table[(sl * n_tables + seq[b]) * pages + fms_geometry::page_of(p, P)], p, P);
      }
    }
    const at::Tensor logits = forward_logits(*stack, tok, pos, cos_tables, sin_tables, k_pools, v_pools, slots,
                                             page_table, chunks, P, std::nullopt, k_scales, v_scales);
    const at::Tensor best_t = argmax(logits.view({M, -1}));
    const int64_t* best = best_t.data_ptr<int64_t>();
    m = 0;
    for (int64_t b : rows) {  // the proposals equal to the argmax, then the argmax after them
      const int64_t k = counts[b], *pr = props.data() + starts[b];
      int64_t a = 0;
      while (a < k && pr[a] == best[m + a]) ++a;
      for (int64_t j = 0; j <= a; ++j) {
        const int64_t next = j < a ? pr[j] : best[m + a];
        o[b * steps + done[b]++] = next;
        own[b].push_back(next);
      }
      if (k) st[4 * b] += 1, st[4 * b + 1] += k, st[4 * b + 2] += a, st[4 * b + 3] += a < k;
      m += k + 1;
    }
    timing.insert(timing.end(), {static_cast<double>(R), static_cast<double>(M),
                                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()});
  }
  at::Tensor times = at::empty({static_cast<int64_t>(timing.size() / 3), 3}, at::TensorOptions().dtype(at::kDouble));
  std::copy(timing.begin(), timing.end(), times.data_ptr<double>());
  return {out, stats, times};
}

// decode_beams: `steps` beam-search steps of beam groups in one call (the engine's lookahead steps
// for beam search, fms_paged/engine/beam.py), with greedy rows beside them. The first rows come in
// groups (keeps.size(0) of them) of `width` consecutive rows, a group's beams best first; scores
// [groups * width] fp32 are the beams' cumulative log-probabilities; the rows after them decode
// greedily, as decode_greedy's rows (their argmax, each at its own position). A step
// runs the forward of every row (as decode_greedy's), then for each group does what
// beam.candidates does on the host, with the same ATen operators (so the same bits): the fp32
// log-softmax of its rows' logits plus each beam's score, the top keeps[g] of the group's
// width * V values (stored: the call's result, which the host replays step by step with
// beam.advance); then it takes the first `width` candidates whose token is not one of the group's
// stops[g] (-1 pads) as the next beams, as beam.advance does while the search goes on (what ends
// by length the host sees from the candidates: the engine plans no step past max_new_tokens).
//
// Pages follow the beams as beam._move moves rows: the first continuation of a parent keeps the
// parent's row; another takes the row of a parent nobody continues (the last such, as `spare.pop`)
// and, in a copy of the page table rows of the call's sequences, that row's logical pages before
// positions[b]'s page become the parent's (shared: the host's page manager counts the references
// when it takes the tables back, `retable`), while its pages from there on (its own: RESERVEd for
// the steps, copy-on-write done) receive the parent's whole pages in every pool (values and 8-bit
// scales) up to the page this step wrote. A row continued by nobody and taken by nobody keeps its
// pages (the host ERASEs it when its search ends). -> (candidate scores fp32 [steps, groups, keep],
// candidates int64 [steps, groups, 2, keep] (their parent beams, then their tokens; keep the
// largest of keeps, a group's entries past its own keep -1), the rows' page table rows int32 [slices, B, pages]
// after the last step (row b's is the table of the sequence seqs[b], the beam it holds now), for
// each row of the call int64 [B], the index in seqs of the sequence that holds its beam now (a
// greedy row: its own), and the greedy rows' tokens int64 [B - groups * width, steps]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_beams(
    const c10::intrusive_ptr<DecoderStack>& stack, const at::Tensor& tokens, const at::Tensor& positions,
    const at::Tensor& seqs, at::TensorList cos_tables, at::TensorList sin_tables, at::TensorList k_pools,
    at::TensorList v_pools, const at::Tensor& page_table, int64_t page_size, int64_t steps, int64_t width,
    const at::Tensor& scores, const at::Tensor& stops, const at::Tensor& keeps,
    const std::optional<at::TensorList>& k_scales, const std::optional<at::TensorList>& v_scales) {
  TORCH_CHECK_VALUE(tokens.dim() == 1 && positions.sizes() == tokens.sizes(), "decode_beams: tokens and positions ",
                    "int64 [B] alike, got ", shape(tokens), " and ", shape(positions));
  const int64_t B = tokens.size(0), G = stack->num_slices, P = page_size;
  TORCH_CHECK_VALUE(keeps.scalar_type() == at::kLong && keeps.dim() == 1, "decode_beams: keeps int64 [groups], got ",
                    dtype_name(keeps.scalar_type()), " ", shape(keeps));
  const int64_t NG = keeps.size(0), NB = NG * width, NR = B - NB;  // groups, their rows, greedy rows
  TORCH_CHECK_VALUE(width >= 1 && NB <= B, "decode_beams: ", NG, " groups of width=", width, " in ", B,
                    " rows; expected width >= 1 and the groups' rows at most the rows");
  TORCH_CHECK_VALUE(scores.scalar_type() == at::kFloat && scores.dim() == 1 && scores.size(0) == NB &&
                        stops.scalar_type() == at::kLong && stops.dim() == 2 && stops.size(0) == NG,
                    "decode_beams: scores fp32 [groups * width] and stops int64 [groups, S] for ", NG,
                    " groups of ", width, ", got ", shape(scores), ", ", shape(stops));
  at::Tensor tok = tokens.contiguous().view({B, 1}), pos = positions.contiguous().view({B, 1});
  const at::Tensor seq_c = seqs.contiguous(), stop_c = stops.contiguous(), keep_c = keeps.contiguous();
  check_steps("decode_beams", *stack, tok, pos, seq_c, cos_tables, sin_tables, page_table, page_size, steps);
  const int64_t n_seqs = page_table.size(0) / G, pages = page_table.size(1), S = stop_c.size(1);
  const int64_t *seq = seq_c.data_ptr<int64_t>(), *first = pos.data_ptr<int64_t>(), *stop = stop_c.data_ptr<int64_t>(),
                *keep = keep_c.data_ptr<int64_t>();
  int64_t K = 0;
  for (int64_t g = 0; g < NG; ++g) {
    TORCH_CHECK_VALUE(keep[g] >= width, "decode_beams: group ", g, " keeps ", keep[g], " candidates; expected >= width=",
                      width);
    K = std::max(K, keep[g]);
    for (int64_t i = 1; i < width; ++i)
      TORCH_CHECK_VALUE(first[g * width + i] == first[g * width], "decode_beams: group ", g,
                        "'s beams must stand at one position, got ", first[g * width], " and ", first[g * width + i]);
  }
  // the call's own page table: row (slice sl, b) is sequence seqs[b]'s row of slice sl
  at::Tensor table_t = at::empty({G * B, pages}, page_table.options());
  const int32_t* src = page_table.data_ptr<int32_t>();
  int32_t* table = table_t.data_ptr<int32_t>();
  for (int64_t sl = 0; sl < G; ++sl)
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(src + (sl * n_seqs + seq[b]) * pages, pages, table + (sl * B + b) * pages);
  // every pool tensor once (a slice's layers share them): its data, heads, and a page's bytes in a
  // head (a page of a head is one run of P * D values: [L, Hkv, pages * P, D] contiguous)
  struct Store {
    char* data;
    int64_t heads, head_bytes, page_bytes;
  };
  std::vector<Store> stores;
  auto add_store = [&](const at::Tensor& t) {
    for (const Store& u : stores)
      if (u.data == t.data_ptr()) return;
    TORCH_CHECK_VALUE(t.dim() == 4 && t.is_contiguous() && t.size(2) % P == 0, "decode_beams: pools must be ",
                      "contiguous [L, Hkv, pages * P, D], got ", shape(t));
    const int64_t page_bytes = P * t.size(3) * static_cast<int64_t>(t.element_size());
    stores.push_back({static_cast<char*>(t.data_ptr()), t.size(0) * t.size(1), t.size(2) / P * page_bytes, page_bytes});
  };
  for (const at::Tensor& t : k_pools) add_store(t);
  for (const at::Tensor& t : v_pools) add_store(t);
  for (const auto& scales : {k_scales, v_scales})
    if (scales)
      for (const at::Tensor& t : *scales) add_store(t);
  at::Tensor out_v = at::empty({steps, NG, K}, scores.options()), out_i = at::full({steps, NG, 2, K}, -1, tok.options());
  at::Tensor score = scores.contiguous().clone();
  at::Tensor out_g = at::empty({NR, steps}, tok.options());  // the greedy rows' tokens
  int64_t* og = out_g.data_ptr<int64_t>();
  std::vector<int64_t> who(B);  // the row of table_t each group's beam i holds (batch row g * width + i)
  for (int64_t b = 0; b < B; ++b) who[b] = b;
  at::Tensor slots = G == 1 ? at::empty({B}, tok.options()) : at::empty({G, B}, tok.options());
  at::Tensor chunks = at::empty({B, 4}, tok.options());
  int64_t *slot = slots.data_ptr<int64_t>(), *chunk = chunks.data_ptr<int64_t>();
  std::vector<int64_t> parents(width), next(width), used, spare, was(width);
  std::vector<std::pair<float, int64_t>> best;  // a group's best candidates of a step so far
  for (int64_t j = 0; j < steps; ++j) {
    const at::Tensor at_j = at::add(pos, j);
    for (int64_t b = 0; b < B; ++b) {  // a chunk of one token per row, in the row's table
      const int64_t p = first[b] + j, r = who[b];
      for (int64_t sl = 0; sl < G; ++sl)
        slot[sl * B + b] = fms_geometry::slot(table[(sl * B + r) * pages + fms_geometry::page_of(p, P)], p, P);
      chunk[4 * b] = r, chunk[4 * b + 1] = p, chunk[4 * b + 2] = 1, chunk[4 * b + 3] = b;
    }
    const at::Tensor logits = forward_logits(*stack, tok, at_j, cos_tables, sin_tables, k_pools, v_pools, slots,
                                             table_t, chunks, P, std::nullopt, k_scales, v_scales).view({B, -1});
    const int64_t V = logits.size(1);
    int64_t* tk = tok.data_ptr<int64_t>();
    if (NR) {  // the greedy rows: their argmax (as decode_greedy's), next step's input
      const at::Tensor best_t = argmax(logits.narrow(0, NB, NR));
      const int64_t* best = best_t.data_ptr<int64_t>();
      for (int64_t r = 0; r < NR; ++r) tk[NB + r] = og[r * steps + j] = best[r];
    }
    float* sc = score.data_ptr<float>();
    // (a group's few rows on this thread: waking the pool for them cost more than they take)
    const c10::ParallelGuard serial(true);
    for (int64_t g = 0; g < NG; ++g) {
      const int64_t g0 = g * width, n = std::min(keep[g], width * V);
      const at::Tensor lp_t = at::log_softmax(logits.narrow(0, g0, width).to(at::kFloat), -1);  // (contiguous)
      const float* lp = lp_t.data_ptr<float>();
      // the n best of lp + the beam's score (one fp32 add, as at::add), best first (at::topk's
      // values and order; equal scores, which its order leaves open: the lower beam * V + token
      // first), in one pass that keeps the best so far
      best.clear();
      for (int64_t i = 0; i < width; ++i) {
        const float add = sc[g0 + i], *row = lp + i * V;
        for (int64_t t = 0; t < V; ++t) {
          const float v = row[t] + add;
          if (static_cast<int64_t>(best.size()) == n && !(v > best.back().first)) continue;  // (NaN: never)
          if (v != v) continue;
          auto at_ = best.end();
          while (at_ != best.begin() && std::prev(at_)->first < v) --at_;
          best.insert(at_, {v, i * V + t});
          if (static_cast<int64_t>(best.size()) > n) best.pop_back();
        }
      }
      float* cand_v = out_v.data_ptr<float>() + (j * NG + g) * K;
      int64_t* cand = out_i.data_ptr<int64_t>() + (j * NG + g) * 2 * K;  // [2, K]: parents, then tokens
      const int64_t m = static_cast<int64_t>(best.size());
      for (int64_t e = 0; e < m; ++e)
        cand_v[e] = best[e].first, cand[e] = best[e].second / V, cand[K + e] = best[e].second % V;
      int64_t c = 0;  // the next beams: the first `width` candidates whose token is no stop
      for (int64_t e = 0; e < m && c < width; ++e) {
        const int64_t t = cand[K + e];
        if (std::find(stop + g * S, stop + (g + 1) * S, t) != stop + (g + 1) * S) continue;
        parents[c] = cand[e], next[c] = t, sc[g0 + c] = cand_v[e], ++c;
      }
      TORCH_CHECK(c == width, "decode_beams: group ", g, " has ", c, " candidates without a stop token among its ",
                  m, "; expected ", width);
      // rows follow the beams (beam._move): a parent's first continuation keeps its row, a further
      // one takes the row of the last parent nobody continues
      std::copy_n(who.begin() + g0, width, was.begin());
      used.assign(width, 0), spare.clear();
      for (int64_t i = 0; i < width; ++i) used[parents[i]] = 1;
      for (int64_t q = 0; q < width; ++q)
        if (!used[q]) spare.push_back(was[q]);
      std::vector<char> claimed(width, 0);
      const int64_t p0 = first[g0], own = fms_geometry::page_of(p0, P), upto = fms_geometry::page_of(p0 + j, P);
      for (int64_t i = 0; i < width; ++i) {
        const int64_t q = parents[i], from = was[q];
        if (!claimed[q]) {
          claimed[q] = 1, who[g0 + i] = from;
        } else {
          const int64_t r = spare.back();
          spare.pop_back();
          who[g0 + i] = r;
          for (int64_t sl = 0; sl < G; ++sl) {
            int32_t *dst = table + (sl * B + r) * pages, *par = table + (sl * B + from) * pages;
            std::copy_n(par, own, dst);  // the pages before the call's: the parent's, shared
            for (int64_t lp_i = own; lp_i <= upto; ++lp_i)  // its own pages: the parent's contents
              for (const Store& st : stores)
                for (int64_t h = 0; h < st.heads; ++h)
                  std::memcpy(st.data + h * st.head_bytes + dst[lp_i] * st.page_bytes,
                              st.data + h * st.head_bytes + par[lp_i] * st.page_bytes, st.page_bytes);
          }
        }
        tk[g0 + i] = next[i];
      }
    }
  }
  at::Tensor rows = at::empty({B}, tok.options());
  std::copy(who.begin(), who.end(), rows.data_ptr<int64_t>());
  return {out_v, out_i, table_t.view({G, B, pages}), rows, out_g};
}

}  // namespace fms_paged_ops

TORCH_LIBRARY_FRAGMENT(fms_paged, m) {
  using fms_paged_ops::DecoderStack;
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, int64_t, std::vector<int64_t>, std::vector<double>,
                       std::vector<int64_t>, std::vector<double>, c10::List<std::optional<at::Tensor>>, double, bool,
                       double, int64_t>())
      .def("set_ends", &DecoderStack::set_ends)
      .def("set_slices", &DecoderStack::set_slices);
  m.def(
      "decoder_stack(__torch__.torch.classes.fms_paged.DecoderStack stack, Tensor x, Tensor[] cos, Tensor[] sin, "
      "Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, Tensor slots, Tensor page_table, Tensor chunks, int page_size, "
      "Tensor(c!)[]? k_scales=None, Tensor(d!)[]? v_scales=None) -> Tensor");
  m.def(
      "decoder_logits(__torch__.torch.classes.fms_paged.DecoderStack stack, Tensor tokens, Tensor positions, "
      "Tensor[] cos_tables, Tensor[] sin_tables, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, Tensor slots, "
      "Tensor page_table, Tensor chunks, int page_size, Tensor? logits_at, Tensor(c!)[]? k_scales=None, "
      "Tensor(d!)[]? v_scales=None) -> Tensor");
  m.def(
      "decode_greedy(__torch__.torch.classes.fms_paged.DecoderStack stack, Tensor tokens, Tensor positions, "
      "Tensor seqs, Tensor[] cos_tables, Tensor[] sin_tables, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, "
      "Tensor page_table, int page_size, int steps, Tensor(c!)[]? k_scales=None, Tensor(d!)[]? v_scales=None) "
      "-> Tensor");
  m.def(
      "decode_lookup(__torch__.torch.classes.fms_paged.DecoderStack stack, Tensor tokens, Tensor positions, "
      "Tensor seqs, Tensor[] cos_tables, Tensor[] sin_tables, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, "
      "Tensor page_table, int page_size, int steps, Tensor history, Tensor offsets, Tensor caps, int n_max, "
      "int n_min, int max_rows, Tensor(c!)[]? k_scales=None, Tensor(d!)[]? v_scales=None) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "decode_beams(__torch__.torch.classes.fms_paged.DecoderStack stack, Tensor tokens, Tensor positions, "
      "Tensor seqs, Tensor[] cos_tables, Tensor[] sin_tables, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, "
      "Tensor page_table, int page_size, int steps, int width, Tensor scores, Tensor stops, Tensor keeps, "
      "Tensor(c!)[]? k_scales=None, Tensor(d!)[]? v_scales=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fms_paged, CPU, m) {
  m.impl("decoder_stack", &fms_paged_ops::decoder_stack);
  m.impl("decoder_logits", &fms_paged_ops::decoder_logits);
  m.impl("decode_greedy", &fms_paged_ops::decode_greedy);
  m.impl("decode_lookup", &fms_paged_ops::decode_lookup);
  m.impl("decode_beams", &fms_paged_ops::decode_beams);
}
