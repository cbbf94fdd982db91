// Products of many rows with row-major weights, y = x W^T, for prefill steps: the same plain
// [N, K] weights the GEMV kernel (gemv.cpp) reads, so that a CPU model holds each weight once (no
// packed copy of it in another layout for a GEMM library). Built and loaded by fms_paged/native
// once per storage type T of x, the weights and y (-DFMS_ELEM: float, fms_bf16 or fms_f16); the
// dot products accumulate in fp32.
//
// The register tile is MR rows of x by NR weight rows: MR x NR accumulators, each a vector of
// lanes along K, reduced across its lanes once at the end of K (a transpose of sums:
// fms_vec::reduce_lanes, MR x NR = one register's lanes, so that one reduction gives a tile's
// outputs). Both operands are read where they lie, K contiguous: nothing is packed per call.
// - AVX512_BF16, bf16 (FMS_VEC_BF16_DP): each accumulator takes 32 products a step by vdpbf16ps
//   on bf16 pairs as stored (exact products, fp32 sums); a K that is not a multiple of 32 ends
//   with masked loads (zeros past K on both sides).
// - Otherwise (fp32; fp16; bf16 without AVX512_BF16; AVX2 and baseline builds): x converted to fp32
//   once per call, the weights to fp32 as they are loaded, fp32 multiply-adds; the tail of K
//   past whole vectors summed one by one after the lanes.
//
// Cache blocking: the threads take groups of GROUP blocks of NR weight rows one at a time
// (dynamic: a shared machine serves them unevenly; no barrier but the last); a thread passes x
// over its group in chunks of rows that fit L2 beside the group's weights (CHUNK_X_BYTES), and
// keeps each block's NR weight rows in L1 while the chunk's rows pass over them MR at a time. A
// product's result does not depend on the thread count or the chunk: a row's sums run in one
// order.
#include <omp.h>

#include "args.h"
#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifndef FMS_ELEM
#error "compile with -DFMS_ELEM=<float, fms_bf16 or fms_f16>: the storage type of x, the weights and y"
#endif

namespace {

using fms_vec::from_f32;
using fms_vec::to_f32;
using T = FMS_ELEM;
constexpr int W = fms_vec::NATIVE;  // floats per vector: one register
using vf = fms_vec::vec<W>;
// the tile: MR rows of x by NR weight rows, MR x NR accumulators, reduced W at a time (W / NR rows
// of the tile per reduction): 24 of the 32 vector registers of AVX-512 (6 x 4: 10 loads a step
// for 24 products), 8 of AVX2's 16 (2 x 4)
#if FMS_VEC_NATIVE == 16
constexpr int MR = 6, NR = 4;
#else
constexpr int MR = 2, NR = 4;
#endif
static_assert(W % NR == 0, "a reduction takes whole rows of a tile");
constexpr int64_t GRAIN = int64_t(1) << 17;  // multiply-adds per thread, at least (as the GEMV)
// rows of x per chunk: this many bytes of them (L2 holds them beside a group's weight rows)
constexpr int64_t CHUNK_X_BYTES = int64_t(128) << 10;
// blocks of NR weight rows a thread takes at a time (32 rows: 40 KB of bf16 weights at K = 640)
constexpr int64_t GROUP = 8;

struct Segment {
  const T* w;      // [n, K]
  int64_t n, col;  // rows, first column in y
};

#if FMS_VEC_BF16_DP
using X = T;  // x as stored: bf16 pairs
constexpr int KSTEP = 32;  // bf16 values per vector
#else
using X = float;  // x converted once (fms_vec::rows_as)
constexpr int KSTEP = W;
#endif

// the tile's outputs y[i, s.col + j0 + j] (i < mr, j < nr) from its accumulators: one reduction,
// whose lane i NR + j is output (i, j) (accumulator (i, j) goes in at bitrev(i NR + j):
// fms_vec::reduce_lanes sums p[bitrev(lane)] into each lane), plus `tail(i, j, sum)` (the sums of K's
// last values past whole vectors, or nothing), rounded to T as one vector
template <int mr, int nr, bool has_tail, class Tail>
inline void finish(const vf (&acc)[mr][nr], const Tail& tail, int64_t j0, const Segment& s, T* y, int64_t y_st) {
  constexpr int RG = W / NR;  // rows of the tile per reduction
  for (int i0 = 0; i0 < mr; i0 += RG) {
    vf p[W];  // (a copy: the loop's accumulators stay in registers)
    for (int i = 0; i < W; ++i) p[i] = fms_vec::splat<W>(0.0f);
    for (int i = i0; i < mr && i < i0 + RG; ++i)
      for (int j = 0; j < nr; ++j) p[fms_vec::bitrev((i - i0) * NR + j)] = acc[i][j];
    vf r = fms_vec::reduce_lanes(p);
    if constexpr (has_tail)
      for (int i = i0; i < mr && i < i0 + RG; ++i)
        for (int j = 0; j < nr; ++j) r[(i - i0) * NR + j] = tail(i, j, r[(i - i0) * NR + j]);
    T out[W];
    fms_vec::store<W>(out, r);
    for (int i = i0; i < mr && i < i0 + RG; ++i)
      std::memcpy(y + i * y_st + s.col + j0, out + (i - i0) * NR, nr * sizeof(T));
  }
}

// y[i, s.col + j0 + j] for i < mr, j < nr: the tile's mr x nr sums over K
template <int mr, int nr>
void tile(const X* x, int64_t x_st, int64_t K, const Segment& s, int64_t j0, T* y, int64_t y_st) {
  vf acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = fms_vec::splat<W>(0.0f);
  const T* w = s.w + j0 * K;
#if FMS_VEC_BF16_DP
  const auto step = [&](int64_t k, auto load) {
    __m512i wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = load(w + j * K + k);
    for (int i = 0; i < mr; ++i) {
      const __m512bh xv = (__m512bh)load(x + i * x_st + k);
      for (int j = 0; j < nr; ++j) acc[i][j] = (vf)_mm512_dpbf16_ps((__m512)acc[i][j], xv, (__m512bh)wv[j]);
    }
  };
  const int64_t kv = K / KSTEP * KSTEP;
  for (int64_t k = 0; k < kv; k += KSTEP) step(k, [](const T* p) { return _mm512_loadu_si512(p); });
  if (kv < K) {  // the last K - kv values, zeros past them on both sides
    const __mmask32 mask = (__mmask32)((1ull << (K - kv)) - 1);
    step(kv, [mask](const T* p) { return _mm512_maskz_loadu_epi16(mask, p); });
  }
  finish<mr, nr, false>(acc, [](int, int, float sum) { return sum; }, j0, s, y, y_st);
#else
  const int64_t kv = K / KSTEP * KSTEP;
  for (int64_t k = 0; k < kv; k += KSTEP) {
    vf wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = fms_vec::load<W>(w + j * K + k);
    for (int i = 0; i < mr; ++i) {
      const vf xv = fms_vec::load<W>(x + i * x_st + k);
      for (int j = 0; j < nr; ++j) acc[i][j] += xv * wv[j];
    }
  }
  const auto tail = [&](int i, int j, float sum) {
    for (int64_t k = kv; k < K; ++k) sum += x[i * x_st + k] * to_f32(w[j * K + k]);
    return sum;
  };
  if (kv < K)
    finish<mr, nr, true>(acc, tail, j0, s, y, y_st);
  else
    finish<mr, nr, false>(acc, tail, j0, s, y, y_st);
#endif
}

// the last rows of x (fewer than MR): one tile of `left` rows
template <int mr, int nr>
void rest(int64_t left, const X* x, int64_t x_st, int64_t K, const Segment& s, int64_t j0, T* y, int64_t y_st) {
  if constexpr (mr > 0) {
    if (left == mr) return tile<mr, nr>(x, x_st, K, s, j0, y, y_st);
    rest<mr - 1, nr>(left, x, x_st, K, s, j0, y, y_st);
  }
}

// rows [0, M) of x over one block of nr weight rows, MR rows at a time
template <int nr>
void columns(const X* x, int64_t x_st, int64_t M, int64_t K, const Segment& s, int64_t j0, T* y, int64_t y_st) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, nr>(x + m * x_st, x_st, K, s, j0, y + m * y_st, y_st);
  rest<MR - 1, nr>(M - m, x + m * x_st, x_st, K, s, j0, y + m * y_st, y_st);
}

// a block of n (1 .. nr) weight rows: columns<n>
template <int nr>
void block(int64_t n, const X* x, int64_t x_st, int64_t M, int64_t K, const Segment& s, int64_t j0, T* y,
           int64_t y_st) {
  if constexpr (nr > 0) {
    if (n == nr) return columns<nr>(x, x_st, M, K, s, j0, y, y_st);
    block<nr - 1>(n, x, x_st, M, K, s, j0, y, y_st);
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
  // the blocks of NR weight rows, segment by segment: block b is segment i's rows from
  // (b - first[i]) NR on, for first[i] <= b < first[i + 1]
  std::vector<Segment> segs;
  std::vector<int64_t> first{0};
  int64_t col = 0;
  for (int i = 0; i < (int)a.n_weights; ++i) {
    segs.push_back({a.weights[i], a.rows[i], col});
    first.push_back(first.back() + (a.rows[i] + NR - 1) / NR);
    col += a.rows[i];
  }
  const int64_t nb = first.back();
  const int64_t chunk = std::max<int64_t>(MR, CHUNK_X_BYTES / (K * (int64_t)sizeof(X)) / MR * MR);
  const int64_t n_groups = (nb + GROUP - 1) / GROUP;
  const int64_t by_work = std::max<int64_t>(1, M * col * K / GRAIN);
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)a.threads, n_groups, by_work}));
  T* y = a.y;
  // groups of GROUP blocks handed out one at a time (one barrier, at the end: a thread the OS
  // deschedules holds up no other); within a group, x a chunk of rows at a time, the group's blocks
  // over each chunk
#pragma omp parallel for num_threads(threads) schedule(dynamic)
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t b0 = g * GROUP, b1 = std::min(nb, b0 + GROUP);
    int i = (int)(std::upper_bound(first.begin(), first.end(), b0) - first.begin()) - 1;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t rows = std::min(chunk, M - m0);
      int seg = i;
      for (int64_t b = b0; b < b1; ++b) {
        while (b >= first[seg + 1]) ++seg;
        const Segment& s = segs[seg];
        const int64_t j0 = (b - first[seg]) * NR;
        block<NR>(std::min<int64_t>(NR, s.n - j0), x + m0 * x_st, x_st, rows, K, s, j0, y + m0 * col, col);
      }
    }
  }
  return 0;
}

}  // extern "C"
