// Products of many rows with row-major weights, y = x W^T, for prefill steps: the same plain
// [N, K] weights the GEMV kernel (gemv.cpp) reads, so that a CPU model holds each weight once (no
// packed copy of it in another layout kept beside it). Built and loaded by fms_paged/native once
// per storage type T of x, the weights and y (-DFMS_ELEM: float, fms_bf16 or fms_f16); the dot
// products accumulate in fp32.
//
// The driver, the panels and the register tiles are panels.h's (shared with qgemv.cpp's prefill);
// this file packs plain weight rows into them: a copy and a transpose, 16 x 16 words at a time in
// registers with AVX-512, 8 x 8 with AVX2, else word by word.
// - AVX512_BF16, bf16 (FMS_VEC_BF16_DP): the panel holds bf16 pairs (the VNNI layout), x is read as
//   stored.
// - Otherwise (fp32; fp16; bf16 without AVX512_BF16; AVX2 and baseline builds): the panel holds
//   the weights converted to fp32, and x is converted to fp32 once per call.
//
// Calls of every row count take panels. Calls of few rows repay the packing least: where
// `linear` takes this kernel, those of too few rows run the GEMV kernel instead (the rule's one
// place: fms_paged/native/gemm.py, OWN_GEMV_MAX_ROWS).
#include "args.h"
#include "kernels.h"
#include "panels.h"
#include "vec.h"

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef FMS_ELEM
#error "compile with -DFMS_ELEM=<float, fms_bf16 or fms_f16>: the storage type of x, the weights and y"
#endif

namespace {

using fms_vec::to_f32;
using T = FMS_ELEM;
constexpr bool DP = FMS_VEC_BF16_DP;  // bf16 pair panels (panels.h)
using X = fms_panels::Words<DP>::X;  // x as stored (bf16 pairs), else converted once (fms_vec::rows_as)
using P = fms_panels::Words<DP>::P;  // panel values: bf16, in pairs, else fp32
constexpr int KU = fms_panels::Words<DP>::KU;  // values of K per step (per 32-bit panel word)
using fms_panels::NC;

// the weights' rows as one stack: row r of the call's [sum of rows, K] matrix
struct Rows {
  const T* const* w;      // the weights, [rows[i], K] each
  const int64_t* first;   // first[i]: the stack's first row of weight i; first[n] = all rows
  int n;
  const T* row(int64_t r, int& i, int64_t K) const {  // i: a weight at or before r's (advanced)
    while (r >= first[i + 1]) ++i;
    return w[i] + (r - first[i]) * K;
  }
};

// panel <- rows [r0, r0 + nc) of the stack, steps [s_begin, s_end) of K, K-major:
// panel[((s - s_begin) NC + c) KU + u] = W[r0 + c, s KU + u] (in P), zeros past K and past nc. A
// panel is a transpose of 32-bit words (a bf16 pair, or one fp32 value): blocks of 16 x 16 words in
// registers with AVX-512, 8 x 8 with AVX2, else word by word.
#if FMS_VEC_NATIVE == 16 && defined(__AVX512F__)
// the 16 words of a weight row from step s0 on, in P, as one vector: `whole` when they lie
// inside K, else zeros past K (the last steps copied into a zeroed buffer first, so an odd K's
// last pair ends with a zero)
template <bool whole>
inline __m512i words(const T* w, int64_t s0, int64_t K) {
  constexpr int E = 16 * KU;  // values of K in 16 words
  const int64_t k0 = s0 * KU;
  const T* p = w + k0;
  T tail[E];
  if constexpr (!whole) {
    for (int e = 0; e < E; ++e) tail[e] = k0 + e < K ? w[k0 + e] : T{};
    p = tail;
  }
#if FMS_VEC_BF16_DP
  return _mm512_loadu_si512(p);
#else
  return (__m512i)fms_vec::load<16>(p);  // (converted to fp32)
#endif
}

void pack(const Rows& rows, int64_t r0, int64_t nc, int64_t K, int64_t s_begin, int64_t s_end, P* panel) {
  const T* w[NC];
  int seg = 0;
  for (int64_t c = 0; c < nc; ++c) w[c] = rows.row(r0 + c, seg, K);
  char* out = reinterpret_cast<char*>(panel);  // 4-byte words, NC a step
  const auto block = [&](int64_t c0, int64_t s0, auto whole) {  // columns c0.., steps s0.. (16 each)
    __m512i r[16];
    if (c0 + 16 <= nc) {
      for (int i = 0; i < 16; ++i) r[i] = words<decltype(whole)::value>(w[c0 + i], s0, K);
    } else {
      for (int i = 0; i < 16; ++i) r[i] = c0 + i < nc ? words<decltype(whole)::value>(w[c0 + i], s0, K) : _mm512_setzero_si512();
    }
    fms_panels::transpose16(r);
    for (int64_t e = 0; e < 16 && s0 + e < s_end; ++e)
      _mm512_store_si512(out + ((s0 - s_begin + e) * NC + c0) * 4, r[e]);
  };
  const int64_t inside = K / (16 * KU) * 16;  // steps in whole blocks of 16 words
  for (int64_t s0 = s_begin; s0 < s_end; s0 += 16)  // (s_begin: a multiple of 16)
    for (int64_t c0 = 0; c0 < NC; c0 += 16) {
      if (s0 < inside)
        block(c0, s0, std::true_type{});
      else
        block(c0, s0, std::false_type{});
    }
}
#elif FMS_VEC_NATIVE == 8 && defined(__AVX2__)
// AVX2 (fp32 panels, 16 columns): blocks of 8 x 8 values, each row's 8 converted to fp32 as loaded
// (zeros past K: the last steps copied into a zeroed buffer first)
template <bool whole>
inline __m256 values8(const T* w, int64_t k0, int64_t K) {
  if constexpr (whole) return (__m256)fms_vec::load<8>(w + k0);
  T tail[8];
  for (int e = 0; e < 8; ++e) tail[e] = k0 + e < K ? w[k0 + e] : T{};
  return (__m256)fms_vec::load<8>(tail);
}

void pack(const Rows& rows, int64_t r0, int64_t nc, int64_t K, int64_t s_begin, int64_t s_end, P* panel) {
  const T* w[NC];
  int seg = 0;
  for (int64_t c = 0; c < nc; ++c) w[c] = rows.row(r0 + c, seg, K);
  const auto block = [&](int64_t c0, int64_t s0, auto whole) {  // columns c0.., steps s0.. (8 each)
    __m256 r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = c0 + i < nc ? values8<decltype(whole)::value>(w[c0 + i], s0, K) : _mm256_setzero_ps();
    fms_panels::transpose8(r);
    for (int64_t e = 0; e < 8 && s0 + e < s_end; ++e) _mm256_storeu_ps(panel + (s0 - s_begin + e) * NC + c0, r[e]);
  };
  const int64_t inside = K / 8 * 8;  // steps in whole blocks of 8
  for (int64_t s0 = s_begin; s0 < s_end; s0 += 8)  // (s_begin: a multiple of 16)
    for (int64_t c0 = 0; c0 < NC; c0 += 8) {
      if (s0 < inside)
        block(c0, s0, std::true_type{});
      else
        block(c0, s0, std::false_type{});
    }
}
#else
void pack(const Rows& rows, int64_t r0, int64_t nc, int64_t K, int64_t s_begin, int64_t s_end, P* panel) {
  int seg = 0;
  for (int64_t c = 0; c < NC; ++c) {
    const T* w = c < nc ? rows.row(r0 + c, seg, K) : nullptr;
    for (int64_t k = s_begin * KU; k < s_end * KU; ++k)
      panel[((k / KU - s_begin) * NC + c) * KU + k % KU] = w && k < K ? P(to_f32(w[k])) : P{};
  }
}
#endif

}  // namespace

// The kernel's arguments, passed by pointer: the struct of FMS_PAGED_GEMM_FIELDS
// (kernels/kernels.h), checked by the operator that calls it (csrc/ops/ops.cpp) against its own
// layout of the struct when it loads the library.
extern "C" {

FMS_PAGED_ARGS(FmsGemmArgs, FMS_PAGED_GEMM_FIELDS, fms_paged_gemm_layout)

int fms_paged_gemm(const FmsGemmArgs* args) {
  const FmsGemmArgs& a = *args;
  const int64_t M = a.M, K = a.K;
  std::vector<float> xf;
  int64_t x_st = a.x_st;
  const X* x = fms_vec::rows_as<X>(a.x, M, K, x_st, xf);
  std::vector<int64_t> first{0};
  for (int i = 0; i < (int)a.n_weights; ++i) first.push_back(first.back() + a.rows[i]);
  const Rows rows{a.weights, first.data(), (int)a.n_weights};
  const auto pack_rows = [&](int64_t r0, int64_t nc, int64_t s_begin, int64_t s_end, P* panel, void*) {
    pack(rows, r0, nc, K, s_begin, s_end, panel);
  };
  const auto span = [&](int64_t r, int64_t k0, int64_t k1) {
    int seg = 0;
    return std::pair<const void*, int64_t>(rows.row(r, seg, K) + k0, (k1 - k0) * (int64_t)sizeof(T));
  };
  fms_panels::run<DP>(M, K, first.back(), x, x_st, a.y, a.threads, 16, 0, pack_rows, span);
  return 0;
}

}  // extern "C"
