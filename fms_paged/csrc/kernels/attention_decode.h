// A decode row's path of the paged attention kernel: a part of attention.cpp, included by it
// inside its namespace after what it uses (T, D, W, the vectors, Args, Item, Scratch, the key
// rows, prefetches and softmax helpers), and built with it (fms_paged/native hashes a kernel's
// own headers, <source stem>*.h, into the library's key). Keys sit in the lanes: see the top of
// attention.cpp.
#pragma once

// the scores of W keys (rows krow[0 .. W)) with q (qv: D / W vectors, scaled), one per lane:
// unrolled, so that the W keys' dot products run side by side in registers. A lane's score
// depends on its own key alone (reduce_lanes), so a block's last vector pads its rows past the
// keys with a real one and the caller masks those lanes. R: the pool's type, or float (an int8
// block's rows converted once for its heads).
template <class R>
inline vf key_scores(const R* const* krow, const vf* qv) {
  vf part[W];
#pragma GCC unroll 16
  for (int j = 0; j < W; ++j) {
    vf acc = splat(0.0f);
#pragma GCC unroll 16
    for (int i = 0; i < D / W; ++i) acc += load(krow[j] + i * W) * qv[i];
    part[bitrev(j)] = acc;
  }
  return reduce_lanes(part);
}

// heads whose outputs a decode block's value rows update together: each value row is loaded (and
// converted) once for the group, and the group's D / W accumulators a head are independent chains
constexpr int HG = std::max(1, (W == 16 ? 16 : 8) / (D / W));

// O[g] = O[g] * alpha[g] + sum_j p[g][j] V[j] for NH heads g (O: o, [NH, D]; p: [NH, BK]) over
// keys j < nk in order: per head the same multiply-adds in the same order as one head at a time.
// kI8: V[j] is value row j's int8 times its scale vsc[j], applied to p[g][j] (one product per key)
template <int NH>
inline void accumulate_values(float* o, const float* alpha, const float* p, const KV* const* vrow, int nk,
                              [[maybe_unused]] const float* vsc) {
  vf ov[NH][D / W];
  for (int g = 0; g < NH; ++g)
    for (int i = 0; i < D / W; ++i) ov[g][i] = load(o + g * D + i * W) * alpha[g];
  for (int j = 0; j < nk; ++j) {
    vf v[D / W];
    for (int i = 0; i < D / W; ++i) v[i] = load(vrow[j] + i * W);
#pragma GCC unroll 16
    for (int g = 0; g < NH; ++g) {
      const vf pj = splat(kI8 ? p[g * BK + j] * vsc[j] : p[g * BK + j]);
      for (int i = 0; i < D / W; ++i) ov[g][i] += pj * v[i];
    }
  }
  for (int g = 0; g < NH; ++g)
    for (int i = 0; i < D / W; ++i) store(o + g * D + i * W, ov[g][i]);
}

// accumulate_values for nh <= HG heads, nh known at run time
template <int NH = HG>
inline void accumulate_values_n(int nh, float* o, const float* alpha, const float* p, const KV* const* vrow, int nk,
                                const float* vsc) {
  if constexpr (NH > 1)
    if (nh < NH) return accumulate_values_n<NH - 1>(nh, o, alpha, p, vrow, nk, vsc);
  accumulate_values<NH>(o, alpha, p, vrow, nk, vsc);
}

// a decode row: heads r0 .. r1 - 1 of the item's kv head for the chunk's token it.tok, at position
// q0 (the chunk's first plus tok), which sees keys first_key(q0) .. q0 (all of them from 0 without
// a window); keys in lanes (see the top).
// A block's scores and softmax run head by head, then its values update the heads' outputs HG
// heads at a time.
void run_decode(const Args& a, const Item& it, Scratch& sc) {
  const int G = a.H / a.Hkv, nh = it.r1 - it.r0;
  const int64_t* c = a.chunks + 4 * it.chunk;
  const int64_t q0 = c[1] + it.tok, n_keys = q0 + 1, off = c[3] + it.tok;
  const int32_t* pt = a.pages + c[0] * a.pages_st;
  const KV* kh = a.k + (int64_t)it.kvh * a.pool_tokens * D;
  const KV* vh = a.v + (int64_t)it.kvh * a.pool_tokens * D;
  [[maybe_unused]] const float* ksh = kI8 ? a.ks + (int64_t)it.kvh * a.pool_tokens : nullptr;
  [[maybe_unused]] const float* vsh = kI8 ? a.vs + (int64_t)it.kvh * a.pool_tokens : nullptr;
  const T* q = a.q + off * a.q_st + (int64_t)(it.kvh * G + it.r0) * a.q_sh;
  const float inv_cap = 1.0f / a.softcap;  // (used only when softcap > 0)
  float m[LG * W], l[LG * W], alpha[LG * W];  // per head: the softmax's running max and sum, a block's rescale
  for (int g = 0; g < nh; ++g) softmax_start(a, it.kvh * G + it.r0 + g, m[g], l[g]);
  std::memset(sc.ot, 0, sizeof(float) * nh * D);  // O per head, [nh, D] (unnormalised)
  vf lane;
  for (int i = 0; i < W; ++i) lane[i] = (float)i;
  const KV* krow[BK];
  const KV* vrow[BK];
  [[maybe_unused]] alignas(64) float ksc[BK], vsc[BK];  // kI8: the block's key and value scales
  for (int64_t k0 = first_key(a, q0); k0 < n_keys; k0 += BK) {  // every key of a block is seen
    const int nk = (int)std::min<int64_t>(BK, n_keys - k0), nkt = (nk + W - 1) / W * W;
    key_rows(a, pt, k0, nk, kh, vh, krow, vrow, ksh, vsh, ksc, vsc);
    for (int j = nk; j < nkt; ++j) krow[j] = krow[0], ksc[j] = 0.0f;  // (their scores masked below)
    prefetch_keys(a, pt, k0 + BK, (int)std::min<int64_t>(BK, n_keys - k0 - BK), kh, vh);
    // kI8 with several heads: the block's key rows converted to fp32 once (exactly), which every
    // head's scores then read, not converted again a head (sign-extend and convert cost more than
    // the load they save: with the int8 pages in cache, a conversion a head made int8 the slower)
    [[maybe_unused]] const float* kfrow[BK];
    const bool once = kI8 && nh > 1;
    if constexpr (kI8)
      if (once) {
        for (int j = 0; j < nk; ++j) {
          for (int i = 0; i < D / W; ++i) store(sc.kf + j * D + i * W, load(krow[j] + i * W));
          kfrow[j] = sc.kf + j * D;
        }
        for (int j = nk; j < nkt; ++j) kfrow[j] = kfrow[0];
      }
    for (int g = 0; g < nh; ++g) {
      float* s = sc.pd + g * BK;
      vf qv[D / W];
      for (int i = 0; i < D / W; ++i) qv[i] = load(q + g * a.q_sh + i * W) * a.scale;
      for (int j0 = 0; j0 < nk; j0 += W) {  // scores of keys j0 .. j0 + W - 1, one per lane
        const int n = std::min(W, nk - j0);
        vf sv = once ? key_scores(kfrow + j0, qv) : key_scores(krow + j0, qv);
        if constexpr (kI8) sv *= load(ksc + j0);  // each lane's key row times its scale
        if (a.softcap > 0.0f) sv = vtanh(sv * inv_cap) * a.softcap;
        store(s + j0, lane < splat((float)n) ? sv : splat(-INFINITY));  // lanes past the keys: -inf
      }
      vf mv = load(s);
      for (int j0 = W; j0 < nkt; j0 += W) mv = vmax(mv, load(s + j0));
      float mx = mv[0];
      for (int i = 1; i < W; ++i) mx = std::max(mx, mv[i]);
      const float mnew = std::max(m[g], mx);  // m[g] is finite
      alpha[g] = std::exp(m[g] - mnew);
      m[g] = mnew;
      vf sum = splat(0.0f);
      for (int j0 = 0; j0 < nkt; j0 += W) {
        const vf p = vexp(load(s + j0) - mnew);
        sum += p;
        store(s + j0, p);
      }
      float total = 0.0f;
      for (int i = 0; i < W; ++i) total += sum[i];
      l[g] = l[g] * alpha[g] + total;
    }
    for (int g = 0; g < nh; g += HG)
      accumulate_values_n(std::min(HG, nh - g), sc.ot + g * D, alpha + g, sc.pd + g * BK, vrow, nk, vsc);
  }
  for (int g = 0; g < nh; ++g) {
    T* dst = a.out + (off * a.H + it.kvh * G + it.r0 + g) * D;
    const vf inv = splat(1.0f / l[g]);
    for (int i = 0; i < D / W; ++i) store(dst + i * W, load(sc.ot + g * D + i * W) * inv);
  }
}
