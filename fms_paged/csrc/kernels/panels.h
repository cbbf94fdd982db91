// Products of many rows, y = x W^T, on panels packed on the fly (GotoBLAS / BLIS's way): the
// driver and the register tiles that gemm.cpp (plain weight rows) and qgemv.cpp (GGUF blocks, a
// prefill's rows) share. Each kernel brings its own `pack`, which fills a panel from its weights
// (gemm.cpp copies and transposes them; qgemv.cpp dequantizes blocks into it), so that neither
// holds a second, packed copy of a weight: a panel of a few hundred KB is all that ever is.
//
// A thread takes NC weight rows (output columns) at a time and packs a block of K of them into its
// own panel, K-major, NC columns per step of K: the layout a broadcast tile reads with whole-vector
// loads and no reduction across lanes (what oneDNN's packed copy holds for good). The panel (at
// most KC_MAX steps: 256 KB of bf16, 128 KB of fp32) stays in L2 while every row of x passes over
// it MR rows at a time, so that its cost is spread over the M rows. The register tile is MR rows of
// x by NC columns: MR x NV accumulator vectors, each holding W consecutive outputs of one row; a step
// of K loads NV vectors of the panel and broadcasts one value (a pair) of each of the MR rows.
// - bf16 pairs (`dp`, where the CPU has AVX512_BF16): the panel holds bf16 pairs, [steps][NC][2]
//   (the VNNI layout), x's pairs are broadcast as 32-bit words and vdpbf16ps takes 16 outputs x 2
//   products a step (exact products, fp32 sums); an odd K's last pair has a zero in its second half
//   on both sides.
// - fp32 words (otherwise): the panel holds fp32 values ([steps][NC]), x is fp32, and each step is
//   one fp32 multiply-add per output.
// Columns past the last weight row of a panel are zeros in it, and are not stored. Between blocks
// of K a tile's sums wait in the thread's fp32 partial sums (the same sums, in the same order, as
// one pass). While a panel's tiles run, they fetch the next panel's weight bytes into L2 (Ahead),
// so that packing it reads L2: the weights stream in behind the multiply-adds.
//
// Threads take panels one at a time (dynamic: a shared machine serves them unevenly; no barrier
// but the last). A row's result does not depend on the thread count or on its place among the
// rows of a call, whatever their number: each output sums its products in one fixed order.
#pragma once

#include <omp.h>

#include "args.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fms_panels {

constexpr int W = fms_vec::NATIVE;  // floats per vector: one register
using vf = fms_vec::vec<W>;
// the tile: MR rows of x by NV vectors of W columns: MR x NV accumulators, NV loads of the panel
// and MR broadcasts a step. AVX-512: 24 of the 32 registers (6 x 4, 64 columns); 8 lanes (AVX2's
// 16 registers): 12 (6 x 2, 16 columns)
#if FMS_VEC_NATIVE == 16
constexpr int MR = 6, NV = 4;
#else
constexpr int MR = 6, NV = 2;
#endif
constexpr int NC = NV * W;  // columns (weight rows) per panel
constexpr int64_t GRAIN = int64_t(1) << 17;  // multiply-adds per thread, at least (as the GEMV)
// the work items a thread has at least, where x's rows are many enough to split (see `run`), and
// the fewest tiles of rows a part of them keeps (96 rows: its panel's packing spread over them)
constexpr int64_t ITEMS_PER_THREAD = 8, PART_MIN_TILES = 16;

// what a panel holds: bf16 pairs (dp) or fp32 words. X: x's values as a tile reads them; P: the
// panel's; KU: values of K per step (per 32-bit panel word). KC_MAX: steps of K per panel, at most:
// 256 KB of bf16 pairs (one panel at K <= 2048), 128 KB of fp32 words, which L2 (1 MB on Zen 4) holds
// beside the rows of x and the next panel's weights on their way in (an fp32 panel of 512 KB at K =
// 2048 measured ~1.2x oneDNN's time at 64 rows; blocks of 512 steps ~1.05-1.1x)
template <bool dp>
struct Words;
template <>
struct Words<true> {
  using X = fms_bf16;
  using P = fms_bf16;
  static constexpr int KU = 2;
  static constexpr int64_t KC_MAX = 1024;
};
template <>
struct Words<false> {
  using X = float;
  using P = float;
  static constexpr int KU = 1;
  static constexpr int64_t KC_MAX = 512;
};

#if FMS_VEC_NATIVE == 16 && defined(__AVX512F__)
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
#endif

#if FMS_VEC_NATIVE == 8 && defined(__AVX2__)
// r[e] <- the e-th values of r[0..7] (an 8 x 8 transpose)
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + j], half h: value 4 h + j of rows i .. i + 3
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}
#endif

// the bytes of a thread's next panel (one span per weight row), fetched into L2 a cache line per
// step of K while a tile runs on this panel (each tile of the panel takes a share of the rows), so
// that packing the next panel reads L2, not memory
struct Ahead {
  const char* p = nullptr;    // the next line to fetch
  const char* end = nullptr;  // the end of its span
  const char* const* row = nullptr;  // the share's spans after it: starts and byte counts
  const int64_t* bytes = nullptr;
  int64_t rows = 0;
  int per_step = 1;  // lines a step (the share's lines over the tile's steps, rounded up)
  void step() {
    for (int i = 0; i < per_step; ++i) {
      if (p >= end) {
        if (rows == 0) return;
        p = *row++;
        end = p + *bytes++;
        --rows;
      }
      __builtin_prefetch(p, 0, 2);
      p += 64;
    }
  }
};

// a block of K's steps as a tile runs it: the steps [s_begin, s_end) of K; whether it is K's first
// (the sums start from zeros) and its last (the sums go to y; otherwise to the thread's fp32 partial
// sums, which the next block starts from: the same sums in the same order as one pass over K)
struct Steps {
  int64_t s_begin, s_end;
  bool first, last;
};

// y[i, j] for i < mr, j < nc (nc <= NC; y's row stride y_st) from the mr rows of x (from K's
// first value on) over a panel of the block `b` of K; part: the tile's partial sums, [mr][NC]
template <int mr, bool dp, class Y>
void tile(const typename Words<dp>::X* x, int64_t x_st, int64_t K, const Steps& b, const typename Words<dp>::P* panel,
          int64_t nc, float* part, Y* y, int64_t y_st, Ahead ahead) {
  vf acc[mr][NV];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < NV; ++j)
      acc[i][j] = b.first ? fms_vec::splat<W>(0.0f) : fms_vec::load<W>(part + i * NC + j * W);
  const int64_t n = b.s_end - b.s_begin;
  x += b.s_begin * Words<dp>::KU;
  if constexpr (dp) {
#if defined(__AVX512BF16__) && FMS_VEC_NATIVE == 16
    const auto step = [&](const fms_bf16* w, auto pair) {
      ahead.step();
      __m512i bv[NV];
      for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_si512(w + j * W * 2);
      for (int i = 0; i < mr; ++i) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair(i));
        for (int j = 0; j < NV; ++j) acc[i][j] = (vf)_mm512_dpbf16_ps((__m512)acc[i][j], xv, (__m512bh)bv[j]);
      }
    };
    const int64_t whole = b.last && K % 2 ? n - 1 : n;  // steps of whole pairs
    for (int64_t s = 0; s < whole; ++s)
      step(panel + s * NC * 2, [&](int i) {
        int32_t u;
        std::memcpy(&u, x + i * x_st + 2 * s, 4);
        return u;
      });
    if (whole < n)  // the last value of each row, a zero beside it (not the next row's value)
      step(panel + whole * NC * 2, [&](int i) { return (int32_t)x[i * x_st + 2 * whole].bits; });
#else
    static_assert(!dp, "bf16 pair panels need AVX512_BF16 and 16 lanes");
#endif
  } else {
    for (int64_t k = 0; k < n; ++k) {
      ahead.step();
      const float* w = panel + k * NC;
      vf bv[NV];
      for (int j = 0; j < NV; ++j) bv[j] = fms_vec::load<W>(w + j * W);
      for (int i = 0; i < mr; ++i) {
        const vf xv = fms_vec::splat<W>(x[i * x_st + k]);
        for (int j = 0; j < NV; ++j) acc[i][j] += xv * bv[j];
      }
    }
  }
  for (int i = 0; i < mr; ++i) {
    if (!b.last) {
      for (int j = 0; j < NV; ++j) fms_vec::store<W>(part + i * NC + j * W, acc[i][j]);
    } else if (nc == NC) {
      for (int j = 0; j < NV; ++j) fms_vec::store<W>(y + i * y_st + j * W, acc[i][j]);
    } else {
      Y out[NC];
      for (int j = 0; j < NV; ++j) fms_vec::store<W>(out + j * W, acc[i][j]);
      std::memcpy(y + i * y_st, out, nc * sizeof(Y));
    }
  }
}

// the last rows of x (fewer than MR): one tile of `left` rows
template <int mr, bool dp, class Y>
void rest(int64_t left, const typename Words<dp>::X* x, int64_t x_st, int64_t K, const Steps& b,
          const typename Words<dp>::P* panel, int64_t nc, float* part, Y* y, int64_t y_st, Ahead ahead) {
  if constexpr (mr > 0) {
    if (left == mr) return tile<mr, dp>(x, x_st, K, b, panel, nc, part, y, y_st, ahead);
    rest<mr - 1, dp>(left, x, x_st, K, b, panel, nc, part, y, y_st, ahead);
  }
}

// this thread's buffer `which` of at least `bytes`, 64-byte aligned (whole cache lines): kept from
// call to call (the OpenMP threads persist), so that a call neither maps nor faults in fresh pages;
// it grows to the largest size the thread has needed; nullptr where memory runs out
template <int which>
void* thread_buffer(size_t bytes) {
  thread_local std::unique_ptr<void, decltype(&std::free)> buf(nullptr, &std::free);
  thread_local size_t size = 0;
  if (size < bytes) {
    size = (bytes + 4095) / 4096 * 4096;
    buf.reset(std::aligned_alloc(64, size));
    if (!buf) size = 0;
  }
  return buf.get();
}

// y [M, N] (row stride N) = x [M, K] (row stride x_st, as Words<dp>::X) . the N weight rows, K
// values each, on `threads` threads at most. The kernel's own callbacks:
// - pack(r0, nc, s_begin, s_end, panel): panel <- rows [r0, r0 + nc) (nc <= NC), steps [s_begin,
//   s_end) of K, K-major: panel[((s - s_begin) NC + c) KU + u] = W[r0 + c, s KU + u], zeros past K
//   and past nc; called by the thread that owns `panel`, with that thread's `scratch` (of
//   scratch_bytes, 64-byte aligned; nullptr where none was asked for);
// - span(r, k0, k1) -> {start, bytes}: where weight row r's values [k0, k1) lie (prefetched ahead).
// K's blocks of steps are whole multiples of `align` steps (16 at least: a multiple of the
// transposes' blocks; a kernel whose weights come in larger blocks asks for those).
// Throws std::bad_alloc (after the parallel region) where a thread's buffers cannot be had.
template <bool dp, class Y, class Pack, class Span>
void run(int64_t M, int64_t K, int64_t N, const typename Words<dp>::X* x, int64_t x_st, Y* y, int max_threads,
         int64_t align, size_t scratch_bytes, const Pack& pack, const Span& span) {
  using P = typename Words<dp>::P;
  constexpr int KU = Words<dp>::KU;
  const int64_t panels = (N + NC - 1) / NC;
  const int64_t tiles = (M + MR - 1) / MR;
  // work items: a panel and a part of x's rows. Few panels a thread (a weight of a few hundred
  // rows) would leave the threads uneven (15 panels on 2 threads: 8 against 7), so x's rows are
  // split until there are ITEMS_PER_THREAD items a thread, each part at least PART_MIN_TILES tiles;
  // each part packs its panel again (its cost spread over fewer rows). A row's sums are the same.
  const int64_t split = std::max<int64_t>(1, std::min<int64_t>(
      (ITEMS_PER_THREAD * max_threads + panels - 1) / panels, tiles / PART_MIN_TILES));
  const int64_t part_tiles = (tiles + split - 1) / split, parts = (tiles + part_tiles - 1) / part_tiles;
  const int64_t items = panels * parts;  // (no part empty)
  const int64_t by_work = std::max<int64_t>(1, M * N * K / GRAIN);
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)max_threads, items, by_work}));
  // K in blocks of at most KC_MAX steps (equal, whole multiples of `align`), a panel of each at a time
  const int64_t steps = (K + KU - 1) / KU, at_most = (steps + Words<dp>::KC_MAX - 1) / Words<dp>::KC_MAX;
  const int64_t kc = ((steps + at_most - 1) / at_most + align - 1) / align * align, blocks = (steps + kc - 1) / kc;
  const size_t panel_bytes = (size_t)kc * KU * NC * sizeof(P), part_bytes = (size_t)M * NC * sizeof(float);
  // panels claimed one at a time (dynamic: a shared machine serves the threads unevenly; no
  // barrier but the last), each thread holding its next claim while it works on a panel so that it
  // knows which weight rows to fetch ahead
  std::atomic<int64_t> claims{0};
  std::atomic<bool> out_of_memory{false};
#pragma omp parallel num_threads(threads)
  {
    P* panel = static_cast<P*>(thread_buffer<0>(panel_bytes));
    float* part = blocks > 1 ? static_cast<float*>(thread_buffer<1>(part_bytes)) : nullptr;
    void* scratch = scratch_bytes ? thread_buffer<2>(scratch_bytes) : nullptr;
    if (!panel || (blocks > 1 && !part) || (scratch_bytes && !scratch)) {  // (no exception may leave the parallel region: thrown after it)
      out_of_memory = true;
      claims = items;
    }
    const char* next_rows[NC];
    int64_t next_bytes[NC];
    for (int64_t it = out_of_memory ? items : claims.fetch_add(1); it < items;) {
      const int64_t next = claims.fetch_add(1);  // the next item
      const int64_t p = it / parts, q = next < items ? next / parts : panels;  // its panel, the next one's
      const int64_t t0 = it % parts * part_tiles, t1 = std::min(tiles, t0 + part_tiles);
      const int64_t r0 = p * NC, nc = std::min<int64_t>(NC, N - r0);
      for (int64_t kb = 0; kb < blocks; ++kb) {
        const Steps b{kb * kc, std::min(steps, (kb + 1) * kc), kb == 0, kb == blocks - 1};
        // the next block's rows: this panel's next block, else the next panel's first
        const int64_t nr0 = kb + 1 < blocks ? r0 : q * NC;
        const int64_t nn = kb + 1 < blocks ? nc : q < panels ? std::min<int64_t>(NC, N - nr0) : 0;
        const int64_t nk0 = (kb + 1 < blocks ? b.s_end : 0) * KU, nk1 = std::min(K, nk0 + kc * KU);
        for (int64_t c = 0; c < nn; ++c) {
          const auto s = span(nr0 + c, nk0, nk1);
          next_rows[c] = static_cast<const char*>(s.first);
          next_bytes[c] = s.second;
        }
        pack(r0, nc, b.s_begin, b.s_end, panel, scratch);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t m = t * MR, c0 = (t - t0) * nn / (t1 - t0), c1 = (t - t0 + 1) * nn / (t1 - t0);
          int64_t lines = 0;
          for (int64_t c = c0; c < c1; ++c) lines += (next_bytes[c] + 63) / 64;
          const int64_t n = b.s_end - b.s_begin;
          const int per_step = (int)std::min<int64_t>(4, (lines + n - 1) / n);
          const Ahead ahead{nullptr, nullptr, next_rows + c0, next_bytes + c0, c1 - c0, per_step};
          float* tpart = part ? part + m * NC : nullptr;
          if (m + MR <= M)
            tile<MR, dp>(x + m * x_st, x_st, K, b, panel, nc, tpart, y + m * N + r0, N, ahead);
          else
            rest<MR - 1, dp>(M - m, x + m * x_st, x_st, K, b, panel, nc, tpart, y + m * N + r0, N, ahead);
        }
      }
      it = next;
    }
  }
  if (out_of_memory) throw std::bad_alloc();
}

}  // namespace fms_panels
