// The GGUF block layouts the qgemv kernel reads (kernels/qgemv.cpp) and the operators check and
// look up (ops/qlinear.cpp: block_type, block_embedding): ggml's type ids, each block's values and
// bytes, and a portable (scalar) decoder of one sub-block of 32 values into the form the kernel
// computes with. Learnt from the layouts of ggml-quants (llama.cpp) and gguf.quants' dequantizers;
// blocks as llama.cpp writes them, no repacking.
//
// Blocks of 32 values (a weight row of K values is K / 32 blocks):
// - Q8_0 (34 bytes): fp16 d, 32 int8 q: w = d q;
// - Q4_0 (18): fp16 d, 16 bytes of nibbles (byte j: element j low, j + 16 high): w = d (q - 8);
// - Q5_0 (22): fp16 d, a little-endian uint32 of fifth bits (bit i: element i), then nibbles as
//   Q4_0's: w = d (q - 16), q in [0, 31].
// Super-blocks of 256 values (K / 256 of them a row), eight sub-blocks of 32:
// - Q4_K (144): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc and eight 6-bit mins m
//   (k_scale), 128 bytes of nibbles (bytes 32 p .. 32 p + 31: sub-block 2 p low, 2 p + 1 high):
//   w = d sc_j q - dmin m_j, q in [0, 15];
// - Q5_K (176): Q4_K's d, dmin and scales, 32 bytes qh (bit j of byte i: element i of sub-block
//   j's fifth bit), then Q4_K's nibbles: w = d sc_j q - dmin m_j, q in [0, 31];
// - Q6_K (210): 128 bytes ql (low nibbles), 64 bytes qh (two bits each), 16 int8 scales (one per
//   16 values), fp16 d last: w = d sc_g (q - 32), q in [0, 63]. Sub-block j lies in half h = j / 4
//   (r = j % 4): low bits from ql[64 h + 32 (r % 2) + i] >> 4 (r / 2), high bits from
//   qh[32 h + i] >> 2 r.
//
// Every type other than Q8_0 / Q4_0 is taken in one form: a sub-block of 32 is 32 unsigned
// integers u (at most 63) and, per half of 16 values, a multiplier a and an offset b, w = a u + b
// (Q5_0: a = d, b = -16 d; Q4_K / Q5_K: a = d sc, b = -dmin m; Q6_K: a = d sc, b = -32 d sc).
// a and b are exact in fp32 (an fp16 times an integer of at most 8 bits).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fms_gguf {

constexpr int kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;  // ggml's type ids

// values per block of `type` (32, or 256 for the K-quants)
constexpr int block_values(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K ? 256 : 32; }
// bytes per block of `type`; 0 for a type the kernel does not read
constexpr int block_bytes(int type) {
  return type == kQ8_0 ? 34 : type == kQ4_0 ? 18 : type == kQ5_0 ? 22 : type == kQ4_K ? 144
       : type == kQ5_K ? 176 : type == kQ6_K ? 210 : 0;
}
// the type whose blocks are `bytes` long (every type read has its own size), else 0
constexpr int type_of_bytes(int64_t bytes) {
  return bytes == 34 ? kQ8_0 : bytes == 18 ? kQ4_0 : bytes == 22 ? kQ5_0 : bytes == 144 ? kQ4_K
       : bytes == 176 ? kQ5_K : bytes == 210 ? kQ6_K : 0;
}
// bytes of a row of K values of `type`
constexpr int64_t row_bytes(int type, int64_t K) { return K / block_values(type) * block_bytes(type); }

inline float f16(const uint8_t* p) {  // an fp16 value, unaligned, exactly
  const uint32_t h = uint32_t(p[0]) | uint32_t(p[1]) << 8;
  const uint32_t e = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (e == 0) {
    v = std::ldexp(float(man), -24);
  } else if (e == 31) {
    v = man ? NAN : INFINITY;
  } else {
    const uint32_t bits = (e + 112) << 23 | man << 13;
    std::memcpy(&v, &bits, 4);
  }
  return h & 0x8000 ? -v : v;
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 scale bytes s: j < 4 in the low six
// bits of bytes j and j + 4; j >= 4 four bits in byte j + 4 (scale low, min high) and two in the
// top of bytes j - 4 (scale) and j (min)
inline void k_scale(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63, m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | (s[j - 4] >> 6) << 4;
    m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
  }
}

// Sub-block `sub` (32 values from 32 sub) of the row `row` of a type other than Q8_0 / Q4_0:
// u[32], and a[h], b[h] of each half h (w = a u + b)
inline void decode_sub(int type, const uint8_t* row, int64_t sub, uint8_t* u, float* a, float* b) {
  if (type == kQ5_0) {
    const uint8_t* blk = row + sub * 22;
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    for (int i = 0; i < 32; ++i) {
      const int nib = i < 16 ? blk[6 + i] & 0x0f : blk[6 + i - 16] >> 4;
      u[i] = uint8_t(nib | ((qh >> i) & 1) << 4);
    }
    a[0] = a[1] = f16(blk), b[0] = b[1] = -16.0f * a[0];
    return;
  }
  const int j = int(sub % 8);
  if (type == kQ6_K) {
    const uint8_t* blk = row + sub / 8 * 210;
    const int h = j / 4, r = j % 4;
    const uint8_t *ql = blk + 64 * h + 32 * (r % 2), *qh = blk + 128 + 32 * h;
    for (int i = 0; i < 32; ++i) u[i] = uint8_t(((ql[i] >> 4 * (r / 2)) & 0x0f) | ((qh[i] >> 2 * r) & 3) << 4);
    const float d = f16(blk + 208);
    for (int k = 0; k < 2; ++k) a[k] = d * float(int8_t(blk[192 + 2 * j + k])), b[k] = -32.0f * a[k];
    return;
  }
  // Q4_K, Q5_K
  const bool five = type == kQ5_K;
  const uint8_t* blk = row + sub / 8 * (five ? 176 : 144);
  const uint8_t* qs = blk + (five ? 48 : 16) + 32 * (j / 2);
  int sc, m;
  k_scale(blk + 4, j, sc, m);
  for (int i = 0; i < 32; ++i) {
    const int hi = five ? ((blk[16 + i] >> j) & 1) << 4 : 0;
    u[i] = uint8_t(((qs[i] >> 4 * (j % 2)) & 0x0f) | hi);
  }
  a[0] = a[1] = f16(blk) * float(sc), b[0] = b[1] = -f16(blk + 2) * float(m);
}

}  // namespace fms_gguf
