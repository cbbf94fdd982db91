// Products of rows with weights held as GGUF blocks, y = x W^T, dequantized in registers: the
// projections of a GGUF model's Q8_0, Q4_0, Q5_0, Q4_K, Q5_K and Q6_K tensors (fms_paged/modules/
// quantized.py BlockLinear; one call may mix types, as a Q4_K_M file's Q4_K q/k and Q6_K v),
// for decode rows and prefill chunks alike. Built and loaded by fms_paged/native once per storage
// type T of x and y (-DFMS_ELEM: float, fms_bf16 or fms_f16), like gemv.cpp.
//
// A weight row of K values is K / 32 blocks, each an fp16 scale d and 32 quants, as llama.cpp
// writes them (ggml's block_q8_0 / block_q4_0, no repacking):
// - Q8_0 (34 bytes): d, then 32 int8 q: w = d q;
// - Q4_0 (18 bytes): d, then 16 bytes of nibbles, byte j holding element j (low) and j + 16
//   (high): w = d (q - 8).
// The other types (Q5_0's blocks of 32, the K-quants' super-blocks of 256: qgemv_blocks.h) are
// read as sub-blocks of 32 unsigned quants u with, per 16 values, a multiplier a and an offset b
// (w = a u + b), dotted as sum a dx (sum u qx) + b dx (sum qx): the sums of x's quants come with
// x's quantization (XQ::xs).
//
// x is quantized per block of 32 for every type, where llama.cpp quantizes x for the K-quants
// per 256 (q8_K: one scale, with sums per 16): one quantization then serves every weight of a
// call whatever their types (a Q4_K_M layer's q/k/v are Q4_K and Q6_K), the K-quants' sub-blocks
// (32 for Q4_K / Q5_K, 16 for Q6_K) each fall in one of x's blocks, and a scale per 32 rounds x
// finer than one per 256 (the bound below holds alike).
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
// The other types' u (at most 63) are unsigned already: u times qx as they are, no sign moved.
//
// Register tiles of MR rows of x by NR weight rows: a weight block is decoded once for MR rows,
// and a tile's fp32 accumulators are vectors (cvt and FMA per block, one horizontal sum per tile).
// Decode calls of up to 8 rows (AVX-512 VNNI; Q4_0, Q4_K, and Q8_0 / Q6_K from 2 / 3 rows) read 16
// weight rows at a time instead, transposed in registers so that each 32-bit lane is one weight row
// (cols16, cols16_k below); Q6_K's one or two rows a weight row at a time, its offset in the
// integer sums (row_q6k). Calls of more rows (prefill) dequantize bf16 where the CPU has
// AVX512_BF16 (FMS_QTILES below): a weight row pair at a time for a few rows, panels of 64 weight
// rows (panels.h, shared with gemm.cpp) from PANEL_ROWS rows; an AVX2 build dequantizes fp32
// panels from PANEL_ROWS rows (FMS_QPANELS).
// Threads split the weight rows (all segments of one call: q/k/v side by side in y) into
// contiguous shares of rows; a prefill's rows of x are reused from L2 for each weight row pair.
#include <omp.h>

#include "args.h"
#include "kernels.h"
#include "panels.h"
#include "qgemv_blocks.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
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
using fms_gguf::kQ8_0, fms_gguf::kQ4_0, fms_gguf::kQ5_0, fms_gguf::kQ4_K, fms_gguf::kQ5_K, fms_gguf::kQ6_K;
using fms_gguf::block_bytes;
// f(the ggml type as a compile-time constant: std::integral_constant<int, type>) for a type the
// kernel reads (block_bytes(type) != 0)
template <class F>
void with_type(int type, F&& f) {
  switch (type) {
    case kQ8_0: return f(std::integral_constant<int, kQ8_0>{});
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    case kQ4_K: return f(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int, kQ5_K>{});
    default: return f(std::integral_constant<int, kQ6_K>{});
  }
}
// the types taken as sub-blocks of unsigned integers u with a multiplier and an offset
// (qgemv_blocks.h): all but Q8_0 / Q4_0, whose own paths stay as they were
constexpr bool sub_type(int type) { return type != kQ8_0 && type != kQ4_0; }
#if defined(__AVX512F__)
constexpr int MR = 8, NR = 2;  // register tile: rows of x by weight rows (32 registers)
#else
constexpr int MR = 4, NR = 2;  // register tile: rows of x by weight rows
#endif
constexpr int NG = 16;  // weight rows a block of cols16 (AVX-512)
constexpr int64_t GRAIN = int64_t(1) << 17;  // multiply-adds per thread, at least (as gemv.cpp)

inline float half(const uint8_t* p) {  // an fp16 scale, unaligned
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fms_vec::to_f32(fms_f16{h});
}

// x [M, K] (row stride x_st) quantized per block of 32: q [M, K] int8, d [M, K / 32] fp32
// With AVX-512 (Z512), also per block: x + 128 as unsigned bytes (qu: the Q8_0 products), the block's
// scale repeated over 8 lanes (dv, [M, nb2, 8]) and -8 x's sums over 4 bytes as 8 int32 lanes (c4,
// [M, nb2, 8]: Q4_0's offset, the products' starting sums), each row padded to an even number of
// blocks nb2 (zeros): two blocks are one 512-bit register.
// Where a call holds a type other than Q8_0 / Q4_0 (`sums`), also dx times the sums of x's quants over 4
// bytes as 8 fp32 lanes a block (xs, [M, nb2, 8]): what the offsets b of those types multiply.
struct XQ {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<uint8_t> qu;
  std::vector<float> dv;
  std::vector<int32_t> c4;
  std::vector<float> xs;
  std::vector<int32_t> o8;  // (AVX-512) -8 times the sum of each block's quants, [M, nb2]: Q4_0's offset (cols16)
  // (AVX-512, `sums`) dx times the sum of each block's quants [M, nb2] (Q4_K's mins), and -32 times
  // the sum of each half's (16 values) quants [M, nb2, 2] (Q6_K's offset): cols16_k
  std::vector<float> xsb;
  std::vector<int32_t> o32;
  int64_t K, nb, nb2;
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

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define FMS_Q512 1
#endif

void quantize_rows(const T* x, int64_t M, int64_t K, int64_t x_st, int threads, bool sums, XQ& out) {
  out.nb = K / QK, out.nb2 = (out.nb + 1) / 2 * 2, out.K = out.nb2 * QK;  // (rows padded: K2)
  const int64_t K2 = out.K, nb2 = out.nb2;
  out.q.assign(M * K2, 0), out.d.assign(M * nb2, 0.0f);
#ifdef FMS_Q512
  out.qu.resize(M * K2), out.dv.resize(M * nb2 * 8), out.c4.resize(M * nb2 * 8), out.o8.resize(M * nb2);
#endif
  if (sums) out.xs.assign(M * nb2 * 8, 0.0f);
#ifdef FMS_Q512
  if (sums) out.xsb.assign(M * nb2, 0.0f), out.o32.assign(M * nb2 * 2, 0);
#endif
  const int t = (int)std::max<int64_t>(1, std::min<int64_t>(threads, M * K / 65536));
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1)
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(x + m * x_st, K, out.q.data() + m * K2, out.d.data() + m * nb2);
#ifdef FMS_Q512
    for (int64_t b = 0; b < nb2; ++b) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out.q.data() + m * K2 + b * QK));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qu.data() + m * K2 + b * QK),
                          _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)));
      const __m256i c = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(8),
                                            _mm256_sub_epi8(_mm256_setzero_si256(), v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.c4.data() + (m * nb2 + b) * 8), c);
      out.o8[m * nb2 + b] = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(c));
      _mm256_storeu_ps(out.dv.data() + (m * nb2 + b) * 8, _mm256_set1_ps(out.d[m * nb2 + b]));
      if (sums) {
        const __m256i s4 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), v);
        _mm256_storeu_ps(out.xs.data() + (m * nb2 + b) * 8,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(s4), _mm256_set1_ps(out.d[m * nb2 + b])));
        alignas(32) int32_t l[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(l), s4);
        const int32_t h0 = l[0] + l[1] + l[2] + l[3], h1 = l[4] + l[5] + l[6] + l[7];
        out.xsb[m * nb2 + b] = float(h0 + h1) * out.d[m * nb2 + b];
        out.o32[(m * nb2 + b) * 2] = -32 * h0, out.o32[(m * nb2 + b) * 2 + 1] = -32 * h1;
      }
    }
#else
    if (sums)
      for (int64_t b = 0; b < out.nb; ++b)
        for (int l = 0; l < 8; ++l) {
          const int8_t* q = out.q.data() + m * K2 + b * QK + 4 * l;
          out.xs[(m * nb2 + b) * 8 + l] = float(q[0] + q[1] + q[2] + q[3]) * out.d[m * nb2 + b];
        }
#endif
  }
}

#ifdef FMS_Q512
// Two blocks at a time in 512-bit registers, one vpdpbusd per pair of blocks and row of x:
// - Q4_0: the quants q in [0, 15] as they are (unsigned) times x (signed), the sums starting at
//   -8 sum x (c4): sum (q - 8) x;
// - Q8_0: x + 128 (unsigned) times w (signed), the sums starting at -128 sum w (one vpdpbusd per
//   weight block pair, for all the tile's rows): sum x w.
// Then each lane's int32 sum to fp32, times dx (dv) and dw, into the tile's fp32 accumulators.
// A row's odd last block is a pair whose second block is zeros (x's padding; w's not read).
template <int type>
inline __m512i decode2(const uint8_t* blk, bool two, __m512& dw, __m512i& start) {
  const int bb = block_bytes(type);
  const float d0 = half(blk), d1 = two ? half(blk + bb) : 0.0f;
  dw = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
  if constexpr (type == kQ8_0) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const __m256i w1 = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + bb + 2)) : _mm256_setzero_si256();
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
    start = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80),
                                _mm512_sub_epi8(_mm512_setzero_si512(), w));  // -128 sum w
    return w;
  } else {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i q1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + bb + 2)) : _mm_setzero_si128();
    const __m256i y = _mm256_set_m128i(q1, q0);
    const __m256i lo = _mm256_and_si256(y, _mm256_set1_epi8(0x0f));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(y, 4), _mm256_set1_epi8(0x0f));
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // lo0 lo1 hi0 hi1
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));              // lo0 hi0 lo1 hi1
  }
}
inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

template <int type, int mr, int nr>
void tile(const XQ& xq, int64_t m0, const uint8_t* const* w, float (*out)[NR]) {
  __m512 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_setzero_ps();
  const int bb = block_bytes(type);
  const int64_t K = xq.K, nb2 = xq.nb2;
  for (int64_t b = 0; b < xq.nb; b += 2) {
    const bool two = b + 1 < xq.nb;
    __m512i wv[nr], start[nr];
    __m512 dw[nr];
    for (int j = 0; j < nr; ++j) wv[j] = decode2<type>(w[j] + b * bb, two, dw[j], start[j]);
    for (int i = 0; i < mr; ++i) {
      const int64_t r = m0 + i;
      const __m512 dx = _mm512_loadu_ps(xq.dv.data() + (r * nb2 + b) * 8);
      __m512i xv, c;
      if constexpr (type == kQ8_0) {
        xv = _mm512_loadu_si512(xq.qu.data() + r * K + b * QK);
      } else {
        xv = _mm512_loadu_si512(xq.q.data() + r * K + b * QK);
        c = _mm512_loadu_si512(xq.c4.data() + (r * nb2 + b) * 8);
      }
      for (int j = 0; j < nr; ++j) {
        const __m512i s = type == kQ8_0 ? _mm512_dpbusd_epi32(start[j], xv, wv[j]) : _mm512_dpbusd_epi32(c, wv[j], xv);
        acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dx), dw[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i][j] = hsum512(acc[i][j]);
}

// The other types (sub_type), two sub-blocks of 32 (values 64 p ..) at a time: u, 64 unsigned
// integers (at most 63), and per lane of 4 values the multiplier A and offset B (qgemv_blocks.h:
// w = a u + b). Then per row of x: vpdpbusd of u (unsigned) by x's quants (signed), exact in int32,
// times A dx, plus B times dx sum x's quants (xs): sum_lanes (a dx sum u qx + b dx sum qx).
// A row's odd last Q5_0 block is a pair whose second block is zeros (A = B = 0; x's padding zeros).
// The K-quants' scales are decoded once a super-block (sb_scales: S), each pair's lanes then picked
// from S (vpermps).
constexpr bool k_type(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

// Super-block sb of a row: Q4_K / Q5_K: d sc_j in lanes j < 8, -dmin m_j in lanes 8 + j (the 12
// scale bytes unpacked as 32-bit words: qgemv_blocks.h's k_scale, four sub-blocks at a time);
// Q6_K: d sc_g of each 16 values g in lane g
template <int type>
__attribute__((always_inline)) inline __m512 sb_scales(const uint8_t* row, int64_t sb) {
  if constexpr (type == kQ6_K) {
    const uint8_t* blk = row + sb * 210;
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
    return _mm512_mul_ps(sc, _mm512_set1_ps(half(blk + 208)));
  } else if constexpr (type == kQ4_K || type == kQ5_K) {
    const uint8_t* blk = row + sb * (type == kQ5_K ? 176 : 144);
    uint32_t s[3];
    std::memcpy(s, blk + 4, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    const __m128i v = _mm_setr_epi32(int(s[0] & low6), int((s[2] & low4) | ((s[0] >> 6) & low2) << 4),  // sc 0-3, 4-7
                                     int(s[1] & low6), int(((s[2] >> 4) & low4) | ((s[1] >> 6) & low2) << 4));  // m
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
    return _mm512_mul_ps(f, _mm512_insertf32x8(_mm512_set1_ps(half(blk)), _mm256_set1_ps(-half(blk + 2)), 1));
  } else {
    return _mm512_setzero_ps();
  }
}

template <int type>
__attribute__((always_inline)) inline __m512i decode_pair(const uint8_t* row, int64_t p, bool two, const __m512& S, __m512& A,
                                                        __m512& B) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  if constexpr (type == kQ5_0) {
    const uint8_t* blk = row + 2 * p * 22;
    auto one = [&](const uint8_t* bl) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bl + 6));
      uint32_t qh;
      std::memcpy(&qh, bl + 2, 4);
      const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
      return _mm256_or_si256(nib, _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16)));
    };
    const float d0 = half(blk), d1 = two ? half(blk + 22) : 0.0f;
    A = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
    B = _mm512_mul_ps(A, _mm512_set1_ps(-16.0f));
    const __m256i u1 = two ? one(blk + 22) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(one(blk)), u1, 1);
  } else if constexpr (type == kQ6_K) {
    // sub-blocks j = 2 pp, 2 pp + 1 of the super-block: half h = pp / 2, r = 2 (pp % 2) and r + 1
    const uint8_t* blk = row + p / 4 * 210;
    const int pp = int(p % 4), h = pp / 2, odd = pp % 2;
    const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
    const __m512i lo = _mm512_and_si512(_mm512_srl_epi16(ql, _mm_cvtsi32_si128(4 * odd)), _mm512_set1_epi8(0x0f));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    const __m512i hi = _mm512_and_si512(_mm512_srl_epi16(qh2, _mm_cvtsi32_si128(4 * odd)), _mm512_set1_epi8(3));
    // the pair's four scales of 16 values 4 pp .. 4 pp + 3, each over 4 lanes
    const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(4 * pp),
                                        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
    A = _mm512_permutexvar_ps(at, S);
    B = _mm512_mul_ps(A, _mm512_set1_ps(-32.0f));
    return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
  } else {  // Q4_K, Q5_K: sub-blocks 2 pp (low nibbles), 2 pp + 1 (high) of bytes 32 pp ..
    constexpr bool five = type == kQ5_K;
    const uint8_t* blk = row + p / 4 * (five ? 176 : 144);
    const int pp = int(p % 4);
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (five ? 48 : 16) + 32 * pp));
    __m256i lo = _mm256_and_si256(y, m4), hi = _mm256_and_si256(_mm256_srli_epi16(y, 4), m4);
    if constexpr (five) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      const __m256i sixteen = _mm256_set1_epi8(16);
      lo = _mm256_or_si256(lo, _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * pp)))), sixteen));
      hi = _mm256_or_si256(hi, _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(2 << (2 * pp)))), sixteen));
    }
    // sub-blocks 2 pp (lanes 0-7) and 2 pp + 1 (8-15): S's lanes 2 pp, 2 pp + 1 and, for B, 8 on
    const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(2 * pp),
                                        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    A = _mm512_permutexvar_ps(at, S);
    B = _mm512_permutexvar_ps(_mm512_add_epi32(at, _mm512_set1_epi32(8)), S);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

template <int type, int mr, int nr>
void tile_sub(const XQ& xq, int64_t m0, const uint8_t* const* w, float (*out)[NR]) {
  __m512 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t K = xq.K, nb2 = xq.nb2;
  constexpr int64_t step = k_type(type) ? 8 : 2;  // a super-block of the K-quants, else a pair
  for (int64_t b0 = 0; b0 < xq.nb; b0 += step) {
  __m512 S[nr];  // the K-quants' super-block scales (sb_scales)
  for (int j = 0; j < nr; ++j) S[j] = sb_scales<type>(w[j], b0 / 8);
  for (int64_t b = b0; b < b0 + step; b += 2) {
    const bool two = b + 1 < xq.nb;
    __m512i u[nr];
    __m512 A[nr], B[nr];
    for (int j = 0; j < nr; ++j) u[j] = decode_pair<type>(w[j], b / 2, two, S[j], A[j], B[j]);
    for (int i = 0; i < mr; ++i) {
      const int64_t r = m0 + i;
      const __m512 dx = _mm512_loadu_ps(xq.dv.data() + (r * nb2 + b) * 8);
      const __m512 xs = _mm512_loadu_ps(xq.xs.data() + (r * nb2 + b) * 8);
      const __m512i xv = _mm512_loadu_si512(xq.q.data() + r * K + b * QK);
      for (int j = 0; j < nr; ++j) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[j], xv);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(A[j], dx), acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(B[j], xs, acc[i][j]);
      }
    }
  }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i][j] = hsum512(acc[i][j]);
}

// Decode calls of a few rows of x (GROUP_ROWS at most) over Q4_0 / Q8_0 (the K-quants: cols16_k
// below): 16 weight rows at a time, transposed in registers so that each 32-bit lane is one weight
// row. Four bytes k .. k + 3 of
// 16 rows' blocks then meet x's bytes k .. k + 3 broadcast to every lane: one vpdpbusd adds 4
// products to each of the 16 rows' sums, and each block ends in one int32 -> fp32 conversion and
// one FMA for 16 weight rows (the rows' scales dw loaded into one vector, times x's dx), where
// tile() spends a conversion and two multiplies per weight row and block pair. The weights'
// nibbles are unpacked once for all rows of x. Each output's sums are exact integers per block,
// as tile()'s; only the order of the fp32 sums over blocks differs (block by block here).
// - Q4_0: the quants q (unsigned, [0, 15]) times x's quants (signed), the sums starting at
//   -8 sum qx (XQ::o8): sum (q - 8) qx;
// - Q8_0: x + 128 (unsigned: XQ::qu) times w (signed), the sums starting at -128 sum w: sum qx w.
// The 16 rows are 16 streams, which the hardware prefetcher did not keep up with: the next 16 rows
// (one contiguous run) are prefetched into L2 in order, a sixteenth of them per block (into L1 they
// evicted the rows being read). A group's rows lie one after another (16 row_bytes); a group of
// fewer rows (a weight's last) reads its last row again in the lanes past it and stores only its own.
constexpr int64_t GROUP_ROWS = 8;  // rows of x a cols16 call takes, at most
// Calls of up to INT8_ROWS rows take cols16 (GROUP_ROWS at a time), more rows the bf16 tiles, which
// keep prefill's activations in bf16 (perplexity within 0.01% of the dequantized model's, where int8
// activations cost 0.27-0.42%: docs/benchmarks.md). cols16 would be the faster for prefill too (64
// rows of an 11264 x 2048 weight, single thread: Q4_0 11.6 against 23.7 ms, Q4_K 12.4 / 23.9, Q6_K
// 16.1 / 25.5; a 1.1B Q4_K_M model's 512-token prefill 2.4 against 3.8 s, two threads).
constexpr int64_t INT8_ROWS = GROUP_ROWS;

// dwords of four 128-bit lanes (a, b, c, d) transposed within each lane: lane l's dword k of
// input t becomes lane l's dword t of output k
__attribute__((always_inline)) inline void transpose4(__m512i& a, __m512i& b, __m512i& c, __m512i& d) {
  const __m512i t0 = _mm512_unpacklo_epi32(a, b), t1 = _mm512_unpackhi_epi32(a, b);
  const __m512i t2 = _mm512_unpacklo_epi32(c, d), t3 = _mm512_unpackhi_epi32(c, d);
  a = _mm512_unpacklo_epi64(t0, t2), b = _mm512_unpackhi_epi64(t0, t2);
  c = _mm512_unpacklo_epi64(t1, t3), d = _mm512_unpackhi_epi64(t1, t3);
}
// the 16 bytes at p[r] + off of rows r = q, q + 4, q + 8, q + 12 in 128-bit lanes 0 .. 3: after
// transpose4 of q = 0 .. 3, 32-bit lane 4 l + q holds row 4 l + q, i.e. lane r row r
__attribute__((always_inline)) inline __m512i load4(const uint8_t* const* p, int q, int64_t off) {
  __m512i z = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[q] + off)));
  z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[q + 4] + off)), 1);
  z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[q + 8] + off)), 2);
  return _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[q + 12] + off)), 3);
}

// the 32 bytes at a + off and at b + off in the low and high halves of a register
__attribute__((always_inline)) inline __m512i load2(const uint8_t* a, const uint8_t* b, int64_t off) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + off))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + off)), 1);
}

// y[m0 + i, 0 .. n) from acc[i] (lane j: weight row j of the 16; n <= NG), rounded to T
template <int mr>
inline void store_rows(const __m512 (&acc)[mr], int64_t m0, int64_t n, T* y, int64_t y_st) {
  for (int i = 0; i < mr; ++i) {
    alignas(64) float o[NG];
    _mm512_store_ps(o, acc[i]);
    for (int64_t j = 0; j < n; ++j) y[(m0 + i) * y_st + j] = fms_vec::from_f32<T>(o[j]);
  }
}

// y[m0 + i, j] (i < mr, j < n <= 16) = x row m0 + i . weight row j of w (row_bytes apart)
template <int type, int mr>
void cols16(const XQ& xq, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t n, T* y, int64_t y_st) {
  constexpr int bb = block_bytes(type);
  const uint8_t* p[NG];
  for (int r = 0; r < NG; ++r) p[r] = w + std::min<int64_t>(r, n - 1) * row_bytes;
  const int64_t K = xq.K, nb2 = xq.nb2, nb = xq.nb;
  __m512 acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = _mm512_setzero_ps();
  // the next group's bytes (the 16 rows after these) fetched while these are computed: a 16th of
  // them each block, in order (one sequential stream, where the vector loop reads 16 streams)
  const uint8_t* next = w + NG * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t off = b * bb;
    for (int64_t o = b * NG * bb; o < (b + 1) * NG * bb; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T1);
    // the 16 rows' scales (scalar loads: the integer pipes are otherwise idle)
    alignas(32) uint16_t dh[NG];
    for (int r = 0; r < NG; ++r) std::memcpy(&dh[r], p[r] + off, 2);
    const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh)));
    __m512i v[8];  // v[k]: bytes 4 k .. 4 k + 3 of the block's values (32-bit lane r: row r)
    if constexpr (type == kQ4_0) {
      __m512i z0 = load4(p, 0, off + 2), z1 = load4(p, 1, off + 2), z2 = load4(p, 2, off + 2),
              z3 = load4(p, 3, off + 2);
      transpose4(z0, z1, z2, z3);
      const __m512i m4 = _mm512_set1_epi8(0x0f);
      const __m512i z[4] = {z0, z1, z2, z3};
      for (int k = 0; k < 4; ++k)
        v[k] = _mm512_and_si512(z[k], m4), v[k + 4] = _mm512_and_si512(_mm512_srli_epi16(z[k], 4), m4);
    } else {
      for (int h = 0; h < 2; ++h) {
        const int64_t o = off + 2 + 16 * h;
        __m512i z0 = load4(p, 0, o), z1 = load4(p, 1, o), z2 = load4(p, 2, o), z3 = load4(p, 3, o);
        transpose4(z0, z1, z2, z3);
        v[4 * h] = z0, v[4 * h + 1] = z1, v[4 * h + 2] = z2, v[4 * h + 3] = z3;
      }
    }
    __m512i start = _mm512_setzero_si512();
    if constexpr (type == kQ8_0) {  // -128 sum w
      const __m512i c = _mm512_set1_epi8((char)0x80);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int k = 0; k < 8; k += 2) s0 = _mm512_dpbusd_epi32(s0, c, v[k]), s1 = _mm512_dpbusd_epi32(s1, c, v[k + 1]);
      start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_add_epi32(s0, s1));
    }
    for (int i = 0; i < mr; ++i) {
      const int64_t r = m0 + i;
      const uint8_t* xr = type == kQ8_0 ? xq.qu.data() : reinterpret_cast<const uint8_t*>(xq.q.data());
      const int32_t* xv = reinterpret_cast<const int32_t*>(xr + r * K + b * QK);
      __m512i s0 = type == kQ8_0 ? start : _mm512_set1_epi32(xq.o8[r * nb2 + b]), s1 = _mm512_setzero_si512();
      for (int k = 0; k < 8; k += 2) {
        if constexpr (type == kQ8_0) {
          s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(xv[k]), v[k]);
          s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(xv[k + 1]), v[k + 1]);
        } else {
          s0 = _mm512_dpbusd_epi32(s0, v[k], _mm512_set1_epi32(xv[k]));
          s1 = _mm512_dpbusd_epi32(s1, v[k + 1], _mm512_set1_epi32(xv[k + 1]));
        }
      }
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                               _mm512_mul_ps(dw, _mm512_set1_ps(xq.d[r * nb2 + b])), acc[i]);
    }
  }
  store_rows<mr>(acc, m0, n, y, y_st);
}
// The K-quants alike (Q4_K, Q6_K), a super-block of 256 values at a time: its scales decoded for
// the 16 rows at once (each row's scale bytes transposed into its lane as the quants are), then
// per sub-block of 32 (x's block) the rows' unsigned quants u dotted with x's quants exactly in
// int32, times the rows' multipliers a (w = a u + b, qgemv_blocks.h) and dx:
// - Q4_K: a = d sc_j, b = -dmin m_j: sum a dx (sum u qx) + b (dx sum qx) (XQ::xsb);
// - Q6_K: a = d sc per 16 values, b = -32 a: the sums of each 16 start at -32 sum qx (XQ::o32),
//   exact: sum a dx (sum (u - 32) qx).
template <int type, int mr>
void cols16_k(const XQ& xq, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t n, T* y, int64_t y_st) {
  constexpr int sbb = block_bytes(type);
  const uint8_t* p[NG];
  for (int r = 0; r < NG; ++r) p[r] = w + std::min<int64_t>(r, n - 1) * row_bytes;
  const int64_t K = xq.K, nb2 = xq.nb2, nsb = xq.nb / 8;
  const uint8_t* next = w + NG * row_bytes;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  __m512 acc[mr];
  for (int i = 0; i < mr; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const int64_t off = sb * sbb;
    if constexpr (type != kQ4_K)
      for (int64_t o = sb * NG * sbb; o < (sb + 1) * NG * sbb; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T1);
    if constexpr (type == kQ4_K) {
      alignas(64) float A[8][NG], B[8][NG];  // a and b of sub-block j, lane r: row r
      {
        __m512i t0 = load4(p, 0, off), t1 = load4(p, 1, off), t2 = load4(p, 2, off), t3 = load4(p, 3, off);
        transpose4(t0, t1, t2, t3);  // t0: d, dmin; t1, t2, t3: the 12 scale bytes
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(t0));
        const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(t0, 16)));
        const __m512i low6 = _mm512_set1_epi8(0x3f), top2 = _mm512_set1_epi8(0x30);
        const __m512i sc[2] = {  // sc 0-3, 4-7 (qgemv_blocks.h's k_scale)
            _mm512_and_si512(t1, low6),
            _mm512_or_si512(_mm512_and_si512(t3, m4), _mm512_and_si512(_mm512_srli_epi32(t1, 2), top2))};
        const __m512i mn[2] = {_mm512_and_si512(t2, low6),
                               _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(t3, 4), m4),
                                               _mm512_and_si512(_mm512_srli_epi32(t2, 2), top2))};
        const __m512i byte = _mm512_set1_epi32(0xff);
        for (int j = 0; j < 8; ++j) {
          const int sh = 8 * (j % 4);
          const __m512 s = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(sc[j / 4], sh), byte));
          const __m512 m = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(mn[j / 4], sh), byte));
          _mm512_store_ps(A[j], _mm512_mul_ps(d, s));
          _mm512_store_ps(B[j], _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin), m));
        }
      }
      for (int pp = 0; pp < 4; ++pp) {  // sub-blocks 2 pp (low nibbles), 2 pp + 1 (high) of bytes 32 pp ..
        // a quarter of the next group's super-block each time (NG sbb / 4 = 9 lines): in a burst of
        // 36 the prefetches stalled the loop once the core's misses in flight were at their limit
        for (int64_t o = (4 * sb + pp) * NG * sbb / 4; o < (4 * sb + pp + 1) * NG * sbb / 4; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T1);
        // lo: the low nibbles; hi: the high ones times 16 (bits 4-7 left in place: one and, no
        // shift; their sums are 16 times the quants', < 2^24, and their dx is taken / 16 below:
        // the same products, bit for bit)
        __m512i lo[8], hi[8];
        const __m512i f0 = _mm512_set1_epi8((char)0xf0);
        // the pair's 32 bytes of rows q, q + 4 and q + 8, q + 12 in two registers, then each half
        // h's 16 bytes of the four rows picked from both by a shuffle (load4(p, q, o + 16 h) in two
        // shuffles a pair of halves, where load4 takes three inserts a half)
        const int64_t o = off + 16 + 32 * pp;
        __m512i z[2][4];
        for (int q = 0; q < 4; ++q) {
          const __m512i a = load2(p[q], p[q + 4], o), c = load2(p[q + 8], p[q + 12], o);
          z[0][q] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));
          z[1][q] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));
        }
        for (int h = 0; h < 2; ++h) {
          transpose4(z[h][0], z[h][1], z[h][2], z[h][3]);
          for (int g = 0; g < 4; ++g)
            lo[4 * h + g] = _mm512_and_si512(z[h][g], m4), hi[4 * h + g] = _mm512_and_si512(z[h][g], f0);
        }
        const int64_t b0 = sb * 8 + 2 * pp;
        for (int i = 0; i < mr; ++i) {
          const int64_t r = m0 + i;
          for (int t = 0; t < 2; ++t) {
            const __m512i* u = t ? hi : lo;
            const int64_t b = b0 + t;
            const int32_t* xv = reinterpret_cast<const int32_t*>(xq.q.data() + r * K + b * QK);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int k = 0; k < 8; k += 2) {
              s0 = _mm512_dpbusd_epi32(s0, u[k], _mm512_set1_epi32(xv[k]));
              s1 = _mm512_dpbusd_epi32(s1, u[k + 1], _mm512_set1_epi32(xv[k + 1]));
            }
            const int j = 2 * pp + t;
            const float dx = t ? xq.d[r * nb2 + b] * 0.0625f : xq.d[r * nb2 + b];  // (hi: 16 u)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                     _mm512_mul_ps(_mm512_load_ps(A[j]), _mm512_set1_ps(dx)), acc[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_load_ps(B[j]), _mm512_set1_ps(xq.xsb[r * nb2 + b]), acc[i]);
          }
        }
      }
    } else {  // Q6_K
      alignas(64) float A[16][NG];  // a of each 16 values g, lane r: row r
      {
        __m512i t0 = load4(p, 0, off + 192), t1 = load4(p, 1, off + 192), t2 = load4(p, 2, off + 192),
                t3 = load4(p, 3, off + 192);
        transpose4(t0, t1, t2, t3);  // the 16 int8 scales, 4 a register
        alignas(32) uint16_t dh[NG];
        for (int r = 0; r < NG; ++r) std::memcpy(&dh[r], p[r] + off + 208, 2);
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh)));
        const __m512i t[4] = {t0, t1, t2, t3};
        for (int g = 0; g < 16; ++g) {
          const __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(t[g / 4], 24 - 8 * (g % 4)), 24);
          _mm512_store_ps(A[g], _mm512_mul_ps(d, _mm512_cvtepi32_ps(v)));
        }
      }
      const __m512i top2 = _mm512_set1_epi8(0x30);
      // values 128 h ..: sub-blocks 4 h + rr; per 16 of their values (hh: bytes 16 hh .. of each part,
      // one scale each), ql bytes 64 h + 16 hh (qa; sub-blocks rr 0, 2) and 64 h + 32 + 16 hh (qb; 1,
      // 3), qh bytes 32 h + 16 hh (qc), each as 4 registers of 4 bytes a row
      for (int h = 0; h < 2; ++h)
        for (int hh = 0; hh < 2; ++hh) {
          __m512i qa[4], qb[4], qc[4];
          for (int part = 0; part < 3; ++part) {
            __m512i* dst = part == 0 ? qa : part == 1 ? qb : qc;
            const int64_t o = off + (part == 2 ? 128 + 32 * h : 64 * h + 32 * part) + 16 * hh;
            dst[0] = load4(p, 0, o), dst[1] = load4(p, 1, o), dst[2] = load4(p, 2, o), dst[3] = load4(p, 3, o);
            transpose4(dst[0], dst[1], dst[2], dst[3]);
          }
          for (int rr = 0; rr < 4; ++rr) {
            __m512i u[4];  // low 4 bits of ql (high nibble for rr >= 2), bits 2 rr, 2 rr + 1 of qh
            for (int k = 0; k < 4; ++k) {
              const __m512i l = rr % 2 ? qb[k] : qa[k];
              const __m512i lo4 = rr >= 2 ? _mm512_srli_epi16(l, 4) : l;
              const int sh = 2 * rr;  // qh's bits sh, sh + 1 to bits 4, 5
              const __m512i hb = sh < 4    ? _mm512_slli_epi16(qc[k], 4 - sh)
                                 : sh == 4 ? qc[k]
                                           : _mm512_srli_epi16(qc[k], sh - 4);
              u[k] = _mm512_ternarylogic_epi32(lo4, m4, _mm512_and_si512(hb, top2), 0xEA);  // (lo4 & m4) | hb
            }
            const int j = 4 * h + rr;
            const int64_t b = sb * 8 + j;
            const __m512 a = _mm512_load_ps(A[2 * j + hh]);
            for (int i = 0; i < mr; ++i) {
              const int64_t r = m0 + i;
              const int32_t* xv = reinterpret_cast<const int32_t*>(xq.q.data() + r * K + b * QK) + 4 * hh;
              __m512i s0 = _mm512_set1_epi32(xq.o32[(r * nb2 + b) * 2 + hh]), s1 = _mm512_setzero_si512();
              s0 = _mm512_dpbusd_epi32(s0, u[0], _mm512_set1_epi32(xv[0]));
              s1 = _mm512_dpbusd_epi32(s1, u[1], _mm512_set1_epi32(xv[1]));
              s0 = _mm512_dpbusd_epi32(s0, u[2], _mm512_set1_epi32(xv[2]));
              s1 = _mm512_dpbusd_epi32(s1, u[3], _mm512_set1_epi32(xv[3]));
              acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                       _mm512_mul_ps(a, _mm512_set1_ps(xq.d[r * nb2 + b])), acc[i]);
            }
          }
        }
    }
  }
  store_rows<mr>(acc, m0, n, y, y_st);
}
// Q6_K, one weight row at a time against mr rows of x (decode of one or two rows, where cols16_k's
// transposes of three parts (ql, qh, scales) cost more than they save): a half super-block (128
// values: ql's 64 bytes, qh's 32) unpacked into two registers of 64 unsigned quants u, sub-blocks
// 4 h, 4 h + 1 (ql's low nibbles, qh's bits 0-1 and 2-3) and 4 h + 2, 4 h + 3 (high nibbles, bits
// 4-5 and 6-7); each meets two blocks of x side by side (64 bytes) in one vpdpbusd, whose sums
// start at -32 x's quants over 4 bytes (4 XQ::c4): sum (u - 32) qx, exact, so Q6_K's offset costs
// nothing per block; then one int32 -> fp32 conversion and one FMA by a dx (the lanes' scale a of
// their 16 values picked from the super-block's, sb_scales). Two accumulators a row (the pairs of
// sub-blocks alternate): tile_sub's one chain of two FMAs a pair bound the row by their latency.
template <int mr>
void row_q6k(const XQ& xq, int64_t m0, const uint8_t* row, float* out) {
  const int64_t K = xq.K, nb2 = xq.nb2, nsb = xq.nb / 8;
  const __m512i m4 = _mm512_set1_epi8(0x0f), m33 = _mm512_set1_epi8(0x33);
  const __m512i g4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[mr][2];
  for (int i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = row + sb * 210;
    const __m512 S = sb_scales<kQ6_K>(row, sb);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      // bytes 0-31: qh's bits 0-1 (sub-block 4 h) and 4-5 (4 h + 2); 32-63: bits 2-3, 6-7 moved down
      const __m512i z = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1), m33);
      // (a & m4) | (b & ~m4): the low four bits from ql, bits 4-5 from z
      const __m512i u[2] = {_mm512_ternarylogic_epi32(ql, _mm512_slli_epi16(z, 4), m4, 0xE4),
                            _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), z, m4, 0xE4)};
      for (int t = 0; t < 2; ++t) {
        const int64_t b = sb * 8 + 4 * h + 2 * t;  // x's blocks b, b + 1
        const __m512 A = _mm512_permutexvar_ps(_mm512_add_epi32(g4, _mm512_set1_epi32(8 * h + 4 * t)), S);
        for (int i = 0; i < mr; ++i) {
          const int64_t r = m0 + i;
          const __m512i xv = _mm512_loadu_si512(xq.q.data() + r * K + b * QK);
          __m512i s;
          __m512 dx;
          if constexpr (mr == 1) {  // x's sums and scales as vectors (XQ::c4, dv: 4 and 8 times x's own bytes)
            s = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_loadu_si512(xq.c4.data() + (r * nb2 + b) * 8), 2), u[t], xv);
            dx = _mm512_loadu_ps(xq.dv.data() + (r * nb2 + b) * 8);
          } else {  // from x's quants and its scalar dx: two rows' c4 and dv crowded L1 (2 rows of 5632: 2x the time)
            s = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[t], xv),
                                 _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(32), xv));
            dx = _mm512_insertf32x8(_mm512_set1_ps(xq.d[r * nb2 + b]), _mm256_set1_ps(xq.d[r * nb2 + b + 1]), 1);
          }
          acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(A, dx), acc[i][t]);
        }
      }
    }
  }
  for (int i = 0; i < mr; ++i) out[i] = hsum512(_mm512_add_ps(acc[i][0], acc[i][1]));
}
// y[m, j0] for every row m of x against the Q6_K weight row `row` (row_q6k, two rows of x at a time)
inline void rows_q6k(const XQ& xq, int64_t M, const uint8_t* row, int64_t j0, T* y, int64_t y_st) {
  for (int64_t m = 0; m < M; m += 2) {
    float out[2];
    const int mr = (int)std::min<int64_t>(2, M - m);
    if (mr == 2) row_q6k<2>(xq, m, row, out);
    else row_q6k<1>(xq, m, row, out);
    for (int i = 0; i < mr; ++i) y[(m + i) * y_st + j0] = fms_vec::from_f32<T>(out[i]);
  }
}
template <int type, int mr>
void cols(const XQ& xq, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t n, T* y, int64_t y_st) {
  if constexpr (type == kQ4_0 || type == kQ8_0)
    cols16<type, mr>(xq, m0, w, row_bytes, n, y, y_st);
  else
    cols16_k<type, mr>(xq, m0, w, row_bytes, n, y, y_st);
}
// rows 0 .. M of x against one group, GROUP_ROWS rows at a time (the group's bytes read from memory
// once, then from the caches)
template <int type>
void group(const XQ& xq, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t n, T* y, int64_t y_st) {
  for (int64_t m0 = 0; m0 < M; m0 += GROUP_ROWS) {
    switch (std::min<int64_t>(M - m0, GROUP_ROWS)) {
      case 1: cols<type, 1>(xq, m0, w, row_bytes, n, y, y_st); break;
      case 2: cols<type, 2>(xq, m0, w, row_bytes, n, y, y_st); break;
      case 3: cols<type, 3>(xq, m0, w, row_bytes, n, y, y_st); break;
      case 4: cols<type, 4>(xq, m0, w, row_bytes, n, y, y_st); break;
      case 5: cols<type, 5>(xq, m0, w, row_bytes, n, y, y_st); break;
      case 6: cols<type, 6>(xq, m0, w, row_bytes, n, y, y_st); break;
      case 7: cols<type, 7>(xq, m0, w, row_bytes, n, y, y_st); break;
      default: cols<type, 8>(xq, m0, w, row_bytes, n, y, y_st); break;
    }
  }
}
#elif defined(__AVX2__)
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
  const float* xd = xq.d.data() + m0 * xq.nb2;
  for (int64_t b = 0; b < xq.nb; ++b) {
    __m256i ws[nr], aw[nr];
    float dw[nr];
    for (int j = 0; j < nr; ++j) {
      ws[j] = decode<type>(w[j] + b * bb, dw[j]);
      aw[j] = _mm256_sign_epi8(ws[j], ws[j]);  // |w|
    }
    for (int i = 0; i < mr; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + i * xq.K + b * QK));
      const float dx = xd[i * xq.nb2 + b];
      for (int j = 0; j < nr; ++j) {
        const __m256i s = dot(aw[j], _mm256_sign_epi8(xv, ws[j]));  // |w| times x with w's sign
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw[j] * dx), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i][j] = hsum(acc[i][j]);
}

// Sub-block `sub` of a row of the other types (sub_type) in a register: u (32 unsigned bytes), and
// per half the multiplier a and offset b (qgemv_blocks.h: w = a u + b), vectors over bytes where
// qgemv_blocks.h's portable decoder goes value by value (five times slower on Q4_K)
template <int type>
inline __m256i decode_sub(const uint8_t* row, int64_t sub, float* a, float* b) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  if constexpr (type == kQ5_0) {
    const uint8_t* blk = row + sub * 22;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    // byte i: byte i / 8 of qh, then its bit i % 8
    const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32(int(qh)),
                                            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit);
    a[0] = a[1] = half(blk), b[0] = b[1] = -16.0f * a[0];
    return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)));
  } else if constexpr (type == kQ6_K) {
    const uint8_t* blk = row + sub / 8 * 210;
    const int j = int(sub % 8), h = j / 4, r = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (r % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (r / 2))), m4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
    const float d = half(blk + 208);
    for (int k = 0; k < 2; ++k) a[k] = d * float(int8_t(blk[192 + 2 * j + k])), b[k] = -32.0f * a[k];
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  } else {  // Q4_K, Q5_K
    constexpr bool five = type == kQ5_K;
    const uint8_t* blk = row + sub / 8 * (five ? 176 : 144);
    const int j = int(sub % 8);
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (five ? 48 : 16) + 32 * (j / 2)));
    __m256i u = _mm256_and_si256(_mm256_srl_epi16(y, _mm_cvtsi32_si128(4 * (j % 2))), m4);
    if constexpr (five) {  // bit j of qh byte i
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      const __m256i bit = _mm256_set1_epi8((char)(1 << j));
      u = _mm256_or_si256(u, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(16)));
    }
    int sc, m;
    fms_gguf::k_scale(blk + 4, j, sc, m);
    a[0] = a[1] = half(blk) * float(sc), b[0] = b[1] = -half(blk + 2) * float(m);
    return u;
  }
}

// The other types (sub_type), a sub-block of 32 at a time (decode_sub: u, and per half a
// multiplier and an offset: w = a u + b): dot of u (unsigned, at most 63: the
// pairwise int16 sums of vpmaddubsw stay below 2 * 63 * 127) by x's quants, times a dx, plus b
// times dx sum x's quants (xs).
template <int type, int mr, int nr>
void tile_sub(const XQ& xq, int64_t m0, const uint8_t* const* w, float (*out)[NR]) {
  __m256 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_setzero_ps();
  const int8_t* xr = xq.q.data() + m0 * xq.K;
  const float* xd = xq.d.data() + m0 * xq.nb2;
  const float* xs = xq.xs.data() + m0 * xq.nb2 * 8;
  for (int64_t b = 0; b < xq.nb; ++b) {
    __m256i u[nr];
    __m256 A[nr], B[nr];
    for (int j = 0; j < nr; ++j) {
      float a[2], o[2];
      u[j] = decode_sub<type>(w[j], b, a, o);
      A[j] = _mm256_setr_m128(_mm_set1_ps(a[0]), _mm_set1_ps(a[1]));
      B[j] = _mm256_setr_m128(_mm_set1_ps(o[0]), _mm_set1_ps(o[1]));
    }
    for (int i = 0; i < mr; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + i * xq.K + b * QK));
      const __m256 dx = _mm256_set1_ps(xd[i * xq.nb2 + b]);
      const __m256 sx = _mm256_loadu_ps(xs + (i * xq.nb2 + b) * 8);
      for (int j = 0; j < nr; ++j) {
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot(u[j], xv)), _mm256_mul_ps(A[j], dx), acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(B[j], sx, acc[i][j]);
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
      const float dx = xq.d[(m0 + i) * xq.nb2 + b];
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
// The other types (sub_type): per half of a sub-block, a (sum u qx) dx + b (sum qx) dx, the sums
// exact in int32 (qgemv_blocks.h: w = a u + b)
template <int type, int mr, int nr>
void tile_sub(const XQ& xq, int64_t m0, const uint8_t* const* w, float (*out)[NR]) {
  float acc[mr][nr] = {};
  for (int64_t b = 0; b < xq.nb; ++b) {
    uint8_t u[nr][QK];
    float a[nr][2], o[nr][2];
    for (int j = 0; j < nr; ++j) fms_gguf::decode_sub(type, w[j], b, u[j], a[j], o[j]);
    for (int i = 0; i < mr; ++i) {
      const int8_t* xv = xq.q.data() + (m0 + i) * xq.K + b * QK;
      const float dx = xq.d[(m0 + i) * xq.nb2 + b];
      for (int j = 0; j < nr; ++j)
        for (int h = 0; h < 2; ++h) {
          int32_t s = 0, t = 0;
          for (int k = 16 * h; k < 16 * h + 16; ++k) s += int32_t(u[j][k]) * xv[k], t += xv[k];
          acc[i][j] += float(s) * (a[j][h] * dx) + float(t) * (o[j][h] * dx);
        }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i][j] = acc[i][j];
}
#endif

// rows m .. m + mr of y, columns j0 .. j0 + nr: one tile
template <int type, int mr, int nr>
void tile_to(const XQ& xq, int64_t m, const uint8_t* const* ws, int64_t j0, T* y, int64_t y_st) {
  float out[MR][NR];
  if constexpr (sub_type(type))
    tile_sub<type, mr, nr>(xq, m, ws, out);
  else
    tile<type, mr, nr>(xq, m, ws, out);
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) y[(m + i) * y_st + j0 + j] = fms_vec::from_f32<T>(out[i][j]);
}
// the last `left` (< MR) rows: one tile of that many
template <int type, int mr, int nr>
void rest(int64_t left, const XQ& xq, int64_t m, const uint8_t* const* ws, int64_t j0, T* y, int64_t y_st) {
  if constexpr (mr > 0) {
    if (left == mr) return tile_to<type, mr, nr>(xq, m, ws, j0, y, y_st);
    rest<type, mr - 1, nr>(left, xq, m, ws, j0, y, y_st);
  }
}

// y[m, col + j0 + j] for every row m of x and weight rows j0 .. j0 + n (n <= NR) of one weight
template <int type, int nr>
void rows_of(const XQ& xq, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t j0, T* y, int64_t y_st) {
  const uint8_t* ws[NR];
  for (int j = 0; j < nr; ++j) ws[j] = w + (j0 + j) * row_bytes;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile_to<type, MR, nr>(xq, m, ws, j0, y, y_st);
  rest<type, MR - 1, nr>(M - m, xq, m, ws, j0, y, y_st);
}

template <int type>
void block(int64_t n, const XQ& xq, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t j0, T* y,
           int64_t y_st) {
  if (n == NR)
    rows_of<type, NR>(xq, M, w, row_bytes, j0, y, y_st);
  else
    rows_of<type, 1>(xq, M, w, row_bytes, j0, y, y_st);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Calls of M >= TILE_ROWS rows of x that cols16 does not take (prefill; 4-8 decode rows of Q5_0 /
// Q5_K: the int8 path a row pair at a time was 2.1x faster at one row, slower at four) where the CPU
// multiplies bf16 pairs (vdpbf16ps); up to PANEL_ROWS rows (below: panels from there), a weight row
// pair at a time is dequantized into bf16 (d q, rounded to nearest even: 2^-9 of each weight at
// most) in a buffer of the thread's, then dotted with every row of x in bf16 (x itself for a bf16
// model, else rounded once: 2^-9 of each value), fp32 sums: one instruction per 32 products of a row
// pair, no activation quantization. The blocks stay the only copy of the weights: a tile of two
// rows (a few KB) is all that is ever dequantized.
// The other types (sub_type) alike: their dequantization costs more (w = a u + b, a scale per 16 or
// 32), so that in cache the int8 path was the faster at four rows (3072 x 768, single thread: 0.28-
// 0.33 ms against the tiles' 0.34-0.39 over Q4_K, Q5_K, Q6_K, Q5_0); but in a model, whose weights
// come from memory, the tiles were (a 124M-parameter Q4_K / Q6_K model, four streams, one thread:
// 20.1 against 22.8 ms a step), and they round x to bf16, not int8.
#define FMS_QTILES 1
constexpr int64_t TILE_ROWS = 4;

template <int type>
void dequant_row_bf16(const uint8_t* w, int64_t nb, uint16_t* out) {
  if constexpr (sub_type(type)) {
    // the other types: w = a u + b in fp32 (one rounding of the exact value, FMA), then bf16
#ifdef FMS_Q512
    __m512 S = _mm512_setzero_ps();
    for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
      const bool two = 2 * p + 1 < nb;
      if (k_type(type) && p % 4 == 0) S = sb_scales<type>(w, p / 4);
      __m512 A, B;
      const __m512i u = decode_pair<type>(w, p, two, S, A, B);
      __m512 v[4];  // values 16 q .. 16 q + 15 of the pair: lanes 4 q .. 4 q + 3 of A and B
      const __m256i u0 = _mm512_castsi512_si256(u), u1 = _mm512_extracti64x4_epi64(u, 1);
      v[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u0)));
      v[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u0, 1)));
      v[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u1)));
      v[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u1, 1)));
      if constexpr (type == kQ6_K) {  // a scale per 16 values: each quarter its own
        for (int q = 0; q < 4; ++q) {
          const __m512i at = _mm512_set1_epi32(4 * q);
          v[q] = _mm512_fmadd_ps(v[q], _mm512_permutexvar_ps(at, A), _mm512_permutexvar_ps(at, B));
        }
      } else {  // one per 32 (lanes 0-7, 8-15): two quarters each
        const __m512i hi = _mm512_set1_epi32(8);
        const __m512 a0 = _mm512_broadcastss_ps(_mm512_castps512_ps128(A)), a1 = _mm512_permutexvar_ps(hi, A);
        const __m512 b0 = _mm512_broadcastss_ps(_mm512_castps512_ps128(B)), b1 = _mm512_permutexvar_ps(hi, B);
        v[0] = _mm512_fmadd_ps(v[0], a0, b0), v[1] = _mm512_fmadd_ps(v[1], a0, b0);
        v[2] = _mm512_fmadd_ps(v[2], a1, b1), v[3] = _mm512_fmadd_ps(v[3], a1, b1);
      }
      _mm512_storeu_si512(out + p * 64, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
      if (two) _mm512_storeu_si512(out + p * 64 + 32, (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]));
    }
#else
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t u[QK];
      float a[2], o[2];
      fms_gguf::decode_sub(type, w, b, u, a, o);
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u)))),
                                        _mm512_set1_ps(a[0]), _mm512_set1_ps(o[0]));
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 16)))),
                                        _mm512_set1_ps(a[1]), _mm512_set1_ps(o[1]));
      _mm512_storeu_si512(out + b * QK, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
#endif
    return;
  }
  const int bb = block_bytes(type);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bb;
    const __m512 d = _mm512_set1_ps(half(blk));
    __m512 lo, hi;  // elements 0..15, 16..31
    if constexpr (type == kQ8_0) {
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      const __m128i eight = _mm_set1_epi8(8), mask = _mm_set1_epi8(0x0f);
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_and_si128(q, mask), eight)));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), mask), eight)));
    }
    _mm512_storeu_si512(out + b * QK, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, d), _mm512_mul_ps(lo, d)));
  }
}

// y [mr rows from m, nr columns from j0] = x rows (bf16, row stride K) . weight rows wb (bf16 [nr, K])
template <int mr, int nr>
void tile_bf16(const uint16_t* x, int64_t K, int64_t m, const uint16_t* wb, int64_t j0, T* y, int64_t y_st) {
  __m512 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[nr];
    for (int j = 0; j < nr; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wb + j * K + k);
    for (int i = 0; i < mr; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m + i) * K + k);
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) y[(m + i) * y_st + j0 + j] = fms_vec::from_f32<T>(_mm512_reduce_add_ps(acc[i][j]));
}
template <int mr, int nr>
void rest_bf16(int64_t left, const uint16_t* x, int64_t K, int64_t m, const uint16_t* wb, int64_t j0, T* y,
               int64_t y_st) {
  if constexpr (mr > 0) {
    if (left == mr) return tile_bf16<mr, nr>(x, K, m, wb, j0, y, y_st);
    rest_bf16<mr - 1, nr>(left, x, K, m, wb, j0, y, y_st);
  }
}
// y [M rows, n <= NR columns from j0] = x rows (bf16 [M, K]) . weight rows wb (bf16 [n, K]): tiles of
// MR rows of x, then one of the rest
void rows_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wb, int64_t n, int64_t j0, T* y,
                     int64_t y_st) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) {
    if (n == NR)
      tile_bf16<MR, NR>(x, K, m, wb, j0, y, y_st);
    else
      tile_bf16<MR, 1>(x, K, m, wb, j0, y, y_st);
  }
  if (n == NR)
    rest_bf16<MR - 1, NR>(M - m, x, K, m, wb, j0, y, y_st);
  else
    rest_bf16<MR - 1, 1>(M - m, x, K, m, wb, j0, y, y_st);
}
// x [M, K] (row stride x_st) as bf16 rows [M, K] in buf (rounded to nearest even; K a multiple of 16)
void rows_to_bf16(const T* x, int64_t M, int64_t K, int64_t x_st, std::vector<uint16_t>& buf) {
  buf.resize(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 16)
      fms_vec::store<16>(reinterpret_cast<fms_bf16*>(buf.data() + m * K + k), fms_vec::load<16>(x + m * x_st + k));
}
#endif

// Calls of PANEL_ROWS rows or more (prefill): panels.h's driver and broadcast tiles, no sum across
// lanes at the end of a dot product. Where the CPU has AVX512_BF16 (FMS_QTILES) a panel holds bf16
// pairs: its 64 weight rows are dequantized 16 at a time into the thread's scratch
// (dequant_row_bf16: the same bf16 values as the row-pair tiles) and transposed into the pairs,
// and 6 rows of x pass over it by vdpbf16ps. An AVX2 build's panel holds fp32 (16 weight rows,
// dequantized 8 at a time by dequant_row_f32: w = a u + b rounded once), x is fp32, and each step
// is an fp32 multiply-add per output: no activation quantization there either. The panel (256 KB
// at most) is all that is dequantized at once, and its dequantization is spread over the call's rows.
// Measured (TinyLlama-1.1B Q4_K_M's q, gate and two Q6_K downs, 2-vCPU Zen 4, min of 15):
// - bf16 pairs: one thread, 64 rows 28.8 ms against the row pairs' 35.5 (oneDNN-class bf16 GEMM on
//   a dense copy: 24.5); two threads, 64 rows 15.5 against 19.4, 512 rows 96 against 137 (dense
//   90). From 12 rows the panels led (32 rows 17.5 against 19.6 ms; 9 rows 9.5 against 9.2).
// - fp32 (the AVX2 build, forced on that CPU): one thread, 64 rows 75 ms against the int8 path's
//   105 (the GEMM kernel's fp32 panels on a dense copy: 68); two threads 38 against 53. From 20
//   rows the panels led (24 rows 34.6 against 38.5 ms; 16 rows 26.7 against 25.2).
#if defined(FMS_QTILES) || (FMS_VEC_NATIVE == 8 && defined(__AVX2__))
#define FMS_QPANELS 1
#ifdef FMS_QTILES
constexpr bool PANEL_DP = true;
#else
constexpr bool PANEL_DP = false;
#endif
using PX = fms_panels::Words<PANEL_DP>::X;  // x's values as the panels' tiles read them
constexpr int64_t PANEL_ROWS = PANEL_DP ? 12 : 20;

#ifndef FMS_QTILES
// a weight row's nb blocks of 32 values (from a super-block's start for the K-quants) as fp32, by
// the AVX2 int8 path's decoders: d q (exact), or a u + b by one FMA (one rounding of the exact value)
template <int type>
void dequant_row_f32(const uint8_t* w, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b) {
    __m256i u;
    __m256 A[2], B[2];
    if constexpr (!sub_type(type)) {
      float d;
      u = decode<type>(w + b * block_bytes(type), d);
      A[0] = A[1] = _mm256_set1_ps(d), B[0] = B[1] = _mm256_setzero_ps();
    } else {
      float a[2], o[2];
      u = decode_sub<type>(w, b, a, o);
      for (int h = 0; h < 2; ++h) A[h] = _mm256_set1_ps(a[h]), B[h] = _mm256_set1_ps(o[h]);
    }
    const __m128i half16[2] = {_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)};
    for (int q = 0; q < 4; ++q) {  // values 8 q .. 8 q + 7: half q / 2 (a, b per 16)
      const __m128i bytes = q % 2 ? _mm_srli_si128(half16[q / 2], 8) : half16[q / 2];
      const __m256i v = sub_type(type) ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
      _mm256_storeu_ps(out + b * QK + 8 * q, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), A[q / 2], B[q / 2]));
    }
  }
}
#endif

// y [M, N] (N: the weights' rows side by side, from col[i] on for weights[i] of ggml type types[i]) =
// x ([M, K], row stride x_st) . the weights, on the panels, `threads` at most
void panels(const PX* x, int64_t M, int64_t K, int64_t x_st, const int8_t* const* weights, const int32_t* types,
            const std::vector<int64_t>& col, T* y, int threads) {
  using fms_panels::NC;
  using P = fms_panels::Words<PANEL_DP>::P;
  constexpr int KU = fms_panels::Words<PANEL_DP>::KU;
  constexpr int B = fms_panels::W;  // weight rows dequantized at once: one transpose's words a row
  int64_t values = QK;  // K's blocks of steps hold whole blocks (a K-quant's super-block: 256 values)
  for (size_t i = 0; i + 1 < col.size(); ++i) values = std::max<int64_t>(values, fms_gguf::block_values(types[i]));
  // weight row r of the stack: its first byte (i: its segment, advanced from one at or before r's)
  const auto row_of = [&](int64_t r, int64_t& i) {
    while (r >= col[i + 1]) ++i;
    return reinterpret_cast<const uint8_t*>(weights[i]) + (r - col[i]) * fms_gguf::row_bytes(types[i], K);
  };
  // the bytes of a row of `type` before its value k (k: a multiple of the blocks' values)
  const auto bytes_to = [](int type, int64_t k) { return k / fms_gguf::block_values(type) * block_bytes(type); };
  // where row r's values [k0, k1) lie in its blocks
  const auto span = [&](int64_t r, int64_t k0, int64_t k1) {
    int64_t i = 0;
    const uint8_t* w = row_of(r, i);
    return std::pair<const void*, int64_t>(w + bytes_to(types[i], k0), bytes_to(types[i], k1) - bytes_to(types[i], k0));
  };
  const auto pack = [&](int64_t r0, int64_t nc, int64_t s_begin, int64_t s_end, P* panel, void* scratch) {
    const int64_t k0 = KU * s_begin, n = KU * (s_end - s_begin);  // values (K % 32 == 0: whole blocks)
    P* rows = static_cast<P*>(scratch);  // B weight rows' n values
    char* out = reinterpret_cast<char*>(panel);  // 4-byte words, NC a step
    int64_t i = 0;
    for (int64_t c0 = 0; c0 < NC; c0 += B) {
      for (int64_t c = c0; c < std::min<int64_t>(nc, c0 + B); ++c) {
        const uint8_t* w = row_of(r0 + c, i);
        w += bytes_to(types[i], k0);
        with_type(types[i], [&](auto type) {
#ifdef FMS_QTILES
          dequant_row_bf16<type()>(w, n / QK, reinterpret_cast<uint16_t*>(rows + (c - c0) * n));
#else
          dequant_row_f32<type()>(w, n / QK, rows + (c - c0) * n);
#endif
        });
      }
      for (int64_t s0 = 0; s0 < n / KU; s0 += B) {  // B x B words
#ifdef FMS_QTILES
        __m512i r[16];
        for (int c = 0; c < 16; ++c)
          r[c] = c0 + c < nc ? _mm512_loadu_si512(rows + c * n + KU * s0) : _mm512_setzero_si512();
        fms_panels::transpose16(r);
        for (int e = 0; e < 16; ++e) _mm512_store_si512(out + ((s0 + e) * NC + c0) * 4, r[e]);
#else
        __m256 r[8];
        for (int c = 0; c < 8; ++c) r[c] = c0 + c < nc ? _mm256_loadu_ps(rows + c * n + s0) : _mm256_setzero_ps();
        fms_panels::transpose8(r);
        for (int e = 0; e < 8; ++e) _mm256_store_ps(reinterpret_cast<float*>(out + ((s0 + e) * NC + c0) * 4), r[e]);
#endif
      }
    }
  };
  const size_t scratch = B * fms_panels::Words<PANEL_DP>::KC_MAX * KU * sizeof(P);
  fms_panels::run<PANEL_DP>(M, K, col.back(), x, x_st, y, threads, std::max<int64_t>(16, values / KU), scratch,
                            pack, span);
}
#endif

}  // namespace

// The kernel's arguments: the struct of FMS_PAGED_QGEMV_FIELDS (kernels/kernels.h), checked by
// the operators against their own layout when they load the library (as gemv.cpp's).
extern "C" {

FMS_PAGED_ARGS(FmsQgemvArgs, FMS_PAGED_QGEMV_FIELDS, fms_paged_qgemv_layout)

// -> 0, or 1 for a weight of a type the kernel does not read (qgemv_blocks.h) or K not a multiple of
// its blocks' values (32; 256 for the K-quants)
int fms_paged_qgemv(const FmsQgemvArgs* args) {
  const FmsQgemvArgs& a = *args;
  const int64_t M = a.M, K = a.K;
  if (K % QK) return 1;
  bool sums = false;  // a type other than Q8_0 / Q4_0: x's quants' sums (XQ::xs) are needed
  for (int64_t i = 0; i < a.n_weights; ++i) {
    if (!block_bytes(a.types[i]) || K % fms_gguf::block_values(a.types[i])) return 1;
    sums = sums || sub_type(a.types[i]);
  }
#ifdef FMS_QPANELS
  if (M >= PANEL_ROWS) {  // (prefill; K a multiple of 32: checked above)
    std::vector<int64_t> col{0};
    for (int64_t i = 0; i < a.n_weights; ++i) col.push_back(col.back() + a.rows[i]);
    int64_t x_st = a.x_st;
#ifdef FMS_QTILES
    const PX* x = reinterpret_cast<const PX*>(a.x);  // (a bf16 model's rows as they are)
    if constexpr (!std::is_same_v<T, fms_bf16>) {
      static thread_local std::vector<uint16_t> xb_kept;
      rows_to_bf16(a.x, M, K, a.x_st, xb_kept);
      x = reinterpret_cast<const PX*>(xb_kept.data());
      x_st = K;
    }
#else
    static thread_local std::vector<float> xf_kept;
    const PX* x = fms_vec::rows_as<PX>(a.x, M, K, x_st, xf_kept);
#endif
    panels(x, M, K, x_st, a.weights, a.types, col, a.y, a.threads);
    return 0;
  }
#endif
  static thread_local XQ kept;  // kept from call to call: a prefill's rows are megabytes
  XQ& xq = kept;  // (the caller's: a thread_local named inside the parallel region is each thread's own)
  // cols16 (16 weight rows at a time) for a weight of `type` at M rows: from the row counts where
  // it was the faster (single thread, a weight of 11264 x 2048 from memory: Q4_0 and Q4_K at one
  // row 0.75 / 0.67 ms against 1.33 / 1.29 ms; Q8_0 from two rows, Q6_K from three, where a row at
  // a time (tile, tile_sub) reads fewer bytes a weight's value with fewer instructions)
  auto grouped_at = [&](int type) {
#ifdef FMS_Q512
    if (M > INT8_ROWS) return false;
    return type == kQ4_0 || type == kQ4_K || (type == kQ8_0 && M >= 2) || (type == kQ6_K && M >= 3);
#else
    (void)type;
    return false;
#endif
  };
  bool all_grouped = true;
  for (int64_t i = 0; i < a.n_weights; ++i) all_grouped = all_grouped && grouped_at(a.types[i]);
#ifdef FMS_QTILES
  const bool tiles = M >= TILE_ROWS && K % 32 == 0 && !all_grouped;
  static thread_local std::vector<uint16_t> xb_kept;
  std::vector<uint16_t>& xb = xb_kept;
  if (tiles) rows_to_bf16(a.x, M, K, a.x_st, xb);
  else
#else
  constexpr bool tiles = false;
#endif
  quantize_rows(a.x, M, K, a.x_st, a.threads, sums, xq);
  // the weights' row blocks of nr[i] rows, segment by segment: block p is segment i's rows
  // (p - first[i]) nr[i] on. A decode of one or two rows reads one weight row at a time: a thread's
  // share is then one sequential stream, which the hardware prefetcher follows (gemv.cpp's
  // finding for its own decode; not measured apart here: this machine's memory was shared)
  // (and the int8 path of a call holding another type (sub_type), whatever its rows: Q4_K / Q5_K
  // took 1.4x as long at three rows a weight row pair, single thread, in cache, Q6_K / Q5_0 ~5%
  // less; results alike bit for bit: each output's sums are the same whatever the tile), except
  // the weights that cols16 takes (grouped_at), 16 rows a block
  const bool one_row = (M <= 2 || sums) && !tiles;  // (the tiles: a row pair, every type)
  std::vector<int64_t> first{0}, col{0}, nr;
  for (int64_t i = 0; i < a.n_weights; ++i) {
    nr.push_back(tiles ? NR : grouped_at(a.types[i]) ? NG : one_row ? 1 : NR);
    first.push_back(first.back() + (a.rows[i] + nr[i] - 1) / nr[i]);
    col.push_back(col.back() + a.rows[i]);
  }
  const int64_t np = first.back(), y_st = col.back();
  const int64_t by_work = std::max<int64_t>(1, M * y_st * K / GRAIN);
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)a.threads, np, by_work}));
  // the first block whose rows start at or after row R of y: threads take equal shares of rows
  auto block_at = [&](int64_t R) {
    for (int64_t i = 0; i < a.n_weights; ++i)
      if (R < col[i + 1]) return first[i] + (R - col[i] + nr[i] - 1) / nr[i];
    return np;
  };
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    int64_t i = 0;
#ifdef FMS_QTILES
    std::vector<uint16_t> wb(tiles ? NR * K : 0);  // the thread's dequantized row pair
#endif
    const int64_t p_end = block_at(y_st * (t + 1) / threads);
    for (int64_t p = block_at(y_st * t / threads); p < p_end; ++p) {
      while (p >= first[i + 1]) ++i;
      const int type = a.types[i];
      const int64_t j0 = (p - first[i]) * nr[i], n = std::min<int64_t>(nr[i], a.rows[i] - j0);
      const int64_t row_bytes = fms_gguf::row_bytes(type, K);
      const uint8_t* w = reinterpret_cast<const uint8_t*>(a.weights[i]);
      T* y = a.y + col[i];
#ifdef FMS_QTILES
      if (tiles) {  // (fewer than PANEL_ROWS rows: x is small, and the pair stays in L1 until used)
        with_type(type, [&](auto type) {
          for (int64_t j = 0; j < n; ++j) dequant_row_bf16<type()>(w + (j0 + j) * row_bytes, K / QK, wb.data() + j * K);
        });
        rows_bf16(xb.data(), M, K, wb.data(), n, j0, y, y_st);
        continue;
      }
#endif
#ifdef FMS_Q512
      if (nr[i] == NG) {
        const uint8_t* wg = w + j0 * row_bytes;
        if (type == kQ4_0) group<kQ4_0>(xq, M, wg, row_bytes, n, y + j0, y_st);
        else if (type == kQ8_0) group<kQ8_0>(xq, M, wg, row_bytes, n, y + j0, y_st);
        else if (type == kQ4_K) group<kQ4_K>(xq, M, wg, row_bytes, n, y + j0, y_st);
        else group<kQ6_K>(xq, M, wg, row_bytes, n, y + j0, y_st);
        continue;
      }
      if (type == kQ6_K && nr[i] == 1) {
        rows_q6k(xq, M, w + j0 * row_bytes, j0, y, y_st);
        continue;
      }
#endif
      with_type(type, [&](auto type) { block<type()>(n, xq, M, w, row_bytes, j0, y, y_st); });
    }
  }
  return 0;
}

}  // extern "C"
