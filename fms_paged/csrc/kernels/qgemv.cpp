// Products of rows with weights held as GGUF blocks, y = x W^T, dequantized in registers: the
// projections of a GGUF model loaded at Q8_0 or Q4_0 (fms_paged/modules/quantized.py BlockLinear),
// for decode rows and prefill chunks alike. Built and loaded by fms_paged/native once per storage
// type T of x and y (-DFMS_ELEM: float, fms_bf16 or fms_f16), like gemv.cpp.
//
// A weight row of K values is K / 32 blocks, each an fp16 scale d and 32 quants, as llama.cpp
// writes them (ggml's block_q8_0 / block_q4_0, no repacking):
// - Q8_0 (34 bytes): d, then 32 int8 q: w = d q;
// - Q4_0 (18 bytes): d, then 16 bytes of nibbles, byte j holding element j (low) and j + 16
//   (high): w = d (q - 8).
// As llama.cpp's vec_dot_q8_0_q8_0 / vec_dot_q4_0_q8_0 do, each row of x is quantized once per
// call to int8 per block of 32 (scale dx = max |x| / 127, fp32 here where llama.cpp rounds it to
// fp16; q = x / dx rounded to nearest even), and each block's dot product is a sum of int8 x int8
// products in int32, exact, times dw dx in fp32: sum_b dw_b dx_b sum_i qw_bi qx_bi. The only
// error beside fp32 sums is the activations' rounding, at most dx / 2 = max|x_b| / 254 per value.
//
// Per ISA (chosen when built, as gemv.cpp's): AVX-512 VNNI (vpdpbusd on 256-bit registers, one
// block per register: 32 products into 8 int32 sums in one instruction; AVX-VNNI likewise), AVX2
// (vpmaddubsw then vpmaddwd against ones), and a scalar baseline. vpdpbusd / vpmaddubsw multiply
// unsigned by signed bytes, so the signs move onto x: |w| times x with w's sign (vpsignb), as
// llama.cpp does; |w| <= 127 and |qx| <= 127 keep vpmaddubsw's pairwise int16 sums below 32767.
//
// Register tiles of MR rows of x by NR weight rows: a weight block is decoded once for MR rows,
// and a tile's fp32 accumulators are vectors (cvt and FMA per block, one horizontal sum per tile).
// Threads split the weight rows (all segments of one call: q/k/v side by side in y) into
// contiguous shares; a prefill's rows of x are reused from L2 for each weight row pair.
#include <omp.h>

#include "args.h"
#include "kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef FMS_ELEM
#error "compile with -DFMS_ELEM=<float, fms_bf16 or fms_f16>: the storage type of x and y"
#endif

namespace {

using T = FMS_ELEM;
constexpr int QK = 32;  // values per block
constexpr int kQ8_0 = 8, kQ4_0 = 2;  // ggml's type ids
constexpr int MR = 4, NR = 2;  // register tile: rows of x by weight rows
constexpr int64_t GRAIN = int64_t(1) << 17;  // multiply-adds per thread, at least (as gemv.cpp)

inline int block_bytes(int type) { return type == kQ8_0 ? 34 : 18; }

inline float half(const uint8_t* p) {  // an fp16 scale, unaligned
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fms_vec::to_f32(fms_f16{h});
}

// x [M, K] (row stride x_st) quantized per block of 32: q [M, K] int8, d [M, K / 32] fp32
struct XQ {
  std::vector<int8_t> q;
  std::vector<float> d;
  int64_t K, nb;
};

void quantize_row(const T* x, int64_t K, int8_t* q, float* d) {
  constexpr int W = 8;
  typedef float v8 __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t i8v __attribute__((vector_size(W * sizeof(int32_t))));
  for (int64_t b = 0; b < K / QK; ++b) {
    v8 v[QK / W];
    for (int k = 0; k < QK / W; ++k) v[k] = fms_vec::load<W>(x + b * QK + k * W);
    v8 mx = v8{} + 0.0f;
    for (int k = 0; k < QK / W; ++k) {
      const v8 a = v[k] < 0.0f ? -v[k] : v[k];
      mx = a > mx ? a : mx;
    }
    float amax = 0.0f;
    for (int i = 0; i < W; ++i) amax = std::max(amax, mx[i]);
    const float dx = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = dx;
    for (int k = 0; k < QK / W; ++k) {
      // round to nearest even (|v id| <= 127: the magic number's trick is exact)
      const v8 r = (v[k] * id + 12582912.0f) - 12582912.0f;
      const i8v qi = __builtin_convertvector(r, i8v);
      for (int i = 0; i < W; ++i) q[b * QK + k * W + i] = (int8_t)qi[i];
    }
  }
}

void quantize_rows(const T* x, int64_t M, int64_t K, int64_t x_st, int threads, XQ& out) {
  out.K = K, out.nb = K / QK;
  out.q.resize(M * K), out.d.resize(M * out.nb);
  const int t = (int)std::max<int64_t>(1, std::min<int64_t>(threads, M * K / 65536));
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1)
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * x_st, K, out.q.data() + m * K, out.d.data() + m * out.nb);
}

#if defined(__AVX2__)
// a weight block's 32 values as signed bytes, and its scale
template <int type>
inline __m256i decode(const uint8_t* blk, float& d) {
  d = half(blk);
  if constexpr (type == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f));
    return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
  }
}
// 8 int32 sums of products of unsigned a by signed b, 4 byte pairs each
inline __m256i dot(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// out[i][j] = x row m0 + i . weight row w[j] (i < mr, j < nr)
template <int type, int mr, int nr>
void tile(const XQ& xq, int64_t m0, const uint8_t* const* w, float (*out)[NR]) {
  __m256 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_setzero_ps();
  const int bb = block_bytes(type);
  const int8_t* xr = xq.q.data() + m0 * xq.K;
  const float* xd = xq.d.data() + m0 * xq.nb;
  for (int64_t b = 0; b < xq.nb; ++b) {
    __m256i ws[nr], aw[nr];
    float dw[nr];
    for (int j = 0; j < nr; ++j) {
      ws[j] = decode<type>(w[j] + b * bb, dw[j]);
      aw[j] = _mm256_sign_epi8(ws[j], ws[j]);  // |w|
    }
    for (int i = 0; i < mr; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + i * xq.K + b * QK));
      const float dx = xd[i * xq.nb + b];
      for (int j = 0; j < nr; ++j) {
        const __m256i s = dot(aw[j], _mm256_sign_epi8(xv, ws[j]));  // |w| times x with w's sign
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw[j] * dx), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i][j] = hsum(acc[i][j]);
}
#else
template <int type>
inline void decode(const uint8_t* blk, int8_t* v, float& d) {
  d = half(blk);
  if constexpr (type == kQ8_0) {
    std::memcpy(v, blk + 2, QK);
  } else {
    for (int j = 0; j < QK / 2; ++j) v[j] = (int8_t)((blk[2 + j] & 0x0f) - 8), v[j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
  }
}
template <int type, int mr, int nr>
void tile(const XQ& xq, int64_t m0, const uint8_t* const* w, float (*out)[NR]) {
  float acc[mr][nr] = {};
  const int bb = block_bytes(type);
  for (int64_t b = 0; b < xq.nb; ++b) {
    int8_t v[nr][QK];
    float dw[nr];
    for (int j = 0; j < nr; ++j) decode<type>(w[j] + b * bb, v[j], dw[j]);
    for (int i = 0; i < mr; ++i) {
      const int8_t* xv = xq.q.data() + (m0 + i) * xq.K + b * QK;
      const float dx = xq.d[(m0 + i) * xq.nb + b];
      for (int j = 0; j < nr; ++j) {
        int32_t s = 0;
        for (int k = 0; k < QK; ++k) s += (int32_t)v[j][k] * xv[k];
        acc[i][j] += (float)s * (dw[j] * dx);
      }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i][j] = acc[i][j];
}
#endif

// y[m, col + j0 + j] for every row m of x and weight rows j0 .. j0 + n (n <= NR) of one weight
template <int type, int nr>
void rows_of(const XQ& xq, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t j0, T* y, int64_t y_st) {
  const uint8_t* ws[NR];
  for (int j = 0; j < nr; ++j) ws[j] = w + (j0 + j) * row_bytes;
  float out[MR][NR];
  int64_t m = 0;
  for (; m + MR <= M; m += MR) {
    tile<type, MR, nr>(xq, m, ws, out);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < nr; ++j) y[(m + i) * y_st + j0 + j] = fms_vec::from_f32<T>(out[i][j]);
  }
  for (; m < M; ++m) {
    tile<type, 1, nr>(xq, m, ws, out);
    for (int j = 0; j < nr; ++j) y[m * y_st + j0 + j] = fms_vec::from_f32<T>(out[0][j]);
  }
}

template <int type>
void block(int64_t n, const XQ& xq, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t j0, T* y,
           int64_t y_st) {
  if (n == NR)
    rows_of<type, NR>(xq, M, w, row_bytes, j0, y, y_st);
  else
    rows_of<type, 1>(xq, M, w, row_bytes, j0, y, y_st);
}

}  // namespace

// The kernel's arguments: the struct of FMS_PAGED_QGEMV_FIELDS (kernels/kernels.h), checked by
// the operators against their own layout when they load the library (as gemv.cpp's).
extern "C" {

FMS_PAGED_ARGS(FmsQgemvArgs, FMS_PAGED_QGEMV_FIELDS, fms_paged_qgemv_layout)

// -> 0, or 1 for a weight of a type other than Q8_0 / Q4_0 or K not a multiple of 32
int fms_paged_qgemv(const FmsQgemvArgs* args) {
  const FmsQgemvArgs& a = *args;
  const int64_t M = a.M, K = a.K;
  if (K % QK) return 1;
  for (int64_t i = 0; i < a.n_weights; ++i)
    if (a.types[i] != kQ8_0 && a.types[i] != kQ4_0) return 1;
  static thread_local XQ kept;  // kept from call to call: a prefill's rows are megabytes
  XQ& xq = kept;  // (the caller's: a thread_local named inside the parallel region is each thread's own)
  quantize_rows(a.x, M, K, a.x_st, a.threads, xq);
  // the weights' row pairs, segment by segment: pair p is segment i's rows (p - first[i]) NR on
  std::vector<int64_t> first{0}, col{0};
  for (int64_t i = 0; i < a.n_weights; ++i) {
    first.push_back(first.back() + (a.rows[i] + NR - 1) / NR);
    col.push_back(col.back() + a.rows[i]);
  }
  const int64_t np = first.back(), y_st = col.back();
  const int64_t by_work = std::max<int64_t>(1, M * y_st * K / GRAIN);
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)a.threads, np, by_work}));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    int64_t i = 0;
    for (int64_t p = np * t / threads; p < np * (t + 1) / threads; ++p) {
      while (p >= first[i + 1]) ++i;
      const int type = a.types[i];
      const int64_t j0 = (p - first[i]) * NR, n = std::min<int64_t>(NR, a.rows[i] - j0);
      const int64_t row_bytes = K / QK * block_bytes(type);
      const uint8_t* w = reinterpret_cast<const uint8_t*>(a.weights[i]);
      T* y = a.y + col[i];
      if (type == kQ8_0)
        block<kQ8_0>(n, xq, M, w, row_bytes, j0, y, y_st);
      else
        block<kQ4_0>(n, xq, M, w, row_bytes, j0, y, y_st);
    }
  }
  return 0;
}

}  // extern "C"
