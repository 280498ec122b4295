/* Split-KV decode, described once and compiled per ISA (kernels_<isa>.c
 * defines FM_VL and FM_SFX, then includes simd.h and this file).
 *
 * A workgroup takes a contiguous run of keys (vec_split.h; mlx-native's GPU
 * split strided 32-key chunks, which kept the cpu's prefetchers from
 * streaming) for every query row of a kv head's GQA group, so K and V come
 * from memory once per group (row blocks beyond the first re-read a tile
 * from cache). One item is one (kv row, workgroup) when each head's keys are
 * contiguous (fm_vec_item), or one (sequence, workgroup) with all heads
 * tile by tile when the heads of a key are adjacent (fm_vec_item_keys):
 * either way memory is read in order. Keys go in tiles of FM_VT whose row
 * pointers are resolved once (contiguous or through the block table), and
 * every load of a tile's K and V is shadowed by a prefetch of the same
 * bytes of a tile ahead (vec_prefetch_span). The scores of 8 (row, key)
 * pairs fold into one vector by a transposing tree (fm_v_sum8: separate
 * horizontal sums cost as much as the dot products), the softmax runs
 * FM_VL keys per vector, and P.V keeps NV vectors of each output row in
 * registers over the tile. A score's arithmetic depends only on its row and
 * key (one chain over D, whichever block computes it) and tiles start at the
 * workgroup's first key, which depends only on positions: a paged cache
 * gives the bits of a contiguous one, and either item order the same bits.
 * Scratch (heap, per worker): M, S [n_kv_heads * gqa], scores [gqa, FM_VT]. */
#include <math.h>
#include "vec_split.h"

#define FM_VT FM_VEC_TILE

/* Bytes per cached element of dtype (FMDType: f32, or f16/bf16). */
static inline int64_t FM_SFX(vec_esz)(int32_t dtype) { return dtype == FM_DTYPE_F32 ? 4 : 2; }

/* Row pointers of keys [p0, p0 + n) of kv head g of sequence b. */
static inline void FM_SFX(vec_rows)(const FMVecArgs *a, const void *base, const int64_t *st, int64_t b,
                                    int64_t g, int64_t p0, int64_t n, int64_t esz, const char **rp) {
    const char *x = (const char *)base;
    if (!a->block_table) {
        const char *r = x + (b * st[0] + g * st[1] + p0 * st[2]) * esz;
        for (int64_t j = 0; j < n; j++) rp[j] = r + j * st[2] * esz;
        return;
    }
    const int32_t *bt = a->block_table + b * a->max_pages;
    int64_t page = p0 / a->page_size, off = p0 % a->page_size;
    const char *pg = x + ((int64_t)bt[page] * st[0] + g * st[1]) * esz;
    for (int64_t j = 0; j < n; j++, off++) {
        if (off == a->page_size) {
            page++;
            off = 0;
            pg = x + ((int64_t)bt[page] * st[0] + g * st[1]) * esz;
        }
        rp[j] = pg + off * st[2] * esz;
    }
}

/* Software prefetch, issued by the first row block of a tile
 * (vec_block): key j's V row into L1 as its K row is read (P.V reads the
 * tile column-wise; rows of >= 512 bytes only), and a tile ahead into L2
 * as a shadow of this tile's loads: each K or V load of key j prefetches
 * the same bytes of that tile's key j. The hardware prefetchers stop at
 * every 4 KiB page (16 keys of a 16-bit D = 128 row; without software
 * prefetch that case ran at 40% of the read bandwidth), and the shadow
 * keeps a steady stream of requests in flight through the whole tile:
 * prefetching whole rows at the start of each key's K pass, as before,
 * bunched the requests into the K pass and left the memory idle during
 * P.V (measured on two threads: +15-40% at every row size, AVX2 and
 * AVX-512 alike). */
typedef struct {
    const char *const *pv; /* this tile's V rows, or NULL */
    const char *const *nk; /* the K and V rows of the tile ahead, nn of them */
    const char *const *nv;
    int64_t nn;
} FM_SFX(VecPrefetch);

/* Prefetches into L2 the cache lines of row that start in bytes [c0, c1). */
static inline __attribute__((always_inline)) void FM_SFX(vec_prefetch_span)(const char *row, int64_t c0,
                                                                           int64_t c1) {
    for (int64_t c = (c0 + 63) & ~(int64_t)63; c < c1; c += 64) __builtin_prefetch(row + c, 0, 2);
}

/* Key j's FM_VL elements at d (zeros past D), after a prefetch of the same
 * bytes of the tile ahead (the shadow). */
static inline __attribute__((always_inline)) fm_v FM_SFX(vec_load_k)(const FM_SFX(VecPrefetch) *pf,
                                                                    const char *const *kp, int64_t j, int32_t d,
                                                                    int32_t D, int32_t dtype) {
    const int64_t esz = FM_SFX(vec_esz)(dtype);
    if (j < pf->nn) FM_SFX(vec_prefetch_span)(pf->nk[j], d * esz, (d + FM_VL) * esz);
    return D - d >= FM_VL ? fm_v_load_any(kp[j], d, dtype) : fm_v_load_any_n(kp[j], d, D - d, dtype);
}

/* q's FM_VL elements at d, zeros past D. */
static inline __attribute__((always_inline)) fm_v FM_SFX(vec_load_q)(const float *q, int32_t d, int32_t D) {
    return D - d >= FM_VL ? fm_v_load(q + d) : fm_v_load_n(q + d, D - d);
}

static inline __attribute__((always_inline)) void FM_SFX(vec_prefetch_v_row)(const FM_SFX(VecPrefetch) *pf,
                                                                            int64_t j, int64_t rowbytes) {
    if (pf->pv)
        for (int64_t c = 0; c < rowbytes; c += 64) __builtin_prefetch(pf->pv[j] + c);
}

#ifndef FM_VEC_KEYS_SIDE_BY_SIDE
#define FM_VEC_KEYS_SIDE_BY_SIDE 0
#endif
/* acc[r * KJ + t] += q_r . K_(j0 + t) for rows [0, NR) and T keys from j0
 * (T = KJ: the keys side by side; T = 1: one key, acc pointing at its
 * chains), each chain in order over d. On AVX2 a cache line of each row at
 * a time (LE elements, at least a vector), its shadow prefetch issued once
 * per line and key, then the row's tail vector by vector: vec_load_k's
 * per-vector test of which lines start in the vector was a third of the
 * loop's instructions (10-25% of the decode's time on Zen 3, every row
 * size). Elsewhere vector by vector through vec_load_k. */
static inline __attribute__((always_inline)) void FM_SFX(vec_dots)(
    const float *const qr[4], const char *const *kp, const FM_SFX(VecPrefetch) *pf, int32_t dtype, int32_t D,
    int NR, int KJ, int64_t j0, int T, fm_v *acc) {
    const int64_t esz = FM_SFX(vec_esz)(dtype);
    const int32_t LE = 64 / esz > FM_VL ? (int32_t)(64 / esz) : FM_VL;
    int32_t d = 0;
    for (; FM_VEC_KEYS_SIDE_BY_SIDE && d + LE <= D; d += LE) {
        for (int t = 0; t < T; t++)
            if (j0 + t < pf->nn) __builtin_prefetch(pf->nk[j0 + t] + d * esz, 0, 2);
        for (int32_t e = 0; e < LE; e += FM_VL)
            for (int t = 0; t < T; t++) {
                const fm_v kv = fm_v_load_any(kp[j0 + t], d + e, dtype);
                for (int r = 0; r < NR; r++) acc[r * KJ + t] = fm_v_fma(fm_v_load(qr[r] + d + e), kv, acc[r * KJ + t]);
            }
    }
    for (; d < D; d += FM_VL)
        for (int t = 0; t < T; t++) {
            const fm_v kv = FM_SFX(vec_load_k)(pf, kp, j0 + t, d, D, dtype);
            for (int r = 0; r < NR; r++)
                acc[r * KJ + t] = fm_v_fma(FM_SFX(vec_load_q)(qr[r], d, D), kv, acc[r * KJ + t]);
        }
}

/* Raw dot products of rows [0, NR) with the n keys at kp, into sc (row
 * stride FM_VT). KJ = 8 / NR keys form one group whose 8 chains fold into
 * one vector of sums. Each key row is read from start to end before the
 * next and the chains overlap in the out-of-order window; except with
 * FM_VEC_KEYS_SIDE_BY_SIDE (AVX2): there a group's rows under 512 bytes go
 * side by side, so the 8 chains advance together (10-15% faster from
 * cache; on AVX-512 it made no difference, and for longer rows it was
 * 30-50% slower). Either order gives each chain the same sums over d: same
 * bits. */
static inline __attribute__((always_inline)) void FM_SFX(vec_scores)(
    const float *const qr[4], const char *const *kp, const FM_SFX(VecPrefetch) *pf, int32_t dtype, int64_t n,
    int32_t D, int NR, float *sc) {
    const int KJ = 8 / NR;
    const int64_t esz = FM_SFX(vec_esz)(dtype), rowbytes = (int64_t)D * esz;
    int64_t j = 0;
    for (; j + KJ <= n; j += KJ) {
        fm_v acc[8];
        for (int i = 0; i < 8; i++) acc[i] = fm_v_splat(0.0f);
        if (FM_VEC_KEYS_SIDE_BY_SIDE && rowbytes < 512) {
            for (int t = 0; t < KJ; t++) FM_SFX(vec_prefetch_v_row)(pf, j + t, rowbytes);
            FM_SFX(vec_dots)(qr, kp, pf, dtype, D, NR, KJ, j, KJ, acc);
        } else {
            for (int t = 0; t < KJ; t++) {
                FM_SFX(vec_prefetch_v_row)(pf, j + t, rowbytes);
                FM_SFX(vec_dots)(qr, kp, pf, dtype, D, NR, KJ, j + t, 1, acc + t);
            }
        }
        float s8[8];
        fm_v_sum8(acc, s8);
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < KJ; t++) sc[r * FM_VT + j + t] = s8[r * KJ + t];
    }
    for (; j < n; j++) {
        fm_v acc[4];
        FM_SFX(vec_prefetch_v_row)(pf, j, rowbytes);
        for (int r = 0; r < NR; r++) acc[r] = fm_v_splat(0.0f);
        for (int32_t d = 0; d < D; d += FM_VL) {
            const fm_v kv = FM_SFX(vec_load_k)(pf, kp, j, d, D, dtype);
            for (int r = 0; r < NR; r++) acc[r] = fm_v_fma(FM_SFX(vec_load_q)(qr[r], d, D), kv, acc[r]);
        }
        for (int r = 0; r < NR; r++) sc[r * FM_VT + j] = fm_v_sum(acc[r]);
    }
}

/* Scale, softcap, the ALiBi bias (slopes: NR slopes or NULL; key j sits
 * |d0 - j| from the query), the floor, the online softmax of rows [0, NR) over n
 * keys: sc (row stride FM_VT) holds raw dots on entry and p (0 past n, up
 * to a whole vector) on exit; f[r] receives the factor of row r's previous
 * O and S. The rows' horizontal max and sums fold together (fm_v_max8,
 * fm_v_sum8: one tree per row, as fm_v_max/fm_v_sum). */
static inline __attribute__((always_inline)) void FM_SFX(vec_softmax)(const FlashAttnVecParams *p, float *sc,
                                                                     int64_t n, float *M, float *S, float *f,
                                                                     int NR, const float *slopes, int64_t d0) {
    const int64_t nv = (n + FM_VL - 1) / FM_VL * FM_VL;
    fm_vi lane;
    for (int i = 0; i < FM_VL; i++) lane[i] = i;
    fm_v fold[8];
    float mx[8], tot[8];
    for (int r = 0; r < 8; r++) {
        fold[r] = fm_v_splat(r < NR ? M[r] : 0.0f);
        if (r >= NR) continue;
        float *x_r = sc + r * FM_VT;
        if (p->softcap > 0 || slopes) {
            for (int64_t j = 0; j < nv; j++) {
                float s = -INFINITY;
                if (j < n) {
                    s = p->softcap > 0 ? p->softcap * tanhf(p->scale * x_r[j] / p->softcap) : p->scale * x_r[j];
                    if (slopes) s -= slopes[r] * (float)(d0 - j >= 0 ? d0 - j : j - d0);
                    s = s < FM_M_INIT ? FM_M_INIT : s;
                }
                x_r[j] = s;
            }
        }
        for (int64_t c = 0; c < nv; c += FM_VL) {
            fm_v x = fm_v_load(x_r + c);
            if (!(p->softcap > 0) && !slopes) {
                x = x * p->scale;
                x = fm_v_sel(x < FM_M_INIT, fm_v_splat(FM_M_INIT), x);
                x = fm_v_sel(lane + (int32_t)c < (int32_t)n, x, fm_v_splat(-INFINITY));
                fm_v_store(x_r + c, x);
            }
            fold[r] = fm_v_sel(x > fold[r], x, fold[r]); /* NaN never becomes the max */
        }
    }
    fm_v_max8(fold, mx);
    for (int r = 0; r < 8; r++) {
        fold[r] = fm_v_splat(0.0f);
        if (r >= NR) continue;
        float *x_r = sc + r * FM_VT;
        for (int64_t c = 0; c < nv; c += FM_VL) {
            const fm_v pv = fm_v_exp(fm_v_load(x_r + c) - mx[r]);
            fold[r] += pv;
            fm_v_store(x_r + c, pv);
        }
    }
    fm_v_sum8(fold, tot);
    for (int r = 0; r < NR; r++) {
        /* Before the first key nothing was summed (S = 0, O = 0): skip expf's
         * slow underflow path for e^(M_INIT - mx). */
        f[r] = S[r] == 0.0f ? 0.0f : expf(M[r] - mx[r]);
        S[r] = S[r] * f[r] + tot[r];
        M[r] = mx[r];
    }
}

/* o[r] = o[r] * f[r] + sum_j p[r][j] v[j] for rows [0, NR): NV vectors of
 * each row in registers over all n keys (the shadow of earlier tiles
 * brought this tile's V rows into L2, and rows of >= 512 bytes into L1 as
 * their K was read, so reading them column-wise is cheap); its loads
 * shadow the tile ahead's V rows. */
static inline __attribute__((always_inline)) void FM_SFX(vec_pv)(
    float *const o[4], const float *f, const float *pr, const char *const *vp, const FM_SFX(VecPrefetch) *pf,
    int32_t dtype, int64_t n, int32_t D, int NR) {
    const int NV = NR >= 4 ? 2 : 4;
    const int64_t esz = FM_SFX(vec_esz)(dtype);
    int32_t d = 0;
    for (; d + NV * FM_VL <= D; d += NV * FM_VL) {
        fm_v acc[4][4];
        for (int r = 0; r < NR; r++)
            for (int i = 0; i < NV; i++) acc[r][i] = fm_v_load(o[r] + d + i * FM_VL) * f[r];
        for (int64_t t = 0; t < n; t++) {
            if (t < pf->nn) FM_SFX(vec_prefetch_span)(pf->nv[t], d * esz, (d + NV * FM_VL) * esz);
            fm_v vv[4];
            for (int i = 0; i < NV; i++) vv[i] = fm_v_load_any(vp[t], d + i * FM_VL, dtype);
            for (int r = 0; r < NR; r++) {
                const fm_v pj = fm_v_splat(pr[r * FM_VT + t]);
                for (int i = 0; i < NV; i++) acc[r][i] = fm_v_fma(pj, vv[i], acc[r][i]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int i = 0; i < NV; i++) fm_v_store(o[r] + d + i * FM_VL, acc[r][i]);
    }
    for (; d < D; d += FM_VL) {
        /* The row's last vector may be partial (D not a multiple of FM_VL):
         * its lanes past D load zeros and are never stored. */
        const int32_t w = D - d < FM_VL ? D - d : FM_VL;
        fm_v acc[4];
        for (int r = 0; r < NR; r++) acc[r] = (w == FM_VL ? fm_v_load(o[r] + d) : fm_v_load_n(o[r] + d, w)) * f[r];
        for (int64_t t = 0; t < n; t++) {
            if (t < pf->nn) FM_SFX(vec_prefetch_span)(pf->nv[t], d * esz, (d + FM_VL) * esz);
            const fm_v vv = w == FM_VL ? fm_v_load_any(vp[t], d, dtype) : fm_v_load_any_n(vp[t], d, w, dtype);
            for (int r = 0; r < NR; r++) acc[r] = fm_v_fma(fm_v_splat(pr[r * FM_VT + t]), vv, acc[r]);
        }
        for (int r = 0; r < NR; r++) {
            if (w == FM_VL) fm_v_store(o[r] + d, acc[r]);
            else fm_v_store_n(o[r] + d, acc[r], w);
        }
    }
}

/* Rows row0 + r * fm_vec_head_rows, r < NR (ALiBi slopes at `slopes`, or NULL) over one tile
 * of n keys, the first d0 keys before the query; `lead` marks the block that
 * issues the tile's prefetches. */
static inline __attribute__((always_inline)) void FM_SFX(vec_block)(
    const FMVecArgs *a, const char *const *kp, const char *const *vp, int64_t n, const FM_SFX(VecPrefetch) *next,
    int64_t row0, const float *slopes, int lead, int64_t wg, float *M, float *S, float *sc, int NR, int32_t dtype,
    int64_t d0) {
    const int32_t D = (int32_t)a->p.head_dim, Dv = (int32_t)a->p.head_dim_v; /* q/k's, v's */
    const int64_t nwg = a->p.nwg;
    const float *qr[4];
    float *o[4];
    float f[4];
    const int64_t hs = fm_vec_head_rows(a);
    for (int r = 0; r < NR; r++) {
        qr[r] = a->q + (row0 + r * hs) * D;
        o[r] = a->tmp + ((row0 + r * hs) * nwg + wg) * Dv;
    }
    const int long_rows = FM_SFX(vec_esz)(dtype) * D >= 512;
    const FM_SFX(VecPrefetch) pf = {lead && long_rows ? vp : NULL, next->nk, next->nv, lead ? next->nn : 0};
    FM_SFX(vec_scores)(qr, kp, &pf, dtype, n, D, NR, sc);
    FM_SFX(vec_softmax)(&a->p, sc, n, M, S, f, NR, slopes, d0);
    FM_SFX(vec_pv)(o, f, sc, vp, &pf, dtype, n, Dv, NR);
}

/* Every head of a GQA group (rows row + i * fm_vec_head_rows, i < gqa; ALiBi slopes from
 * `slopes` or NULL) over one tile (its first key d0 before the query), in
 * blocks of 4, 2, 1. */
static inline __attribute__((always_inline)) void FM_SFX(vec_tile)(
    const FMVecArgs *a, const char *const *kp, const char *const *vp, int64_t n, const FM_SFX(VecPrefetch) *next,
    int64_t row, const float *slopes, int lead, int64_t wg, float *M, float *S, float *scores, int32_t dtype,
    int64_t d0) {
    const int64_t gqa = (int64_t)a->p.n_heads / a->p.n_kv_heads;
    for (int64_t i = 0; i < gqa;) {
        const int64_t left = gqa - i, row0 = row + i * fm_vec_head_rows(a);
        const float *sl = slopes ? slopes + i : NULL;
        const int ld = lead && i == 0;
        float *sc = scores + i * FM_VT;
        if (left >= 4) {
            FM_SFX(vec_block)(a, kp, vp, n, next, row0, sl, ld, wg, M + i, S + i, sc, 4, dtype, d0);
            i += 4;
        } else if (left >= 2) {
            FM_SFX(vec_block)(a, kp, vp, n, next, row0, sl, ld, wg, M + i, S + i, sc, 2, dtype, d0);
            i += 2;
        } else {
            FM_SFX(vec_block)(a, kp, vp, n, next, row0, sl, ld, wg, M + i, S + i, sc, 1, dtype, d0);
            i += 1;
        }
    }
}

/* Row of head h of query row qi of sequence b (q, tmp and out). */
static inline int64_t FM_SFX(vec_row)(const FMVecArgs *a, int64_t b, int64_t qi, int64_t h) {
    const int64_t L = fm_vec_qrows(a), H = a->p.n_heads;
    return a->head_major ? (b * H + h) * L + qi : (b * L + qi) * H + h;
}

/* Opens the partials of kv head g of sequence b (its GQA rows of every
 * query row; M, S indexed qi * gqa + i) in workgroup wg: O = 0,
 * M = FM_M_INIT, S = 0. */
static void FM_SFX(vec_begin)(const FMVecArgs *a, int64_t b, int64_t g, int64_t wg, float *M, float *S) {
    const int64_t gqa = (int64_t)a->p.n_heads / a->p.n_kv_heads, Dv = a->p.head_dim_v, L = fm_vec_qrows(a);
    for (int64_t qi = 0; qi < L; qi++)
        for (int64_t i = 0; i < gqa; i++) {
            memset(a->tmp + (FM_SFX(vec_row)(a, b, qi, g * gqa + i) * a->p.nwg + wg) * Dv, 0, sizeof(float) * Dv);
            M[qi * gqa + i] = FM_M_INIT;
            S[qi * gqa + i] = 0.0f;
        }
}

/* Closes them: (S, M) into tmp. A workgroup that saw no key writes S = 0
 * (its O is not read). */
static void FM_SFX(vec_end)(const FMVecArgs *a, int64_t b, int64_t g, int64_t wg, const float *M, const float *S) {
    const int64_t gqa = (int64_t)a->p.n_heads / a->p.n_kv_heads, L = fm_vec_qrows(a);
    for (int64_t qi = 0; qi < L; qi++)
        for (int64_t i = 0; i < gqa; i++) {
            float *sm = fm_vec_sm(a, FM_SFX(vec_row)(a, b, qi, g * gqa + i), wg);
            sm[0] = S ? S[qi * gqa + i] : 0.0f;
            sm[1] = M ? M[qi * gqa + i] : FM_M_INIT;
        }
}

/* How far the shadow prefetch runs ahead: one tile, two for rows under 512
 * bytes read head-major (a tile of those is under 16 KiB of K and V, too
 * close behind: two tiles ran 3-25% faster at D = 128 16-bit on AVX2, the
 * same elsewhere). Key-major, a tile spans every head's rows: two tiles
 * ahead ran 5-15% slower there. */
static inline int64_t FM_SFX(vec_ahead)(const FMVecArgs *a) {
    const int short_rows = a->p.head_dim * FM_SFX(vec_esz)(a->kv_dtype) < 512;
    return (short_rows && !fm_vec_key_major(a) ? 2 : 1) * FM_VT;
}

/* Keys [t0, min(t0 + FM_VT, e)) of kv head g of sequence b for that head's
 * GQA rows of every query row, each query row over the part of the tile it
 * sees (a row that sees none of it is left as it was), shadowing the tile
 * ahead. Past the run's end [s, e) the shadow reaches into the next
 * workgroup's keys (still visible, below hi): the worker usually takes that
 * item next. */
static void FM_SFX(vec_head_tile)(const FMVecArgs *a, int64_t b, int64_t g, int64_t wg, int64_t t0, int64_t e,
                                  int64_t hi, float *M, float *S, float *scores) {
    const int64_t esz = FM_SFX(vec_esz)(a->kv_dtype);
    const int64_t n = e - t0 < FM_VT ? e - t0 : FM_VT, t1 = t0 + FM_SFX(vec_ahead)(a);
    const int64_t nn = hi - t1 <= 0 ? 0 : hi - t1 < FM_VT ? hi - t1 : FM_VT;
    const char *rows[2][FM_VT], *shadow[2][FM_VT];
    FM_SFX(vec_rows)(a, a->k, a->k_strides, b, g, t0, n, esz, rows[0]);
    FM_SFX(vec_rows)(a, a->v, a->v_strides, b, g, t0, n, esz, rows[1]);
    if (nn) {
        FM_SFX(vec_rows)(a, a->k, a->k_strides, b, g, t1, nn, esz, shadow[0]);
        FM_SFX(vec_rows)(a, a->v, a->v_strides, b, g, t1, nn, esz, shadow[1]);
    }
    const FM_SFX(VecPrefetch) next = {NULL, shadow[0], shadow[1], nn};
    const int64_t gqa = (int64_t)a->p.n_heads / a->p.n_kv_heads, L = fm_vec_qrows(a);
    const int64_t len = a->seqlens ? (int64_t)a->seqlens[b] : (int64_t)a->p.kv_seq_len;
    for (int64_t qi = 0; qi < L; qi++) {
        int64_t lo_r, hi_r;
        fm_vec_row_visible(a, b, qi, &lo_r, &hi_r);
        const int64_t j0 = lo_r > t0 ? lo_r - t0 : 0, j1 = hi_r - t0 < n ? hi_r - t0 : n;
        if (j1 <= j0) continue;
        const char *const *kp = rows[0] + j0, *const *vp = rows[1] + j0;
        const int64_t d0 = len - L + qi - (t0 + j0); /* the query sits at len - L + qi */
        const int64_t row = FM_SFX(vec_row)(a, b, qi, g * gqa);
        const float *slopes = a->alibi ? a->alibi + b * (int64_t)a->p.n_heads + g * gqa : NULL;
        float *m = M + qi * gqa, *s = S + qi * gqa;
        const int lead = qi == 0;
        switch (a->kv_dtype) { /* constant inside: the loads specialise */
        case FM_DTYPE_F32:
            FM_SFX(vec_tile)(a, kp, vp, j1 - j0, &next, row, slopes, lead, wg, m, s, scores, FM_DTYPE_F32, d0);
            break;
        case FM_DTYPE_F16:
            FM_SFX(vec_tile)(a, kp, vp, j1 - j0, &next, row, slopes, lead, wg, m, s, scores, FM_DTYPE_F16, d0);
            break;
        default:
            FM_SFX(vec_tile)(a, kp, vp, j1 - j0, &next, row, slopes, lead, wg, m, s, scores, FM_DTYPE_BF16, d0);
            break;
        }
    }
}

/* Head-major: one kv head's run of keys, tile after tile (each head's keys
 * are contiguous: the plain decode's [(B,) Hkv, cap, D]). */
void FM_SFX(fm_vec_item)(const FMVecArgs *a, int64_t kvrow, int64_t wg, float *scratch) {
    const int64_t hkv = a->p.n_kv_heads, rows = (int64_t)a->p.n_heads / hkv * fm_vec_qrows(a);
    const int64_t b = kvrow / hkv, g = kvrow % hkv;
    int64_t lo, hi, s, e;
    fm_vec_visible(a, b, &lo, &hi);
    fm_vec_wg_keys(lo, hi, a->p.nwg, wg, &s, &e);
    if (s >= e) {
        FM_SFX(vec_end)(a, b, g, wg, NULL, NULL);
        return;
    }
    float *M = scratch, *S = M + rows, *scores = S + rows;
    FM_SFX(vec_begin)(a, b, g, wg, M, S);
    for (int64_t t0 = s; t0 < e; t0 += FM_VT) FM_SFX(vec_head_tile)(a, b, g, wg, t0, e, hi, M, S, scores);
    FM_SFX(vec_end)(a, b, g, wg, M, S);
}

/* Key-major: every kv head of sequence b over the workgroup's run, a tile
 * of keys at a time and all heads within it, for caches whose heads of one
 * key are adjacent (flash-attn's [B, cap, Hkv, D] and its pages): the run
 * is then read front to back. Head by head, each pass read 1/Hkv of every
 * key's bytes at an Hkv-row stride: two threads, Hkv = 8, D = 128, it
 * decoded at 8.5-16 GB/s against 23-47 for the same keys laid out
 * head-major; a tile at a time, at 75-80% of head-major (a head's rows
 * still sit a power-of-two stride apart). Same arithmetic per (row,
 * workgroup) as head-major: same bits. Scratch: M, S of every row of the
 * sequence, then the scores. */
void FM_SFX(fm_vec_item_keys)(const FMVecArgs *a, int64_t b, int64_t wg, float *scratch) {
    const int64_t hkv = a->p.n_kv_heads, rows = (int64_t)a->p.n_heads / hkv * fm_vec_qrows(a);
    int64_t lo, hi, s, e;
    fm_vec_visible(a, b, &lo, &hi);
    fm_vec_wg_keys(lo, hi, a->p.nwg, wg, &s, &e);
    if (s >= e) {
        for (int64_t g = 0; g < hkv; g++) FM_SFX(vec_end)(a, b, g, wg, NULL, NULL);
        return;
    }
    float *M = scratch, *S = M + hkv * rows, *scores = S + hkv * rows;
    for (int64_t g = 0; g < hkv; g++) FM_SFX(vec_begin)(a, b, g, wg, M + g * rows, S + g * rows);
    for (int64_t t0 = s; t0 < e; t0 += FM_VT)
        for (int64_t g = 0; g < hkv; g++)
            FM_SFX(vec_head_tile)(a, b, g, wg, t0, e, hi, M + g * rows, S + g * rows, scores);
    for (int64_t g = 0; g < hkv; g++) FM_SFX(vec_end)(a, b, g, wg, M + g * rows, S + g * rows);
}

#undef FM_VT
