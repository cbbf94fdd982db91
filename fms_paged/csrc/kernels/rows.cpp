// The row-wise work of a decoder block, on M token rows at once, for `fms_paged::decoder_stack`
// (csrc/ops/layer.cpp): RMSNorm, the residual add, the q/k/v rows' bias, q/k norms, RoPE
// and ASSIGN, and the gated activation. Built and loaded by fms_paged/native once per storage
// type T of the rows and weights (-DFMS_ELEM: float, fms_bf16 or fms_f16), for the CPU's own
// vectors (csrc/kernels/vec.h), like the GEMV and attention kernels.
//
// Each op computes what the blocks' modules compute (fms_paged/modules/norm.py, positions.py,
// feedforward.py, models/llama.py LLaMABlock) and rounds to T where they round: fp32 inside, each
// product and sum rounded on its own (no contraction into FMAs, as ATen's pointwise ops), so a
// fused step differs from the modules only by the order of RMSNorm's sum. A prefill step's rows
// are spread over the threads, a decode step's few run on the calling thread.
#pragma GCC optimize("fp-contract=off")
#include <omp.h>

#include "args.h"
#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef FMS_ELEM
#error "compile with -DFMS_ELEM=<float, fms_bf16 or fms_f16>: the storage type of the rows and weights"
#endif

namespace {

using fms_vec::from_f32;
using fms_vec::to_f32;
using T = FMS_ELEM;
constexpr int W = fms_vec::NATIVE;
using vf = fms_vec::vec<W>;
inline vf load(const T* p) { return fms_vec::load<W>(p); }
inline vf loadf(const float* p) { return fms_vec::load<W>(p); }
inline void store(T* p, vf v) { fms_vec::store<W>(p, v); }
inline vf splat(float x) { return fms_vec::splat<W>(x); }
inline vf round(vf v) { return fms_vec::round_to<T, W>(v); }
inline float round(float v) { return to_f32(from_f32<T>(v)); }
constexpr int64_t GRAIN = int64_t(1) << 14;  // elements per thread, at least

enum Op { NORM = 0, RESIDUAL = 1, QKV = 2, SILU_MUL = 3, GELU_MUL = 4, ARGMAX = 5 };

struct Args {
  FMS_PAGED_ROWS_FIELDS(FMS_PAGED_FIELD_DECL)
};

// RMSNorm of row r [n] into o [n]: x / rms(x) in fp32, then with unit_offset (Gemma) times
// (1 + w) in fp32 and rounded once, else rounded and then scaled by w in T (LLaMA)
void norm_row(const T* r, int64_t n, const T* w, float eps, bool unit_offset, T* o) {
  const int64_t nv = n / W * W;
  vf acc = splat(0.0f);
  for (int64_t i = 0; i < nv; i += W) {
    const vf v = load(r + i);
    acc += v * v;
  }
  float ss = 0.0f;
  for (int i = 0; i < W; ++i) ss += acc[i];
  for (int64_t i = nv; i < n; ++i) ss += to_f32(r[i]) * to_f32(r[i]);
  const float inv = 1.0f / std::sqrt(ss / (float)n + eps);
  for (int64_t i = 0; i < nv; i += W) {
    const vf h = load(r + i) * inv;
    store(o + i, unit_offset ? h * (1.0f + load(w + i)) : load(w + i) * round(h));
  }
  for (int64_t i = nv; i < n; ++i) {
    const float h = to_f32(r[i]) * inv;
    o[i] = from_f32<T>(unit_offset ? h * (1.0f + to_f32(w[i])) : to_f32(w[i]) * round(h));
  }
}

// x + h (h times the multiplier, rounded, unless it is 1), rounded: the residual stream's update
void residual_row(T* x, const T* h, int64_t n, float mult) {
  const int64_t nv = n / W * W;
  for (int64_t i = 0; i < nv; i += W) {
    const vf v = mult == 1.0f ? load(h + i) : round(load(h + i) * mult);
    store(x + i, load(x + i) + v);
  }
  for (int64_t i = nv; i < n; ++i) {
    const float v = mult == 1.0f ? to_f32(h[i]) : round(to_f32(h[i]) * mult);
    x[i] = from_f32<T>(to_f32(x[i]) + v);
  }
}

// the lanes' pairs swapped: (x1, x0, x3, x2, ...)
inline vf swap_pairs(vf v) {
#if (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)) && FMS_VEC_NATIVE == 16
  return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#else
  vf r;
  for (int i = 0; i < W; ++i) r[i] = v[i ^ 1];
  return r;
#endif
}

// RoPE on one head's interleaved pairs in place: x[d] cos[d] + x[d ^ 1] sin[d] (sin carries the
// pair's sign, as `RotaryEmbedding` lays the tables out), each product and the sum in fp32
void rope_head(T* x, const float* cos, const float* sin, int64_t D) {
  const int64_t nv = D / W * W;
  for (int64_t d = 0; d < nv; d += W) {
    const vf v = load(x + d);
    store(x + d, v * loadf(cos + d) + swap_pairs(v) * loadf(sin + d));
  }
  for (int64_t d = nv; d < D; d += 2) {
    const float a = to_f32(x[d]), b = to_f32(x[d + 1]);
    x[d] = from_f32<T>(a * cos[d] + b * sin[d]), x[d + 1] = from_f32<T>(b * cos[d + 1] + a * sin[d + 1]);
  }
}

// x [n] += b [n]
void add_row(T* x, const T* b, int64_t n) {
  const int64_t nv = n / W * W;
  for (int64_t j = 0; j < nv; j += W) store(x + j, load(x + j) + load(b + j));
  for (int64_t j = nv; j < n; ++j) x[j] = from_f32<T>(to_f32(x[j]) + to_f32(b[j]));
}

// one head's row x [D] as int8 q [D] and its scale: symmetric, scale = absmax / 127 (0 for an
// all-zero row, whose q is 0), q = x / scale rounded to nearest even: fms_paged.kv.quant.quantize's
// operations in the same fp32 order, so either writer stores the same bytes
void quantize_head(const T* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_f32(x[d])));
  const float s = amax / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int64_t d = 0; d < D; ++d)
    q[d] = (int8_t)std::clamp(std::nearbyint(to_f32(x[d]) * inv), -127.0f, 127.0f);
  *scale = s;
}

// row m of the q/k/v projection [(H + 2 Hkv) D] in place: + biases, q/k norms, RoPE; then its k
// and v heads ASSIGNed to slot slots[m] of the pools [Hkv, pool_tokens, D]
void qkv_row(const Args& a, int64_t m, T* tmp) {
  const int64_t D = a.D, q_width = a.H * D, kv_width = a.Hkv * D;
  T* row = a.x + m * a.x_st;
  if (a.q_bias) {  // the model's own bias vectors, one per projection
    add_row(row, a.q_bias, q_width);
    add_row(row + q_width, a.k_bias, kv_width);
    add_row(row + q_width + kv_width, a.v_bias, kv_width);
  }
  for (int64_t h = 0; h < a.H + a.Hkv; ++h) {
    T* head = row + h * D;
    const T* norm = h < a.H ? a.q_norm : a.k_norm;
    if (norm) {
      norm_row(head, D, norm, a.eps, a.unit_offset, tmp);
      std::memcpy(head, tmp, D * sizeof(T));
    }
    rope_head(head, a.cos + m * D, a.sin + m * D, D);
  }
  const int64_t slot = a.slots[m];
  for (int64_t g = 0; g < a.Hkv; ++g) {
    const int64_t at = g * a.pool_tokens + slot;
    if (a.k_scale) {  // 8-bit KV pages
      quantize_head(row + (a.H + g) * D, D, a.k_pool8 + at * D, a.k_scale + at);
      quantize_head(row + (a.H + a.Hkv + g) * D, D, a.v_pool8 + at * D, a.v_scale + at);
      continue;
    }
    std::memcpy(a.k_pool + at * D, row + (a.H + g) * D, D * sizeof(T));
    std::memcpy(a.v_pool + at * D, row + (a.H + a.Hkv + g) * D, D * sizeof(T));
  }
}

// silu(g) = g / (1 + e^-g); tanh-approximated GELU 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
inline vf silu(vf g) { return g / (1.0f + fms_vec::vexp<W>(-g)); }
inline vf gelu_tanh(vf g) {
  return 0.5f * g * (1.0f + fms_vec::vtanh<W>(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// out[m] [n] = act(gate) rounded, times up, rounded: row x[m] is [gate (n) | up (n)]
void act_row(const T* x, int64_t n, bool gelu, T* o) {
  const int64_t nv = n / W * W;
  for (int64_t j = 0; j < nv; j += W) {
    const vf g = load(x + j);
    store(o + j, round(gelu ? gelu_tanh(g) : silu(g)) * load(x + n + j));
  }
  if (nv < n) {  // the tail through one padded vector
    float g[W] = {}, up[W] = {};
    for (int64_t j = nv; j < n; ++j) g[j - nv] = to_f32(x[j]), up[j - nv] = to_f32(x[n + j]);
    const vf gv = loadf(g);
    const vf r = round(gelu ? gelu_tanh(gv) : silu(gv)) * loadf(up);
    for (int64_t j = nv; j < n; ++j) o[j] = from_f32<T>(r[j - nv]);
  }
}

// the index of the first largest of row r [n], or of its first NaN (torch.argmax's answer): each
// lane keeps its largest and where it first saw it (a strict >, so the earliest of equals), then
// the lanes' largest with the smallest index; a row with a NaN is scanned again for the first
int64_t argmax_row(const T* r, int64_t n) {
  const int64_t nv = n / W * W;
  float best = n ? to_f32(r[0]) : 0.0f;
  int64_t at = 0;
  bool nan = best != best;
  if (nv) {
    vf mv = load(r);
    using vi = fms_vec::ivec<W>;
    vi idx, where;
    for (int i = 0; i < W; ++i) idx[i] = i;
    where = idx;
    vi seen_nan = mv != mv;
    for (int64_t i = W; i < nv; i += W) {
      idx += W;
      const vf v = load(r + i);
      const vi gt = v > mv;
      mv = gt ? v : mv, where = gt ? idx : where, seen_nan |= v != v;
    }
    best = mv[0], at = where[0];
    for (int i = 0; i < W; ++i) {
      nan |= seen_nan[i] != 0;
      if (mv[i] > best || (mv[i] == best && where[i] < at)) best = mv[i], at = where[i];
    }
  }
  for (int64_t i = std::max<int64_t>(nv, 1); i < n; ++i) {  // the tail (all of a row shorter than W)
    const float v = to_f32(r[i]);
    nan |= v != v;
    if (v > best) best = v, at = i;
  }
  if (nan)
    for (int64_t i = 0; i < n; ++i)
      if (to_f32(r[i]) != to_f32(r[i])) return i;
  return at;
}

void run_rows(const Args& a, int64_t m0, int64_t m1) {
  alignas(64) T tmp[1024];  // one normalised head (D <= 1024)
  for (int64_t m = m0; m < m1; ++m) {
    switch (a.op) {
      case NORM: norm_row(a.x + m * a.x_st, a.n, a.w, a.eps, a.unit_offset, a.out + m * a.n); break;
      case RESIDUAL: residual_row(a.x + m * a.x_st, a.h + m * a.n, a.n, a.multiplier); break;
      case QKV: qkv_row(a, m, tmp); break;
      case ARGMAX: a.index[m] = argmax_row(a.x + m * a.x_st, a.n); break;
      default: act_row(a.x + m * a.x_st, a.n, a.op == GELU_MUL, a.out + m * a.n); break;
    }
  }
}

}  // namespace

// The kernel's arguments: the struct of FMS_PAGED_ROWS_FIELDS (kernels/kernels.h, which says what
// each op reads and writes), its layout checked by the operators as the other kernels' are.
extern "C" {

FMS_PAGED_ARGS(FmsRowsArgs, FMS_PAGED_ROWS_FIELDS, fms_paged_rows_layout)

// 0, or 1: an op or a head dim the kernel does not take (nothing written)
int fms_paged_rows(const FmsRowsArgs* args) {
  Args a;
  static_assert(sizeof(Args) == sizeof(FmsRowsArgs), "one field list");
  std::memcpy(&a, args, sizeof a);
  if (a.op < NORM || a.op > ARGMAX || (a.op == QKV && (a.D <= 0 || a.D > 1024 || a.D % 2)) || a.M < 0)
    return 1;
  const int64_t per_row = a.op == QKV ? (a.H + 2 * (int64_t)a.Hkv) * a.D : a.n;
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(a.threads, a.M * per_row / GRAIN));
  if (threads == 1) {
    run_rows(a, 0, a.M);
    return 0;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    run_rows(a, a.M * t / n, a.M * (t + 1) / n);
  }
  return 0;
}

}  // extern "C"
