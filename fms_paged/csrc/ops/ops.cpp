// The project's CPU kernels as PyTorch operators (TORCH_LIBRARY): schemas and CPU implementations
// that eager mode, inductor's generated code and an AOT-compiled graph all call through the
// dispatcher, with no Python and no ctypes on the way.
//
// The kernels themselves (kernels/attention.cpp, kernels/gemv.cpp, kernels/rows.cpp)
// include no torch header: they are built per instruction set, storage type and head dim when
// first needed (fms_paged/native, in seconds) and loaded here by path (`_load_kernel`), which
// checks each library's argument struct against this file's (kernels/kernels.h) before taking its
// entry point. This file is built once per torch version and compiler (at install time, else on
// first use) and is the same on every CPU.
//
// Operators (fms_paged::, schemas below):
// - paged_attention: causal attention of a step's query tokens over their pages (the "cpp" kernel);
//   paged_attention_i8: the same over int8 pools with their fp32 row scales (8-bit KV pages; an
//   operator of its own, so that paged_attention's schema, which compiled graphs call, is as it was);
// - gemv: a few rows times stacked row-major weights (decode projections);
// - linear: a projection by the path its rows call for: the GEMV kernel for a few rows, oneDNN's
//   blocked GEMM on a packed copy of the weights (kept here, per weight) for many, at::linear else;
// - decoder_stack: a model's decoder blocks on a step in one call (norms, q/k/v, q/k norms, RoPE,
//   ASSIGN, attention, output projection, residuals, gated MLP; ops/layer.cpp, which registers
//   it and the class DecoderStack): the host work of a step's layers is one
//   dispatch instead of some fifty operator calls per layer; decoder_logits: the model's whole
//   forward (embedding, blocks, final norm, head) in one call;
// - rms_norm, argmax: the rows kernel's RMSNorm and argmax on any rows: the model's final norm and
//   greedy sampling, which as ATen's operations (eight for the norm; argmax's own scalar loop)
//   took a one-request decode step ~0.1 ms each for a single row.
#include <dlfcn.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "ops.h"

namespace fms_paged_ops {

// ---------------------------------------------------------------- the registry of loaded kernels

template <class T, class KV = T>
std::string attention_layout() {
  using Args = AttentionArgs<T, KV>;  // (no comma inside the macro's arguments)
  return FMS_PAGED_LAYOUT_OF(Args, "FmsPagedAttentionArgs", FMS_PAGED_ATTENTION_FIELDS);
}
template <class T>
std::string gemv_layout() {
  return FMS_PAGED_LAYOUT_OF(GemvArgs<T>, "FmsGemvArgs", FMS_PAGED_GEMV_FIELDS);
}
template <class T>
std::string gemm_layout() {
  return FMS_PAGED_LAYOUT_OF(GemvArgs<T>, "FmsGemmArgs", FMS_PAGED_GEMM_FIELDS);
}
template <class T>
std::string rows_layout() {
  return FMS_PAGED_LAYOUT_OF(RowsArgs<T>, "FmsRowsArgs", FMS_PAGED_ROWS_FIELDS);
}
template <class T>
std::string qgemv_layout() {
  return FMS_PAGED_LAYOUT_OF(QgemvArgs<T>, "FmsQgemvArgs", FMS_PAGED_QGEMV_FIELDS);
}
// the kinds of kernel `_load_kernel` takes, in this order ("attention_i8": attention over int8
// pools, attention.cpp built with -DFMS_KV_INT8=1; "gemm": gemm.cpp, many rows; "qgemv": products
// with GGUF blocks, qgemv.cpp)
constexpr std::array<const char*, 6> kKinds = {"attention", "gemv", "rows", "attention_i8", "gemm", "qgemv"};
template <class T>
std::string layout_of(int kind) {
  return kind == 0   ? attention_layout<T>()
         : kind == 1 ? gemv_layout<T>()
         : kind == 2 ? rows_layout<T>()
         : kind == 4 ? gemm_layout<T>()
         : kind == 5 ? qgemv_layout<T>()
                     : attention_layout<T, int8_t>();
}
std::string expected_layout(int kind, int e) {
  switch (e) {
    case 0: return layout_of<float>(kind);
    case 1: return layout_of<fms_bf16>(kind);
    default: return layout_of<fms_f16>(kind);
  }
}

constexpr int64_t kHeadDimStep = 16, kMaxHeadDim = 1024;
// the loaded kernels: attention per (storage type, head dim / 16), GEMV per storage type; set
// once by `_load_kernel`, read by every call without a lock
std::array<std::array<std::atomic<KernelFn>, kMaxHeadDim / kHeadDimStep + 1>, kElems> attention_fns{},
    attention_i8_fns{};
std::array<std::atomic<KernelFn>, kElems> gemv_fns{}, rows_fns{}, gemm_fns{}, qgemv_fns{};

KernelFn attention_fn(int e, int64_t head_dim) {
  if (e < 0 || head_dim <= 0 || head_dim > kMaxHeadDim || head_dim % kHeadDimStep) return nullptr;
  return attention_fns[e][head_dim / kHeadDimStep].load(std::memory_order_acquire);
}
KernelFn attention_i8_fn(int e, int64_t head_dim) {
  if (e < 0 || head_dim <= 0 || head_dim > kMaxHeadDim || head_dim % kHeadDimStep) return nullptr;
  return attention_i8_fns[e][head_dim / kHeadDimStep].load(std::memory_order_acquire);
}
KernelFn gemv_fn(int e) { return e < 0 ? nullptr : gemv_fns[e].load(std::memory_order_acquire); }
KernelFn rows_fn(int e) { return e < 0 ? nullptr : rows_fns[e].load(std::memory_order_acquire); }
KernelFn gemm_fn(int e) { return e < 0 ? nullptr : gemm_fns[e].load(std::memory_order_acquire); }
KernelFn qgemv_fn(int e) { return e < 0 ? nullptr : qgemv_fns[e].load(std::memory_order_acquire); }

// _load_kernel: the library at `path` (built by fms_paged.native) as the `kind` ("attention",
// "gemv" or "rows") kernel of `dtype` (and `head_dim`, attention); refused unless its struct is
// laid out as this file's
// the index of `kind` in kKinds; ValueError naming it otherwise
int kind_index(const char* op, c10::string_view kind) {
  const int k = (int)(std::find(kKinds.begin(), kKinds.end(), kind) - kKinds.begin());
  TORCH_CHECK_VALUE(k < (int)kKinds.size(), op, ": kind='", kind,
                    "'; expected 'attention', 'gemv', 'rows', 'attention_i8', 'gemm' or 'qgemv'");
  return k;
}

void load_kernel(c10::string_view kind, c10::string_view path, at::ScalarType dtype, int64_t head_dim) {
  const int k = kind_index("_load_kernel", kind);
  const bool attention = k == 0 || k == 3;
  const int e = elem_index(dtype);
  TORCH_CHECK_VALUE(e >= 0, "_load_kernel: dtype ", dtype, "; the kernels take ", elem_names);
  TORCH_CHECK_VALUE(!attention || (head_dim > 0 && head_dim <= kMaxHeadDim && head_dim % kHeadDimStep == 0),
                    "_load_kernel: head_dim=", head_dim, "; expected a multiple of ", kHeadDimStep, " up to ",
                    kMaxHeadDim);
  const std::string file(path);
  void* lib = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib, "_load_kernel: loading ", file, " failed: ", dlerror());
  const std::string name = std::string("fms_paged_") + kKinds[k];
  auto layout_fn = reinterpret_cast<const char* (*)()>(dlsym(lib, (name + "_layout").c_str()));
  auto fn = reinterpret_cast<KernelFn>(dlsym(lib, name.c_str()));
  TORCH_CHECK(layout_fn && fn, "_load_kernel: ", file, " exports no ", name, " and ", name, "_layout()");
  const std::string built = layout_fn(), want = expected_layout(k, e);
  TORCH_CHECK(built == want, "_load_kernel: ", file, ": the kernel's argument struct is laid out as '", built,
              "', the operator's as '", want, "': built from another version of kernels/kernels.h");
  if (attention)
    (k == 0 ? attention_fns : attention_i8_fns)[e][head_dim / kHeadDimStep].store(fn, std::memory_order_release);
  else
    (k == 1 ? gemv_fns : k == 2 ? rows_fns : k == 4 ? gemm_fns : qgemv_fns)[e].store(fn, std::memory_order_release);
}

bool kernel_loaded(c10::string_view kind, at::ScalarType dtype, int64_t head_dim) {
  const int k = kind_index("_kernel_loaded", kind), e = elem_index(dtype);
  return (k == 0   ? attention_fn(e, head_dim)
          : k == 1 ? gemv_fn(e)
          : k == 2 ? rows_fn(e)
          : k == 4 ? gemm_fn(e)
          : k == 5 ? qgemv_fn(e)
                   : attention_i8_fn(e, head_dim)) != nullptr;
}

std::string shape(at::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + (sizes.size() == 1 ? ",)" : ")");
}
std::string shape(const at::Tensor& t) { return shape(t.sizes()); }
std::string dtype_name(at::ScalarType t) {
  std::string s = c10::toString(t);  // "Float", "BFloat16", ...
  static const std::unordered_map<std::string, std::string> names = {
      {"Float", "float32"}, {"BFloat16", "bfloat16"}, {"Half", "float16"}, {"Double", "float64"},
      {"Int", "int32"},     {"Long", "int64"},        {"Bool", "bool"}, {"Char", "int8"}};
  auto it = names.find(s);
  return "torch." + (it == names.end() ? s : it->second);
}
std::string py_float(double v) {  // as Python's repr spells a float
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof buf, "%.*g", p, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

// ------------------------------------------------------------------------------ paged_attention

void check_variants(int64_t H, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(window >= 0, "paged_attention: window=", window, "; expected an int >= 0 (0: no window)");
  const double tiny = std::numeric_limits<float>::min(), big = std::numeric_limits<float>::max();
  TORCH_CHECK_VALUE(softcap == 0 || (softcap >= tiny && softcap <= big), "paged_attention: softcap=",
                    py_float(softcap), "; expected 0.0 (none) or a finite float32 in [1.175e-38, 3.403e+38]");
  if (sinks) {
    const at::Tensor& s = *sinks;
    const bool ok = s.scalar_type() == at::kFloat && s.dim() == 1 && s.size(0) == H && s.is_cpu() &&
                    s.is_contiguous();
    TORCH_CHECK_VALUE(ok, "paged_attention: sinks must be None or a contiguous torch.float32 CPU tensor [", H,
                      "] (one logit per query head), got ", dtype_name(s.scalar_type()), " ", shape(s), " on ",
                      s.device(), s.is_contiguous() ? "" : ", not contiguous");
  }
}

// paged_attention over pools of q's dtype, or (k_scales and v_scales given) over int8 pools
at::Tensor attention_over_pools(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& page_table, const at::Tensor& chunks, int64_t page_size, double scale,
                                int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
                                const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales) {
  const at::ScalarType dt = q.scalar_type();
  const int e = elem_index(dt);
  TORCH_CHECK_VALUE(e >= 0, "paged_attention: q is ", dtype_name(dt), "; the kernel takes ", elem_names);
  TORCH_CHECK_VALUE(q.dim() == 4 && q.is_cpu(), "paged_attention: q must be a 4-D ", dtype_name(dt),
                    " CPU tensor, got ", shape(q), " on ", q.device());
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  check_variants(H, window, softcap, sinks);
  // 8-bit KV pages: int8 pools, each row with its fp32 scale [1, Hkv, NP, 1]
  const bool i8 = k_pool.scalar_type() == at::kChar;
  const at::ScalarType kv = i8 ? at::kChar : dt;
  TORCH_CHECK_VALUE(i8 == (k_scales.has_value() && v_scales.has_value()) && k_scales.has_value() == v_scales.has_value(),
                    "paged_attention: int8 pools take their k_scales and v_scales, 16/32-bit pools none; got ",
                    dtype_name(k_pool.scalar_type()), " pools with", k_scales ? "" : "out", " k_scales");
  const std::pair<const char*, std::tuple<const at::Tensor&, at::ScalarType, int64_t>> want[] = {
      {"k_pool", {k_pool, kv, 4}}, {"v_pool", {v_pool, kv, 4}}, {"page_table", {page_table, at::kInt, 2}},
      {"chunks", {chunks, at::kLong, 2}}};
  for (const auto& [name, spec] : want) {
    const auto& [t, type, dims] = spec;
    TORCH_CHECK_VALUE(t.scalar_type() == type && t.dim() == dims && t.is_cpu(), "paged_attention: ", name,
                      " must be a ", dims, "-D ", dtype_name(type), " CPU tensor, got ", dtype_name(t.scalar_type()),
                      " ", shape(t), " on ", t.device());
  }
  const bool pools = k_pool.size(0) == 1 && k_pool.size(3) == D && k_pool.sizes() == v_pool.sizes();
  TORCH_CHECK_VALUE(pools && chunks.size(1) == 4, "paged_attention: pools ", shape(k_pool), " / ", shape(v_pool),
                    ", chunks ", shape(chunks), ": expected two pools [1, Hkv, NP, ", D, "] and chunks [n, 4]");
  TORCH_CHECK_VALUE(k_pool.is_contiguous() && v_pool.is_contiguous() && page_table.is_contiguous() &&
                        chunks.is_contiguous(),
                    "paged_attention: the pools, the page table and the chunks must be contiguous");
  PoolPtrs ptrs = pool_ptrs(k_pool, v_pool);
  if (i8) {
    for (const at::Tensor* t : {&*k_scales, &*v_scales}) {
      const bool ok = t->scalar_type() == at::kFloat && t->dim() == 4 && t->size(0) == 1 &&
                      t->size(1) == k_pool.size(1) && t->size(2) == k_pool.size(2) && t->size(3) == 1 &&
                      t->is_cpu() && t->is_contiguous();
      TORCH_CHECK_VALUE(ok, "paged_attention: int8 pools ", shape(k_pool), " take contiguous torch.float32 CPU "
                        "scales [1, ", k_pool.size(1), ", ", k_pool.size(2), ", 1] (one per row), got ",
                        dtype_name(t->scalar_type()), " ", shape(*t));
    }
    ptrs.ks = k_scales->data_ptr<float>(), ptrs.vs = v_scales->data_ptr<float>();
  }
  const KernelFn fn = i8 ? attention_i8_fn(e, D) : attention_fn(e, D);
  TORCH_CHECK(fn, "paged_attention: no kernel loaded for head_dim=", D, " and ", dtype_name(dt),
              i8 ? " over int8 pools" : "", " (fms_paged.native.load_attention builds and loads it)");
  // q's tokens as rows [B * S, H, D] with D contiguous: q [B, H, S, D] transposed, copied only
  // when its tokens are not evenly strided
  at::Tensor rows = q.transpose(1, 2);  // [B, S, H, D]
  if (!(B == 1 || S == 1 || rows.stride(0) == S * rows.stride(1)) || rows.stride(3) != 1) rows = rows.contiguous();
  const int64_t q_st = S == 1 ? rows.stride(0) : rows.stride(1), q_sh = rows.stride(2);
  at::Tensor out = at::empty({B, S, H, D}, q.options());
  by_elem(e, [&](auto t) {
    if (i8)
      run_attention<decltype(t), int8_t>(fn, rows.data_ptr(), q_st, q_sh, B * S, ptrs, page_table, chunks, H,
                                         page_size, scale, window, softcap, sinks, out.data_ptr());
    else
      run_attention<decltype(t)>(fn, rows.data_ptr(), q_st, q_sh, B * S, ptrs, page_table, chunks, H, page_size,
                                 scale, window, softcap, sinks, out.data_ptr());
  });
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& page_table, const at::Tensor& chunks, int64_t page_size, double scale,
                           int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  return attention_over_pools(q, k_pool, v_pool, page_table, chunks, page_size, scale, window, softcap, sinks,
                              std::nullopt, std::nullopt);
}

at::Tensor paged_attention_i8(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& k_scales, const at::Tensor& v_scales, const at::Tensor& page_table,
                              const at::Tensor& chunks, int64_t page_size, double scale, int64_t window,
                              double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(k_pool.scalar_type() == at::kChar, "paged_attention_i8: int8 pools, got ",
                    dtype_name(k_pool.scalar_type()));
  return attention_over_pools(q, k_pool, v_pool, page_table, chunks, page_size, scale, window, softcap, sinks,
                              k_scales, v_scales);
}

// ----------------------------------------------------------------------------------------- gemv

// y [M, sum N_i] = x [M, K] (row stride x_st) @ [w_1; w_2; ...]^T by the GEMV kernel of index e
void run_gemv(KernelFn fn, int e, const void* x, int64_t M, int64_t K, int64_t x_st, const void* const* weights,
              const int64_t* rows, int64_t n_weights, void* y) {
  by_elem(e, [&](auto t) {
    using T = decltype(t);
    GemvArgs<T> a{};
    a.x = static_cast<const T*>(x), a.M = M, a.K = K, a.x_st = x_st;
    a.weights = reinterpret_cast<const T* const*>(weights), a.rows = rows;
    a.n_weights = n_weights, a.y = static_cast<T*>(y), a.threads = threads();
    timed([&] { return fn(&a); });
  });
}

// x [..., K] @ [w_1; w_2; ...]^T by the GEMV or GEMM kernel `fn` of x's dtype (op: the operator's
// name; ATen where `fn` is null: not loaded)
at::Tensor product(const char* op, const at::Tensor& x, at::TensorList weights, KernelFn fn) {
  const int e = elem_index(x.scalar_type());
  TORCH_CHECK_VALUE(e >= 0 && x.is_cpu() && x.dim() > 0, op, ": x must be a CPU tensor [..., K] of ", elem_names,
                    ", got ", dtype_name(x.scalar_type()), " ", shape(x), " on ", x.device());
  TORCH_CHECK_VALUE(!weights.empty(), op, ": no weights");
  const int64_t K = x.size(-1);
  std::vector<at::Tensor> keep;  // contiguous copies of non-contiguous weights
  std::vector<const void*> ptrs;
  std::vector<int64_t> rows;
  int64_t width = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK_VALUE(w.scalar_type() == x.scalar_type() && w.is_cpu() && w.dim() == 2 && w.size(1) == K, op, ": weight ",
                      i, " must be a 2-D ", dtype_name(x.scalar_type()), " CPU tensor [N, ", K,
                      "] (x's dtype and width), got ", dtype_name(w.scalar_type()), " ", shape(w), " on ", w.device());
    if (!w.is_contiguous()) keep.push_back(w.contiguous());
    ptrs.push_back(w.is_contiguous() ? w.data_ptr() : keep.back().data_ptr());
    rows.push_back(w.size(0));
    width += w.size(0);
  }
  if (!fn) {  // not loaded (no compiler): the same product by ATen
    std::vector<at::Tensor> ys;
    for (const at::Tensor& w : weights) ys.push_back(at::linear(x, w));
    return ys.size() == 1 ? ys[0] : at::cat(ys, -1);
  }
  at::Tensor rows2d = x.reshape({-1, K});
  if (rows2d.stride(-1) != 1) rows2d = rows2d.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = width;
  at::Tensor y = at::empty(out_shape, x.options());
  run_gemv(fn, e, rows2d.data_ptr(), rows2d.size(0), K, rows2d.stride(0), ptrs.data(), rows.data(),
           (int64_t)ptrs.size(), y.data_ptr());
  return y;
}

at::Tensor gemv(const at::Tensor& x, at::TensorList weights) {
  return product("gemv", x, weights, gemv_fn(elem_index(x.scalar_type())));
}

// gemm: the same product by the GEMM kernel (as `linear` computes many rows where it takes it)
at::Tensor gemm(const at::Tensor& x, at::TensorList weights) {
  return product("gemm", x, weights, gemm_fn(elem_index(x.scalar_type())));
}

// --------------------------------------------------------------------------------------- linear

// how `linear` picks its path (set by fms_paged.native when it loads the operators: `_configure_linear`)
struct LinearConfig {
  int64_t gemv_max_rows = 8, pack_min_weight = 1 << 18, pack_min_rows = 256;
  bool onednn = false;
  bool own_gemm = false;  // past the GEMV's rows, the GEMM kernel on the plain weights (where loaded)
  // with the GEMM kernel: the most rows the GEMV kernel takes, per storage type (at least gemv_max_rows)
  std::array<int64_t, kElems> own_gemv_max_rows{8, 8, 8};
  std::array<at::ScalarType, kElems> pack_dtype{at::kFloat, at::kFloat, at::kFloat};  // per storage type
};
LinearConfig linear_config;
std::mutex linear_config_mu;

void configure_linear(int64_t gemv_max_rows, int64_t pack_min_weight, int64_t pack_min_rows,
                      std::vector<at::ScalarType> pack_dtypes, bool own_gemm, std::vector<int64_t> own_gemv_rows) {
  TORCH_CHECK_VALUE(pack_dtypes.empty() || pack_dtypes.size() == kElems, "_configure_linear: pack_dtypes has ",
                    pack_dtypes.size(), " entries; expected none (no oneDNN) or one per ", elem_names);
  std::lock_guard<std::mutex> lock(linear_config_mu);
  linear_config.gemv_max_rows = gemv_max_rows, linear_config.pack_min_weight = pack_min_weight;
  linear_config.pack_min_rows = pack_min_rows, linear_config.onednn = !pack_dtypes.empty();
  for (size_t i = 0; i < pack_dtypes.size(); ++i) linear_config.pack_dtype[i] = pack_dtypes[i];
  TORCH_CHECK_VALUE(own_gemv_rows.empty() || own_gemv_rows.size() == kElems, "_configure_linear: own_gemv_rows has ",
                    own_gemv_rows.size(), " entries; expected none or one per ", elem_names);
  linear_config.own_gemm = own_gemm;
  for (int i = 0; i < kElems; ++i)
    linear_config.own_gemv_max_rows[i] =
        std::max(gemv_max_rows, own_gemv_rows.empty() ? gemv_max_rows : own_gemv_rows[i]);
}

// a packed copy of a stack of weights: what it was made from (each weight's data pointer and
// version, its owner held weakly) and the copy
struct Packed {
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> owners;
  std::vector<std::pair<const void*, int64_t>> stamps;
  at::Tensor packed;
};
std::mutex packed_mu;
std::unordered_map<const c10::TensorImpl*, Packed> packed_cache;  // by the stack's first weight

void drop_expired() {  // the copies of freed weights (packed_mu held)
  for (auto it = packed_cache.begin(); it != packed_cache.end();)
    it = it->second.owners[0].expired() ? packed_cache.erase(it) : std::next(it);
}

// (data pointer, version) of a weight: what changes when its values may have. An inference tensor
// has no version counter: -1, so only a new storage counts for it.
std::pair<const void*, int64_t> stamp(const at::Tensor& w) {
  return {w.data_ptr(), w.is_inference() ? -1 : (int64_t)w._version()};
}

c10::OperatorHandle mkldnn_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor packed_weights(at::TensorList weights, at::ScalarType pack_dtype) {
  std::vector<std::pair<const void*, int64_t>> stamps;
  for (const at::Tensor& w : weights) stamps.push_back(stamp(w));
  const c10::TensorImpl* key = weights[0].unsafeGetTensorImpl();
  {
    std::lock_guard<std::mutex> lock(packed_mu);
    auto it = packed_cache.find(key);
    if (it != packed_cache.end() && it->second.stamps == stamps && it->second.owners[0].lock().get() == key &&
        it->second.packed.scalar_type() == pack_dtype)
      return it->second.packed;
  }
  std::vector<at::Tensor> parts;
  for (const at::Tensor& w : weights) parts.push_back(w.detach());
  at::Tensor stack = (parts.size() == 1 ? parts[0] : at::cat(parts, 0)).to(pack_dtype);
  static const c10::OperatorHandle reorder = mkldnn_op("mkldnn::_reorder_linear_weight");
  torch::jit::Stack args{stack, c10::IValue()};
  reorder.callBoxed(args);
  Packed entry{{}, stamps, args[0].toTensor()};
  for (const at::Tensor& w : weights) entry.owners.push_back(c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr()));
  std::lock_guard<std::mutex> lock(packed_mu);
  drop_expired();
  return (packed_cache[key] = std::move(entry)).packed;
}

// data pointers of the weights that have a packed copy (fms_paged.modules.linear.unpacked_bytes)
std::vector<int64_t> packed_data_ptrs() {
  std::lock_guard<std::mutex> lock(packed_mu);
  drop_expired();
  std::vector<int64_t> out;
  for (const auto& [key, entry] : packed_cache)
    for (const auto& s : entry.stamps) out.push_back((int64_t) reinterpret_cast<intptr_t>(s.first));
  return out;
}

// the packed copy of the stack whose first weight is `weight` (None: none kept)
std::optional<at::Tensor> packed_copy(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(packed_mu);
  auto it = packed_cache.find(weight.unsafeGetTensorImpl());
  if (it == packed_cache.end() || it->second.owners[0].lock().get() != weight.unsafeGetTensorImpl())
    return std::nullopt;
  return it->second.packed;
}

at::Tensor pointwise(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op = mkldnn_op("mkldnn::_linear_pointwise");
  const at::ScalarType pdt = packed.scalar_type();
  const bool same = pdt == x.scalar_type();
  c10::IValue b = bias ? c10::IValue(same ? *bias : bias->to(pdt)) : c10::IValue();
  torch::jit::Stack args{same ? x : x.to(pdt), packed, b, std::string("none"),
                         c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(args);
  at::Tensor y = args[0].toTensor();
  return same ? y : y.to(x.scalar_type());
}

enum class Path { gemv, gemm, packed, aten };

// the path `linear` takes for x [..., K] times weights of `width` rows in all (a stack's): the GEMV
// kernel for a few rows; past them the GEMM kernel where it is configured and loaded (both read
// the plain weights: each held once), else oneDNN's packed GEMM for a large weight or many rows
// (or any half-precision call where oneDNN has no such GEMM), at::linear for the small GEMMs left
// the most rows the GEMV kernel takes for storage type e (more where the GEMM kernel serves e)
int64_t gemv_rows(int e, const LinearConfig& cfg) {
  return e >= 0 && cfg.own_gemm && gemm_fn(e) ? cfg.own_gemv_max_rows[e] : cfg.gemv_max_rows;
}

Path linear_path(const at::Tensor& x, int64_t width, const LinearConfig& cfg) {
  const int64_t K = x.size(-1);
  const int e = elem_index(x.scalar_type());
  if (e >= 0 && x.numel() <= gemv_rows(e, cfg) * K) return Path::gemv;
  if (e >= 0 && cfg.own_gemm && gemm_fn(e)) return Path::gemm;
  const bool pack = cfg.onednn && e >= 0 &&
                    (cfg.pack_dtype[e] != x.scalar_type() || width * K >= cfg.pack_min_weight ||
                     x.numel() >= cfg.pack_min_rows * K);
  return pack ? Path::packed : Path::aten;
}

LinearConfig config() {
  std::lock_guard<std::mutex> lock(linear_config_mu);
  return linear_config;
}

// _linear_path: which path `linear` takes for x and a stack of weights `width` rows wide
std::string linear_path_name(const at::Tensor& x, int64_t width) {
  const Path p = linear_path(x, width, config());
  return p == Path::gemv ? "gemv" : p == Path::gemm ? "gemm" : p == Path::packed ? "packed" : "aten";
}

at::Tensor linear(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(!weights.empty() && x.dim() > 0, "linear: x [..., K] and at least one weight [N, K]");
  const LinearConfig cfg = config();
  int64_t width = 0;
  for (const at::Tensor& w : weights) width += w.size(0);
  const int e = elem_index(x.scalar_type());
  auto add_bias = [&](at::Tensor y) { return bias ? at::add(y, *bias) : y; };
  const Path path = linear_path(x, width, cfg);
  if (path == Path::gemv) return add_bias(gemv(x, weights));
  if (path == Path::gemm) return add_bias(gemm(x, weights));
  if (path == Path::packed) {
    const at::Tensor packed = packed_weights(weights, cfg.pack_dtype[e]);
    return weights.size() == 1 ? pointwise(x, packed, bias) : add_bias(pointwise(x, packed, std::nullopt));
  }
  if (weights.size() == 1) return at::linear(x, weights[0], bias);
  std::vector<at::Tensor> ys;
  for (const at::Tensor& w : weights) ys.push_back(at::linear(x, w));
  return add_bias(at::cat(ys, -1));
}

int64_t linear_gemv_rows(int e) { return gemv_rows(e, config()); }

KernelFn linear_gemm_fn(int e) { return config().own_gemm ? gemm_fn(e) : nullptr; }

// ------------------------------------------------------------------------ rms_norm and argmax

namespace {

// the loaded rows kernel for x's dtype (op: the operator's name, for the errors); ValueError
// unless x is contiguous CPU rows [..., n > 0] of a dtype the kernels store
KernelFn rows_for(const char* op, const at::Tensor& x) {
  const int e = elem_index(x.scalar_type());
  TORCH_CHECK_VALUE(e >= 0 && x.is_cpu() && x.dim() >= 1 && x.size(-1) > 0 && x.is_contiguous(), op,
                    ": x must be contiguous CPU rows [..., n > 0] of ", elem_names, ", got ",
                    dtype_name(x.scalar_type()), " ", shape(x), " on ", x.device());
  const KernelFn fn = rows_fn(e);
  TORCH_CHECK(fn, op, ": no rows kernel loaded for ", dtype_name(x.scalar_type()),
              " (fms_paged.native.load_gemv loads it)");
  return fn;
}

}  // namespace

// RMSNorm of x [..., n] with weight [n] (the rows kernel's op 0: what `RMSNorm` computes)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  const KernelFn fn = rows_for("rms_norm", x);
  const int64_t n = x.size(-1);
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type() && weight.is_cpu() && weight.dim() == 1 &&
                        weight.size(0) == n && weight.is_contiguous(),
                    "rms_norm: weight must be a contiguous CPU vector [", n, "] of x's dtype ",
                    dtype_name(x.scalar_type()), ", got ", dtype_name(weight.scalar_type()), " ", shape(weight));
  at::Tensor out = at::empty_like(x);
  by_elem(elem_index(x.scalar_type()), [&](auto t) {
    using T = decltype(t);
    Rows<T>{fn, eps, unit_offset}.norm(x.data_ptr(), x.numel() / n, n, n, weight.data_ptr(), out.data_ptr());
  });
  return out;
}

// the index of the first largest along x's last dim (torch.argmax(x, -1)): int64 [...]
at::Tensor argmax(const at::Tensor& x) {
  const KernelFn fn = rows_for("argmax", x);
  const int64_t n = x.size(-1);
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  by_elem(elem_index(x.scalar_type()), [&](auto t) {
    using T = decltype(t);
    Rows<T>{fn, 0.0, false}.argmax(x.data_ptr(), x.numel() / n, n, n, out.data_ptr<int64_t>());
  });
  return out;
}

// geometry.h's rules over tensors of int64 (what tests hold to kv/geometry.py): physical pages and
// positions [n] -> (each position's logical page, its slot on its page, the pages for that many
// tokens) [n] each
std::tuple<at::Tensor, at::Tensor, at::Tensor> geometry(const at::Tensor& pages, const at::Tensor& positions,
                                                        int64_t page_size) {
  TORCH_CHECK_VALUE(page_size > 0, "_geometry: page_size=", page_size, "; expected >= 1");
  TORCH_CHECK_VALUE(pages.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && pages.dim() == 1 &&
                        pages.sizes() == positions.sizes(),
                    "_geometry: pages and positions int64 [n] alike, got ", dtype_name(pages.scalar_type()), " ",
                    shape(pages), " and ", dtype_name(positions.scalar_type()), " ", shape(positions));
  const at::Tensor pg = pages.contiguous(), pos = positions.contiguous();
  at::Tensor page_of = at::empty_like(pos), slot = at::empty_like(pos), pages_for = at::empty_like(pos);
  const int64_t *g = pg.data_ptr<int64_t>(), *p = pos.data_ptr<int64_t>();
  int64_t *o = page_of.data_ptr<int64_t>(), *s = slot.data_ptr<int64_t>(), *n = pages_for.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0 && g[i] >= 0, "_geometry: position ", p[i], " on page ", g[i], "; expected both >= 0");
    o[i] = fms_geometry::page_of(p[i], page_size);
    s[i] = fms_geometry::slot(g[i], p[i], page_size);
    n[i] = fms_geometry::pages_for(p[i], page_size);
  }
  return {page_of, slot, pages_for};
}

}  // namespace fms_paged_ops

using namespace fms_paged_ops;

TORCH_LIBRARY_FRAGMENT(fms_paged, m) {
  m.def("_load_kernel(str kind, str path, ScalarType dtype, int head_dim=0) -> ()", &load_kernel);
  m.def("_kernel_loaded(str kind, ScalarType dtype, int head_dim=0) -> bool", &kernel_loaded);
  m.def("_configure_linear(int gemv_max_rows, int pack_min_weight, int pack_min_rows, ScalarType[] pack_dtypes, "
        "bool own_gemm=False, int[] own_gemv_rows=[]) -> ()",
        &configure_linear);
  m.def("_packed_data_ptrs() -> int[]", &packed_data_ptrs);
  m.def("_linear_path(Tensor x, int width) -> str", &linear_path_name);
  m.def("_packed_copy(Tensor weight) -> Tensor?", &packed_copy);
  m.def("_kernel_ns() -> int", &kernel_ns_total);
  m.def("_kernel_clock(bool on) -> bool", &set_kernel_clock);
  m.def("_geometry(Tensor pages, Tensor positions, int page_size) -> (Tensor, Tensor, Tensor)", &geometry);
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor page_table, Tensor chunks, SymInt page_size, "
      "float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def(
      "paged_attention_i8(Tensor q, Tensor k_pool, Tensor v_pool, Tensor k_scales, Tensor v_scales, Tensor page_table, "
      "Tensor chunks, SymInt page_size, float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def("gemv(Tensor x, Tensor[] weights) -> Tensor");
  m.def("gemm(Tensor x, Tensor[] weights) -> Tensor");
  m.def("linear(Tensor x, Tensor[] weights, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(fms_paged, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_i8", &paged_attention_i8);
  m.impl("gemv", &gemv);
  m.impl("gemm", &gemm);
  m.impl("linear", &linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("argmax", &argmax);
}
