/* Simple SDPA on the cpu: one (batch, head, 32-row q tile), online
 * softmax per row in f32. Query i sits at t = kv_len - qL + i (the plain kernel's
 * bottom-right) or, with SdpaExtParams, at t = q_offset + i; causal keeps
 * keys <= t, a window w keeps keys with t - p < w. The optional softcap
 * c*tanh(s/c) applies to the scaled score, then the optional mask is
 * added, -inf / false hiding a key; a row with no visible key outputs zeros;
 * any other score below the running-max start is raised to it.
 * f16/bf16 I/O is rounded once on output. */
#include <float.h>
#include <math.h>
#include "fm_cpu_kernels.h"
#include "half_convert.h"
#include "kernel_math.h"


size_t fm_cpu_sdpa_scratch_floats(int32_t d) { return (size_t)d * 4; } /* d = max(D, Dv) */

static const float *row_f32(const void *base, int32_t dtype, int64_t off, int32_t d, float *buf) {
    if (dtype == FM_DTYPE_F32) return (const float *)base + off;
    fm_load_row(buf, (const uint16_t *)base + off, d, dtype == FM_DTYPE_BF16);
    return buf;
}

static float mask_bias(const void *row, int32_t mask_kind, int32_t dtype, int64_t j) {
    if (mask_kind == FM_MASK_BOOL) return ((const uint8_t *)row)[j] ? 0.0f : -INFINITY;
    if (dtype == FM_DTYPE_F32) return ((const float *)row)[j];
    const uint16_t m = ((const uint16_t *)row)[j];
    return dtype == FM_DTYPE_BF16 ? fm_bf16_to_f32(m) : fm_f16_to_f32(m);
}

void fm_cpu_sdpa_tile(const SdpaParams *p, const SdpaExtParams *ext, int32_t use_softcap, const void *q,
                      const void *k, const void *v, void *o, int32_t dtype, const void *mask,
                      const AttnMaskParams *mp, int32_t mask_kind, int64_t b, int64_t h, int64_t qtile,
                      int32_t tile_q, float *scratch) {
    const int32_t D = (int32_t)p->head_dim, Dv = ext ? ext->head_dim_v : D; /* q/k's, v/out's */
    const int64_t H = p->n_heads, Hkv = p->n_kv_heads, qL = p->seq_len, kL = p->kv_seq_len;
    const int64_t cap = p->kv_capacity ? p->kv_capacity : kL;
    const int64_t kvh = h / (H / Hkv);
    const size_t W = (size_t)(D > Dv ? D : Dv); /* scratch rows */
    float *qbuf = scratch, *kbuf = scratch + W, *vbuf = scratch + 2 * W, *acc = scratch + 3 * W;
    const int64_t r0 = qtile * tile_q;
    const int64_t r1 = (r0 + tile_q) < qL ? (r0 + tile_q) : qL;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t row = (b * H + h) * qL + r, qoff = row * D, ooff = row * Dv;
        const float *qr = row_f32(q, dtype, qoff, D, qbuf);
        if (qr != qbuf) { for (int32_t i = 0; i < D; i++) qbuf[i] = qr[i]; }
        const int64_t t = (ext ? (int64_t)ext->q_offset : kL - qL) + r;
        int64_t first = 0, last = kL - 1;
        if (p->do_causal && t < last) last = t;
        if (ext && ext->window > 0 && t - ext->window + 1 > first) first = t - ext->window + 1;
        const float cap_c = use_softcap && ext ? ext->softcap : 0.0f;
        const size_t msz = mask_kind == FM_MASK_BOOL ? 1 : (dtype == FM_DTYPE_F32 ? 4 : 2);
        const void *mrow = mask_kind == FM_MASK_NONE ? NULL
            : (const char *)mask + msz * (b * mp->M_strides[0] + h * mp->M_strides[1] + r * mp->M_strides[2]);
        for (int32_t i = 0; i < Dv; i++) acc[i] = 0.0f;
        float M = FM_M_INIT, S = 0.0f;
        for (int64_t j = first; j <= last; j++) {
            const int64_t key = (b * Hkv + kvh) * cap + j, koff = key * D;
            float s = p->scale * fm_dot(qbuf, row_f32(k, dtype, koff, D, kbuf), D);
            if (cap_c > 0.0f) s = cap_c * tanhf(s / cap_c);
            const float bias = mrow ? mask_bias(mrow, mask_kind, dtype, j) : 0.0f;
            s += bias;
            /* The floor rule every backend shares: a key that is not masked
             * (-inf) keeps a weight even below the running-max start, so a row
             * of only very negative finite biases averages them. NaN stays. */
            if (bias != -INFINITY && s < FM_M_INIT) s = FM_M_INIT;
            const float mx = s > M ? s : M;
            const float f = expf(M - mx), pj = expf(s - mx);
            const float *vr = row_f32(v, dtype, key * Dv, Dv, vbuf);
            for (int32_t i = 0; i < Dv; i++) acc[i] = acc[i] * f + pj * vr[i];
            S = S * f + pj;
            M = mx;
        }
        const float inv = S == 0.0f ? 0.0f : 1.0f / S;
        if (dtype == FM_DTYPE_F32) {
            float *dst = (float *)o + ooff;
            for (int32_t i = 0; i < Dv; i++) dst[i] = acc[i] * inv;
        } else if (dtype == FM_DTYPE_BF16) {
            uint16_t *dst = (uint16_t *)o + ooff;
            for (int32_t i = 0; i < Dv; i++) dst[i] = fm_f32_to_bf16(acc[i] * inv);
        } else {
            uint16_t *dst = (uint16_t *)o + ooff;
            for (int32_t i = 0; i < Dv; i++) dst[i] = fm_f32_to_f16(acc[i] * inv);
        }
    }
}
