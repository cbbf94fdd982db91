// Paged causal attention on the CPU: prefill chunks and decode rows read their keys and values in
// place, through the page table. Built and loaded by fms_paged/native, once per head dim
// and storage type T (-DFMS_ELEM: float, fms_bf16 or fms_f16) of q, the pools and the output,
// and once more with -DFMS_KV_INT8=1 for int8 pools (8-bit KV pages: each key's and value's row
// int8 with one fp32 scale, `fms_paged.kv.quant`): q and the output stay T, the rows are
// converted to fp32 as they are loaded and multiplied by their scale (a decode row: each key's
// score times its key's scale, each value's probability times its value's scale; a prefill
// block: the block's rows dequantized into its fp32 rows), so the pools' int8 is read as it is
// stored and never written back. That build exports fms_paged_attention_i8.
// Whatever T is, scores, softmax and the output accumulate in fp32: half-precision values are
// converted as they are loaded (csrc/kernels/vec.h), so a decode row reads half the bytes of
// fp32, and a prefill block's keys and values are converted once into fp32 rows that every query
// row of the block then reuses.
//
// A step is a list of chunks (seq, first position q0, tokens n, offset in q/out): token i of a
// chunk sits at position q0 + i and sees keys 0 .. q0 + i of its sequence (causal; a decode row is
// a chunk of one token). The pool holds every key already, the step's own included.
//
// Three per-layer variants, each computing what Hugging Face transformers computes for the model
// families that use it (all off by default, and then the kernel runs as without them):
// - a sliding window of `window` keys (Mistral, Gemma 2 and 3, gpt-oss): a query at position p
//   sees keys max(0, p - window + 1) .. p (HF: key k visible iff k <= p and p - k < window). The
//   key loops start at the window of the item's oldest row (in prefill rounded down to a score
//   tile, within its page: those few keys' scores are computed and masked, their values never
//   read), so no page wholly older than the window is touched; a key masked for a row (causal
//   or window) gets exactly zero weight;
// - a logit soft-cap `softcap` (Gemma 2): each scaled score s becomes softcap * tanh(s / softcap)
//   before the mask and the softmax (vtanh: Cephes' tanhf on vectors, csrc/kernels/vec.h);
// - attention sinks `sinks` (gpt-oss): one learned logit per query head that joins the softmax's
//   denominator but adds nothing to the output, out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j)):
//   the online softmax starts from the sink (running max sink, running sum 1) instead of empty.
// The online softmax's running max starts finite (LOW, or the sink) rather than at -inf: with a
// window, a block may hold no key a row sees, and exp(m_old - m_new) must then be 1, not NaN.
//
// Vectors are the machine's own (W = 16 lanes with AVX-512, 8 with AVX2: csrc/kernels/vec.h),
// so that the register tiles below stay in registers. Work items are (chunk, kv head, up to
// LG * W = 32 query rows), where a row is one query token for one of the G query heads that share
// the kv head. Rows sit in vector lanes, so the online softmax is vertical (no horizontal
// reductions) and K and V are read row by row from their pages (no transposed copies): scores
// S[key][row] = sum_d K[key, d] * Q^T[d][row], then O^T[d][row] += V[key, d] * P[key][row]. Keys
// go in blocks of BK.
//
// bf16 pools on a CPU with AVX512_BF16 (the native build): a prefill block's products take bf16
// pairs as they are, two multiply-adds per lane and instruction (vdpbf16ps, fp32 sums): scores from
// Q^T packed as pairs of head dims per lane (scaled after the products) and each key's pairs
// broadcast from its page; outputs from the probabilities rounded to bf16 as pairs of keys per
// lane and the block's values repacked as pairs of keys (zero for keys outside the values read).
// Rounding the probabilities to bf16 is what torch's CPU flash attention does in bf16: each output
// is then within u * (|out| + sum_j p_j |v_j|) of exact (u = 2^-8) instead of u * |out|; their
// exp is the shorter vexp_nonpos (same accuracy class), computed as the pairs are packed.
//
// A decode row (a chunk of one token) has only its G heads for rows (3 of 16 lanes for G = 3,
// 1 for MHA), so it takes a path of its own with keys in the lanes instead: per head, W keys'
// dot products with q at once (D / W FMAs each, then one transposing reduction for the W),
// the softmax over the keys' lanes, and O[d] += P[key] * V[key, d] over whole rows of V.
//
// Both paths request the next block's K and V rows into L1 while they work on a block (a
// sequence's pages are scattered: the hardware prefetcher stops at a page's end), and Q^T is
// gathered, and O written back, a W x W block at a time transposed in registers.
#include <omp.h>

#include "args.h"
#include "geometry.h"
#include "kernels.h"
#include "vec.h"

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
#ifndef FMS_KV_INT8
#define FMS_KV_INT8 0
#endif
// bf16 pairs (vdpbf16ps) for a prefill block's products: bf16 pools only, so not for int8 ones
#define FMS_ATT_DP (FMS_VEC_BF16_DP && !FMS_KV_INT8)
#ifndef FMS_ELEM
#error "compile with -DFMS_ELEM=<float, fms_bf16 or fms_f16>: the storage type of q, the pools and out"
#endif

namespace {

using fms_vec::bitrev;
using fms_vec::bits;
using fms_vec::from_f32;
using fms_vec::reduce_lanes;
using fms_vec::to_f32;
using T = FMS_ELEM;
constexpr bool kF32 = std::is_same_v<T, float>;
constexpr bool kI8 = FMS_KV_INT8;  // int8 pools with fp32 row scales
using KV = std::conditional_t<kI8, int8_t, T>;  // the pools' storage type
// bf16 pools on a CPU with AVX512_BF16 (and 16 lanes): a prefill block's products take bf16 pairs
// straight from the pools, two multiply-adds per lane and instruction (vdpbf16ps, fp32 sums),
// instead of converting keys and values to fp32 first (see run_item)
constexpr bool kDP = FMS_ATT_DP;

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
static_assert(KG % 4 == 0, "a block's maxima run in four chains");

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// exp(x) for x <= 0 (a score minus its row's running max; -inf for masked keys gives exactly 0)
inline vf vexp(vf x) { return fms_vec::vexp<W>(x); }
inline vf vtanh(vf x) { return fms_vec::vtanh<W>(x); }
// the prefill softmax's exp: the bf16 pairs path's is the shorter one (same accuracy class)
#if FMS_ATT_DP
inline vf softmax_exp(vf x) { return fms_vec::vexp_nonpos(x); }
#else
inline vf softmax_exp(vf x) { return vexp(x); }
#endif

// the running max of a row's online softmax before its first key (without a sink): below any
// score, yet finite, so that a block whose keys a row does not see (a window) leaves the row's
// max, its sum and its output as they were (exp(-inf - LOW) = 0, alpha = exp(LOW - LOW) = 1)
// where -inf would give exp(-inf + inf) = NaN
constexpr float LOW = -1e30f;

struct Args {
  const T* q;
  int64_t q_st, q_sh;  // q[t, h, :] at q + t * q_st + h * q_sh
  const KV* k;         // pools [Hkv, pool_tokens, D]
  const KV* v;
  int64_t pool_tokens;
  const int32_t* pages;  // page table [seqs, pages_st]
  int64_t pages_st;
  const int64_t* chunks;  // [n_chunks, 4]: seq (-1: no sequence, zero output), q0, n, offset
  T* out;                 // [tokens, H, D]
  int H, Hkv, P;
  float scale;
  int64_t window;      // keys seen per query (0: all; see the top)
  float softcap;       // 0: none
  const float* sinks;  // [H], or null: none
  const float* ks;     // kI8: the scale of each key row [Hkv, pool_tokens] (else null)
  const float* vs;     // kI8: the scale of each value row
};

// the oldest key the query at position pos sees
inline int64_t first_key(const Args& a, int64_t pos) {
  return a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
}

// scores s[0 .. n) (n a multiple of W) soft-capped: softcap * tanh(s / softcap), before they
// are masked (a masked -inf would become -softcap)
inline void soft_cap(const Args& a, float* s, int n) {
  const float c = a.softcap, inv = 1.0f / a.softcap;
  for (int j = 0; j < n; j += W) store(s + j, vtanh(load(s + j) * inv) * c);
}

// where head h's online softmax starts: (running max, running sum) = (sink, e^0 = 1) with a
// sink (its e^sink in the denominator), (LOW, 0) without; a sink of -inf (no weight) starts at
// (LOW, 0) as well
inline void softmax_start(const Args& a, int h, float& m, float& l) {
  m = a.sinks ? std::max(a.sinks[h], LOW) : LOW;
  l = a.sinks ? std::exp(a.sinks[h] - m) : 0.0f;
}

// rows r0 .. r1 - 1 of the chunk (row r = token r / G, head r % G); cost: rows x keys read; tok:
// -1, or the chunk's token tok alone, heads r0 .. r1 - 1 (a decode item: run_decode)
struct Item { int chunk, kvh, r0, r1; int64_t cost; int tok = -1; };
// A chunk of at most this many tokens takes the decode path token by token (run_decode): a decode
// row, and a speculative verify's chunk (its last token and up to 7 proposals, the decode
// projections' GEMV rows). In lanes, its n G rows would fill a fraction of a group's W lanes at the
// cost of a whole group per key (a chunk of 2 tokens with G = 4 cost 2.8 decode rows in the
// default model's layers); token by token each costs one decode row, and each token's output is
// the one a decode step of that token computes, bit for bit (a verified token is what decoding
// it alone gives, in every dtype).
constexpr int64_t DECODE_TOKENS = 8;

struct Scratch {
  alignas(64) float qt[LG * D * W];  // Q^T per lane group, pre-scaled
  alignas(64) float ot[LG * D * W];  // O^T per lane group (unnormalised)
  alignas(64) float s[(BK + KG) * W];
  alignas(64) float pd[LG * W * BK];  // a decode item's probabilities of a block, [heads, BK]
  // a prefill block's keys and values converted to fp32 (half-precision pools without kDP)
  alignas(64) float kf[(kF32 && !kI8) || kDP ? 1 : BK * D];
  alignas(64) float vf32[(kF32 && !kI8) || kDP ? 1 : BK * D];
  // kDP: Q^T per lane group as bf16 pairs (Q[row, 2i], Q[row, 2i + 1]) per lane, unscaled; a
  // block's values as pairs of keys (V[2p, d], V[2p + 1, d]) per d; a group's probabilities as
  // pairs of keys per lane
  alignas(64) uint32_t qp[kDP ? LG * D / 2 * W : 1];
  alignas(64) uint32_t vp[kDP ? (BK / 2 + 1) * D : 1];
  alignas(64) uint32_t pp[kDP ? (BK / 2 + 1) * W : 1];
};

// keys k0 .. k0 + nk - 1 of a sequence with page table row pt (nk <= 0: none), a page's run at a
// time: f(j, slot, run) for keys j .. j + run - 1, which sit at pool slots slot .. slot + run - 1
template <class F>
inline void page_runs(const Args& a, const int32_t* pt, int64_t k0, int nk, F f) {
  int64_t page = fms_geometry::page_of(k0, a.P), in_page = k0 % a.P;
  for (int j = 0; j < nk; ++page, in_page = 0) {
    const int run = (int)std::min<int64_t>(a.P - in_page, nk - j);
    f(j, fms_geometry::slot(pt[page], k0 + j, a.P), run);  // key j: position k0 + j
    j += run;
  }
}

// the K and V rows of keys k0 .. k0 + nk - 1; kI8: their scales too (ksc, vsc [nk], from the kv
// head's scales ksh, vsh [pool_tokens])
inline void key_rows(const Args& a, const int32_t* pt, int64_t k0, int nk, const KV* kh, const KV* vh,
                     const KV** krow, const KV** vrow, const float* ksh = nullptr, const float* vsh = nullptr,
                     float* ksc = nullptr, float* vsc = nullptr) {
  page_runs(a, pt, k0, nk, [&](int j, int64_t slot, int run) {
    for (int i = 0; i < run; ++i) krow[j + i] = kh + (slot + i) * D, vrow[j + i] = vh + (slot + i) * D;
    if constexpr (kI8)
      for (int i = 0; i < run; ++i) ksc[j + i] = ksh[slot + i], vsc[j + i] = vsh[slot + i];
  });
}

// the K and V rows of keys k0 .. k0 + nk - 1 requested into L1 ahead of their block: a sequence's
// pages lie anywhere in the pools, so the hardware prefetcher, which follows one page's run of
// rows at most, would leave each page's first lines to miss
inline void prefetch_keys(const Args& a, const int32_t* pt, int64_t k0, int nk, const KV* kh, const KV* vh) {
  page_runs(a, pt, k0, nk, [&](int, int64_t slot, int run) {
    const char* kr = reinterpret_cast<const char*>(kh + slot * D);
    const char* vr = reinterpret_cast<const char*>(vh + slot * D);
    for (int64_t b = 0; b < (int64_t)run * D * (int64_t)sizeof(KV); b += 64)
      __builtin_prefetch(kr + b, 0, 3), __builtin_prefetch(vr + b, 0, 3);
  });
}

#include "attention_decode.h"  // run_decode: a decode row

#if FMS_ATT_DP
using fms_vec::dp_bcast, fms_vec::load_pairs, fms_vec::pair_rows;
// the scaled scores S[0 .. NT KG) of a group's rows (Q^T as pairs, qp) against NT tiles of KG keys
// (tile t's keys in one page, from trow[t KG]), bf16 pairs: NT KG independent sums, so that two
// tiles hide the multiply-adds' latency
template <int NT>
inline void score_tiles(const uint32_t* qp, const T* const* trow, float scale, float* s) {
  vf acc[NT * KG];
  for (int u = 0; u < NT * KG; ++u) acc[u] = splat(0.0f);
  for (int d = 0; d < D; d += 2) {
    const __m512i qd = load_pairs(qp + d / 2 * W);
    for (int t = 0; t < NT; ++t)
      for (int u = 0; u < KG; ++u) acc[t * KG + u] = dp_bcast(acc[t * KG + u], qd, trow[t * KG] + u * D + d);
  }
  for (int u = 0; u < NT * KG; ++u) store(s + u * W, acc[u] * scale);
}
#endif

// rows r0 .. r1 - 1 of a prefill chunk (or of a decode row: run_decode), rows in lanes: row r
// (token t = r / G) sees keys first_key(q0 + t) .. q0 + t
void run_item(const Args& a, const Item& it, Scratch& sc) {
  const int G = a.H / a.Hkv;
  if (it.tok >= 0) return run_decode(a, it, sc);
  const int64_t* c = a.chunks + 4 * it.chunk;
  const int64_t q0 = c[1], off = c[3];
  const int groups = (it.r1 - it.r0 + W - 1) / W;
  const int32_t* pt = a.pages + c[0] * a.pages_st;
  const KV* kh = a.k + (int64_t)it.kvh * a.pool_tokens * D;
  const KV* vh = a.v + (int64_t)it.kvh * a.pool_tokens * D;
  [[maybe_unused]] const float* ksh = kI8 ? a.ks + (int64_t)it.kvh * a.pool_tokens : nullptr;
  [[maybe_unused]] const float* vsh = kI8 ? a.vs + (int64_t)it.kvh * a.pool_tokens : nullptr;
  vf qpos[LG], qold[LG], m[LG], l[LG];  // qold: the newest key too old for the row (window)
  int64_t qmin[LG], qmax[LG];
  for (int g = 0; g < groups; ++g) {  // lanes past the last row repeat it (their output is dropped)
    qmin[g] = INT64_MAX;
    qmax[g] = -1;
    const T* src[W];  // the lanes' query rows
    for (int e = 0; e < W; ++e) {
      const int r = std::min(it.r0 + g * W + e, it.r1 - 1);
      src[e] = a.q + (off + r / G) * a.q_st + (int64_t)(it.kvh * G + r % G) * a.q_sh;
    }
    // Q^T: W x W blocks of (row, head dim or pair of them) transposed in registers
    constexpr int cols = kDP ? D / 2 : D;  // (pairs: D / 2 need not be a multiple of W)
    for (int d0 = 0; d0 < cols; d0 += W) {
      const int n = std::min(W, cols - d0);
      vf x[W];
      for (int e = 0; e < W; ++e) {
        if constexpr (kDP) {
          x[e] = splat(0.0f);
          std::memcpy(&x[e], src[e] + 2 * d0, n * sizeof(float));  // n bf16 pairs, as bits
        } else {
          x[e] = load(src[e] + d0) * a.scale;
        }
      }
      fms_vec::transpose(x);
      for (int i = 0; i < n; ++i) {
        if constexpr (kDP) {
          std::memcpy(&sc.qp[(g * D / 2 + d0 + i) * W], &x[i], sizeof(vf));
        } else {
          store(sc.qt + (g * D + d0 + i) * W, x[i]);
        }
      }
    }
    for (int e = 0; e < W; ++e) {
      const int r = std::min(it.r0 + g * W + e, it.r1 - 1), t = r / G, h = it.kvh * G + r % G;
      qpos[g][e] = (float)(q0 + t);
      qold[g][e] = (float)(q0 + t - a.window);
      qmin[g] = std::min<int64_t>(qmin[g], q0 + t);
      qmax[g] = std::max<int64_t>(qmax[g], q0 + t);
      softmax_start(a, h, m[g][e], l[g][e]);
    }
  }
  std::memset(sc.ot, 0, sizeof(float) * groups * D * W);
  // keys k_first .. kv_end - 1: from the oldest row's window to the newest row. The blocks start
  // on a score tile (KG keys of one page) at or before k_first; keys before k_first are masked
  // (their scores are computed, their values never read)
  const int64_t k_first = first_key(a, q0 + it.r0 / G), kv_end = q0 + (it.r1 - 1) / G + 1;
  const bool softcap = a.softcap > 0.0f;
  const KV* trow[BK];
  const KV* tvrow[BK];
  [[maybe_unused]] float ksc[BK], vsc[BK];  // kI8: the block's key and value scales
  [[maybe_unused]] const float* krow[BK];
  [[maybe_unused]] const float* vrow[BK];
  for (int64_t k0 = k_first / KG * KG; k0 < kv_end; k0 += BK) {
    const int nk = (int)std::min<int64_t>(BK, kv_end - k0);
    const int nkt = (nk + KG - 1) / KG * KG;  // keys nk .. nkt - 1: stale rows of the last page, masked
    const int jv = (int)std::max<int64_t>(0, k_first - k0);  // keys read for their values: jv .. nk - 1
    key_rows(a, pt, k0, nk, kh, vh, trow, tvrow, ksh, vsh, ksc, vsc);
    prefetch_keys(a, pt, k0 + BK, (int)std::min<int64_t>(BK, kv_end - k0 - BK), kh, vh);
#if FMS_ATT_DP  // the values as pairs of keys, from an even key: keys outside jv .. nk - 1 give 0
    for (int j = jv & ~1; j < nk; j += 2)
      fms_vec::pair_values<D>(j >= jv ? tvrow[j] : nullptr, j + 1 < nk ? tvrow[j + 1] : nullptr, sc.vp + j / 2 * D);
#elif FMS_KV_INT8  // dequantized to fp32 rows once per block: keys of whole tiles, the stale ones
    // (past nk: scale 0, their int8 finite) masked below
    for (int j = 0; j < nkt; ++j) {
      const KV* row = trow[j - j % KG] + (j % KG) * D;  // a tile's KG keys lie in one page, in order
      const vf sj = splat(j < nk ? ksc[j] : 0.0f);
      for (int i = 0; i < D; i += W) store(sc.kf + j * D + i, load(row + i) * sj);
    }
    for (int j = 0; j < nk; ++j) {
      if (j >= jv) {
        const vf sj = splat(vsc[j]);
        for (int i = 0; i < D; i += W) store(sc.vf32 + j * D + i, load(tvrow[j] + i) * sj);
      }
      krow[j] = sc.kf + j * D;
      vrow[j] = sc.vf32 + j * D;
    }
#else
    if constexpr (kF32) {
      std::copy(trow, trow + nk, krow);
      std::copy(tvrow, tvrow + nk, vrow);
    } else {  // to fp32 rows once per block: keys of whole tiles (the stale ones too: masked below)
      for (int j0 = 0; j0 < nkt; j0 += KG)  // a tile's KG keys lie in one page, in order
        for (int i = 0; i < KG * D; i += W) store(sc.kf + j0 * D + i, load(trow[j0] + i));
      for (int j = 0; j < nk; ++j) {
        if (j >= jv)
          for (int i = 0; i < D; i += W) store(sc.vf32 + j * D + i, load(tvrow[j] + i));
        krow[j] = sc.kf + j * D;
        vrow[j] = sc.vf32 + j * D;
      }
    }
#endif
    for (int g = 0; g < groups; ++g) {
      // no row of the group sees a key of this block: all past the newest row, or all older than
      // the oldest row's window
      if (qmax[g] < k0 || k0 + nk <= first_key(a, qmin[g])) continue;
      float* s = sc.s;
#if FMS_ATT_DP
      const uint32_t* qp = sc.qp + g * D / 2 * W;
      int j0 = 0;  // two tiles at a time, then the last of an odd count
      for (; j0 + KG < nk; j0 += 2 * KG) score_tiles<2>(qp, trow + j0, a.scale, s + j0 * W);
      if (j0 < nk) score_tiles<1>(qp, trow + j0, a.scale, s + j0 * W);
#else
      const float* qt = sc.qt + g * D * W;
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
#endif
      if (softcap) soft_cap(a, s, nkt * W);
      if (a.window > 0 && k0 <= qmax[g] - a.window) {  // keys too old for some row: both masks
        for (int j = 0; j < nkt; ++j) {
          const vf kp = splat((float)(k0 + j));
          store(s + j * W, (kp > qpos[g]) | (kp <= qold[g]) ? splat(-INFINITY) : load(s + j * W));
        }
      } else if (k0 + nkt - 1 > qmin[g]) {  // the block reaches past some row's position: causal
        for (int j = 0; j < nkt; ++j)
          store(s + j * W, splat((float)(k0 + j)) > qpos[g] ? splat(-INFINITY) : load(s + j * W));
      }
      vf mx = load(s), mx1 = mx, mx2 = mx, mx3 = mx;  // four chains of maxima (nkt: a multiple of KG)
      for (int j = 0; j < nkt; j += 4) {
        mx = vmax(mx, load(s + j * W));
        mx1 = vmax(mx1, load(s + (j + 1) * W));
        mx2 = vmax(mx2, load(s + (j + 2) * W));
        mx3 = vmax(mx3, load(s + (j + 3) * W));
      }
      mx = vmax(vmax(mx, mx1), vmax(mx2, mx3));
      // m[g] is finite (LOW or the sink), so mnew is, even in lanes whose keys here are all masked
      const vf mnew = vmax(m[g], mx);
      const vf alpha = softmax_exp(m[g] - mnew);
      m[g] = mnew;
      // the keys some row of the group sees: j0v .. j1v - 1 (the others have weight 0 in every lane)
      const int j0v = (int)std::clamp<int64_t>(first_key(a, qmin[g]) - k0, jv, nk);
      const int j1v = (int)std::min<int64_t>(nk, qmax[g] - k0 + 1);
      vf sum = splat(0.0f);
      float* ot = sc.ot + g * D * W;
#if FMS_ATT_DP  // the probabilities as pairs of keys, 0 for keys outside j0v .. j1v - 1
      const int p0 = j0v / 2, p1 = (j1v + 1) / 2;
      for (int p = p0; p < p1; ++p) {
        const int j = 2 * p;
        const vf pj = j >= j0v ? softmax_exp(load(s + j * W) - mnew) : splat(0.0f);
        const vf pj1 = j + 1 < j1v ? softmax_exp(load(s + (j + 1) * W) - mnew) : splat(0.0f);
        sum += pj + pj1;
        _mm512_store_si512(sc.pp + p * W, pair_rows(pj, pj1));
      }
      l[g] = l[g] * alpha + sum;
      for (int d0 = 0; d0 < D; d0 += DG) {
        vf o[DG];
        for (int i = 0; i < DG; ++i) o[i] = load(ot + (d0 + i) * W) * alpha;
        for (int p = p0; p < p1; ++p) {
          const __m512i pv = load_pairs(sc.pp + p * W);
          for (int i = 0; i < DG; ++i) o[i] = dp_bcast(o[i], pv, sc.vp + p * D + d0 + i);
        }
        for (int i = 0; i < DG; ++i) store(ot + (d0 + i) * W, o[i]);
      }
#else
      for (int j = j0v; j < j1v; ++j) {
        const vf p = softmax_exp(load(s + j * W) - mnew);
        sum += p;
        store(s + j * W, p);
      }
      l[g] = l[g] * alpha + sum;
      for (int d0 = 0; d0 < D; d0 += DG) {
        vf o[DG];
        for (int i = 0; i < DG; ++i) o[i] = load(ot + (d0 + i) * W) * alpha;
        for (int j = j0v; j < j1v; ++j) {
          const vf p = load(s + j * W);
          const float* vr = vrow[j] + d0;
          for (int i = 0; i < DG; ++i) o[i] += splat(vr[i]) * p;
        }
        for (int i = 0; i < DG; ++i) store(ot + (d0 + i) * W, o[i]);
      }
#endif
    }
  }
  for (int g = 0; g < groups; ++g) {  // O^T normalised, W x W blocks transposed back to rows, rounded to T
    const vf inv = 1.0f / l[g];
    const int rows = std::min(W, it.r1 - it.r0 - g * W);
    T* dst[W];
    for (int e = 0; e < rows; ++e) {
      const int r = it.r0 + g * W + e;
      dst[e] = a.out + ((off + r / G) * a.H + it.kvh * G + r % G) * D;
    }
    for (int d0 = 0; d0 < D; d0 += W) {
      vf x[W];
      for (int i = 0; i < W; ++i) x[i] = load(sc.ot + (g * D + d0 + i) * W) * inv;
      fms_vec::transpose(x);
      for (int e = 0; e < rows; ++e) store(dst[e] + d0, x[e]);
    }
  }
}

}  // namespace

// The kernel's arguments, passed by pointer: the struct of FMS_PAGED_ATTENTION_FIELDS
// (kernels/kernels.h, which says what each field holds). The operator that calls the kernel
// (csrc/ops/ops.cpp) compares its own layout of the struct with fms_paged_attention_layout()'s
// (every field's name, kind and offset, and the size) when it loads the library, and refuses a
// build whose struct differs instead of reading fields at the wrong offsets.
extern "C" {

#if FMS_KV_INT8  // the int8-pool build's entry points (the kernel "attention_i8")
#define FMS_ATTENTION_FN fms_paged_attention_i8
#define FMS_ATTENTION_LAYOUT_FN fms_paged_attention_i8_layout
#else
#define FMS_ATTENTION_FN fms_paged_attention
#define FMS_ATTENTION_LAYOUT_FN fms_paged_attention_layout
#endif

FMS_PAGED_ARGS(FmsPagedAttentionArgs, FMS_PAGED_ATTENTION_FIELDS, FMS_ATTENTION_LAYOUT_FN)

// 0, or 1: heads, page size, window or soft-cap the kernel cannot take (or int8 pools without
// their scales); 2 + i: chunk i is outside the page table or the step's tokens (nothing read or
// written)
int FMS_ATTENTION_FN(const FmsPagedAttentionArgs* args) {
  const FmsPagedAttentionArgs& c = *args;
  const int H = c.H, Hkv = c.Hkv, P = c.P;
  const int n_chunks = (int)c.n_chunks;
  const int64_t* chunks = c.chunks;
  if (H <= 0 || Hkv <= 0 || P <= 0 || H % Hkv || P % KG || c.window < 0 || !(c.softcap >= 0.0f) ||
      std::isinf(c.softcap) || (kI8 && (!c.k_scale || !c.v_scale)))
    return 1;
  for (int i = 0; i < n_chunks; ++i) {
    const int64_t* ch = chunks + 4 * i;
    if (ch[0] >= c.n_seqs || ch[1] < 0 || ch[2] < 0 || ch[3] < 0 || ch[3] + ch[2] > c.n_tokens ||
        (ch[0] >= 0 && ch[1] + ch[2] > c.pages_st * P))
      return 2 + i;
  }
  const Args a{c.q, c.q_st, c.q_sh, c.k, c.v, c.pool_tokens, c.pages, c.pages_st, chunks, c.out, H, Hkv, P,
               c.scale, c.window, c.softcap, c.sinks, c.k_scale, c.v_scale};
  const int G = H / Hkv, rows = LG * W;
  std::vector<Item> items;
  for (int i = 0; i < n_chunks; ++i) {
    const int64_t seq = chunks[4 * i], q0 = chunks[4 * i + 1], n = chunks[4 * i + 2], off = chunks[4 * i + 3];
    if (seq < 0) {
      std::memset(c.out + off * H * D, 0, sizeof(T) * n * H * D);  // zero bits: 0.0 in every T
      continue;
    }
    if (n <= DECODE_TOKENS) {  // token by token (run_decode), each its G heads
      for (int t = 0; t < n; ++t)
        for (int r0 = 0; r0 < G; r0 += rows) {
          const int r1 = std::min(G, r0 + rows);
          const int64_t keys = q0 + t + 1 - first_key(a, q0 + t);
          for (int h = 0; h < Hkv; ++h) items.push_back({i, h, r0, r1, (r1 - r0) * keys, t});
        }
      continue;
    }
    for (int r0 = 0; r0 < n * G; r0 += rows) {
      const int r1 = (int)std::min<int64_t>(n * G, r0 + rows);
      // rows x the keys they read: from the first row's window to the last row
      const int64_t keys = q0 + (r1 - 1) / G + 1 - first_key(a, q0 + r0 / G);
      for (int h = 0; h < Hkv; ++h) items.push_back({i, h, r0, r1, (r1 - r0) * keys});
    }
  }
  // the costliest items first (rows x keys read), handed out one at a time
  std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int n_items = (int)items.size();
  // a thread per GRAIN (row, key) pairs at most (ATen's habit of a grain size): a short step on one
  // thread costs less than a parallel region's fork and join, and far less when another process
  // keeps a core busy and the region waits for a thread the OS has descheduled. A decode row's
  // items are the exception, a thread each: little arithmetic, but keys and values that come from
  // memory (the step before streamed its weights through the caches), as fast as one core can
  // have lines in flight, so a second core reading other items cuts the wait (a SmolLM2-shaped
  // layer's 3 items of 128 keys: 14.8 -> 10.2 us inside a decode step)
  int64_t work = 0, decode_items = 0;
  for (const Item& it : items) work += it.cost, decode_items += it.tok >= 0;
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)c.threads, (int64_t)n_items,
                                                                    std::max(work * D / GRAIN, decode_items)}));
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
