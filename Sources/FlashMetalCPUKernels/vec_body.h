/* Split-KV decode, described once and compiled per ISA (kernels_<isa>.c
 * defines FM_VL and FM_SFX, then includes simd.h and this file).
 *
 * One (kv head, workgroup) item: the gqa query rows sharing a K/V head are
 * processed in blocks of up to 4 rows, so each key and value vector is
 * loaded and converted once (in registers) per block. Scores of a 32-key
 * chunk are exponentiated FM_VL keys per vector. A row's arithmetic does not
 * depend on the others (each (row, key) dot product is one chain over D,
 * whichever block computes it). Scratch (heap, per worker): M, S [gqa],
 * scores [gqa, FM_VEC_CHUNK]; nothing sized by gqa lives on the stack. */
#include <math.h>

#define FM_C FM_VEC_CHUNK

/* Raw dot products of rows [0, NR) with the n keys at kc. KJ keys at a
 * time, so NR * KJ accumulator chains hide the FMA latency (one key at a
 * time, a 2-row group ran on 2 chains: latency-bound). */
static inline __attribute__((always_inline)) void FM_SFX(vec_scores)(
    const float *const qr[4], const void *kc, int32_t dtype, int64_t n, int32_t D, int NR, float *sc) {
    const int KJ = 8 / NR;
    int64_t j = 0;
    for (; j + KJ <= n; j += KJ) {
        fm_v acc[4][8];
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < KJ; t++) acc[r][t] = fm_v_splat(0.0f);
        for (int32_t d = 0; d < D; d += FM_VL) {
            fm_v qv[4];
            for (int r = 0; r < NR; r++) qv[r] = fm_v_load(qr[r] + d);
            for (int t = 0; t < KJ; t++) {
                const fm_v kv = fm_v_load_any(kc, (j + t) * D + d, dtype);
                for (int r = 0; r < NR; r++) acc[r][t] = fm_v_fma(qv[r], kv, acc[r][t]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < KJ; t++) sc[r * FM_C + j + t] = fm_v_sum(acc[r][t]);
    }
    for (; j < n; j++) {
        fm_v acc[4];
        for (int r = 0; r < NR; r++) acc[r] = fm_v_splat(0.0f);
        for (int32_t d = 0; d < D; d += FM_VL) {
            const fm_v kv = fm_v_load_any(kc, j * D + d, dtype);
            for (int r = 0; r < NR; r++) acc[r] = fm_v_fma(fm_v_load(qr[r] + d), kv, acc[r]);
        }
        for (int r = 0; r < NR; r++) sc[r * FM_C + j] = fm_v_sum(acc[r]);
    }
}

/* o[r] = o[r] * f[r] + sum_j p[r][j] v[j] for rows [0, NR): NV vectors of
 * outputs at a time, NR * NV chains (8). */
static inline __attribute__((always_inline)) void FM_SFX(vec_pv)(
    float *const o[4], const float *f, const float *p, const void *vc, int32_t dtype, int64_t n,
    int32_t D, int NR) {
    const int NV = NR >= 4 ? 2 : 4;
    for (int32_t d = 0; d < D; d += NV * FM_VL) {
        fm_v acc[4][4];
        for (int r = 0; r < NR; r++)
            for (int i = 0; i < NV; i++) acc[r][i] = fm_v_load(o[r] + d + i * FM_VL) * f[r];
        for (int64_t j = 0; j < n; j++) {
            fm_v vv[4];
            for (int i = 0; i < NV; i++) vv[i] = fm_v_load_any(vc, j * D + d + i * FM_VL, dtype);
            for (int r = 0; r < NR; r++) {
                const fm_v pj = fm_v_splat(p[r * FM_C + j]);
                for (int i = 0; i < NV; i++) acc[r][i] = fm_v_fma(pj, vv[i], acc[r][i]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int i = 0; i < NV; i++) fm_v_store(o[r] + d + i * FM_VL, acc[r][i]);
    }
}

/* Scale, softcap, the floor, the online softmax of one row over n keys:
 * sc holds raw dots on entry and p (0 past n) on exit. Returns the factor. */
static inline float FM_SFX(vec_softmax)(const FlashAttnVecParams *p, float *sc, int64_t n, float *M,
                                        float *S) {
    float mx = *M;
    for (int64_t j = 0; j < FM_C; j++) {
        float s = -INFINITY;
        if (j < n) {
            s = p->scale * sc[j];
            if (p->softcap > 0) s = p->softcap * tanhf(s / p->softcap);
            s = s < FM_M_INIT ? FM_M_INIT : s;
            if (s > mx) mx = s;
        }
        sc[j] = s;
    }
    const float factor = expf(*M - mx);
    fm_v sum = fm_v_splat(0.0f);
    for (int c = 0; c < FM_C; c += FM_VL) {
        const fm_v pv = fm_v_exp(fm_v_load(sc + c) - mx);
        sum += pv;
        fm_v_store(sc + c, pv);
    }
    *S = *S * factor + fm_v_sum(sum);
    *M = mx;
    return factor;
}

static inline __attribute__((always_inline)) void FM_SFX(vec_block)(
    const FlashAttnVecParams *p, const float *q, const void *kc, const void *vc, int32_t dtype,
    int64_t n, float *tmp, int64_t row0, int64_t wg, float *M, float *S, float *sc, int NR) {
    const int32_t D = (int32_t)p->head_dim;
    const int64_t nwg = p->nwg;
    const float *qr[4];
    float *o[4];
    float f[4];
    for (int r = 0; r < NR; r++) {
        qr[r] = q + (row0 + r) * D;
        o[r] = tmp + ((row0 + r) * nwg + wg) * D;
    }
    FM_SFX(vec_scores)(qr, kc, dtype, n, D, NR, sc);
    for (int r = 0; r < NR; r++) f[r] = FM_SFX(vec_softmax)(p, sc + r * FM_C, n, &M[r], &S[r]);
    FM_SFX(vec_pv)(o, f, sc, vc, dtype, n, D, NR);
}

void FM_SFX(fm_vec_partial_group)(const FlashAttnVecParams *p, const float *q, const void *k,
                                  const void *v, int32_t kv_dtype, float *tmp, int64_t kvrow,
                                  int64_t wg, float *scratch) {
    const int32_t D = (int32_t)p->head_dim;
    const int64_t nrows = p->n_heads, nwg = p->nwg, kv_len = p->kv_seq_len;
    const int64_t gqa = (int64_t)p->n_heads / p->n_kv_heads;
    const int64_t cap = p->kv_capacity;
    const size_t esz = kv_dtype == FM_DTYPE_F32 ? 4 : 2;
    float *M = scratch, *S = M + gqa, *scores = S + gqa;

    /* Visible key range [lo, kv_len). */
    int64_t lo = 0;
    if (p->mask_type == 2) {
        lo = kv_len - (int64_t)p->sliding_window;
        if (lo < 0) lo = 0;
    }
    for (int64_t g = 0; g < gqa; g++) {
        memset(tmp + ((kvrow * gqa + g) * nwg + wg) * D, 0, sizeof(float) * D);
        M[g] = FM_M_INIT;
        S[g] = 0.0f;
    }
    for (int64_t c = wg * FM_C; c < kv_len; c += nwg * FM_C) {
        const int64_t first = c > lo ? c : lo;
        const int64_t end = (c + FM_C) < kv_len ? (c + FM_C) : kv_len;
        if (first >= end) continue;
        const int64_t n = end - first;
        const int64_t off = (kvrow * cap + first) * D;
        const void *kc = (const char *)k + esz * off;
        const void *vc = (const char *)v + esz * off;
        for (int64_t g = 0; g < gqa;) {
            const int64_t left = gqa - g, row0 = kvrow * gqa + g;
            float *sc = scores + g * FM_C;
            if (left >= 4) {
                FM_SFX(vec_block)(p, q, kc, vc, kv_dtype, n, tmp, row0, wg, M + g, S + g, sc, 4);
                g += 4;
            } else if (left >= 2) {
                FM_SFX(vec_block)(p, q, kc, vc, kv_dtype, n, tmp, row0, wg, M + g, S + g, sc, 2);
                g += 2;
            } else {
                FM_SFX(vec_block)(p, q, kc, vc, kv_dtype, n, tmp, row0, wg, M + g, S + g, sc, 1);
                g += 1;
            }
        }
    }
    for (int64_t g = 0; g < gqa; g++) {
        float *sm = tmp + nrows * nwg * D + ((kvrow * gqa + g) * nwg + wg) * 2;
        sm[0] = S[g];
        sm[1] = M[g];
    }
}

#undef FM_C
