/* Split-KV decode on the cpu (seeds 002, 004), following the GPU design:
 * workgroup wg of NWG takes the key chunks [c, c + 32) with c = wg*32,
 * wg*32 + NWG*32, ... and writes its partial (O unnormalised, S, M) to tmp;
 * the reduce then rescales the partials by exp(M_w - M) and normalises.
 *
 * tmp layout: partial outputs [nrows, nwg, D], then (S, M) pairs [nrows, nwg, 2].
 * The query sits at position kv_len - 1: causal sees every valid key,
 * a sliding window w sees keys p with (kv_len - 1) - p < w. */
#include <float.h>
#include <math.h>
#include <string.h>
#include "fm_cpu_kernels.h"
#include "half_convert.h"

#define FM_M_INIT (-FLT_MAX / 2)
#define FM_C 32
#define FM_LANES 16

size_t fm_cpu_vec_scratch_floats(int32_t d) { return (size_t)d * 2; }

static float vec_dot(const float *a, const float *b, int32_t n) {
    float acc[FM_LANES] = {0};
    int32_t i = 0;
    for (; i + FM_LANES <= n; i += FM_LANES)
        for (int j = 0; j < FM_LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[0] += a[i] * b[i];
    float s = 0;
    for (int j = 0; j < FM_LANES; j++) s += acc[j];
    return s;
}

/* Exact f16 -> f32 with integer ops and one multiply (vectorises; the
 * _Float16 cast becomes a library call per element without F16C):
 * normals and subnormals are rebiased by 2^112, inf/NaN keep all-ones. */
static inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    uint32_t u = em << 13;
    float f;
    memcpy(&f, &u, 4);
    f *= 0x1p112f;
    memcpy(&u, &f, 4);
    if (em >= 0x7c00u) u = (em << 13) | 0x7f800000u;
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
}

static const float *load_kv(const void *base, int32_t dtype, int64_t off, int32_t d, float *buf) {
    if (dtype == FM_DTYPE_F32) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
    if (dtype == FM_DTYPE_F16) {
        for (int32_t i = 0; i < d; i++) buf[i] = f16_bits_to_f32(src[i]);
    } else {
        fm_load_row(buf, src, d, 1);
    }
    return buf;
}

void fm_cpu_vec_partial(const FlashAttnVecParams *p, const float *q, const void *k,
                        const void *v, int32_t kv_dtype, float *tmp, int64_t row, int64_t wg,
                        float *scratch) {
    const int32_t D = (int32_t)p->head_dim;
    const int64_t nrows = p->n_heads, nwg = p->nwg, kv_len = p->kv_seq_len;
    const int64_t gqa = (int64_t)p->n_heads / p->n_kv_heads;
    const int64_t kvrow = row / gqa;
    const int64_t cap = p->kv_capacity;
    const float *qrow = q + row * D;
    float *o = tmp + (row * nwg + wg) * D;
    float *sm = tmp + nrows * nwg * D + (row * nwg + wg) * 2;
    float *kbuf = scratch, *vbuf = scratch + D;

    /* Visible key range [lo, kv_len). */
    int64_t lo = 0;
    if (p->mask_type == 2) {
        const int64_t t = kv_len - 1;
        lo = t - (int64_t)p->sliding_window + 1;
        if (lo < 0) lo = 0;
    }
    for (int32_t i = 0; i < D; i++) o[i] = 0.0f;
    float M = FM_M_INIT, S = 0.0f;
    for (int64_t c = wg * FM_C; c < kv_len; c += nwg * FM_C) {
        const int64_t end = (c + FM_C) < kv_len ? (c + FM_C) : kv_len;
        for (int64_t pos = c; pos < end; pos++) {
            if (pos < lo) continue;
            const int64_t off = (kvrow * cap + pos) * D;
            float s = p->scale * vec_dot(qrow, load_kv(k, kv_dtype, off, D, kbuf), D);
            if (p->softcap > 0) s = p->softcap * tanhf(s / p->softcap);
            const float mx = s > M ? s : M;
            const float factor = expf(M - mx);
            const float pj = expf(s - mx);
            const float *vr = load_kv(v, kv_dtype, off, D, vbuf);
            for (int32_t i = 0; i < D; i++) o[i] = o[i] * factor + pj * vr[i];
            S = S * factor + pj;
            M = mx;
        }
    }
    sm[0] = S;
    sm[1] = M;
}

/* In-place natural-order (Sylvester) fast Walsh-Hadamard transform. */
static void fwht(float *x, int32_t n) {
    for (int32_t h = 1; h < n; h <<= 1)
        for (int32_t i = 0; i < n; i += h << 1)
            for (int32_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

void fm_cpu_vec_reduce_row(const float *tmp, float *out, int64_t nrows, int32_t d, int32_t nwg,
                           int64_t row, int32_t fwht_undo, const uint8_t *signs) {
    const float *sm = tmp + nrows * nwg * d + row * nwg * 2;
    float M = FM_M_INIT;
    for (int32_t w = 0; w < nwg; w++) if (sm[2 * w + 1] > M) M = sm[2 * w + 1];
    float S = 0.0f;
    float *y = out + row * d;
    for (int32_t i = 0; i < d; i++) y[i] = 0.0f;
    for (int32_t w = 0; w < nwg; w++) {
        const float f = expf(sm[2 * w + 1] - M);
        S += sm[2 * w] * f;
        const float *o = tmp + (row * nwg + w) * d;
        for (int32_t i = 0; i < d; i++) y[i] += o[i] * f;
    }
    const float inv = S == 0.0f ? 0.0f : 1.0f / S;
    for (int32_t i = 0; i < d; i++) y[i] *= inv;
    if (!fwht_undo) return;
    fwht(y, d);
    const float norm = 1.0f / sqrtf((float)d);
    for (int32_t i = 0; i < d; i++) {
        const int neg = signs ? (signs[i >> 3] >> (i & 7)) & 1 : 0;
        y[i] = neg ? -(y[i] * norm) : y[i] * norm;
    }
}
