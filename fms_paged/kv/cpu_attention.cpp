// Paged causal attention on the CPU: prefill chunks and decode rows read their keys and values in
// place, through the page table. Built and loaded by fms_paged/kv/cpu_kernel.py, once per head dim
// and storage type T (-DFMS_ELEM: float, fms_bf16 or fms_f16) of q, the pools and the output.
// Whatever T is, scores, softmax and the output accumulate in fp32: half-precision values are
// converted as they are loaded (fms_paged/native_vec.h), so a decode row reads half the bytes of
// fp32, and a prefill block's keys and values are converted once into fp32 rows that every query
// row of the block then reuses.
//
// A step is a list of chunks (seq, first position q0, tokens n, offset in q/out): token i of a
// chunk sits at position q0 + i and sees keys 0 .. q0 + i of its sequence (causal; a decode row is
// a chunk of one token). The pool holds every key already, the step's own included.
//
// Vectors are the machine's own (W = 16 lanes with AVX-512, 8 with AVX2: fms_paged/native_vec.h),
// so that the register tiles below stay in registers. Work items are (chunk, kv head, up to
// LG * W = 32 query rows), where a row is one query token for one of the G query heads that share
// the kv head. Rows sit in vector lanes, so the online softmax is vertical (no horizontal
// reductions) and K and V are read row by row from their pages (no transposed copies): scores
// S[key][row] = sum_d K[key, d] * Q^T[d][row], then O^T[d][row] += V[key, d] * P[key][row]. Keys
// go in blocks of BK.
//
// A decode row (a chunk of one token) has only its G heads for rows (3 of 16 lanes for G = 3,
// 1 for MHA), so it takes a path of its own with keys in the lanes instead: per head, W keys'
// dot products with q at once (D / W FMAs each, then one transposing reduction for the W),
// the softmax over the keys' lanes, and O[d] += P[key] * V[key, d] over whole rows of V.
#include <omp.h>

#include "native_args.h"
#include "native_vec.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head dim, a multiple of 16>"
#endif
#ifndef FMS_ELEM
#error "compile with -DFMS_ELEM=<float, fms_bf16 or fms_f16>: the storage type of q, the pools and out"
#endif

namespace {

using fms_vec::bits;
using fms_vec::from_f32;
using fms_vec::to_f32;
using T = FMS_ELEM;
constexpr bool kF32 = std::is_same_v<T, float>;

constexpr int D = HEAD_DIM;
constexpr int W = fms_vec::NATIVE;  // lanes per vector: query rows (prefill), keys (decode)
using vf = fms_vec::vec<W>;
using vi = fms_vec::ivec<W>;
template <class U>
inline vf load(const U* p) { return fms_vec::load<W>(p); }
template <class U>
inline void store(U* p, vf v) { fms_vec::store<W>(p, v); }
inline vf splat(float x) { return fms_vec::splat<W>(x); }
constexpr int LG = 32 / W;  // lane groups per work item
constexpr int BK = 64;  // keys per block
constexpr int KG = 8;   // keys per register tile of the scores (a page holds whole tiles: P % KG == 0)
constexpr int DG = W;   // head-dim slice per register tile of the output
constexpr int64_t GRAIN = int64_t(1) << 18;  // multiply-adds (rows x keys x D) per thread, at least
static_assert(D % DG == 0, "the head dim must be a multiple of 16");

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// exp(x) for x <= 0 (a score minus its row's running max; -inf for masked keys gives exactly 0):
// x = n ln2 + r, e^r by Cephes' degree-6 polynomial, times 2^n built in the exponent bits
inline vf vexp(vf x) {
  const vf keep = x < -87.3f ? splat(0.0f) : splat(1.0f);
  x = x < -87.3f ? splat(-87.3f) : x;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * bits<vf>(e) * keep;
}

struct Args {
  const T* q;
  int64_t q_st, q_sh;  // q[t, h, :] at q + t * q_st + h * q_sh
  const T* k;          // pools [Hkv, pool_tokens, D]
  const T* v;
  int64_t pool_tokens;
  const int32_t* pages;  // page table [seqs, pages_st]
  int64_t pages_st;
  const int64_t* chunks;  // [n_chunks, 4]: seq (-1: no sequence, zero output), q0, n, offset
  T* out;                 // [tokens, H, D]
  int H, Hkv, P;
  float scale;
};

struct Item {
  int chunk, kvh, r0, r1;  // rows r0 .. r1 - 1 of the chunk: row r = token r / G, head r % G
  int64_t cost;
};

struct Scratch {
  alignas(64) float qt[LG * D * W];  // Q^T per lane group, pre-scaled
  alignas(64) float ot[LG * D * W];  // O^T per lane group (unnormalised)
  alignas(64) float s[(BK + KG) * W];
  // a prefill block's keys and values converted to fp32 (half-precision pools only)
  alignas(64) float kf[kF32 ? 1 : BK * D];
  alignas(64) float vf32[kF32 ? 1 : BK * D];
};

// the K and V rows of keys k0 .. k0 + nk - 1 of a sequence with page table row pt
inline void key_rows(const Args& a, const int32_t* pt, int64_t k0, int nk, const T* kh, const T* vh,
                     const T** krow, const T** vrow) {
  int64_t page = k0 / a.P, in_page = k0 % a.P;  // no division per key
  for (int j = 0; j < nk; ++j) {
    const int64_t slot = (int64_t)pt[page] * a.P + in_page;
    krow[j] = kh + slot * D;
    vrow[j] = vh + slot * D;
    if (++in_page == a.P) in_page = 0, ++page;
  }
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif

// i with its log2(W) bits reversed
constexpr int bitrev(int i) {
  int r = 0;
  for (int b = 1; b < W; b <<= 1, i >>= 1) r = (r << 1) | (i & 1);
  return r;
}

// lane j of the result: the sum of the lanes of p[bitrev(j)] (W horizontal sums in W - 1 adds)
inline vf reduce_lanes(const vf* p) {
#if defined(SHUFFLE) && FMS_VEC_NATIVE == 16
  vf c[8], d[4], e[2];  // each level halves the lanes per vector and doubles the vectors per lane
  for (int i = 0; i < 8; ++i)
    c[i] = SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    d[i] = SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUFFLE(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = SHUFFLE(d[2 * i], d[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUFFLE(d[2 * i], d[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return SHUFFLE(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         SHUFFLE(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#elif defined(SHUFFLE)
  vf c[4], d[2];
  for (int i = 0; i < 4; ++i)
    c[i] = SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    d[i] = SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           SHUFFLE(c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return SHUFFLE(d[0], d[1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(d[0], d[1], 1, 9, 3, 11, 5, 13, 7, 15);
#else
  vf r;
  for (int j = 0; j < W; ++j) {
    r[j] = 0.0f;
    for (int i = 0; i < W; ++i) r[j] += p[bitrev(j)][i];
  }
  return r;
#endif
}

// a decode row: heads r0 .. r1 - 1 of the item's kv head for one token at position q0, which sees
// keys 0 .. q0; keys in lanes (see the top)
void run_decode(const Args& a, const Item& it, Scratch& sc) {
  const int G = a.H / a.Hkv, nh = it.r1 - it.r0;
  const int64_t* c = a.chunks + 4 * it.chunk;
  const int64_t n_keys = c[1] + 1, off = c[3];
  const int32_t* pt = a.pages + c[0] * a.pages_st;
  const T* kh = a.k + (int64_t)it.kvh * a.pool_tokens * D;
  const T* vh = a.v + (int64_t)it.kvh * a.pool_tokens * D;
  const T* q = a.q + off * a.q_st + (int64_t)(it.kvh * G + it.r0) * a.q_sh;
  float m[LG * W], l[LG * W];  // per head: running max and sum of the softmax
  for (int g = 0; g < nh; ++g) m[g] = -INFINITY, l[g] = 0.0f;
  std::memset(sc.ot, 0, sizeof(float) * nh * D);  // O per head, [nh, D] (unnormalised)
  vf lane;
  for (int i = 0; i < W; ++i) lane[i] = (float)i;
  const T* krow[BK];
  const T* vrow[BK];
  float* s = sc.s;
  for (int64_t k0 = 0; k0 < n_keys; k0 += BK) {
    const int nk = (int)std::min<int64_t>(BK, n_keys - k0), nkt = (nk + W - 1) / W * W;
    key_rows(a, pt, k0, nk, kh, vh, krow, vrow);
    for (int g = 0; g < nh; ++g) {
      vf qv[D / W];
      for (int i = 0; i < D / W; ++i) qv[i] = load(q + g * a.q_sh + i * W) * a.scale;
      for (int j0 = 0; j0 < nk; j0 += W) {  // scores of keys j0 .. j0 + W - 1, one per lane
        const int n = std::min(W, nk - j0);
        vf part[W];
        for (int j = 0; j < W; ++j) {
          vf acc = splat(0.0f);
          if (j < n)
            for (int i = 0; i < D / W; ++i) acc += load(krow[j0 + j] + i * W) * qv[i];
          part[bitrev(j)] = acc;
        }
        const vf sv = reduce_lanes(part);
        store(s + j0, lane < splat((float)n) ? sv : splat(-INFINITY));  // lanes past the keys: -inf
      }
      vf mv = load(s);
      for (int j0 = W; j0 < nkt; j0 += W) mv = vmax(mv, load(s + j0));
      float mx = mv[0];
      for (int i = 1; i < W; ++i) mx = std::max(mx, mv[i]);
      const float mnew = std::max(m[g], mx), alpha = std::exp(m[g] - mnew);  // finite: key 0 is seen
      m[g] = mnew;
      vf sum = splat(0.0f);
      for (int j0 = 0; j0 < nkt; j0 += W) {
        const vf p = vexp(load(s + j0) - mnew);
        sum += p;
        store(s + j0, p);
      }
      float total = 0.0f;
      for (int i = 0; i < W; ++i) total += sum[i];
      l[g] = l[g] * alpha + total;
      float* o = sc.ot + g * D;
      vf ov[D / W];
      for (int i = 0; i < D / W; ++i) ov[i] = load(o + i * W) * alpha;
      for (int j = 0; j < nk; ++j) {
        const vf p = splat(s[j]);
        for (int i = 0; i < D / W; ++i) ov[i] += p * load(vrow[j] + i * W);
      }
      for (int i = 0; i < D / W; ++i) store(o + i * W, ov[i]);
    }
  }
  for (int g = 0; g < nh; ++g) {
    T* dst = a.out + (off * a.H + it.kvh * G + it.r0 + g) * D;
    const vf inv = splat(1.0f / l[g]);
    for (int i = 0; i < D / W; ++i) store(dst + i * W, load(sc.ot + g * D + i * W) * inv);
  }
}

void run_item(const Args& a, const Item& it, Scratch& sc) {
  const int G = a.H / a.Hkv;
  if (a.chunks[4 * it.chunk + 2] == 1) return run_decode(a, it, sc);
  const int64_t* c = a.chunks + 4 * it.chunk;
  const int64_t q0 = c[1], off = c[3];
  const int groups = (it.r1 - it.r0 + W - 1) / W;
  const int32_t* pt = a.pages + c[0] * a.pages_st;
  const T* kh = a.k + (int64_t)it.kvh * a.pool_tokens * D;
  const T* vh = a.v + (int64_t)it.kvh * a.pool_tokens * D;
  vf qpos[LG], m[LG], l[LG];
  int64_t qmin[LG], qmax[LG];
  for (int g = 0; g < groups; ++g) {  // lanes past the last row repeat it (their output is dropped)
    qmin[g] = INT64_MAX;
    qmax[g] = -1;
    for (int e = 0; e < W; ++e) {
      const int r = std::min(it.r0 + g * W + e, it.r1 - 1), t = r / G, h = it.kvh * G + r % G;
      const T* src = a.q + (off + t) * a.q_st + (int64_t)h * a.q_sh;
      for (int d = 0; d < D; ++d) sc.qt[(g * D + d) * W + e] = to_f32(src[d]) * a.scale;
      qpos[g][e] = (float)(q0 + t);
      qmin[g] = std::min<int64_t>(qmin[g], q0 + t);
      qmax[g] = std::max<int64_t>(qmax[g], q0 + t);
    }
    m[g] = splat(-INFINITY);
    l[g] = splat(0.0f);
  }
  std::memset(sc.ot, 0, sizeof(float) * groups * D * W);
  const int64_t kv_end = q0 + (it.r1 - 1) / G + 1;  // keys 0 .. kv_end - 1
  const T* trow[BK];
  const T* tvrow[BK];
  const float* krow[BK];
  const float* vrow[BK];
  for (int64_t k0 = 0; k0 < kv_end; k0 += BK) {
    const int nk = (int)std::min<int64_t>(BK, kv_end - k0);
    const int nkt = (nk + KG - 1) / KG * KG;  // keys nk .. nkt - 1: stale rows of the last page, masked
    key_rows(a, pt, k0, nk, kh, vh, trow, tvrow);
    if constexpr (kF32) {
      std::copy(trow, trow + nk, krow);
      std::copy(tvrow, tvrow + nk, vrow);
    } else {  // to fp32 rows once per block: keys of whole tiles (the stale ones too: masked below)
      for (int j0 = 0; j0 < nkt; j0 += KG)  // a tile's KG keys lie in one page, in order
        for (int i = 0; i < KG * D; i += W) store(sc.kf + j0 * D + i, load(trow[j0] + i));
      for (int j = 0; j < nk; ++j) {
        for (int i = 0; i < D; i += W) store(sc.vf32 + j * D + i, load(tvrow[j] + i));
        krow[j] = sc.kf + j * D;
        vrow[j] = sc.vf32 + j * D;
      }
    }
    for (int g = 0; g < groups; ++g) {
      if (qmax[g] < k0) continue;  // no row of the group sees a key of this block
      const float* qt = sc.qt + g * D * W;
      float* s = sc.s;
      for (int j0 = 0; j0 < nk; j0 += KG) {  // S[j0 .. j0 + KG): KG keys of one page
        const float* kt = krow[j0];
        vf acc[KG];
        for (int u = 0; u < KG; ++u) acc[u] = splat(0.0f);
        for (int d = 0; d < D; ++d) {
          const vf qd = load(qt + d * W);
          for (int u = 0; u < KG; ++u) acc[u] += splat(kt[u * D + d]) * qd;
        }
        for (int u = 0; u < KG; ++u) store(s + (j0 + u) * W, acc[u]);
      }
      if (k0 + nkt - 1 > qmin[g])  // the block reaches past some row's position: causal mask
        for (int j = 0; j < nkt; ++j)
          store(s + j * W, splat((float)(k0 + j)) > qpos[g] ? splat(-INFINITY) : load(s + j * W));
      vf mx = load(s);
      for (int j = 1; j < nkt; ++j) mx = vmax(mx, load(s + j * W));
      const vf mnew = vmax(m[g], mx);  // finite: key 0 (block 0) is visible to every row
      const vf alpha = vexp(m[g] - mnew);
      m[g] = mnew;
      vf sum = splat(0.0f);
      for (int j = 0; j < nk; ++j) {
        const vf p = vexp(load(s + j * W) - mnew);
        sum += p;
        store(s + j * W, p);
      }
      l[g] = l[g] * alpha + sum;
      float* ot = sc.ot + g * D * W;
      for (int d0 = 0; d0 < D; d0 += DG) {
        vf o[DG];
        for (int i = 0; i < DG; ++i) o[i] = load(ot + (d0 + i) * W) * alpha;
        for (int j = 0; j < nk; ++j) {
          const vf p = load(s + j * W);
          const float* vr = vrow[j] + d0;
          for (int i = 0; i < DG; ++i) o[i] += splat(vr[i]) * p;
        }
        for (int i = 0; i < DG; ++i) store(ot + (d0 + i) * W, o[i]);
      }
    }
  }
  for (int g = 0; g < groups; ++g) {
    const vf inv = 1.0f / l[g];
    for (int e = 0; e < W && it.r0 + g * W + e < it.r1; ++e) {
      const int r = it.r0 + g * W + e, t = r / G, h = it.kvh * G + r % G;
      T* dst = a.out + ((off + t) * a.H + h) * D;
      for (int d = 0; d < D; ++d) dst[d] = from_f32<T>(sc.ot[(g * D + d) * W + e] * inv[e]);
    }
  }
}

}  // namespace

// The kernel's arguments, passed by pointer. fms_paged/kv/cpu_kernel.py mirrors the struct as a
// ctypes.Structure with the same fields and, when it loads the library, compares its layout with
// fms_paged_attention_layout()'s (every field's name, kind and offset, and the size): a build whose
// struct differs from the Python mirror is refused instead of reading fields at the wrong offsets.
//
// q[t, h, :] (t < n_tokens, the step's query tokens) at q + t * q_st + h * q_sh; k, v: the pools
// [Hkv, pool_tokens, D]; pages: the page table [n_seqs, pages_st]; chunks: [n_chunks, 4] (seq, q0,
// n, offset); out: [n_tokens, H, D]; P: tokens per page; threads: at most this many. The step's own
// keys and values are in the pools already (written by the caller's ASSIGN).
#define FMS_PAGED_ATTENTION_FIELDS(X)                                                          \
  X(const T*, q) X(int64_t, q_st) X(int64_t, q_sh) X(int64_t, n_tokens)                        \
  X(T*, k) X(T*, v) X(int64_t, pool_tokens)                                                    \
  X(const int32_t*, pages) X(int64_t, n_seqs) X(int64_t, pages_st)                             \
  X(const int64_t*, chunks) X(int64_t, n_chunks) X(T*, out)                                    \
  X(int32_t, H) X(int32_t, Hkv) X(int32_t, P) X(float, scale) X(int32_t, threads)

extern "C" {

FMS_PAGED_ARGS(FmsPagedAttentionArgs, FMS_PAGED_ATTENTION_FIELDS, fms_paged_attention_layout)

// 0, or 1: heads or page size the kernel cannot take; 2 + i: chunk i is outside the page table or
// the step's tokens (nothing read or written)
int fms_paged_attention(const FmsPagedAttentionArgs* args) {
  const FmsPagedAttentionArgs& c = *args;
  const int H = c.H, Hkv = c.Hkv, P = c.P;
  const int n_chunks = (int)c.n_chunks;
  const int64_t* chunks = c.chunks;
  if (H <= 0 || Hkv <= 0 || P <= 0 || H % Hkv || P % KG) return 1;
  for (int i = 0; i < n_chunks; ++i) {
    const int64_t* ch = chunks + 4 * i;
    if (ch[0] >= c.n_seqs || ch[1] < 0 || ch[2] < 0 || ch[3] < 0 || ch[3] + ch[2] > c.n_tokens ||
        (ch[0] >= 0 && ch[1] + ch[2] > c.pages_st * P))
      return 2 + i;
  }
  const Args a{c.q, c.q_st, c.q_sh, c.k, c.v, c.pool_tokens, c.pages, c.pages_st, chunks, c.out, H, Hkv, P,
               c.scale};
  const int G = H / Hkv, rows = LG * W;
  std::vector<Item> items;
  for (int i = 0; i < n_chunks; ++i) {
    const int64_t seq = chunks[4 * i], q0 = chunks[4 * i + 1], n = chunks[4 * i + 2], off = chunks[4 * i + 3];
    if (seq < 0) {
      std::memset(c.out + off * H * D, 0, sizeof(T) * n * H * D);  // zero bits: 0.0 in every T
      continue;
    }
    for (int r0 = 0; r0 < n * G; r0 += rows) {
      const int r1 = (int)std::min<int64_t>(n * G, r0 + rows);
      for (int h = 0; h < Hkv; ++h) items.push_back({i, h, r0, r1, (int64_t)(r1 - r0) * (q0 + r1 / G)});
    }
  }
  // the costliest items first (rows x keys), handed out one at a time
  std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int n_items = (int)items.size();
  // a thread per GRAIN (row, key) pairs at most (ATen's habit of a grain size): a short step on one
  // thread costs less than a parallel region's fork and join, and far less when another process
  // keeps a core busy and the region waits for a thread the OS has descheduled
  int64_t work = 0;
  for (const Item& it : items) work += it.cost;
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)c.threads, (int64_t)n_items,
                                                                    work * D / GRAIN}));
#pragma omp parallel num_threads(threads)
  {
    // each thread's own, kept for its next calls: up to ~200 KiB (head dim 256 in half precision),
    // off the thread's stack and not allocated (and faulted in) again at every call
    static thread_local const std::unique_ptr<Scratch> sc(new Scratch);
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n_items; ++i) run_item(a, items[i], *sc);
  }
  return 0;
}

}  // extern "C"
