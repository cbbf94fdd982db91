// fp32 products of a few rows with row-major weights, y = x W^T, for decode steps: each
// weight row is streamed from memory once and dotted with every row of x. Built and loaded by
// fms_paged/native.py; see fms_paged/modules/linear.py.
//
// The weights of one call may be several matrices sharing K (q/k/v, gate/up): their outputs sit
// side by side in y. Output columns go in blocks of NR weight rows, split over the threads. While
// a thread reads one block it prefetches the next into L2, as fast as it consumes the current one:
// the hardware prefetcher alone leaves part of the read bandwidth unused on this access pattern
// (many short streams, one per weight row of a block).
#include <omp.h>

#include "native_args.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int W = 16;  // floats per vector
#ifdef __AVX512F__
constexpr int MR = 4;  // rows of x per register tile (NR x MR accumulators)
#else
constexpr int MR = 2;
#endif
constexpr int NR = 4;  // weight rows per register tile

typedef float vf __attribute__((vector_size(W * sizeof(float))));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

inline float hsum(vf v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#else
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

struct Segment {
  const float* w;  // [n, K]
  int64_t n, col;  // rows, first column in y
};

// y[m0 .. m0 + mr, col + j] for weight rows j0 .. j0 + nr of one segment; `next` (or null): the
// next block's weights [nr, K], prefetched at the pace this block is read
template <int mr, int nr>
void tile(const float* x, int64_t x_st, int64_t K, const Segment& s, int64_t j0, float* y, int64_t y_st,
          const float* next) {
  vf acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = splat(0.0f);
  const float* w = s.w + j0 * K;
  const int64_t kv = K / W * W;
  for (int64_t k = 0; k < kv; k += W) {
    vf wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = load(w + j * K + k);
    if (next)
      for (int j = 0; j < nr; ++j) __builtin_prefetch(next + k * nr + j * W, 0, 1);
    for (int i = 0; i < mr; ++i) {
      const vf xv = load(x + i * x_st + k);
      for (int j = 0; j < nr; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float sum = hsum(acc[i][j]);
      for (int64_t k = kv; k < K; ++k) sum += x[i * x_st + k] * w[j * K + k];
      y[i * y_st + s.col + j0 + j] = sum;
    }
}

template <int nr>
void columns(const float* x, int64_t x_st, int64_t M, int64_t K, const Segment& s, int64_t j0, float* y,
             int64_t y_st, const float* next) {
  int64_t m = 0;  // the first tile reads the block from memory (and prefetches), later ones from L1
  for (; m + MR <= M; m += MR, next = nullptr) tile<MR, nr>(x + m * x_st, x_st, K, s, j0, y + m * y_st, y_st, next);
  const float* xm = x + m * x_st;
  float* ym = y + m * y_st;
  switch (M - m) {
    case 3: tile<3, nr>(xm, x_st, K, s, j0, ym, y_st, next); break;
    case 2: tile<2, nr>(xm, x_st, K, s, j0, ym, y_st, next); break;
    case 1: tile<1, nr>(xm, x_st, K, s, j0, ym, y_st, next); break;
  }
}

}  // namespace

// The kernel's arguments, passed by pointer. fms_paged/modules/linear.py mirrors the struct as a
// ctypes.Structure with the same fields and, when it loads the library, compares its layout with
// fms_paged_gemv_layout()'s (every field's name, kind and offset, and the size): a build whose
// struct differs from the Python mirror is refused instead of reading fields at the wrong offsets.
//
// y [M, sum of rows] = x [M, K] (row stride x_st) times each weight weights[i] [rows[i], K]^T
// (i < n_weights, each row-major), side by side; threads: at most this many.
#define FMS_PAGED_GEMV_FIELDS(X)                                                                \
  X(const float*, x) X(int64_t, M) X(int64_t, K) X(int64_t, x_st)                               \
  X(const float* const*, weights) X(const int64_t*, rows) X(int64_t, n_weights)                 \
  X(float*, y) X(int32_t, threads)

extern "C" {

FMS_PAGED_ARGS(FmsGemvArgs, FMS_PAGED_GEMV_FIELDS, fms_paged_gemv_layout)

int fms_paged_gemv(const FmsGemvArgs* args) {
  const FmsGemvArgs& a = *args;
  const float* x = a.x;
  const int64_t M = a.M, K = a.K, x_st = a.x_st;
  std::vector<Segment> segs;
  std::vector<std::pair<int, int64_t>> blocks;  // (segment, first weight row) of each column block
  int64_t col = 0;
  for (int i = 0; i < (int)a.n_weights; ++i) {
    segs.push_back({a.weights[i], a.rows[i], col});
    for (int64_t j = 0; j < a.rows[i]; j += NR) blocks.emplace_back(i, j);
    col += a.rows[i];
  }
  float* y = a.y;
  const int64_t nb = (int64_t)blocks.size();
#pragma omp parallel for schedule(static) num_threads((int)std::max<int64_t>(1, std::min<int64_t>(a.threads, nb)))
  for (int64_t b = 0; b < nb; ++b) {
    const Segment& s = segs[blocks[b].first];
    const int64_t j0 = blocks[b].second;
    const float* next = b + 1 < nb ? segs[blocks[b + 1].first].w + blocks[b + 1].second * K : nullptr;
    switch (std::min<int64_t>(NR, s.n - j0)) {
      case 4: columns<4>(x, x_st, M, K, s, j0, y, col, next); break;
      case 3: columns<3>(x, x_st, M, K, s, j0, y, col, next); break;
      case 2: columns<2>(x, x_st, M, K, s, j0, y, col, next); break;
      default: columns<1>(x, x_st, M, K, s, j0, y, col, next); break;
    }
  }
  return 0;
}

}  // extern "C"
