// Vectors of floats for the project's C++ kernels, and loads and stores that convert the storage
// types of weights, activations and KV pages (fp32, bf16, fp16) to and from fp32 in registers: a
// kernel reads half the bytes in half precision and accumulates in fp32.
//
// `vec<N>` is GCC's generic vector of N floats, which -march=native maps onto the machine's
// registers: `NATIVE` lanes (16 with AVX-512, else 8: one AVX2 register, two NEON registers) fill
// one register; a kernel that keeps many accumulators uses `vec<NATIVE>` so that they stay in
// registers. Conversions:
// - bf16 -> fp32: the 16 bits are the fp32's upper half: a zero-extending widen and a shift;
// - fp32 -> bf16: round to nearest even, a NaN kept a quiet NaN (torch's rounding: a kernel's bf16
//   output equals torch's cast of its fp32 result), by vcvtneps2bf16 where the CPU has AVX512_BF16
//   (which also turns fp32 denormals into zeros, as oneDNN's bf16 outputs);
// - fp16 <-> fp32: F16C's vcvtph2ps / vcvtps2ph where the CPU has it (AVX-512F's 16-wide forms
//   where it has that), else the compiler's _Float16 conversion lane by lane.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "args.h"

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fms_vec {

#ifndef FMS_VEC_NATIVE  // (a build may set it: 16 lanes on an AVX2 CPU run the AVX-512 build's logic)
#if defined(__AVX512F__)
#define FMS_VEC_NATIVE 16
#else
#define FMS_VEC_NATIVE 8
#endif
#endif
constexpr int NATIVE = FMS_VEC_NATIVE;

// FMS_VEC_BF16_DP: 1 in a bf16 kernel (-DFMS_ELEM=fms_bf16) built for 16 lanes on a CPU with
// AVX512_BF16, whose products may then take bf16 pairs as they are (vdpbf16ps: two multiply-adds
// per lane and instruction, fp32 sums); else 0
#define FMS_VEC_ELEM_IS_fms_bf16 1
#define FMS_VEC_CAT(a, b) a##b
#define FMS_VEC_IS_BF16(elem) FMS_VEC_CAT(FMS_VEC_ELEM_IS_, elem)  // an undefined name (0) but for fms_bf16
#if defined(FMS_ELEM) && defined(__AVX512BF16__) && FMS_VEC_NATIVE == 16 && FMS_VEC_IS_BF16(FMS_ELEM)
#define FMS_VEC_BF16_DP 1
#else
#define FMS_VEC_BF16_DP 0
#endif

// N lanes of float, int32, uint32 and uint16 (GCC's vector_size cannot depend on a template
// parameter directly: one specialization per width)
template <int N>
struct lanes;
#define FMS_VEC_LANES(N)                                                    \
  template <>                                                               \
  struct lanes<N> {                                                         \
    typedef float f __attribute__((vector_size(N * sizeof(float))));       \
    typedef int32_t i __attribute__((vector_size(N * sizeof(int32_t))));   \
    typedef uint32_t u __attribute__((vector_size(N * sizeof(uint32_t)))); \
    typedef uint16_t h __attribute__((vector_size(N * sizeof(uint16_t)))); \
  };
FMS_VEC_LANES(8)
FMS_VEC_LANES(16)
#undef FMS_VEC_LANES

template <int N>
using vec = typename lanes<N>::f;
template <int N>
using ivec = typename lanes<N>::i;
template <int N>
using uvec = typename lanes<N>::u;
template <int N>
using hvec = typename lanes<N>::h;

template <int N>
inline vec<N> splat(float x) {
  return vec<N>{} + x;
}

template <class To, class From>
inline To bits(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast between types of one size");
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

// ---- scalars
inline float to_f32(float x) { return x; }
inline float to_f32(fms_bf16 x) { return bits<float>((uint32_t)x.bits << 16); }
inline float to_f32(fms_f16 x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  return (float)bits<_Float16>(x.bits);
#endif
}

template <class T>
inline T from_f32(float x);
template <>
inline float from_f32<float>(float x) { return x; }
template <>
inline fms_bf16 from_f32<fms_bf16>(float x) {
  const uint32_t u = bits<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};  // NaN: a quiet NaN
  return {(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
template <>
inline fms_f16 from_f32<fms_f16>(float x) {
#if defined(__F16C__)
  return {(uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)};
#else
  return {bits<uint16_t>((_Float16)x)};
#endif
}

// ---- N lanes (N = 8 or 16)
template <int N>
inline vec<N> load(const float* p) {
  vec<N> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int N>
inline vec<N> load(const fms_bf16* p) {
#if defined(__AVX512F__)
  if constexpr (N == 16)
    return (vec<N>)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#endif
#if defined(__AVX2__)
  if constexpr (N == 8)
    return (vec<N>)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#endif
  hvec<N> h;
  std::memcpy(&h, p, sizeof h);
  return (vec<N>)(__builtin_convertvector(h, uvec<N>) << 16);  // a vector cast keeps the bits
}
template <int N>
inline vec<N> load(const fms_f16* p) {
#if defined(__AVX512F__)
  if constexpr (N == 16) return (vec<N>)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
#if defined(__F16C__)
  if constexpr (N == 8) {
    return (vec<N>)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    vec<N> v;
    for (int i = 0; i < N; i += 8) {
      const vec<8> part = load<8>(p + i);
      std::memcpy(reinterpret_cast<float*>(&v) + i, &part, sizeof part);
    }
    return v;
  }
#else
  vec<N> v;
  for (int i = 0; i < N; ++i) v[i] = to_f32(p[i]);
  return v;
#endif
}
// int8 (8-bit KV pages) -> fp32, exactly
template <int N>
inline vec<N> load(const int8_t* p) {
#if defined(__AVX512F__)
  if constexpr (N == 16)
    return (vec<N>)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
#if defined(__AVX2__)
  if constexpr (N == 8)
    return (vec<N>)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
  vec<N> v;
  for (int i = 0; i < N; ++i) v[i] = (float)p[i];
  return v;
}

template <int N>
inline void store(float* p, vec<N> v) {
  std::memcpy(p, &v, sizeof v);
}
// fp32 -> bf16 bits in the upper halves of the lanes (lower halves zero): from_f32<fms_bf16> on
// every lane at once
template <int N>
inline uvec<N> bf16_bits(vec<N> v) {
#if defined(__AVX512BF16__)
  if constexpr (N == 16)  // one rounding instruction (see store)
    return (uvec<N>)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)v)), 16);
#endif
  const uvec<N> u = bits<uvec<N>>(v);
  const uvec<N> nan = (uvec<N>)((u & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  const uvec<N> rne = u + 0x7fffu + ((u >> 16) & 1u);
  return ((nan & (u | 0x400000u)) | (~nan & rne)) & 0xffff0000u;
}
template <int N>
inline void store(fms_bf16* p, vec<N> v) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16: the same rounding and quiet NaN in one instruction, but fp32 denormals (below
  // 2^-126) become zeros, as in oneDNN's bf16 GEMM outputs
  if constexpr (N == 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
    return;
  }
#endif
  const hvec<N> h = __builtin_convertvector(bf16_bits<N>(v) >> 16, hvec<N>);
  std::memcpy(p, &h, sizeof h);
}
template <int N>
inline void store(fms_f16* p, vec<N> v) {
#if defined(__AVX512F__)
  if constexpr (N == 16) {  // vcvtps2ph: round to nearest even, denormals and NaNs as from_f32's
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
    return;
  }
#endif
#if defined(__F16C__)
  if constexpr (N == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
    return;
  }
#endif
  for (int i = 0; i < N; ++i) p[i] = from_f32<fms_f16>(v[i]);
}

// v rounded to T's precision, in fp32 (what storing it as T and loading it back gives)
template <class T, int N>
inline vec<N> round_to(vec<N> v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, fms_bf16>) {
    return bits<vec<N>>(bf16_bits<N>(v));
  } else {
    T h[N];
    store<N>(h, v);
    return load<N>(h);
  }
}

// e^x on every lane (Cephes' expf, a couple of ulps): x = n ln2 + r, e^r by a degree-6 polynomial,
// times 2^n built in the exponent bits; 0 for x < -87.3 (-inf included), x clamped at 88
template <int N>
inline vec<N> vexp(vec<N> x) {
  const vec<N> keep = x < -87.3f ? splat<N>(0.0f) : splat<N>(1.0f);
  x = x < -87.3f ? splat<N>(-87.3f) : x;
  x = x > 88.0f ? splat<N>(88.0f) : x;
  const vec<N> n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vec<N> r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vec<N> y = splat<N>(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const ivec<N> e = (__builtin_convertvector(n, ivec<N>) + 127) << 23;
  return y * bits<vec<N>>(e) * keep;
}

// tanh(x), Cephes' tanhf on vectors (a few ulps): for |x| < 0.625 its odd polynomial (no
// cancellation near 0), else (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.29 and x's sign put
// back; +-1 where e underflows. Both halves are computed, the lanes select.
template <int N>
inline vec<N> vtanh(vec<N> x) {
  const vec<N> ax = x < 0.0f ? -x : x, z = x * x;
  vec<N> p = splat<N>(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const vec<N> small = x + x * z * p;
  const vec<N> e = vexp<N>(-2.0f * ax), big = (1.0f - e) / (1.0f + e);
  return ax < 0.625f ? small : (x < 0.0f ? -big : big);
}

// ---- across lanes
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define FMS_VEC_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif

// i with its log2(NATIVE) bits reversed
constexpr int bitrev(int i) {
  int r = 0;
  for (int b = 1; b < NATIVE; b <<= 1, i >>= 1) r = (r << 1) | (i & 1);
  return r;
}

// lane j of the result: the sum of the lanes of p[bitrev(j)] (NATIVE horizontal sums in NATIVE - 1
// adds: each level halves the lanes per vector and doubles the vectors per lane)
inline vec<NATIVE> reduce_lanes(const vec<NATIVE>* p) {
#if defined(FMS_VEC_SHUFFLE) && FMS_VEC_NATIVE == 16
  vec<16> c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = FMS_VEC_SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           FMS_VEC_SHUFFLE(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    d[i] = FMS_VEC_SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           FMS_VEC_SHUFFLE(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = FMS_VEC_SHUFFLE(d[2 * i], d[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           FMS_VEC_SHUFFLE(d[2 * i], d[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return FMS_VEC_SHUFFLE(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         FMS_VEC_SHUFFLE(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#elif defined(FMS_VEC_SHUFFLE)
  vec<8> c[4], d[2];
  for (int i = 0; i < 4; ++i)
    c[i] = FMS_VEC_SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           FMS_VEC_SHUFFLE(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    d[i] = FMS_VEC_SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           FMS_VEC_SHUFFLE(c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return FMS_VEC_SHUFFLE(d[0], d[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         FMS_VEC_SHUFFLE(d[0], d[1], 1, 9, 3, 11, 5, 13, 7, 15);
#else
  vec<NATIVE> r;
  for (int j = 0; j < NATIVE; ++j) {
    r[j] = 0.0f;
    for (int i = 0; i < NATIVE; ++i) r[j] += p[bitrev(j)][i];
  }
  return r;
#endif
}

// r[i][j] <-> r[j][i]: a NATIVE x NATIVE block of 32-bit lanes transposed in registers (GCC's
// vectors carry float bits; a block of bf16 pairs moves as well): lanes interleaved within 128-bit
// quarters, then 64-bit pairs of them, then the quarters across registers, NATIVE shuffles a level
inline void transpose(vec<NATIVE>* r) {
#if defined(FMS_VEC_SHUFFLE) && FMS_VEC_NATIVE == 16
  vec<16> t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = FMS_VEC_SHUFFLE(r[i], r[i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
    t[i + 1] = FMS_VEC_SHUFFLE(r[i], r[i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  for (int i = 0; i < 16; i += 4)  // r[i + c]'s quarter q: rows i .. i + 3 of column 4q + c
    for (int c = 0; c < 2; ++c) {
      r[i + 2 * c] = FMS_VEC_SHUFFLE(t[i + c], t[i + c + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[i + 2 * c + 1] = FMS_VEC_SHUFFLE(t[i + c], t[i + c + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
  for (int c = 0; c < 4; ++c) {
    const vec<16> u0 = FMS_VEC_SHUFFLE(r[c], r[4 + c], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
                  u1 = FMS_VEC_SHUFFLE(r[c], r[4 + c], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31),
                  v0 = FMS_VEC_SHUFFLE(r[8 + c], r[12 + c], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
                  v1 = FMS_VEC_SHUFFLE(r[8 + c], r[12 + c], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    t[c] = FMS_VEC_SHUFFLE(u0, v0, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    t[8 + c] = FMS_VEC_SHUFFLE(u0, v0, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    t[4 + c] = FMS_VEC_SHUFFLE(u1, v1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    t[12 + c] = FMS_VEC_SHUFFLE(u1, v1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
#elif defined(FMS_VEC_SHUFFLE)
  vec<8> t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = FMS_VEC_SHUFFLE(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = FMS_VEC_SHUFFLE(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4)
    for (int c = 0; c < 2; ++c) {
      r[i + 2 * c] = FMS_VEC_SHUFFLE(t[i + c], t[i + c + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      r[i + 2 * c + 1] = FMS_VEC_SHUFFLE(t[i + c], t[i + c + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int c = 0; c < 4; ++c) {
    t[c] = FMS_VEC_SHUFFLE(r[c], r[4 + c], 0, 1, 2, 3, 8, 9, 10, 11);
    t[4 + c] = FMS_VEC_SHUFFLE(r[c], r[4 + c], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
#else
  for (int i = 0; i < NATIVE; ++i)
    for (int j = i + 1; j < NATIVE; ++j) {
      const float x = r[i][j];
      r[i][j] = r[j][i];
      r[j][i] = x;
    }
#endif
}

#if defined(__AVX512BF16__)
// ---- bf16 pairs (AVX512_BF16: vdpbf16ps takes 16 lanes of two bf16 each)
// acc + the dot products of the bf16 pairs in a's lanes with the pair at p, in every lane
inline vec<16> dp_bcast(vec<16> acc, __m512i a, const void* p) {
  return (vec<16>)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32(*(const int32_t*)p));
}
inline __m512i load_pairs(const uint32_t* p) { return _mm512_load_si512(p); }
// two fp32 vectors as bf16 pairs per lane: lane i holds (pj[i], pj1[i]), each rounded to nearest even
inline __m512i pair_rows(vec<16> pj, vec<16> pj1) {
  const __m512i lo_hi = (__m512i)_mm512_cvtne2ps_pbh((__m512)pj1, (__m512)pj);  // [pj's 16 | pj1's 16]
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, lo_hi);
}
// keys a and b's values (D bf16 each, or null: zeros) as pairs per d: lane d holds (a[d], b[d])
template <int D>
inline void pair_values(const fms_bf16* a, const fms_bf16* b, uint32_t* out) {
  for (int d = 0; d < D; d += 16) {
    const __m512i va = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + d))) : _mm512_setzero_si512();
    const __m512i vb = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + d))) : _mm512_setzero_si512();
    _mm512_store_si512(out + d, _mm512_or_si512(va, _mm512_slli_epi32(vb, 16)));
  }
}
// e^x for x <= 0 (-inf gives 0), as 2^n * p(f): t = x log2(e), n = round(t), f = t - n in
// [-1/2, 1/2], p a degree-5 fit of 2^f (relative error under 2e-7 evaluated in fp32, Cephes'
// expf's class), 2^n applied by vscalefps (t clamped at -150: 0 in fp32). About half of vexp's
// instructions: the softmax of the bf16 path, whose probabilities are rounded to bf16 after
inline vec<16> vexp_nonpos(vec<16> x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps((__m512)x, _mm512_set1_ps(1.44269504088896341f)),
                                 _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vec<16> f = (vec<16>)_mm512_sub_ps(t, n);
  vec<16> y = splat<16>(1.326472731307149e-3f);
  y = y * f + 9.671512991189957e-3f;
  y = y * f + 5.550733581185341e-2f;
  y = y * f + 2.4022242426872253e-1f;
  y = y * f + 6.931470036506653e-1f;
  y = y * f + 1.0f;
  return (vec<16>)_mm512_scalef_ps((__m512)y, n);
}
#endif

// x [M, K] (row stride x_st) as the rows a kernel's tiles read (X): x itself where it is stored
// so, else converted once into fp32 in buf (M x K values: far fewer than the weights'), x_st then K
// (the GEMV and the GEMM: bf16 rows where they take bf16 dot products, else fp32)
template <class X, class U>
const X* rows_as(const U* x, int64_t M, int64_t K, int64_t& x_st, std::vector<float>& buf) {
  if constexpr (std::is_same_v<X, U>) {
    return x;
  } else {
    static_assert(std::is_same_v<X, float>, "rows are read as stored or as fp32");
    buf.resize(M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) buf[m * K + k] = to_f32(x[m * x_st + k]);
    x_st = K;
    return buf.data();
  }
}

}  // namespace fms_vec
