// Products of a few rows with row-major weights, y = x W^T, for decode steps: each weight row is
// streamed from memory once and dotted with every row of x. Built and loaded by
// fms_paged/native once per storage type T of x, the weights and y (-DFMS_ELEM: float, fms_bf16
// or fms_f16); half-precision values are converted to fp32 as they are loaded and the dot products
// accumulate in fp32 (csrc/kernels/vec.h), so a bf16 / fp16 model's decode reads half the
// bytes of fp32. On a CPU with AVX512_BF16 the bf16 build multiplies bf16 pairs as they are
// (vdpbf16ps: exact products, fp32 sums), with no conversion and half the instructions: a decode
// batch of a few rows is then bound by memory rather than by the FMAs. See
// fms_paged/modules/linear.py and fms_paged/native/gemm.py.
//
// The weights of one call may be several matrices sharing K (q/k/v, gate/up): their outputs sit
// side by side in y. Output columns go in blocks of NR weight rows, split over the threads. While
// a thread reads one block it prefetches, at the pace it consumes that block, a block further on
// (PREFETCH_BYTES) into L2 (prefetcht1) and the next block into L1 (prefetcht0): the hardware
// prefetcher alone leaves part of the read bandwidth unused on this access pattern (many short
// streams, one per weight row of a block); a far prefetch into L1 alone left the rate at the mercy
// of L1's few outstanding misses (a process reading fast lost most), one into L2 alone left every
// load of the block an L1 miss on the critical path. A decode step's product of one row
// is different where its multiply-adds are cheap: it reads one weight row at a time and prefetches
// nothing, so a thread's share of the weights is one sequential stream, which the hardware
// prefetcher follows better than any software prefetch did (see STREAM).
//
// Each thread starts on its own contiguous share of the blocks, taken in chunks of CHUNK_BYTES
// of weights from its front; a thread done with its share takes the last chunks of the share with
// the most left (see Share): a product's threads end together however unevenly memory serves them.
#include <omp.h>

#include "args.h"
#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
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
// A register tile holds MR x NR accumulators, NR weight vectors and one of x: within the 32 vector
// registers of AVX-512, the 16 of AVX2. A half-precision weight vector costs a conversion each time
// it is loaded, so those tiles take more rows of x and fewer weight rows: each weight is converted
// once for up to MR rows (all of a decode batch of GEMV_MAX_ROWS, with AVX-512).
constexpr bool kF32 = std::is_same_v<T, float>;
#ifdef __AVX512F__
constexpr int MR = kF32 ? 4 : 8;  // rows of x per register tile
#else
constexpr int MR = kF32 ? 2 : 4;
#endif
constexpr int NR = kF32 ? 4 : 2;  // weight rows per register tile
// How far ahead a thread prefetches into L2: the block this many bytes on (at least two blocks).
// (On a Zen 4 VM, against 9 KB ahead into L1 alone: a one-request decode 1.33x as fast in bf16,
// 1.06x in fp16, 1.07x in fp32, in one process with the two builds swapped between runs.)
constexpr int64_t PREFETCH_BYTES = 18432;
// A product of at most FEW rows (a decode step of one or two sequences) takes blocks of NR_FEW
// weight rows. Where a multiply-add is cheap (AVX-512, whose bf16 pairs need no conversion; fp32
// weights with AVX2) a product of one row streams (STREAM): one weight row a block and no software
// prefetch, so each thread reads its contiguous share of the weights in order and the hardware
// prefetcher sees one stream. On a Zen 4 VM, in one process with the builds swapped between runs,
// a one-request SmolLM2 decode read its weights 1.08x as fast in bf16 as with blocks of 2 rows and
// the prefetches (level in fp16 and fp32); the AVX2 build forced there, fp32, 1.2x. Two rows of x
// stream no better: a two-request decode ran 0.95x as fast streamed; and blocks of 2 weight rows
// without the prefetches read at ~60% (two interleaved streams defeat the hardware prefetcher).
// With AVX2's conversions of half-precision weights the multiply-adds bound one row's chain of
// dependent sums (a short K, such as a 576-wide model's, leaves them exposed): there blocks of 4
// rows, prefetched, read 1.1-1.2x as fast as one row streamed (one row of x). A row's
// sums run in the same order any way: its result does not depend on how many rows its call has
// or on the block size.
#if defined(__AVX512F__)
constexpr bool STREAM = true;
#elif defined(__AVX2__)
constexpr bool STREAM = kF32;
#else
constexpr bool STREAM = false;  // (NEON builds: not measured)
#endif
constexpr int FEW = STREAM ? 1 : 2;
constexpr int NR_FEW = STREAM ? 1 : kF32 ? NR : 4;
constexpr int64_t GRAIN = int64_t(1) << 17;  // multiply-adds per thread, at least (see the kernel)
// Weights a thread claims at a time. Memory serves a product's threads unevenly, now one and now
// another ahead, so that fixed shares leave the first done waiting for the last; a thread done
// with its share takes the last chunks of another's (Share). Smaller chunks break each thread's
// stream (the hardware prefetcher's) more often, larger ones leave less to even out with: see
// docs/design.md for the measured trade-off.
constexpr int64_t CHUNK_BYTES = int64_t(128) << 10;

using vf = fms_vec::vec<W>;
inline vf load(const T* p) { return fms_vec::load<W>(p); }
inline vf splat(float x) { return fms_vec::splat<W>(x); }

// FMS_PIN(v): v is in a register here (an empty asm that takes and gives it back), so that a tile
// loads each weight vector and each row of x once a step. Without it GCC folds the loads into the
// multiply-adds' memory operands, loading each weight vector again for every row of x: a tile of 4
// x 4 ran 20 loads a step for its 16 multiply-adds, and products of 2-8 rows ran at ~50% of the
// multiply-adds' peak, bound by the loads (Zen 4, fp32, K = 256: 4 rows of a 4096-row head 157 ->
// 125 us, 8 rows 287 -> 236 us; one row, which streams, unchanged). Where a vector is wider than
// a register (16 lanes on AVX2, the generic SSE2 / NEON builds) nothing is pinned.
#if defined(__AVX512F__) || (defined(__AVX2__) && FMS_VEC_NATIVE == 8)
#define FMS_PIN(v) __asm__("" : "+v"(v))
#else
#define FMS_PIN(v) (void)0
#endif

inline float hsum(vf v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
#if FMS_VEC_NATIVE == 16
  typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
  const v8 a = v;
#endif
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#else
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

// out[q] = hsum of a, b, c, d, bit for bit (the same lanes summed in the same pairs and order: lane i
// with i + 8, then with i + 4, then (b0 + b2) + (b1 + b3)), the four vectors' halves shuffled side by
// side so that each shuffle and add serves all four: 13 instructions for four sums against ~9
// each. A tile's epilogue sums mr x nr accumulators of K / W multiply-adds each: at K = 256 (16 a
// sum), one at a time it took a fifth of a 2-3 row product (Zen 4, fp32, 4096 x 256: 2 rows
// 86 -> 79 us, 3 rows 108 -> 100 us; 4 and 8 rows level)
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
#if (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)) && FMS_VEC_NATIVE == 16
  const vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vf q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vf e = q + __builtin_shufflevector(q, q, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const vf f = e + __builtin_shufflevector(e, e, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  out[0] = f[0], out[1] = f[4], out[2] = f[8], out[3] = f[12];
#else
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
#endif
}

struct Segment {
  const T* w;      // [n, K]
  int64_t n, col;  // rows, first column in y
};

// y[m0 .. m0 + mr, col + j] for weight rows j0 .. j0 + nr of one segment; `next` (or null: no
// prefetches): the weights [nr, K] of a block further on, prefetched into L2 at the pace this
// block is read, with the block after this one in memory into L1
#if FMS_VEC_BF16_DP
// x's rows as the kernel reads them: bf16 as they are (the products take bf16 pairs, vdpbf16ps)
using X = T;
// 32 bf16 at p, the last K - k of them alone where fewer are left (zeros after them)
inline __m512i load32(const T* p, int64_t left) {
  return left >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), p);
}
template <int mr, int nr>
void tile(const X* x, int64_t x_st, int64_t K, const Segment& s, int64_t j0, T* y, int64_t y_st, const T* next) {
  __m512 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_setzero_ps();
  const T* w = s.w + j0 * K;
  // 32 products of each row and weight row per instruction pair; the whole vectors' steps apart
  // from the last, masked one: with the masked loads' branch inside the loop GCC kept the
  // accumulators in memory, storing every one at every step (a store port bound: 4 rows ran at
  // a quarter of the dot products' peak)
  const auto step = [&](int64_t k, int64_t left) __attribute__((always_inline)) {
    __m512i wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = load32(w + j * K + k, left);
    if (next)
      for (int j = 0; j < nr; ++j) {
        __builtin_prefetch(next + k * nr + 32 * j, 0, 2);
        __builtin_prefetch(w + nr * K + k * nr + 32 * j, 0, 3);
      }
    if constexpr (mr > 1)
      for (int j = 0; j < nr; ++j) FMS_PIN(wv[j]);
    for (int i = 0; i < mr; ++i) {
      __m512i xv = load32(x + i * x_st + k, left);
      if constexpr (nr > 1) FMS_PIN(xv);
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  };
  if constexpr (mr == 1) {  // (one loop: a one-row decode streamed 1.1-1.2x as fast unsplit, Zen 4)
    for (int64_t k = 0; k < K; k += 32) step(k, K - k);
  } else {
    const int64_t kf = K / 32 * 32;
    for (int64_t k = 0; k < kf; k += 32) step(k, 32);
    if (kf < K) step(kf, K - kf);
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) y[i * y_st + s.col + j0 + j] = from_f32<T>(hsum((vf)acc[i][j]));
}
#else
// x's rows as the kernel reads them: fp32 (half-precision rows converted once: fms_vec::rows_as)
using X = float;
template <int mr, int nr>
void tile(const X* x, int64_t x_st, int64_t K, const Segment& s, int64_t j0, T* y, int64_t y_st,
          const T* next) {
  vf acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = splat(0.0f);
  const T* w = s.w + j0 * K;
  const int64_t kv = K / W * W;
  for (int64_t k = 0; k < kv; k += W) {
    vf wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = load(w + j * K + k);
    if (next)
      for (int j = 0; j < nr; ++j) {
        __builtin_prefetch(next + k * nr + j * W, 0, 2);
        __builtin_prefetch(w + nr * K + k * nr + j * W, 0, 3);
      }
    if constexpr (mr > 1)  // (a vector used once is left to the compiler)
      for (int j = 0; j < nr; ++j) FMS_PIN(wv[j]);
    for (int i = 0; i < mr; ++i) {
      vf xv = fms_vec::load<W>(x + i * x_st + k);
      if constexpr (nr > 1) FMS_PIN(xv);
      for (int j = 0; j < nr; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < mr; ++i) {
    float sums[nr];
    if constexpr (nr == 4) {
      hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums);
    } else {
      for (int j = 0; j < nr; ++j) sums[j] = hsum(acc[i][j]);
    }
    for (int j = 0; j < nr; ++j) {
      float sum = sums[j];
      for (int64_t k = kv; k < K; ++k) sum += x[i * x_st + k] * to_f32(w[j * K + k]);
      y[i * y_st + s.col + j0 + j] = from_f32<T>(sum);
    }
  }
}
#endif

// the last rows (fewer than MR): one tile of `left` rows
template <int mr, int nr>
void rest(int64_t left, const X* x, int64_t x_st, int64_t K, const Segment& s, int64_t j0, T* y,
          int64_t y_st, const T* next) {
  if constexpr (mr > 0) {
    if (left == mr) return tile<mr, nr>(x, x_st, K, s, j0, y, y_st, next);
    rest<mr - 1, nr>(left, x, x_st, K, s, j0, y, y_st, next);
  }
}

// tiles of up to mr rows over one block of nr weight rows
template <int mr, int nr>
void columns(const X* x, int64_t x_st, int64_t M, int64_t K, const Segment& s, int64_t j0, T* y,
             int64_t y_st, const T* next) {
  int64_t m = 0;  // the first tile reads the block from memory (and prefetches), later ones from L1
  for (; m + mr <= M; m += mr, next = nullptr) tile<mr, nr>(x + m * x_st, x_st, K, s, j0, y + m * y_st, y_st, next);
  rest<mr - 1, nr>(M - m, x + m * x_st, x_st, K, s, j0, y + m * y_st, y_st, next);
}

// a block of n (1 .. nr) weight rows: columns<mr, n>
template <int mr, int nr>
void block(int64_t n, const X* x, int64_t x_st, int64_t M, int64_t K, const Segment& s, int64_t j0, T* y,
           int64_t y_st, const T* next) {
  if constexpr (nr > 0) {
    if (n == nr) return columns<mr, nr>(x, x_st, M, K, s, j0, y, y_st, next);
    block<mr, nr - 1>(n, x, x_st, M, K, s, j0, y, y_st, next);
  }
}

// One thread's share of a call's chunks, [front, end): its owner claims chunks from the front, a
// thread done with its own share claims them from the end. Both in one word, so that a chunk is
// claimed once (compare-and-swap); a cache line a share, so that the owners do not contend.
struct alignas(64) Share {
  std::atomic<uint64_t> v{0};  // front (low 32 bits), end (high 32 bits)
  void set(int64_t front, int64_t end) { v.store(uint64_t(end) << 32 | uint64_t(front), std::memory_order_relaxed); }
  int64_t left() const {
    const uint64_t x = v.load(std::memory_order_relaxed);
    return int64_t(x >> 32) - int64_t(uint32_t(x));
  }
  // -> whether a chunk was left: then `chunk` is the front's (the owner) or the end's (a thief)
  bool claim(bool front, int64_t& chunk) {
    uint64_t x = v.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t f = uint32_t(x), e = uint32_t(x >> 32);
      if (f >= e) return false;
      const uint64_t want = front ? x + 1 : (uint64_t(e - 1) << 32 | f);
      if (v.compare_exchange_weak(x, want, std::memory_order_relaxed)) {
        chunk = front ? f : e - 1;
        return true;
      }
    }
  }
};

}  // namespace

// The kernel's arguments, passed by pointer: the struct of FMS_PAGED_GEMV_FIELDS
// (kernels/kernels.h, which says what each field holds). The operator that calls the kernel
// (csrc/ops/ops.cpp) compares its own layout of the struct with fms_paged_gemv_layout()'s
// (every field's name, kind and offset, and the size) when it loads the library, and refuses a
// build whose struct differs instead of reading fields at the wrong offsets.
extern "C" {

FMS_PAGED_ARGS(FmsGemvArgs, FMS_PAGED_GEMV_FIELDS, fms_paged_gemv_layout)

int fms_paged_gemv(const FmsGemvArgs* args) {
  const FmsGemvArgs& a = *args;
  const int64_t M = a.M, K = a.K;
  std::vector<float> xf;
  int64_t x_st = a.x_st;
  const X* x = fms_vec::rows_as<X>(a.x, M, K, x_st, xf);
  const bool few = M <= FEW;
  const int64_t nr = few ? NR_FEW : NR;
  const int64_t ahead = std::clamp<int64_t>(PREFETCH_BYTES / (nr * K * (int64_t)sizeof(T)), 2, 8);
  // the column blocks of nr weight rows, segment by segment: block b is segment i's rows
  // (b - first[i]) nr onwards for first[i] <= b < first[i + 1] (the blocks are not listed: the
  // output projection of a 49k vocabulary has 24k of them, a list built on one thread at every
  // call cost a decode step ~0.1 ms)
  std::vector<Segment> segs;
  std::vector<int64_t> first{0};
  int64_t col = 0;
  for (int i = 0; i < (int)a.n_weights; ++i) {
    segs.push_back({a.weights[i], a.rows[i], col});
    first.push_back(first.back() + (a.rows[i] + nr - 1) / nr);
    col += a.rows[i];
  }
  const auto locate = [&](int64_t b, int& i) {  // -> block b's segment i (from i on) and first row
    while (b >= first[i + 1]) ++i;
    return (b - first[i]) * nr;
  };
  T* y = a.y;
  const int64_t nb = first.back();
  // a thread per GRAIN multiply-adds at most (ATen's habit of a grain size): a small product on one
  // thread costs less than a parallel region's fork and join, and far less when another process
  // keeps a core busy and the region waits for a thread the OS has descheduled
  const int64_t by_work = std::max<int64_t>(1, M * col * K / GRAIN);
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)a.threads, nb, by_work}));
  // the chunks in contiguous shares, one a thread (as schedule(static) would hand them out)
  const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (nr * K * (int64_t)sizeof(T)));
  const int64_t n_chunks = (nb + chunk - 1) / chunk;
  std::vector<Share> shares(threads);
  for (int t = 0; t < threads; ++t) shares[t].set(n_chunks * t / threads, n_chunks * (t + 1) / threads);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    int i = 0, i_next = 0;
    // chunk c's blocks; prefetching into the chunks after it where the thread's own (those it
    // will likely read next), not past a stolen one
    const auto run = [&](int64_t c, bool own) {
      const int64_t b1 = std::min(nb, (c + 1) * chunk), stop = own ? nb : b1;
      if (!own) i = i_next = 0;  // (locate searches forwards)
      for (int64_t b = c * chunk; b < b1; ++b) {
        const int64_t j0 = locate(b, i);
        const Segment& s = segs[i];
        const T* next = nullptr;  // stays null for a streamed one-row product: it prefetches nothing
        if (!(few && STREAM) && b + ahead < stop) {
          const int64_t jn = locate(b + ahead, i_next);
          next = segs[i_next].w + jn * K;
        }
        const int64_t n = std::min<int64_t>(nr, s.n - j0);
        if (few)
          block<FEW, NR_FEW>(n, x, x_st, M, K, s, j0, y, col, next);
        else
          block<MR, NR>(n, x, x_st, M, K, s, j0, y, col, next);
      }
    };
    int64_t c;
    while (shares[t].claim(true, c)) run(c, true);
    for (;;) {  // then the last chunk of the share with the most left, until none is
      int from = -1;
      int64_t most = 0;
      for (int u = 0; u < (int)shares.size(); ++u)  // (all: a team may have fewer threads than shares)
        if (const int64_t left = shares[u].left(); u != t && left > most) from = u, most = left;
      if (from < 0) break;
      if (shares[from].claim(false, c)) run(c, false);
    }
  }
  return 0;
}

}  // extern "C"
