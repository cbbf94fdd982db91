// Paged causal attention on the CPU (fp32): prefill chunks and decode rows read their keys and
// values in place, through the page table. Built and loaded by fms_paged/kv/cpu_kernel.py.
//
// A step is a list of chunks (seq, first position q0, tokens n, offset in q/out): token i of a
// chunk sits at position q0 + i and sees keys 0 .. q0 + i of its sequence (causal; a decode row is
// a chunk of one token). The pool holds every key already, the step's own included.
//
// Work items are (chunk, kv head, up to LANE_GROUPS * 16 query rows), where a row is one query
// token for one of the G query heads that share the kv head. Rows sit in vector lanes, so the
// online softmax is vertical (no horizontal reductions) and K and V are read row by row from
// their pages (no transposed copies): scores S[key][row] = sum_d K[key, d] * Q^T[d][row], then
// O^T[d][row] += V[key, d] * P[key][row]. Keys go in blocks of BK.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head dim, a multiple of 16>"
#endif

namespace {

constexpr int D = HEAD_DIM;
constexpr int W = 16;   // lanes per vector: query rows
constexpr int LG = 2;   // lane groups per work item
constexpr int BK = 64;  // keys per block
constexpr int KG = 8;   // keys per register tile of the scores (a page holds whole tiles: P % KG == 0)
constexpr int DG = 16;  // head-dim slice per register tile of the output
static_assert(D % DG == 0, "the head dim must be a multiple of 16");

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
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
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale * keep;
}

struct Args {
  const float* q;
  int64_t q_st, q_sh;  // q[t, h, :] at q + t * q_st + h * q_sh
  const float* k;      // pools [Hkv, pool_tokens, D]
  const float* v;
  int64_t pool_tokens;
  const int32_t* pages;  // page table [seqs, pages_st]
  int64_t pages_st;
  const int64_t* chunks;  // [n_chunks, 4]: seq (-1: no sequence, zero output), q0, n, offset
  float* out;             // [T, H, D]
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
};

void run_item(const Args& a, const Item& it, Scratch& sc) {
  const int G = a.H / a.Hkv;
  const int64_t* c = a.chunks + 4 * it.chunk;
  const int64_t q0 = c[1], off = c[3];
  const int groups = (it.r1 - it.r0 + W - 1) / W;
  const int32_t* pt = a.pages + c[0] * a.pages_st;
  const float* kh = a.k + (int64_t)it.kvh * a.pool_tokens * D;
  const float* vh = a.v + (int64_t)it.kvh * a.pool_tokens * D;
  vf qpos[LG], m[LG], l[LG];
  int64_t qmin[LG], qmax[LG];
  for (int g = 0; g < groups; ++g) {  // lanes past the last row repeat it (their output is dropped)
    qmin[g] = INT64_MAX;
    qmax[g] = -1;
    for (int e = 0; e < W; ++e) {
      const int r = std::min(it.r0 + g * W + e, it.r1 - 1), t = r / G, h = it.kvh * G + r % G;
      const float* src = a.q + (off + t) * a.q_st + (int64_t)h * a.q_sh;
      for (int d = 0; d < D; ++d) sc.qt[(g * D + d) * W + e] = src[d] * a.scale;
      qpos[g][e] = (float)(q0 + t);
      qmin[g] = std::min<int64_t>(qmin[g], q0 + t);
      qmax[g] = std::max<int64_t>(qmax[g], q0 + t);
    }
    m[g] = splat(-INFINITY);
    l[g] = splat(0.0f);
  }
  std::memset(sc.ot, 0, sizeof(float) * groups * D * W);
  const int64_t kv_end = q0 + (it.r1 - 1) / G + 1;  // keys 0 .. kv_end - 1
  const float* krow[BK];
  const float* vrow[BK];
  for (int64_t k0 = 0; k0 < kv_end; k0 += BK) {
    const int nk = (int)std::min<int64_t>(BK, kv_end - k0);
    const int nkt = (nk + KG - 1) / KG * KG;  // keys nk .. nkt - 1: stale rows of the last page, masked
    for (int j = 0; j < nk; ++j) {
      const int64_t pos = k0 + j, slot = (int64_t)pt[pos / a.P] * a.P + pos % a.P;
      krow[j] = kh + slot * D;
      vrow[j] = vh + slot * D;
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
      float* dst = a.out + ((off + t) * a.H + h) * D;
      for (int d = 0; d < D; ++d) dst[d] = sc.ot[(g * D + d) * W + e] * inv[e];
    }
  }
}

}  // namespace

// Optionally ASSIGNs the step's new keys and values first: token t's k_new[t, h, :] (at
// k_new + t * kn_st + h * kn_sh; v_new likewise with its own strides) goes to slot slots[t] of kv
// head h's pool.
extern "C" int fms_paged_attention(const float* q, int64_t q_st, int64_t q_sh, int64_t n_tokens, float* k,
                                   float* v, int64_t pool_tokens, const int32_t* pages, int64_t n_seqs,
                                   int64_t pages_st, const int64_t* chunks, int n_chunks, float* out, int H, int Hkv, int P,
                                   float scale, int threads, const float* k_new, int64_t kn_st,
                                   int64_t kn_sh, const float* v_new, int64_t vn_st, int64_t vn_sh,
                                   const int64_t* slots, int64_t n_new) {
  if (H % Hkv || P % KG) return 1;
  // every chunk within the page table and the step's tokens, every new slot within the pool:
  // 2 + i names the first chunk that is not, 1 + n_chunks + 1 a slot that is not
  for (int i = 0; i < n_chunks; ++i) {
    const int64_t* c = chunks + 4 * i;
    if (c[0] >= n_seqs || c[1] < 0 || c[2] < 0 || c[3] < 0 || c[3] + c[2] > n_tokens ||
        (c[0] >= 0 && c[1] + c[2] > pages_st * P))
      return 2 + i;
  }
  for (int64_t t = 0; k_new && t < n_new; ++t)
    if (slots[t] < 0 || slots[t] >= pool_tokens) return 2 + n_chunks;
  const Args a{q, q_st, q_sh, k, v, pool_tokens, pages, pages_st, chunks, out, H, Hkv, P, scale};
  const int G = H / Hkv, rows = LG * W;
  std::vector<Item> items;
  for (int i = 0; i < n_chunks; ++i) {
    const int64_t seq = chunks[4 * i], q0 = chunks[4 * i + 1], n = chunks[4 * i + 2], off = chunks[4 * i + 3];
    if (seq < 0) {
      std::memset(out + off * H * D, 0, sizeof(float) * n * H * D);
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
  const int64_t n_store = k_new ? n_new * Hkv : 0;
  const int64_t work = std::max<int64_t>(n_items, n_store);
#pragma omp parallel num_threads((int)std::max<int64_t>(1, std::min<int64_t>(threads, work)))
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n_store; ++i) {  // ASSIGN (then the for's barrier: every key is in place)
      const int64_t t = i / Hkv, h = i % Hkv, dst = (h * pool_tokens + slots[t]) * D;
      if (slots[t] < P) continue;  // rows with no sequence write to the null page: nobody reads it
      std::memcpy(k + dst, k_new + t * kn_st + h * kn_sh, sizeof(float) * D);
      std::memcpy(v + dst, v_new + t * vn_st + h * vn_sh, sizeof(float) * D);
    }
    Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n_items; ++i) run_item(a, items[i], sc);
  }
  return 0;
}
