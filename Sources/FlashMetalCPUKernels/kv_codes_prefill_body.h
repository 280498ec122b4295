/* The prefill over quantized caches (kv_codec.c, fm_cpu_kv_codes_prefill_items),
 * compiled once per ISA after kv_codes_body.h (whose row unpacking it uses):
 * the including file defines FM_SFX, FM_VL and the target, and FM_PF_R /
 * FM_PF_NC where the ISA has a prefill register block.
 *
 * A work item is up to FM_CPU_KVQ_PREFILL_ITEMS (query row, head) items of
 * one kv head. Keys go in tiles of FM_KVQ_PREFILL_KEYS starting at absolute
 * multiples of it; each tile's K and V rows are decoded once into float rows
 * (centroid * block norm, the rotated basis) and every item reads them
 * through register-blocked kernels:
 *   scores S^T [keys][items] = K tile . Q panel: R keys (broadcast) x NC
 *     vectors of items, the queries packed once per work item into panels
 *     [items / CW][D][CW] (rotated with K's signs and Hadamard blocks, the
 *     scale and 1/n folded in);
 *   the online softmax runs down each item's column, FM_VL items per
 *     vector: masks, max, one vector exp per (key, FM_VL items);
 *   O [items][D] += P . V tile: R items (broadcast p) x NC vectors of D,
 *     over the keys some item of the R sees.
 * A row's result depends only on its own keys (absolute tiles, per-lane
 * softmax, p = 0 adds +0), not on the other items of its work item. Keys an
 * item does not see never reach it: their scores are replaced by -inf, and
 * when a tile's V holds a non-finite value (a dense V row, or a norm) each
 * item accumulates only its own keys of that tile. */
#include <math.h>
#include <string.h>

#include "fm_kv_codec.h"
#include "kv_codes_keys.h"

#ifdef FM_PF_R
#define KQ_R FM_PF_R
#define KQ_NC FM_PF_NC
#else
#define KQ_R 4
#define KQ_NC 2
#endif
#define KQ_CW (KQ_NC * FM_VL)
#define KQ_M FM_CPU_KVQ_PREFILL_ITEMS
#define KQ_TK FM_KVQ_PREFILL_KEYS

_Static_assert(FM_CPU_KVQ_PREFILL_STEP % KQ_CW == 0 && KQ_M % KQ_CW == 0, "work items are whole column blocks");
_Static_assert(KQ_R <= FM_KVQ_PREFILL_PAD, "the tiles' padding holds a register block");

/* ST[r][0..CW) = Kt[r] . Qb[.][0..CW) for R key rows of Kt (stride kd; ST's
 * stride ms): one column block of items over the head dim d. */
static inline void FM_SFX(kvq_pf_qk)(const float *Kt, int32_t kd, const float *Qb, int32_t d, int32_t ms,
                                     float *ST) {
    fm_v acc[KQ_R][KQ_NC];
    for (int r = 0; r < KQ_R; r++)
        for (int c = 0; c < KQ_NC; c++) acc[r][c] = fm_v_splat(0.0f);
    for (int32_t i = 0; i < d; i++) {
        fm_v q[KQ_NC];
        for (int c = 0; c < KQ_NC; c++) q[c] = fm_v_load(Qb + (size_t)i * KQ_CW + c * FM_VL);
        for (int r = 0; r < KQ_R; r++) {
            const fm_v kb = fm_v_splat(Kt[(size_t)r * kd + i]);
            for (int c = 0; c < KQ_NC; c++) acc[r][c] = fm_v_fma(kb, q[c], acc[r][c]);
        }
    }
    for (int r = 0; r < KQ_R; r++)
        for (int c = 0; c < KQ_NC; c++) fm_v_store(ST + (size_t)r * ms + c * FM_VL, acc[r][c]);
}

/* Columns [dc, dc + nv * FM_VL) of O[r] = O[r] * F[r] + sum_t P[t][r] V[t]
 * for R items (P = PT + item, stride ms; O rows of stride d; V rows of
 * stride kd) over the
 * tile's keys [ta, tb). `nv` must be a constant after inlining. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_pf_pv_cols)(const float *PT, int32_t ms,
                                                                          const float *Vt, int32_t kd, int32_t d,
                                                                          int32_t ta, int32_t tb,
                                                                          const float *F, float *O, int32_t dc,
                                                                          const int nv) {
    fm_v acc[KQ_R][KQ_NC];
    for (int r = 0; r < KQ_R; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = fm_v_load(O + (size_t)r * d + dc + i * FM_VL) * F[r];
    for (int32_t t = ta; t < tb; t++) {
        fm_v v[KQ_NC];
        for (int i = 0; i < nv; i++) v[i] = fm_v_load(Vt + (size_t)t * kd + dc + i * FM_VL);
        for (int r = 0; r < KQ_R; r++) {
            const fm_v pb = fm_v_splat(PT[(size_t)t * ms + r]);
            for (int i = 0; i < nv; i++) acc[r][i] = fm_v_fma(pb, v[i], acc[r][i]);
        }
    }
    for (int r = 0; r < KQ_R; r++)
        for (int i = 0; i < nv; i++) fm_v_store(O + (size_t)r * d + dc + i * FM_VL, acc[r][i]);
}

/* kvq_pf_pv_cols over every column of D: NC vectors while they fit, then
 * the tail (D = 80, 96 or 192 on wide vectors) with fewer. */
static void FM_SFX(kvq_pf_pv)(const float *PT, int32_t ms, const float *Vt, int32_t kd, int32_t d, int32_t ta,
                              int32_t tb, const float *F, float *O) {
    int32_t dc = 0;
    for (; dc + KQ_CW <= d; dc += KQ_CW) FM_SFX(kvq_pf_pv_cols)(PT, ms, Vt, kd, d, ta, tb, F, O, dc, KQ_NC);
    const int rem = (d - dc) / FM_VL;
    if (KQ_NC > 1 && rem == 1) FM_SFX(kvq_pf_pv_cols)(PT, ms, Vt, kd, d, ta, tb, F, O, dc, 1);
    if (KQ_NC > 2 && rem == 2) FM_SFX(kvq_pf_pv_cols)(PT, ms, Vt, kd, d, ta, tb, F, O, dc, 2);
    if (KQ_NC > 3 && rem == 3) FM_SFX(kvq_pf_pv_cols)(PT, ms, Vt, kd, d, ta, tb, F, O, dc, 3);
}

/* One K or V row of storage row r as floats in the rotated basis: codes as
 * centroid * block norm (n-wide blocks), a dense row as stored. Returns 0
 * when a value may be non-finite (a dense row's value, a norm). */
static inline int FM_SFX(kvq_pf_row)(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a,
                                     const FMKVQTables *tab, int64_t r, int v_side, float *out) {
    const int32_t d = p->head_dim, n = p->block, nb = d / n;
    const void *dense = v_side ? a->v_dense : a->k_dense;
    if (dense != NULL) {
        FM_SFX(kvq_load_dense)(out, dense, a->dense_dtype, r, d);
        if (!v_side) return 1;
        fm_vi bad = (fm_vi)0;
        for (int32_t i = 0; i < d; i += FM_VL) {
            const fm_v x = fm_v_load(out + i);
            bad |= ~((x - x) == fm_v_splat(0.0f));
        }
        for (int i = 0; i < FM_VL; i++)
            if (bad[i]) return 0;
        return 1;
    }
    const uint8_t *codes = v_side ? a->v_codes + r * p->v_row_bytes : a->k_codes + r * p->k_row_bytes;
    const float *norms = (v_side ? a->v_norms : a->k_norms) + r * nb;
    FM_SFX(kvq_row)(codes, d, v_side ? p->v_bits : p->k_bits, tab, out);
    int finite = 1;
    for (int32_t blk = 0; blk < nb; blk++) {
        const float rn = norms[blk];
        finite &= isfinite(rn) != 0;
        const fm_v s = fm_v_splat(rn);
        for (int32_t i = blk * n; i < (blk + 1) * n; i += FM_VL) fm_v_store(out + i, fm_v_load(out + i) * s);
    }
    return finite;
}

void FM_SFX(fm_kvq_prefill)(const FMKVQKeys *k) {
    const KVCodesDecodeParams *p = k->p;
    const FMCPUKVCodesAttnArgs *a = k->a;
    const int32_t d = p->head_dim, count = k->heads;
    /* Column blocks of items; the score tile's rows hold them and room for
     * a last group of R items past them. */
    const int32_t ncb = (count + KQ_CW - 1) / KQ_CW, mc = ncb * KQ_CW, ms = mc + FM_KVQ_PREFILL_PAD;
    const float unit = (a->k_dense != NULL ? 1.0f : 1.0f / (float)p->block) * p->scale;
    const float softcap = p->softcap;
    float *Qp = k->scratch;                      /* [M / CW][D][CW] */
    const int32_t kd = d + FM_KVQ_PREFILL_SKEW;
    float *Kt = Qp + (size_t)KQ_M * d;           /* [TK + PAD][kd] */
    float *Vt = Kt + (size_t)(KQ_TK + FM_KVQ_PREFILL_PAD) * kd; /* [TK][kd] */
    float *ST = Vt + (size_t)KQ_TK * kd;         /* [TK + PAD][ms]: scores, then p */
    float *O = k->acc;                           /* [count + PAD][D], zero on entry */
    enum { MS_MAX = KQ_M + FM_KVQ_PREFILL_PAD };
    float m[MS_MAX] __attribute__((aligned(64))), l[MS_MAX] __attribute__((aligned(64)));
    float F[MS_MAX] __attribute__((aligned(64)));
    int32_t lo[MS_MAX] __attribute__((aligned(64))), hi[MS_MAX] __attribute__((aligned(64)));
    float slope[MS_MAX] __attribute__((aligned(64)));
    int32_t pos[MS_MAX] __attribute__((aligned(64)));
    int64_t rows[KQ_TK];
    for (int32_t s = 0; s < ms; s++) {
        const int real = s < count;
        m[s] = real ? k->mx[s] : FM_RUNNING_MAX_START;
        l[s] = real ? k->sum[s] : 0.0f;
        F[s] = 1.0f;
        lo[s] = real ? k->lo[s] : 0;
        hi[s] = real ? k->hi[s] : 0;
        slope[s] = real && k->slopes != NULL ? k->slopes[s] : 0.0f;
        pos[s] = real && k->pos != NULL ? k->pos[s] : 0;
    }
    for (int32_t s = 0; s < mc; s++) {
        float *col = Qp + (size_t)(s / KQ_CW) * KQ_CW * d + s % KQ_CW;
        for (int32_t i = 0; i < d; i++) col[(size_t)i * KQ_CW] = s < count ? k->qz[(size_t)s * d + i] * unit : 0.0f;
    }
    memset(Kt, 0, sizeof(float) * (KQ_TK + FM_KVQ_PREFILL_PAD) * kd);
    memset(ST, 0, sizeof(float) * (KQ_TK + FM_KVQ_PREFILL_PAD) * ms);

    for (int32_t t0 = k->start - k->start % KQ_TK; t0 < k->end; t0 += KQ_TK) {
        const int32_t nt = k->end - t0 < KQ_TK ? k->end - t0 : KQ_TK;
        /* Every item's keys of the tile, [ta, tb) relative to t0, and
         * whether all of them see all of it. */
        int all = 1;
        for (int32_t s = 0; s < count; s++) all &= lo[s] <= t0 && hi[s] >= t0 + nt;
        const int32_t t_first = k->start > t0 ? k->start - t0 : 0;
        int v_finite = 1;
        for (int32_t t = t_first; t < nt; t++) {
            /* A kv head's rows sit Hkv rows apart in flash-attn's layout, a
             * stride the hardware prefetcher does not follow. */
            if (t0 + t + FM_KVQ_PREFILL_AHEAD < k->end)
                fm_kvq_prefetch_row(p, a, fm_kvq_row(p, a, k->b, k->g, t0 + t + FM_KVQ_PREFILL_AHEAD));
            rows[t] = fm_kvq_row(p, a, k->b, k->g, t0 + t);
            FM_SFX(kvq_pf_row)(p, a, k->tables, rows[t], 0, Kt + (size_t)t * kd);
        }
        for (int32_t t = t_first; t < nt; t++)
            v_finite &= FM_SFX(kvq_pf_row)(p, a, k->tables, rows[t], 1, Vt + (size_t)t * kd);

        /* Scores of the tile's keys (R at a time) for every column block. */
        for (int32_t r0 = t_first - t_first % KQ_R; r0 < nt; r0 += KQ_R)
            for (int32_t cb = 0; cb < ncb; cb++)
                FM_SFX(kvq_pf_qk)(Kt + (size_t)r0 * kd, kd, Qp + (size_t)cb * KQ_CW * d, d, ms,
                                  ST + (size_t)r0 * ms + cb * KQ_CW);

        /* The online softmax down each item's column, FM_VL items at once. */
        for (int32_t c = 0; c < mc; c += FM_VL) {
            fm_vi lv, hv;
            memcpy(&lv, lo + c, sizeof lv);
            memcpy(&hv, hi + c, sizeof hv);
            fm_v sv = fm_v_splat(0.0f);
            fm_vi pv = (fm_vi)0;
            if (k->slopes != NULL) {
                sv = fm_v_load(slope + c);
                memcpy(&pv, pos + c, sizeof pv);
            }
            const fm_v m_old = fm_v_load(m + c);
            fm_v mv = m_old;
            for (int32_t t = t_first; t < nt; t++) {
                float *st = ST + (size_t)t * ms + c;
                fm_v s = fm_v_load(st);
                if (softcap > 0.0f) {
                    for (int i = 0; i < FM_VL; i++) s[i] = softcap * tanhf(s[i] / softcap);
                }
                const fm_vi key = (fm_vi)(t0 + t);
                if (k->slopes != NULL) {
                    /* ALiBi: -slope * |pos - key| per item. */
                    const fm_v dist = __builtin_convertvector(pv - key, fm_v);
                    s -= sv * fm_v_max2(dist, -dist);
                }
                if (!all) s = fm_v_sel((key < lv) | (key >= hv), fm_v_splat(-INFINITY), s);
                if (softcap > 0.0f || k->slopes != NULL || !all) fm_v_store(st, s);
                mv = fm_v_sel(s > mv, s, mv);
            }
            const fm_v fac = fm_v_exp(m_old - mv);
            fm_v sum = fm_v_splat(0.0f);
            for (int32_t t = t_first; t < nt; t++) {
                float *st = ST + (size_t)t * ms + c;
                const fm_v pv = fm_v_exp(fm_v_load(st) - mv);
                fm_v_store(st, pv);
                sum += pv;
            }
            fm_v_store(l + c, fm_v_load(l + c) * fac + sum);
            fm_v_store(m + c, mv);
            fm_v_store(F + c, fac);
        }

        /* O += P.V, R items at a time, over the keys any of them sees. */
        for (int32_t g0 = 0; g0 < count; g0 += KQ_R) {
            int32_t ta = nt, tb = t_first;
            for (int32_t s = g0; s < g0 + KQ_R && s < count; s++) {
                const int32_t a0 = lo[s] - t0 < t_first ? t_first : (lo[s] - t0 > nt ? nt : lo[s] - t0);
                const int32_t b0 = hi[s] - t0 > nt ? nt : (hi[s] - t0 < a0 ? a0 : hi[s] - t0);
                if (a0 < b0 && a0 < ta) ta = a0;
                if (a0 < b0 && b0 > tb) tb = b0;
            }
            if (ta >= tb) continue; /* none of them sees the tile: factor 1, nothing added */
            if (v_finite) {
                FM_SFX(kvq_pf_pv)(ST + g0, ms, Vt, kd, d, ta, tb, F + g0, O + (size_t)g0 * d);
                continue;
            }
            /* A non-finite V value: each item adds only its own keys. */
            for (int32_t s = g0; s < g0 + KQ_R && s < count; s++) {
                float *o = O + (size_t)s * d;
                for (int32_t i = 0; i < d; i++) o[i] *= F[s];
                const int32_t a0 = lo[s] - t0 < t_first ? t_first : (lo[s] - t0 > nt ? nt : lo[s] - t0);
                const int32_t b0 = hi[s] - t0 > nt ? nt : (hi[s] - t0 < a0 ? a0 : hi[s] - t0);
                for (int32_t t = a0; t < b0; t++) {
                    const fm_v w = fm_v_splat(ST[(size_t)t * ms + s]);
                    for (int32_t i = 0; i < d; i += FM_VL)
                        fm_v_store(o + i, fm_v_fma(w, fm_v_load(Vt + (size_t)t * kd + i), fm_v_load(o + i)));
                }
            }
        }
    }
    for (int32_t s = 0; s < count; s++) {
        k->mx[s] = m[s];
        k->sum[s] = l[s];
    }
}

#undef KQ_R
#undef KQ_NC
#undef KQ_CW
#undef KQ_M
#undef KQ_TK
