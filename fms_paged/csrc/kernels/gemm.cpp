// Products of many rows with row-major weights, y = x W^T, for prefill steps: the same plain
// [N, K] weights the GEMV kernel (gemv.cpp) reads, so that a CPU model holds each weight once (no
// packed copy of it in another layout kept beside it). Built and loaded by fms_paged/native once
// per storage type T of x, the weights and y (-DFMS_ELEM: float, fms_bf16 or fms_f16); the dot
// products accumulate in fp32.
//
// Packing on the fly (GotoBLAS / BLIS's way): a thread takes NC weight rows (output columns) at a
// time and copies them into its own panel, K-major, NC columns per step of K: the layout a
// broadcast tile reads with whole-vector loads and no reduction across lanes. The panel (K x NC
// values: 80 KB of bf16 at K = 640, 256 KB at K = 2048) stays in L2 while every row of x passes
// over it MR rows at a time; its cost (one read of the weights) is spread over the M rows, which
// is why the GEMV kernel takes the calls of a few rows. The register tile is MR rows of x by NC
// columns: MR x NV accumulator vectors, each holding W consecutive outputs of one row, and a step
// of K loads NV vectors of the panel and broadcasts one value (a pair) of each of the MR rows.
// - AVX512_BF16, bf16 (FMS_VEC_BF16_DP): the panel holds bf16 pairs, [ceil(K / 2)][NC][2] (the
//   VNNI layout), x's pairs are broadcast as 32-bit words and vdpbf16ps takes 16 outputs x 2
//   products a step (exact products, fp32 sums); an odd K's last pair has a zero in its second
//   half on both sides.
// - Otherwise (fp32; fp16; bf16 without AVX512_BF16; AVX2 and baseline builds): the panel holds
//   the weights converted to fp32 ([K][NC]), x is converted to fp32 once per call, and each step
//   is one fp32 multiply-add per output.
// Columns past the last weight row of a panel are zeros in it, and are not stored.
//
// Threads take panels one at a time (dynamic: a shared machine serves them unevenly; no barrier
// but the last). A row's result does not depend on the thread count or on its place among the
// rows: each output sums its products in K's order in one lane of one accumulator.
#include <omp.h>

#include "args.h"
#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#ifndef FMS_ELEM
#error "compile with -DFMS_ELEM=<float, fms_bf16 or fms_f16>: the storage type of x, the weights and y"
#endif

namespace {

using fms_vec::to_f32;
using T = FMS_ELEM;
constexpr int W = fms_vec::NATIVE;  // floats per vector: one register
using vf = fms_vec::vec<W>;
// the tile: MR rows of x by NV vectors of W columns: MR x NV accumulators, NV loads of the panel
// and MR broadcasts a step. AVX-512: 24 of the 32 registers (6 x 4, 64 columns); 8 lanes (AVX2's
// 16 registers): 12 (6 x 2, 16 columns)
#if FMS_VEC_NATIVE == 16
#if FMS_VEC_BF16_DP
constexpr int MR = 6, NV = 4;
#else
constexpr int MR = 6, NV = 4;
#endif
#else
constexpr int MR = 6, NV = 2;
#endif
constexpr int NC = NV * W;  // columns (weight rows) per panel
constexpr int64_t GRAIN = int64_t(1) << 17;  // multiply-adds per thread, at least (as the GEMV)

#if FMS_VEC_BF16_DP
using X = T;      // x as stored: bf16 pairs
using P = T;      // panel values: bf16, in pairs
constexpr int KU = 2;  // values of K per step (per 32-bit panel word)
#else
using X = float;  // x converted once (fms_vec::rows_as)
using P = float;  // panel values: fp32
constexpr int KU = 1;
#endif

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

// panel <- rows [r0, r0 + nc) of the stack, K-major: panel[(s NC + c) KU + u] = W[r0 + c, s KU + u]
// (in P), zeros past K and past nc. A panel is a transpose of 32-bit words (a bf16 pair, or one
// fp32 value): with AVX-512, blocks of 16 x 16 words in registers; otherwise word by word.
constexpr int64_t steps_of(int64_t K) { return (K + KU - 1) / KU; }  // words of K: a panel's steps
#if FMS_VEC_NATIVE == 16 && defined(__AVX512F__)
// the 16 words of a weight row from step s0 on, in P, as one vector (zeros past K: the last
// steps copied into a zeroed buffer first, so an odd K's last pair ends with a zero)
inline __m512i words(const T* w, int64_t s0, int64_t K) {
  constexpr int E = 16 * KU;  // values of K in 16 words
  const int64_t k0 = s0 * KU;
  T tail[E];
  const T* p = w + k0;
  if (k0 + E > K) {
    for (int e = 0; e < E; ++e) tail[e] = k0 + e < K ? w[k0 + e] : T{};
    p = tail;
  }
#if FMS_VEC_BF16_DP
  return _mm512_loadu_si512(p);
#else
  return (__m512i)fms_vec::load<16>(p);  // (converted to fp32)
#endif
}

// r[e] <- the e-th words of r[0..15] (a 16 x 16 transpose of 32-bit words)
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // in each 128-bit lane: words (0, 1) and (2, 3) of two rows
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + j], lane L: word 4 L + j of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // the 4 x 4 lanes of u[j], u[4 + j], u[8 + j], u[12 + j]
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

void pack(const Rows& rows, int64_t r0, int64_t nc, int64_t K, P* panel) {
  const int64_t steps = steps_of(K);
  const T* w[NC];
  int seg = 0;
  for (int64_t c = 0; c < nc; ++c) w[c] = rows.row(r0 + c, seg, K);
  char* out = reinterpret_cast<char*>(panel);  // 4-byte words, NC a step
  for (int64_t c0 = 0; c0 < NC; c0 += 16)
    for (int64_t s0 = 0; s0 < steps; s0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = c0 + i < nc ? words(w[c0 + i], s0, K) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t e = 0; e < 16 && s0 + e < steps; ++e)
        _mm512_store_si512(out + ((s0 + e) * NC + c0) * 4, r[e]);
    }
}
#else
void pack(const Rows& rows, int64_t r0, int64_t nc, int64_t K, P* panel) {
  const int64_t steps = steps_of(K);
  int seg = 0;
  for (int64_t c = 0; c < NC; ++c) {
    const T* w = c < nc ? rows.row(r0 + c, seg, K) : nullptr;
    for (int64_t k = 0; k < steps * KU; ++k) panel[(k / KU * NC + c) * KU + k % KU] = w && k < K ? P(to_f32(w[k])) : P{};
  }
}
#endif

// y[i, j] for i < mr, j < nc (nc <= NC; y's row stride y_st) from the mr rows of x over a panel
template <int mr>
void tile(const X* x, int64_t x_st, int64_t K, const P* panel, int64_t nc, T* y, int64_t y_st) {
  vf acc[mr][NV];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = fms_vec::splat<W>(0.0f);
#if FMS_VEC_BF16_DP
  const auto step = [&](const P* b, auto pair) {
    __m512i bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_si512(b + j * W * 2);
    for (int i = 0; i < mr; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair(i));
      for (int j = 0; j < NV; ++j) acc[i][j] = (vf)_mm512_dpbf16_ps((__m512)acc[i][j], xv, (__m512bh)bv[j]);
    }
  };
  const int64_t whole = K / 2;
  for (int64_t s = 0; s < whole; ++s)
    step(panel + s * NC * 2, [&](int i) {
      int32_t u;
      std::memcpy(&u, x + i * x_st + 2 * s, 4);
      return u;
    });
  if (K % 2)  // the last value of each row, a zero beside it (not the next row's value)
    step(panel + whole * NC * 2, [&](int i) { return (int32_t)x[i * x_st + K - 1].bits; });
#else
  for (int64_t k = 0; k < K; ++k) {
    const P* b = panel + k * NC;
    vf bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = fms_vec::load<W>(b + j * W);
    for (int i = 0; i < mr; ++i) {
      const vf xv = fms_vec::splat<W>(x[i * x_st + k]);
      for (int j = 0; j < NV; ++j) acc[i][j] += xv * bv[j];
    }
  }
#endif
  for (int i = 0; i < mr; ++i) {
    if (nc == NC) {
      for (int j = 0; j < NV; ++j) fms_vec::store<W>(y + i * y_st + j * W, acc[i][j]);
    } else {
      T out[NC];
      for (int j = 0; j < NV; ++j) fms_vec::store<W>(out + j * W, acc[i][j]);
      std::memcpy(y + i * y_st, out, nc * sizeof(T));
    }
  }
}

// the last rows of x (fewer than MR): one tile of `left` rows
template <int mr>
void rest(int64_t left, const X* x, int64_t x_st, int64_t K, const P* panel, int64_t nc, T* y, int64_t y_st) {
  if constexpr (mr > 0) {
    if (left == mr) return tile<mr>(x, x_st, K, panel, nc, y, y_st);
    rest<mr - 1>(left, x, x_st, K, panel, nc, y, y_st);
  }
}

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
  const int64_t N = first.back();
  const int64_t panels = (N + NC - 1) / NC;
  const int64_t by_work = std::max<int64_t>(1, M * N * K / GRAIN);
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)a.threads, panels, by_work}));
  const size_t panel_bytes = (size_t)((K + KU - 1) / KU * KU) * NC * sizeof(P);
  T* y = a.y;
#pragma omp parallel num_threads(threads)
  {
    // this thread's panel, 64-byte aligned (whole cache lines)
    std::unique_ptr<void, decltype(&std::free)> buf(std::aligned_alloc(64, (panel_bytes + 63) / 64 * 64), &std::free);
    P* panel = static_cast<P*>(buf.get());
#pragma omp for schedule(dynamic)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t r0 = p * NC, nc = std::min<int64_t>(NC, N - r0);
      pack(rows, r0, nc, K, panel);
      int64_t m = 0;
      for (; m + MR <= M; m += MR) tile<MR>(x + m * x_st, x_st, K, panel, nc, y + m * N + r0, N);
      rest<MR - 1>(M - m, x + m * x_st, x_st, K, panel, nc, y + m * N + r0, N);
    }
  }
  return 0;
}

}  // extern "C"
