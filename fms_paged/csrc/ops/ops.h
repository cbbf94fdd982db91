// What the operators' two sources share (ops/ops.cpp: the kernel registry, paged_attention,
// gemv, linear, rms_norm, argmax and the schemas; ops/layer.cpp: decoder_stack and
// decoder_logits): the kernels' storage types and argument structs, and how a loaded kernel is
// called.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "../kernels/args.h"
#include "../kernels/qgemv_blocks.h"
#include "../kernels/geometry.h"
#include "../kernels/kernels.h"

namespace fms_paged_ops {

// the storage types the kernels take, in this order: index e of a dtype (-1: none of them)
constexpr int kElems = 3;
inline int elem_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}
inline const char* elem_names = "torch.float32, torch.bfloat16, torch.float16";

// KV: the pools' storage type, T or int8_t (8-bit KV pages: the kernel "attention_i8")
template <class T, class KV = T>
struct AttentionArgs {
  FMS_PAGED_ATTENTION_FIELDS(FMS_PAGED_FIELD_DECL)
};
template <class T>
struct GemvArgs {
  FMS_PAGED_GEMV_FIELDS(FMS_PAGED_FIELD_DECL)
};
template <class T>
struct QgemvArgs {
  FMS_PAGED_QGEMV_FIELDS(FMS_PAGED_FIELD_DECL)
};
template <class T>
struct RowsArgs {
  FMS_PAGED_ROWS_FIELDS(FMS_PAGED_FIELD_DECL)
};

using KernelFn = int (*)(const void*);
// the loaded kernel of storage type e (and head dim), or null (ops/ops.cpp); attention_i8_fn:
// the attention kernel over int8 pools with fp32 row scales
KernelFn attention_fn(int e, int64_t head_dim);
KernelFn attention_i8_fn(int e, int64_t head_dim);
KernelFn gemv_fn(int e);
KernelFn rows_fn(int e);
// the GEMM kernel of storage type e where `linear` takes it past the GEMV's rows (configured and
// loaded: `_configure_linear`), else null
KernelFn linear_gemm_fn(int e);
KernelFn qgemv_fn(int e);  // products with GGUF blocks (kernels/qgemv.cpp)

inline int threads() { return at::get_num_threads(); }

// nanoseconds spent inside the kernels (every call of every thread of this process) while the
// kernel clock is on (`_kernel_clock`, off by default: a benchmark turns it on, through
// fms_paged.native.kernel_clock): what a step's host work is measured against (`_kernel_ns`)
inline std::atomic<int64_t> kernel_ns{0};
inline std::atomic<bool> kernel_clock_on{false};
template <class F>
int timed(F&& call) {
  if (!kernel_clock_on.load(std::memory_order_relaxed)) return call();
  const auto t0 = std::chrono::steady_clock::now();
  const int err = call();
  kernel_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
                          .count(),
                      std::memory_order_relaxed);
  return err;
}
// turn the kernel clock on or off -> whether it was on
inline bool set_kernel_clock(bool on) { return kernel_clock_on.exchange(on, std::memory_order_relaxed); }
inline int64_t kernel_ns_total() { return kernel_ns.load(std::memory_order_relaxed); }


std::string shape(const at::Tensor& t);  // "(2, 3)", as Python prints a shape
std::string shape(at::IntArrayRef sizes);
std::string dtype_name(at::ScalarType t);  // "torch.float32"
std::string py_float(double v);  // as Python's repr spells a float
// ValueError unless window >= 0, softcap 0 or a normal float32, sinks None or contiguous fp32 [H] on the CPU
void check_variants(int64_t H, int64_t window, double softcap, const std::optional<at::Tensor>& sinks);

// a pair of pools [1, Hkv, pool_tokens, D] as the kernels read them (ks, vs: int8 pools' row
// scales [1, Hkv, pool_tokens, 1] fp32, null for 16/32-bit pools)
struct PoolPtrs {
  void *k, *v;
  int64_t Hkv, pool_tokens;
  const float *ks = nullptr, *vs = nullptr;
};
inline PoolPtrs pool_ptrs(const at::Tensor& k_pool, const at::Tensor& v_pool) {
  return {k_pool.data_ptr(), v_pool.data_ptr(), k_pool.size(1), k_pool.size(2)};
}

// the kernel on q rows [tokens, H, D] at (q_st, q_sh) -> out [tokens, H, D]; ValueError for what it
// refuses
template <class T, class KV = T>
void run_attention(KernelFn fn, const void* q, int64_t q_st, int64_t q_sh, int64_t n_tokens, const PoolPtrs& pools,
                   const at::Tensor& page_table, const at::Tensor& chunks, int64_t H, int64_t page_size,
                   double scale, int64_t window, double softcap, const std::optional<at::Tensor>& sinks, void* out) {
  AttentionArgs<T, KV> a{};
  a.q = static_cast<const T*>(q), a.q_st = q_st, a.q_sh = q_sh, a.n_tokens = n_tokens;
  a.k = static_cast<KV*>(pools.k), a.v = static_cast<KV*>(pools.v), a.pool_tokens = pools.pool_tokens;
  a.k_scale = pools.ks, a.v_scale = pools.vs;
  a.pages = page_table.data_ptr<int32_t>(), a.n_seqs = page_table.size(0), a.pages_st = page_table.size(1);
  a.chunks = chunks.data_ptr<int64_t>(), a.n_chunks = chunks.size(0), a.out = static_cast<T*>(out);
  a.H = (int32_t)H, a.Hkv = (int32_t)pools.Hkv, a.P = (int32_t)page_size, a.scale = (float)scale;
  a.threads = threads(), a.softcap = (float)softcap, a.window = window;
  a.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  const int err = timed([&] { return fn(&a); });
  TORCH_CHECK_VALUE(err != 1, "paged_attention: nheads=", H, " over kvheads=", a.Hkv, " with page_size=", page_size,
                    ": heads must divide evenly and pages hold a multiple of 8");
  if (err) {
    const int64_t* c = a.chunks + 4 * (err - 2);
    TORCH_CHECK_VALUE(false, "paged_attention: chunk ", err - 2, " [", c[0], ", ", c[1], ", ", c[2], ", ", c[3],
                      "] (seq, first position, tokens, offset) is outside the page table (", a.n_seqs, " seqs x ",
                      a.pages_st, " pages of ", page_size, ") or the step's ", n_tokens, " tokens");
  }
}

template <class F>
void by_elem(int e, F&& f) {  // f(T{}) with T the kernels' storage type of index e
  if (e == 0) f(float{});
  else if (e == 1) f(fms_bf16{});
  else f(fms_f16{});
}

// the row-wise ops of the loaded rows kernel (kernels/rows.cpp; its ops and fields:
// kernels/kernels.h) for storage type T
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
    TORCH_CHECK(timed([&] { return fn(&a); }) == 0, "the rows kernel refused op ", a.op);
  }
  // out [M, n] = RMSNorm(x rows [M, n] at row stride st) with weight w
  void norm(const void* x, int64_t M, int64_t n, int64_t st, const void* w, void* out) const {
    RowsArgs<T> a = base();
    a.op = 0, a.M = M, a.n = n, a.x = static_cast<T*>(const_cast<void*>(x)), a.x_st = st;
    a.w = static_cast<const T*>(w), a.out = static_cast<T*>(out);
    call(a);
  }
  // index [M] = the first largest of each row of x [M, n] (row stride st)
  void argmax(const void* x, int64_t M, int64_t n, int64_t st, int64_t* index) const {
    RowsArgs<T> a = base();
    a.op = 5, a.M = M, a.n = n, a.x = static_cast<T*>(const_cast<void*>(x)), a.x_st = st, a.index = index;
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

// y [M, sum N_i] = x [M, K] (row stride x_st) @ [w_1; w_2; ...]^T by the GEMV kernel of index e
// (or the GEMM kernel: `fn` from linear_gemm_fn, whose struct is the GEMV's fields)
void run_gemv(KernelFn fn, int e, const void* x, int64_t M, int64_t K, int64_t x_st, const void* const* weights,
              const int64_t* rows, int64_t n_weights, void* y);

// GGUF block weights (ops/qlinear.cpp): a weight held as GGUF blocks is a contiguous uint8 CPU
// tensor [N, K / block values, block bytes] (kernels/qgemv_blocks.h: 34 Q8_0, 18 Q4_0, 22 Q5_0 of
// 32 values; 144 Q4_K, 176 Q5_K, 210 Q6_K of 256) -> its ggml type, or 0 for any other tensor;
// and K
int block_type(const at::Tensor& w);
inline int64_t block_cols(const at::Tensor& w) { return w.size(1) * fms_gguf::block_values(block_type(w)); }
// y [M, sum N_i] = x [M, K] (row stride x_st) @ [w_1; w_2; ...]^T by the qgemv kernel of index e,
// each w_i GGUF blocks of ggml type types[i]
void run_qgemv(KernelFn fn, int e, const void* x, int64_t M, int64_t K, int64_t x_st, const void* const* weights,
               const int64_t* rows, const int32_t* types, int64_t n_weights, void* y);
// the operator qlinear: x [..., K] @ [w_1; ...]^T (+ bias) for GGUF block weights
at::Tensor qlinear(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>& bias);
// the rows `tokens` [B, S] of an embedding held as GGUF blocks [V, C / 32, bytes], dequantized
// into `dtype` -> [B, S, C] (fp32 exactly; rounded once to bf16 / fp16)
at::Tensor block_embedding(const at::Tensor& blocks, const at::Tensor& tokens, at::ScalarType dtype);

// x [..., K] @ [w_1; w_2; ...]^T + bias by the path the rows call for (ops/ops.cpp), and the
// most rows it gives the GEMV kernel in storage type e
at::Tensor linear(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>& bias);
int64_t linear_gemv_rows(int e);
// RMSNorm of x [..., n] and the first largest of each row by the rows kernel (ops/ops.cpp)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);
at::Tensor argmax(const at::Tensor& x);

}  // namespace fms_paged_ops
