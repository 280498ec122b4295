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
#include "kernel_math.h"

/* Fused multiply-adds where the ISA has them: the decode is memory bound
 * and its results need no bit-identity across ISAs. */
#pragma clang fp contract(fast)

#define FM_C FM_VEC_CHUNK

size_t fm_cpu_vec_scratch_floats(int32_t d, int32_t gqa) {
    return (size_t)FM_C * d * 2 + (size_t)gqa * FM_C;
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

/* Converts rows [pos0, pos0 + n) of one K or V head to f32 (or points at
 * them when they already are). */
static const float *load_chunk(const void *base, int32_t dtype, int64_t off, int64_t n, int32_t d,
                               float *buf) {
    if (dtype == FM_DTYPE_F32) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
    const int64_t count = n * d;
    if (dtype == FM_DTYPE_F16) {
        for (int64_t i = 0; i < count; i++) buf[i] = f16_bits_to_f32(src[i]);
    } else {
        fm_load_row(buf, src, count, 1);
    }
    return buf;
}

/* One (kv head, workgroup) item: the gqa query rows that share a K/V head
 * are processed together, so each 32-key chunk is read and converted once
 * for all of them. A row's arithmetic does not depend on the others.
 * Inlined into one wrapper per ISA, so the same source is vectorised for
 * each (the portable build targets baseline x86-64 / arm64). */
static inline __attribute__((always_inline)) void vec_partial_group(
    const FlashAttnVecParams *p, const float *q, const void *k, const void *v, int32_t kv_dtype,
    float *tmp, int64_t kvrow, int64_t wg, float *scratch) {
    const int32_t D = (int32_t)p->head_dim;
    const int64_t nrows = p->n_heads, nwg = p->nwg, kv_len = p->kv_seq_len;
    const int64_t gqa = (int64_t)p->n_heads / p->n_kv_heads;
    const int64_t cap = p->kv_capacity;
    float *kbuf = scratch, *vbuf = scratch + (size_t)FM_C * D, *scores = vbuf + (size_t)FM_C * D;

    /* Visible key range [lo, kv_len). */
    int64_t lo = 0;
    if (p->mask_type == 2) {
        lo = kv_len - (int64_t)p->sliding_window;
        if (lo < 0) lo = 0;
    }
    float M[gqa], S[gqa];
    for (int64_t g = 0; g < gqa; g++) {
        float *o = tmp + ((kvrow * gqa + g) * nwg + wg) * D;
        for (int32_t i = 0; i < D; i++) o[i] = 0.0f;
        M[g] = FM_M_INIT;
        S[g] = 0.0f;
    }
    for (int64_t c = wg * FM_C; c < kv_len; c += nwg * FM_C) {
        const int64_t first = c > lo ? c : lo;
        const int64_t end = (c + FM_C) < kv_len ? (c + FM_C) : kv_len;
        if (first >= end) continue;
        const int64_t n = end - first;
        const int64_t off = (kvrow * cap + first) * D;
        const float *kc = load_chunk(k, kv_dtype, off, n, D, kbuf);
        const float *vc = load_chunk(v, kv_dtype, off, n, D, vbuf);
        for (int64_t g = 0; g < gqa; g++) {
            const int64_t row = kvrow * gqa + g;
            const float *qrow = q + row * D;
            float *sc = scores + g * FM_C;
            float mx = M[g];
            for (int64_t j = 0; j < n; j++) {
                float s = p->scale * fm_dot(qrow, kc + j * D, D);
                if (p->softcap > 0) s = p->softcap * tanhf(s / p->softcap);
                sc[j] = s;
                if (s > mx) mx = s;
            }
            const float factor = expf(M[g] - mx);
            float sum = S[g] * factor;
            for (int64_t j = 0; j < n; j++) {
                sc[j] = expf(sc[j] - mx);
                sum += sc[j];
            }
            /* O = O * factor + P V, one block of FM_LANES outputs at a time so
             * the block stays in registers over the chunk's keys (D is a
             * multiple of 16 for every decode head dim). */
            float *o = tmp + (row * nwg + wg) * D;
            for (int32_t i0 = 0; i0 < D; i0 += FM_LANES) {
                float acc[FM_LANES];
                for (int t = 0; t < FM_LANES; t++) acc[t] = o[i0 + t] * factor;
                for (int64_t j = 0; j < n; j++) {
                    const float pj = sc[j];
                    const float *vr = vc + j * D + i0;
                    for (int t = 0; t < FM_LANES; t++) acc[t] += pj * vr[t];
                }
                for (int t = 0; t < FM_LANES; t++) o[i0 + t] = acc[t];
            }
            S[g] = sum;
            M[g] = mx;
        }
    }
    for (int64_t g = 0; g < gqa; g++) {
        float *sm = tmp + nrows * nwg * D + ((kvrow * gqa + g) * nwg + wg) * 2;
        sm[0] = S[g];
        sm[1] = M[g];
    }
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))
static void vec_partial_group_avx512(const FlashAttnVecParams *p, const float *q, const void *k,
                                     const void *v, int32_t kv_dtype, float *tmp, int64_t kvrow,
                                     int64_t wg, float *scratch) {
    vec_partial_group(p, q, k, v, kv_dtype, tmp, kvrow, wg, scratch);
}
#endif

void fm_cpu_vec_partial_group(const FlashAttnVecParams *p, const float *q, const void *k,
                              const void *v, int32_t kv_dtype, float *tmp, int64_t kvrow, int64_t wg,
                              float *scratch) {
#if defined(__x86_64__)
    if (fm_cpu_isa() >= FM_ISA_AVX512) {
        vec_partial_group_avx512(p, q, k, v, kv_dtype, tmp, kvrow, wg, scratch);
        return;
    }
#endif
    vec_partial_group(p, q, k, v, kv_dtype, tmp, kvrow, wg, scratch);
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
        /* A workgroup that saw no key (S = 0, O = 0) adds exactly nothing;
         * skipping it also avoids expf's slow underflow path. */
        if (sm[2 * w] == 0.0f) continue;
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
