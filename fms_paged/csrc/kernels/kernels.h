// The argument structs of the project's CPU kernels, as field lists over the storage type T of
// their tensors (float, fms_bf16 or fms_f16; the attention kernel's pools: KV, T itself or int8_t
// for 8-bit KV pages): one list, read by the kernels (attention.cpp,
// gemv.cpp, rows.cpp: FMS_PAGED_ARGS) and by the operators that call them (ops/ops.cpp), which
// compares its layout of each struct with the one the kernel library spells before it calls it.
#pragma once

#include "args.h"

// q[t, h, :] (t < n_tokens, the step's query tokens) at q + t * q_st + h * q_sh; k, v: the pools
// [Hkv, pool_tokens, D]; pages: the page table [n_seqs, pages_st]; chunks: [n_chunks, 4] (seq, q0,
// n, offset); out: [n_tokens, H, D]; P: tokens per page; scale: the scores' factor; threads: at
// most this many; softcap: the logit soft-cap (0: none); window: keys seen per query (0: all);
// sinks: [H] fp32 logits, one per query head (null: none); k_scale, v_scale: with int8 pools (KV =
// int8_t), the fp32 scale of each key's and value's row [Hkv, pool_tokens] (a row dequantizes to
// its int8 values times its scale; null with 16/32-bit pools). The step's own keys and values are
// in the pools already (written by the caller's ASSIGN).
#define FMS_PAGED_ATTENTION_FIELDS(X)                                                          \
  X(const T*, q) X(int64_t, q_st) X(int64_t, q_sh) X(int64_t, n_tokens)                        \
  X(KV*, k) X(KV*, v) X(int64_t, pool_tokens)                                                  \
  X(const int32_t*, pages) X(int64_t, n_seqs) X(int64_t, pages_st)                             \
  X(const int64_t*, chunks) X(int64_t, n_chunks) X(T*, out)                                    \
  X(int32_t, H) X(int32_t, Hkv) X(int32_t, P) X(float, scale) X(int32_t, threads)              \
  X(float, softcap) X(int64_t, window) X(const float*, sinks)                                  \
  X(const float*, k_scale) X(const float*, v_scale)

// y [M, sum of rows] = x [M, K] (row stride x_st) times each weight weights[i] [rows[i], K]^T
// (i < n_weights, each row-major), side by side; threads: at most this many.
#define FMS_PAGED_GEMV_FIELDS(X)                                                                \
  X(const T*, x) X(int64_t, M) X(int64_t, K) X(int64_t, x_st)                                   \
  X(const T* const*, weights) X(const int64_t*, rows) X(int64_t, n_weights)                     \
  X(T*, y) X(int32_t, threads)

// the same for many rows (prefill steps: gemm.cpp, which reads the weights where they lie as the
// GEMV kernel does; its own struct name, so that neither library passes for the other)
#define FMS_PAGED_GEMM_FIELDS(X) FMS_PAGED_GEMV_FIELDS(X)
// y [M, sum of rows] = x [M, K] (row stride x_st) times each weight weights[i] [rows[i], K]^T held
// as GGUF blocks (ggml type types[i]: 8 Q8_0, 2 Q4_0, 6 Q5_0, 12 Q4_K, 13 Q5_K, 14 Q6_K; rows of
// K / 32 or K / 256 blocks, raw bytes: qgemv_blocks.h), side
// by side; threads: at most this many (kernels/qgemv.cpp).
#define FMS_PAGED_QGEMV_FIELDS(X)                                                               \
  X(const T*, x) X(int64_t, M) X(int64_t, K) X(int64_t, x_st)                                   \
  X(const int8_t* const*, weights) X(const int64_t*, rows) X(const int32_t*, types)             \
  X(int64_t, n_weights) X(T*, y) X(int32_t, threads)

// op on M rows (threads: at most this many), what a decoder block does between its projections:
// - 0 (RMSNorm): out [M, n] = norm(x rows [M, n] at row stride x_st) with weight w, eps and
//   unit_offset (1: Gemma's (1 + w));
// - 1 (residual): x rows [M, n] (row stride x_st) += h [M, n] times multiplier (1: none);
// - 2 (q/k/v): x rows [M, (H + 2 Hkv) D] (row stride x_st) in place: + q_bias [H D], k_bias and
//   v_bias [Hkv D] (all three, or all null), the q and k heads normalised by q_norm / k_norm ([D], or null; eps, unit_offset), RoPE
//   by cos / sin [M, D] (fp32), then the k and v heads written to slot slots[m] of k_pool / v_pool
//   [Hkv, pool_tokens, D]; with k_scale / v_scale (8-bit KV pages), written instead as int8 to
//   k_pool8 / v_pool8 [Hkv, pool_tokens, D], each head's row quantized once (symmetric, scale =
//   its absmax / 127, rounded to nearest even, as fms_paged.kv.quant does) with its scale at
//   k_scale / v_scale [Hkv, pool_tokens];
// - 3, 4 (SiLU, tanh-GELU times up): out [M, n] = act(x[:, :n]) * x[:, n:] for x rows [M, 2n]
//   (row stride x_st);
// - 5 (argmax): index [M] = the index of the first largest of each x row [n] (row stride x_st),
//   the first NaN's where a row has one (torch.argmax's answer).
#define FMS_PAGED_ROWS_FIELDS(X)                                                                  \
  X(int32_t, op) X(int64_t, M) X(int64_t, n) X(T*, x) X(int64_t, x_st) X(const T*, h)             \
  X(const T*, w) X(T*, out) X(float, eps) X(int32_t, unit_offset) X(float, multiplier)            \
  X(const T*, q_bias) X(const T*, k_bias) X(const T*, v_bias) X(const T*, q_norm) X(const T*, k_norm) X(const float*, cos)                  \
  X(const float*, sin) X(const int64_t*, slots) X(T*, k_pool) X(T*, v_pool)                       \
  X(int64_t, pool_tokens) X(int32_t, H) X(int32_t, Hkv) X(int32_t, D) X(int32_t, threads)         \
  X(int64_t*, index) X(int8_t*, k_pool8) X(int8_t*, v_pool8) X(float*, k_scale) X(float*, v_scale)
