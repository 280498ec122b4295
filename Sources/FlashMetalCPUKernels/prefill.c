/* Prefill on the cpu: one query tile at a time, online softmax over key
 * tiles of the dispatch's BK, never more than O(BQ*D + BK*D) memory.
 *
 * Numerics (docs/ARCHITECTURE.md): s = scale*q.k, softcap, the ALiBi bias
 * -slope*|t - p| (with slopes), then the mask; the running
 * max starts at FM_M_INIT = -FLT_MAX/2 so -inf scores give exp(-inf) = 0 and
 * never NaN; a row with no visible key outputs exact zeros. A masked cell
 * (mask -inf, bool false, causal) is -inf; any other cell's score is raised
 * to FM_M_INIT when below it (NaN kept), so a row that sees only keys with a
 * huge finite negative bias (finfo(bf16).min) averages them, as the
 * reference does. Every ISA path applies the same rule. Each row's arithmetic is
 * independent of the other rows of its tile, and a key tile in which a row
 * sees nothing contributes exactly nothing (factor exp(0) = 1, p = 0), so
 * skipping such tiles (blk class 0, causal) leaves the output bit-identical
 * and a resumed chunk matches the one-shot rows bit for bit. The keys a row
 * sees (its sequence's length, causal, window) are one range (prefill_seq.h):
 * the tile loop spans the union of its rows' ranges. */
#include <float.h>
#include <math.h>
#include "fm_cpu_kernels.h"
#include "half_convert.h"
#include "kernel_math.h"
#include "prefill_seq.h"

size_t fm_cpu_prefill_scratch_floats(int32_t bq, int32_t bk, int32_t d) {
    /* Qtile, Otile, K tile, V tile (rows of d = max(D, Dv) floats), scores, m, l */
    return (size_t)bq * d * 2 + (size_t)bk * d * 2 + (size_t)bk + (size_t)bq * 2;
}

static float fm_load_mask(const FMPrefillArgs *a, const void *row, int64_t col) {
    if (a->mask_kind == FM_MASK_BOOL) return ((const uint8_t *)row)[col] ? 0.0f : -INFINITY;
    if (a->io_dtype == FM_DTYPE_F32) return ((const float *)row)[col];
    uint16_t h = ((const uint16_t *)row)[col];
    return a->io_dtype == FM_DTYPE_BF16 ? fm_bf16_to_f32(h) : fm_f16_to_f32(h);
}

/* A row of the I/O dtype (f32, bf16 or f16) as floats. */
static void fm_pf_load_row(const FMPrefillArgs *a, float *dst, const char *src, int32_t n) {
    if (a->io_dtype == FM_DTYPE_F32) {
        for (int32_t i = 0; i < n; i++) dst[i] = ((const float *)src)[i];
    } else {
        fm_load_row(dst, (const uint16_t *)src, n, a->io_dtype == FM_DTYPE_BF16);
    }
}

int64_t fm_cpu_prefill_seq_rows(const FMPrefillArgs *a, int64_t b) { return fm_pf_seq_dims(a, b).qL; }

int64_t fm_cpu_prefill_rows_keys(const FMPrefillArgs *a, int64_t b, int64_t r0, int64_t n) {
    const FMPfSeqDims sd = fm_pf_seq_dims(a, b);
    if (r0 + n > sd.qL) n = sd.qL - r0;
    if (n <= 0) return 0;
    /* lo and hi grow with t: the union spans the first row's lo to the last's hi. */
    int64_t lo, hi, lo2, hi2;
    fm_pf_row_keys(a, sd.t0 + r0, &sd, &lo, &hi);
    fm_pf_row_keys(a, sd.t0 + r0 + n - 1, &sd, &lo2, &hi2);
    return hi2 >= lo ? hi2 - lo + 1 : 0;
}

void fm_cpu_prefill_tile(const FMPrefillArgs *a, int64_t b, int64_t h, int64_t qtile,
                         float *scratch) {
    const AttnParams *p = &a->p;
    /* Q and K rows hold D values, V and O rows Dv (v's head dim); every
     * scratch row is W = max(D, Dv) floats apart. */
    const int32_t D = p->D, Dv = p->Dv, W = D > Dv ? D : Dv, bq = a->bq, bk = a->bk;
    const FMPfSeqDims sd = fm_pf_seq_dims(a, b);
    const int64_t r0 = qtile * bq;
    if (r0 >= sd.qL) return;
    const int64_t nrows = (sd.qL - r0) < bq ? (sd.qL - r0) : bq;
    const int64_t kvh = h / p->gqa_factor;
    const int is_bf16 = a->io_dtype == FM_DTYPE_BF16;
    const float softcap = p->softcapping;
    const float slope = fm_pf_alibi_slope(a, b, h);
    const size_t esz = a->io_dtype == FM_DTYPE_F32 ? 4 : 2;

    float *Qt = scratch;
    float *Ot = Qt + (size_t)bq * W;
    float *Kt = Ot + (size_t)bq * W;
    float *Vt = Kt + (size_t)bk * W;
    float *S = Vt + (size_t)bk * W;
    float *M = S + bk;
    float *L = M + bq;

    const char *q = (const char *)a->q, *k = (const char *)a->k, *v = (const char *)a->v;
    const size_t msz = a->mask_kind == FM_MASK_BOOL ? 1 : esz;
    const char *mbase = a->mask_kind == FM_MASK_NONE ? NULL
        : (const char *)a->mask + msz * (b * a->mp.M_strides[0] + h * a->mp.M_strides[1]);

    /* The keys of the tile: the union of its rows' ranges (they grow with t). */
    int64_t first_lo, first_hi, last_lo, last_hi;
    fm_pf_row_keys(a, sd.t0 + r0, &sd, &first_lo, &first_hi);
    fm_pf_row_keys(a, sd.t0 + r0 + nrows - 1, &sd, &last_lo, &last_hi);
    for (int64_t r = 0; r < nrows; r++) {
        fm_pf_load_row(a, Qt + r * W, q + esz * fm_pf_row_offset(&sd, b, h, r0 + r, p->Q_strides), D);
        for (int32_t d = 0; d < Dv; d++) Ot[r * W + d] = 0.0f;
        M[r] = FM_M_INIT;
        L[r] = 0.0f;
    }

    const int64_t nk = (sd.kL + bk - 1) / bk;
    const int64_t kt_hi = last_hi < 0 ? -1 : last_hi / bk;
    for (int64_t kt = first_lo / bk; kt <= kt_hi && kt < nk; kt++) {
        const int64_t c0 = kt * bk;
        int skip_mask = 0;
        if (a->blk) {
            uint8_t cls = a->blk[qtile * p->NK + kt];
            if (cls == 0) continue;
            skip_mask = cls == 2;
        }
        const int64_t kc = (sd.kL - c0) < bk ? (sd.kL - c0) : bk;
        for (int64_t j = 0; j < kc; j++) {
            fm_pf_load_row(a, Kt + j * W,
                           k + esz * fm_pf_key_offset(a, b, kvh, c0 + j, p->K_strides, a->seq.sp.K_page_stride), D);
            fm_pf_load_row(a, Vt + j * W,
                           v + esz * fm_pf_key_offset(a, b, kvh, c0 + j, p->V_strides, a->seq.sp.V_page_stride), Dv);
        }
        for (int64_t r = 0; r < nrows; r++) {
            int64_t lo, hi;
            fm_pf_row_keys(a, sd.t0 + r0 + r, &sd, &lo, &hi);
            const void *mrow = mbase ? mbase + msz * (r0 + r) * a->mp.M_strides[2] : NULL;
            float mx = M[r];
            for (int64_t j = 0; j < kc; j++) {
                float s = p->scale * fm_dot(Qt + r * W, Kt + j * W, D);
                if (softcap > 0) s = softcap * tanhf(s / softcap);
                if (a->seq.alibi) s += fm_pf_alibi_bias(slope, sd.t0 + r0 + r, c0 + j);
                int masked = c0 + j < lo || c0 + j > hi;
                if (mrow && !skip_mask) {
                    const float m = fm_load_mask(a, mrow, c0 + j);
                    if (m == -INFINITY) masked = 1;
                    else s += m;
                }
                s = masked ? -INFINITY : (s < FM_M_INIT ? FM_M_INIT : s);
                S[j] = s;
                if (s > mx) mx = s;
            }
            const float factor = expf(M[r] - mx);
            float l = L[r] * factor;
            float *o = Ot + r * W;
            for (int32_t d = 0; d < Dv; d++) o[d] *= factor;
            for (int64_t j = 0; j < kc; j++) {
                const float pj = expf(S[j] - mx);
                l += pj;
                const float *vj = Vt + j * W;
                for (int32_t d = 0; d < Dv; d++) o[d] += pj * vj[d];
            }
            M[r] = mx;
            L[r] = l;
        }
    }

    for (int64_t r = 0; r < nrows; r++) {
        float lse;
        const float inv = fm_pf_finish_row(a, h, M[r], L[r], L[r], &lse);
        fm_pf_store_lse(a, &sd, b, h, r0 + r, lse);
        char *row = (char *)a->o + esz * fm_pf_row_offset(&sd, b, h, r0 + r, p->O_strides);
        uint16_t *dst = (uint16_t *)row;
        const float *o = Ot + r * W;
        if (a->io_dtype == FM_DTYPE_F32) {
            for (int32_t d = 0; d < Dv; d++) ((float *)row)[d] = o[d] * inv;
        } else if (is_bf16) {
            for (int32_t d = 0; d < Dv; d++) dst[d] = fm_f32_to_bf16(o[d] * inv);
        } else {
            for (int32_t d = 0; d < Dv; d++) dst[d] = fm_f32_to_f16(o[d] * inv);
        }
    }
}
