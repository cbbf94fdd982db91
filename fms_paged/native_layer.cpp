// The operator fms_paged::decoder_layers (schema in native_ops.cpp): a model's decoder blocks, one
// after the other, for the M token rows of a step of the cpp kernel (decode rows and prefill
// chunks), computed as the Python modules compute them (fms_paged/models/llama.py LLaMABlock,
// modules/attention.py, norm.py, feedforward.py, positions.py): every intermediate rounded to the
// model's dtype where theirs is, fp32 inside. The projections run as `linear` runs them (the GEMV
// kernel for a few rows, oneDNN's packed GEMM for more), the attention by the loaded kernel, the
// rest (norms, RoPE, ASSIGN, activations, residuals) by the rows kernel (modules/cpu_rows.cpp),
// each on all M rows at once.
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>

#include "native_ops.h"

namespace fms_paged_ops {
namespace {
// the row-wise ops of the loaded rows kernel (modules/cpu_rows.cpp; its ops and fields:
// native_kernels.h) for storage type T
template <class T>
struct Rows {
  KernelFn fn;
  double eps;
  bool unit_offset;
  RowsArgs<T> base() const {
    RowsArgs<T> a{};
    a.eps = (float)eps, a.unit_offset = unit_offset, a.threads = threads();
    return a;
  }
  void call(const RowsArgs<T>& a) const {
    TORCH_CHECK(fn(&a) == 0, "decoder_layers: the rows kernel refused op ", a.op);
  }
  // out [M, n] = RMSNorm(x rows [M, n] at row stride st) with weight w
  void norm(const void* x, int64_t M, int64_t n, int64_t st, const at::Tensor& w, void* out) const {
    RowsArgs<T> a = base();
    a.op = 0, a.M = M, a.n = n, a.x = static_cast<T*>(const_cast<void*>(x)), a.x_st = st;
    a.w = static_cast<const T*>(w.data_ptr()), a.out = static_cast<T*>(out);
    call(a);
  }
  // x [M, n] += h [M, n] (* multiplier)
  void residual(void* x, const void* h, int64_t M, int64_t n, double multiplier) const {
    RowsArgs<T> a = base();
    a.op = 1, a.M = M, a.n = n, a.x = static_cast<T*>(x), a.x_st = n, a.h = static_cast<const T*>(h);
    a.multiplier = (float)multiplier;
    call(a);
  }
  // out [M, n] = act(x[:, :n]) * x[:, n:] (activation 0: SiLU, 1: tanh-GELU)
  void act(const void* x, int64_t M, int64_t n, int64_t activation, void* out) const {
    RowsArgs<T> a = base();
    a.op = 3 + (int32_t)activation, a.M = M, a.n = n, a.x = static_cast<T*>(const_cast<void*>(x)), a.x_st = 2 * n;
    a.out = static_cast<T*>(out);
    call(a);
  }
};

// the projections: y [M, sum N] = x [M, K] (row stride x_st) @ weights^T, by the GEMV kernel for
// at most gemv_rows rows, else as `linear` computes it (oneDNN's packed GEMM, or at::linear)
struct Mm {
  KernelFn fn;
  int e;
  int64_t gemv_rows;
  at::TensorOptions opts;
  // -> where the product [M, sum N] is: y, or (oneDNN's) the rows of `out`, which holds them
  template <class T>
  T* operator()(const void* x, int64_t M, int64_t K, int64_t x_st, at::TensorList weights, T* y,
                at::Tensor& out) const {
    if (M <= gemv_rows) {
      std::vector<const void*> ptrs;
      std::vector<int64_t> rows;
      for (const at::Tensor& w : weights) ptrs.push_back(w.data_ptr()), rows.push_back(w.size(0));
      run_gemv(fn, e, x, M, K, x_st, ptrs, rows, y);
      return y;
    }
    out = linear(at::from_blob(const_cast<void*>(x), {M, K}, {x_st, 1}, opts), weights, std::nullopt);
    return static_cast<T*>(out.data_ptr());  // contiguous
  }
};

// one block's arguments: its weights (null: the family has none), RoPE table, pools and spec
struct Layer {
  const at::Tensor *ln, *q, *k, *v, *bias, *q_norm, *k_norm, *o, *post_attn_ln, *ff_ln, *gate, *up, *down,
      *post_ff_ln, *cos, *sin, *k_pool, *v_pool;
  double scale, softcap;
  int64_t window;
  std::optional<at::Tensor> sinks;
};

// the block on the residual stream xs [M, Cd] in place; h, y: scratch rows as wide as its widest
// projection; att: the attention's output [M, H D]
template <class T>
void run_layer(void* xs, int64_t M, int64_t Cd, const Layer& L, const at::Tensor& slots, const at::Tensor& page_table,
               const at::Tensor& chunks, int64_t page_size, double residual_multiplier, int64_t activation,
               KernelFn attn, const Mm& mm, const Rows<T>& rows, T* h, T* y, void* att) {
  const int64_t D = L.cos->size(1), H = L.q->size(0) / D, Hkv = L.k->size(0) / D, F = L.gate->size(0);
  const int64_t width = (H + 2 * Hkv) * D;
  auto opt = [](const at::Tensor* w) { return w ? static_cast<const T*>(w->data_ptr()) : nullptr; };
  // attention: norm, q/k/v, then bias, q/k norms, RoPE and ASSIGN, attention, output projection
  // (a product lands in y, or in the tensor `out` oneDNN made, held until the next product)
  at::Tensor out;
  rows.norm(xs, M, Cd, Cd, *L.ln, h);
  T* qkv = mm(h, M, Cd, Cd, {*L.q, *L.k, *L.v}, y, out);
  RowsArgs<T> a = rows.base();
  a.op = 2, a.M = M, a.x = qkv, a.x_st = width, a.bias = opt(L.bias), a.q_norm = opt(L.q_norm),
  a.k_norm = opt(L.k_norm);
  a.cos = L.cos->data_ptr<float>(), a.sin = L.sin->data_ptr<float>(), a.slots = slots.data_ptr<int64_t>();
  a.k_pool = static_cast<T*>(L.k_pool->data_ptr()), a.v_pool = static_cast<T*>(L.v_pool->data_ptr());
  a.pool_tokens = L.k_pool->size(2), a.H = (int32_t)H, a.Hkv = (int32_t)Hkv, a.D = (int32_t)D;
  rows.call(a);
  run_attention<T>(attn, qkv, width, D, M, *L.k_pool, *L.v_pool, page_table, chunks, H, page_size, L.scale,
                   L.window, L.softcap, L.sinks, att);
  const T* attn_out = mm(att, M, H * D, H * D, {*L.o}, h, out);
  if (L.post_attn_ln) {
    rows.norm(attn_out, M, Cd, Cd, *L.post_attn_ln, y);
    attn_out = y;
  }
  rows.residual(xs, attn_out, M, Cd, residual_multiplier);
  // MLP: norm, gate/up, activation times up, down projection
  rows.norm(xs, M, Cd, Cd, *L.ff_ln, h);
  const T* gate_up = mm(h, M, Cd, Cd, {*L.gate, *L.up}, y, out);
  rows.act(gate_up, M, F, activation, h);
  const T* mlp_out = mm(h, M, F, F, {*L.down}, y, out);
  if (L.post_ff_ln) {
    rows.norm(mlp_out, M, Cd, Cd, *L.post_ff_ln, h);
    mlp_out = h;
  }
  rows.residual(xs, mlp_out, M, Cd, residual_multiplier);
}

// ValueError naming what is wrong with layer i's arguments for rows x [M, Cd] (nothing written yet);
// top: the step's largest slot (its slots are checked against each layer's pools, which may differ)
void check_layer(int64_t i, const Layer& L, const at::Tensor& x, const at::Tensor& slots, int64_t top) {
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
  if (top < NP) return;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t m = std::find_if(slot, slot + M, [&](int64_t s) { return s >= NP; }) - slot;
  TORCH_CHECK_VALUE(false, "decoder_layers: slot ", slot[m], " of row ", m, " is outside the pools' ", NP, " slots");
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
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)  // every layer writes these slots: one pass for the sign, the top per layer
    TORCH_CHECK_VALUE(slot[m] >= 0, "decoder_layers: slot ", slot[m], " of row ", m, " is negative");
  const int64_t top = M ? *std::max_element(slot, slot + M) : -1;
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
    check_layer(i, layers.back(), x, slots, top);
  }
  const int64_t D = n ? layers[0].cos->size(1) : 0;
  const KernelFn attn = attention_fn(e, D), mm = gemv_fn(e), rows_kernel = rows_fn(e);
  TORCH_CHECK(!n || (attn && mm && rows_kernel), "decoder_layers: no ",
              !attn ? "attention" : !mm ? "GEMV" : "rows", " kernel loaded for ", dtype_name(dt),
              attn ? "" : " and head_dim=" + std::to_string(D),
              " (fms_paged.kv.cpu_kernel.unavailable_reason and fms_paged.modules.linear.load_gemv load them)");
  at::Tensor out = x.clone();  // the residual stream, updated in place layer by layer
  int64_t wide = Cd;
  for (const Layer& L : layers) wide = std::max({wide, 2 * L.gate->size(0), L.q->size(0) + 2 * L.k->size(0)});
  // the blocks' scratch rows, kept by the calling thread from one call to the next: a prefill
  // step's are megabytes, which a fresh allocation would take from the OS (and zero) every step
  static thread_local at::Tensor scratch;
  const int64_t need = 3 * M * wide * x.element_size();
  if (!scratch.defined() || scratch.numel() < need) scratch = at::empty({need}, x.options().dtype(at::kByte));
  uint8_t* base = scratch.data_ptr<uint8_t>();
  void *h = base, *y = base + M * wide * x.element_size(), *att = base + 2 * M * wide * x.element_size();
  by_elem(e, [&](auto t) {
    using T = decltype(t);
    const Mm project{mm, e, linear_gemv_rows(), x.options()};
    const Rows<T> rows{rows_kernel, eps, unit_offset};
    for (const Layer& L : layers)
      run_layer<T>(out.data_ptr(), M, Cd, L, slots, page_table, chunks, page_size, residual_multiplier, activation,
                   attn, project, rows, static_cast<T*>(h), static_cast<T*>(y), att);
  });
  return out;
}

}  // namespace fms_paged_ops
