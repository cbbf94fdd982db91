// The operator fms_paged::decoder_layers (schema in native_ops.cpp): a model's decoder blocks, one
// after the other, for the M token rows of a step of the cpp kernel (decode rows and prefill
// chunks), computed as the Python modules compute them (fms_paged/models/llama.py LLaMABlock,
// modules/attention.py, norm.py, feedforward.py, positions.py): every intermediate rounded to the
// model's dtype where theirs is, fp32 inside. The projections run as `linear` runs them (the GEMV
// kernel for a few rows, oneDNN's packed GEMM for more), the attention by the loaded kernel, the
// rest (norms, RoPE, ASSIGN, activations, residuals) here, rows spread over the intra-op threads.
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "native_ops.h"

namespace fms_paged_ops {
namespace {
template <class C>
inline float f32(C v) { return static_cast<float>(v); }

// RMSNorm of rows [M, n] (row stride st) into out [M, n] (row stride n): x / rms(x) * w; with
// unit_offset (1 + w), the product in fp32 before the rounding (Gemma), else the normalised row
// rounded first, then scaled in the dtype (LLaMA)
template <class C>
void rms_norm(const C* x, int64_t M, int64_t n, int64_t st, const C* w, double eps, bool unit_offset, C* out) {
  for (int64_t m = 0; m < M; ++m) {
    const C* r = x + m * st;
    float ss = 0.0f;
    for (int64_t i = 0; i < n; ++i) ss += f32(r[i]) * f32(r[i]);
    const float inv = 1.0f / std::sqrt(ss / (float)n + (float)eps);
    for (int64_t i = 0; i < n; ++i) {
      const float h = f32(r[i]) * inv;
      out[m * n + i] = unit_offset ? C(h * (1.0f + f32(w[i]))) : C(f32(w[i]) * f32(C(h)));
    }
  }
}

// RoPE on one head's interleaved pairs, in place: (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)
// with cos/sin [D] as `RotaryEmbedding` lays them out (sin carries the pair's sign)
template <class C>
void rope(C* x, const float* cos, const float* sin, int64_t D) {
  for (int64_t d = 0; d < D; d += 2) {
    const float a = f32(x[d]), b = f32(x[d + 1]);
    const float p0 = a * cos[d], q0 = b * sin[d], p1 = b * cos[d + 1], q1 = a * sin[d + 1];
    x[d] = C(p0 + q0), x[d + 1] = C(p1 + q1);
  }
}

// the projections: y [M, sum N] = x [M, K] (row stride x_st) @ weights^T, by the GEMV kernel for
// at most gemv_rows rows, else as `linear` computes it (oneDNN's packed GEMM, or at::linear)
struct Mm {
  KernelFn fn;
  int e;
  int64_t gemv_rows;
  at::TensorOptions opts;
  void operator()(const void* x, int64_t M, int64_t K, int64_t x_st, at::TensorList weights, void* y) const {
    if (M <= gemv_rows) {
      std::vector<const void*> ptrs;
      std::vector<int64_t> rows;
      for (const at::Tensor& w : weights) ptrs.push_back(w.data_ptr()), rows.push_back(w.size(0));
      return run_gemv(fn, e, x, M, K, x_st, ptrs, rows, y);
    }
    const at::Tensor out = linear(at::from_blob(const_cast<void*>(x), {M, K}, {x_st, 1}, opts), weights,
                                  std::nullopt);  // [M, sum N], contiguous
    std::memcpy(y, out.data_ptr(), out.numel() * out.element_size());
  }
};

// f(first, last) over row blocks [first, last) of 0 .. M, on the intra-op threads (inline for a
// decode step's few rows)
template <class F>
void by_rows(int64_t M, F&& f) {
  at::parallel_for(0, M, 32, f);
}

template <class C>
void residual(C* x, const C* h, int64_t n, double multiplier) {  // x + h (* multiplier), rounded as torch does
  for (int64_t i = 0; i < n; ++i) {
    const float v = multiplier == 1.0 ? f32(h[i]) : f32(C(f32(h[i]) * (float)multiplier));
    x[i] = C(f32(x[i]) + v);
  }
}

// one block's arguments: its weights (null: the family has none), RoPE table, pools and spec
struct Layer {
  const at::Tensor *ln, *q, *k, *v, *bias, *q_norm, *k_norm, *o, *post_attn_ln, *ff_ln, *gate, *up, *down,
      *post_ff_ln, *cos, *sin, *k_pool, *v_pool;
  double scale, softcap;
  int64_t window;
  std::optional<at::Tensor> sinks;
};

// the block on the residual stream xs [M, Cd] in place; h, y, tmp: scratch of the sizes below
template <class C>
void run_layer(C* xs, int64_t M, int64_t Cd, const Layer& L, const at::Tensor& slots, const at::Tensor& page_table,
               const at::Tensor& chunks, int64_t page_size, double eps, bool unit_offset, double residual_multiplier,
               int64_t activation, KernelFn attn, const Mm& mm, std::vector<C>& h, std::vector<C>& y,
               at::Tensor& att) {
  const int64_t D = L.cos->size(1), H = L.q->size(0) / D, Hkv = L.k->size(0) / D, F = L.gate->size(0);
  const int64_t width = (H + 2 * Hkv) * D, NP = L.k_pool->size(2);
  // attention: norm, q/k/v, bias, q/k norms, RoPE, ASSIGN, attention, output projection
  auto norm_rows = [&](const C* in, const at::Tensor* w, C* out) {
    by_rows(M, [&](int64_t b, int64_t e) {
      rms_norm(in + b * Cd, e - b, Cd, Cd, w->data_ptr<C>(), eps, unit_offset, out + b * Cd);
    });
  };
  auto add_rows = [&](const C* in) {  // the residual stream xs += in (* the multiplier)
    by_rows(M, [&](int64_t b, int64_t e) { residual(xs + b * Cd, in + b * Cd, (e - b) * Cd, residual_multiplier); });
  };
  norm_rows(xs, L.ln, h.data());
  mm(h.data(), M, Cd, Cd, {*L.q, *L.k, *L.v}, y.data());
  const float* cs = L.cos->data_ptr<float>();
  const float* sn = L.sin->data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  C* kp = L.k_pool->data_ptr<C>();
  C* vp = L.v_pool->data_ptr<C>();
  by_rows(M, [&](int64_t first, int64_t last) {
    std::vector<C> tmp(D);
    for (int64_t m = first; m < last; ++m) {
      C* row = y.data() + m * width;
      if (L.bias) {
        const C* b = L.bias->data_ptr<C>();
        for (int64_t j = 0; j < width; ++j) row[j] = C(f32(row[j]) + f32(b[j]));
      }
      for (int64_t hh = 0; hh < H + Hkv; ++hh) {
        C* head = row + hh * D;
        const at::Tensor* norm = hh < H ? L.q_norm : L.k_norm;
        if (norm) {
          rms_norm(head, 1, D, D, norm->data_ptr<C>(), eps, unit_offset, tmp.data());
          std::copy_n(tmp.data(), D, head);
        }
        rope(head, cs + m * D, sn + m * D, D);
      }
      for (int64_t g = 0; g < Hkv; ++g) {  // ASSIGN: pools [1, Hkv, NP, D]
        std::copy_n(row + (H + g) * D, D, kp + (g * NP + slot[m]) * D);
        std::copy_n(row + (H + Hkv + g) * D, D, vp + (g * NP + slot[m]) * D);
      }
    }
  });
  run_attention<std::conditional_t<std::is_same_v<C, float>, float,
                                   std::conditional_t<std::is_same_v<C, c10::BFloat16>, fms_bf16, fms_f16>>>(
      attn, y.data(), width, D, M, *L.k_pool, *L.v_pool, page_table, chunks, H, page_size, L.scale, L.window,
      L.softcap, L.sinks, att.data_ptr());
  mm(att.data_ptr(), M, H * D, H * D, {*L.o}, h.data());
  const C* attn_out = h.data();
  if (L.post_attn_ln) {
    norm_rows(h.data(), L.post_attn_ln, y.data());
    attn_out = y.data();
  }
  add_rows(attn_out);
  // MLP: norm, gate/up, activation times up, down projection
  norm_rows(xs, L.ff_ln, h.data());
  mm(h.data(), M, Cd, Cd, {*L.gate, *L.up}, y.data());
  by_rows(M, [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m)
      for (int64_t j = 0; j < F; ++j) {
        const float g = f32(y[m * 2 * F + j]);
        float a;
        if (activation == 0) {
          a = g / (1.0f + std::exp(-g));
        } else {  // tanh-approximated GELU
          const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
          a = 0.5f * g * (1.0f + std::tanh(inner));
        }
        h[m * F + j] = C(f32(C(a)) * f32(y[m * 2 * F + F + j]));
      }
  });
  mm(h.data(), M, F, F, {*L.down}, y.data());
  const C* mlp_out = y.data();
  if (L.post_ff_ln) {
    norm_rows(y.data(), L.post_ff_ln, h.data());
    mlp_out = h.data();
  }
  add_rows(mlp_out);
}

// ValueError naming what is wrong with layer i's arguments for rows x [M, Cd] (nothing written yet)
void check_layer(int64_t i, const Layer& L, const at::Tensor& x, const at::Tensor& slots) {
  const at::ScalarType dt = x.scalar_type();
  const int64_t M = x.size(0), Cd = x.size(1);
  const at::Tensor &cos = *L.cos, &sin = *L.sin, &k_pool = *L.k_pool, &v_pool = *L.v_pool;
  const int64_t D = cos.dim() == 2 ? cos.size(1) : 0;
  TORCH_CHECK_VALUE(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                        cos.size(0) == M && cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous(),
                    "decoder_layers: layer ", i, ": cos and sin must be contiguous fp32 [", M, ", D], got ",
                    shape(cos), " and ", shape(sin));
  for (const at::Tensor* w : {L.ln, L.q, L.k, L.v, L.bias, L.q_norm, L.k_norm, L.o, L.post_attn_ln, L.ff_ln,
                              L.gate, L.up, L.down, L.post_ff_ln})
    TORCH_CHECK_VALUE(!w || (w->scalar_type() == dt && w->is_cpu() && w->is_contiguous()), "decoder_layers: layer ",
                      i, ": every weight must be a contiguous CPU tensor of x's dtype ", dtype_name(dt), ", got ",
                      dtype_name(w->scalar_type()), " ", shape(*w));
  const int64_t H = D ? L.q->size(0) / D : 0, Hkv = D ? L.k->size(0) / D : 0, F = L.gate->size(0);
  auto mat = [](const at::Tensor* w, int64_t rows, int64_t cols) {
    return w->dim() == 2 && w->size(0) == rows && w->size(1) == cols;
  };
  auto vec = [](const at::Tensor* w, int64_t n) { return !w || w->numel() == n; };
  const bool shapes = D > 0 && D % 2 == 0 && Hkv > 0 && mat(L.q, H * D, Cd) && mat(L.k, Hkv * D, Cd) &&
                      mat(L.v, Hkv * D, Cd) && mat(L.o, Cd, H * D) && mat(L.gate, F, Cd) && mat(L.up, F, Cd) &&
                      mat(L.down, Cd, F) && vec(L.ln, Cd) && vec(L.ff_ln, Cd) && vec(L.bias, (H + 2 * Hkv) * D) &&
                      vec(L.q_norm, D) && vec(L.k_norm, D) && vec(L.post_attn_ln, Cd) && vec(L.post_ff_ln, Cd) &&
                      k_pool.dim() == 4 && k_pool.size(1) == Hkv && k_pool.size(3) == D;
  TORCH_CHECK_VALUE(shapes, "decoder_layers: layer ", i, ": the weights' shapes do not make one decoder block of width ",
                    Cd, " with heads of ", D, " (q ", shape(*L.q), ", k ", shape(*L.k), ", v ", shape(*L.v), ", o ",
                    shape(*L.o), ", gate ", shape(*L.gate), ", up ", shape(*L.up), ", down ", shape(*L.down),
                    ", k_pool ", shape(k_pool), ")");
  check_variants(H, L.window, L.softcap, L.sinks);
  TORCH_CHECK_VALUE(k_pool.scalar_type() == dt && v_pool.scalar_type() == dt && k_pool.sizes() == v_pool.sizes() &&
                        k_pool.is_contiguous() && v_pool.is_contiguous(),
                    "decoder_layers: layer ", i, ": pools [1, Hkv, NP, D] of x's dtype, contiguous, got ",
                    shape(k_pool), " ", dtype_name(k_pool.scalar_type()), " and ", shape(v_pool));
  const int64_t NP = k_pool.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK_VALUE(slot[m] >= 0 && slot[m] < NP, "decoder_layers: slot ", slot[m], " of row ", m,
                      " is outside the pools' ", NP, " slots");
}

}  // namespace

at::Tensor decoder_layers(const at::Tensor& x, at::TensorList weights, at::TensorList cos, at::TensorList sin,
                          at::IntArrayRef rope_index, at::TensorList k_pools, at::TensorList v_pools,
                          const at::Tensor& slots, const at::Tensor& page_table, const at::Tensor& chunks,
                          int64_t page_size, at::ArrayRef<double> scales, at::IntArrayRef windows,
                          at::ArrayRef<double> softcaps, const c10::List<std::optional<at::Tensor>>& sinks,
                          double eps, bool unit_offset, double residual_multiplier, int64_t activation) {
  const at::ScalarType dt = x.scalar_type();
  const int e = elem_index(dt);
  TORCH_CHECK_VALUE(e >= 0 && x.dim() == 2 && x.is_cpu() && x.is_contiguous(),
                    "decoder_layers: x must be contiguous CPU rows [M, C] of ", elem_names, ", got ", dtype_name(dt),
                    " ", shape(x));
  const int64_t n = (int64_t)k_pools.size();
  TORCH_CHECK_VALUE((int64_t)weights.size() == kLayerWeights * n && (int64_t)v_pools.size() == n &&
                        (int64_t)rope_index.size() == n && (int64_t)scales.size() == n &&
                        (int64_t)windows.size() == n && (int64_t)softcaps.size() == n && (int64_t)sinks.size() == n,
                    "decoder_layers: ", n, " layers (k_pools) need ", kLayerWeights * n, " weights (", kLayerWeights,
                    " per layer) and as many v_pools, rope indices, scales, windows, soft-caps and sinks, got ",
                    weights.size(), " weights, ", v_pools.size(), " v_pools, ", rope_index.size(), " rope indices, ",
                    scales.size(), " scales, ", windows.size(), " windows, ", softcaps.size(), " soft-caps, ",
                    sinks.size(), " sinks");
  TORCH_CHECK_VALUE(activation == 0 || activation == 1, "decoder_layers: activation=", activation,
                    "; expected 0 (silu) or 1 (gelu_tanh)");
  TORCH_CHECK_VALUE(!cos.empty() && cos.size() == sin.size(), "decoder_layers: one sin per cos table, got ",
                    cos.size(), " and ", sin.size());
  const int64_t M = x.size(0), Cd = x.size(1);
  TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == M && slots.is_contiguous(),
                    "decoder_layers: slots must be ", M, " contiguous int64, got ", shape(slots));
  TORCH_CHECK_VALUE(page_table.scalar_type() == at::kInt && page_table.is_contiguous() &&
                        chunks.scalar_type() == at::kLong && chunks.dim() == 2 && chunks.size(1) == 4 &&
                        chunks.is_contiguous(),
                    "decoder_layers: an int32 page table and int64 chunks [n, 4], contiguous, got page table ",
                    dtype_name(page_table.scalar_type()), ", chunks ", shape(chunks));
  std::vector<Layer> layers;
  auto opt = [](const at::Tensor& w) { return w.numel() ? &w : nullptr; };
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor* w = weights.data() + kLayerWeights * i;
    const int64_t r = rope_index[i];
    TORCH_CHECK_VALUE(r >= 0 && r < (int64_t)cos.size(), "decoder_layers: layer ", i, ": rope_index=", r, " of ",
                      cos.size(), " tables");
    layers.push_back({&w[0], &w[1], &w[2], &w[3], opt(w[4]), opt(w[5]), opt(w[6]), &w[7], opt(w[8]), &w[9], &w[10],
                      &w[11], &w[12], opt(w[13]), &cos[r], &sin[r], &k_pools[i], &v_pools[i], scales[i], softcaps[i],
                      windows[i], sinks.get(i)});
    check_layer(i, layers.back(), x, slots);
  }
  const int64_t D = n ? layers[0].cos->size(1) : 0;
  const KernelFn attn = attention_fn(e, D), mm = gemv_fn(e);
  TORCH_CHECK(!n || (attn && mm), "decoder_layers: no ", attn ? "GEMV" : "attention", " kernel loaded for ",
              dtype_name(dt), attn ? "" : " and head_dim=" + std::to_string(D),
              " (fms_paged.kv.cpu_kernel.unavailable_reason and fms_paged.modules.linear.load_gemv load them)");
  at::Tensor out = x.clone();  // the residual stream, updated in place layer by layer
  by_elem(e, [&](auto t) {
    using T = decltype(t);
    using C = std::conditional_t<std::is_same_v<T, float>, float,
                                 std::conditional_t<std::is_same_v<T, fms_bf16>, c10::BFloat16, c10::Half>>;
    int64_t wide = Cd;
    for (const Layer& L : layers)
      wide = std::max({wide, 2 * L.gate->size(0), L.q->size(0) + 2 * L.k->size(0)});
    std::vector<C> h(M * wide), y(M * wide);
    const Mm project{mm, e, linear_gemv_rows(), x.options()};
    for (const Layer& L : layers) {
      at::Tensor att = at::empty({M, L.q->size(0)}, x.options());
      run_layer<C>(out.data_ptr<C>(), M, Cd, L, slots, page_table, chunks, page_size, eps, unit_offset,
                   residual_multiplier, activation, attn, project, h, y, att);
    }
  });
  return out;
}

}  // namespace fms_paged_ops
