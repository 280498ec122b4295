/* Split-KV decode on the cpu (with the FWHT undo and the serving extension of
 * flashmetal_kernels.h): workgroup wg of NWG takes a contiguous run of each
 * sequence's visible keys (vec_split.h) and writes its partial
 * (O unnormalised, S, M) to tmp; the reduce then rescales the partials by
 * exp(M_w - M), adds the sink once and normalises.
 *
 * tmp layout: partial outputs [nrows, nwg, Dv] (v's head dim), then (S, M) pairs [nrows, nwg, 2]. */
#include <math.h>
#include "half_convert.h"
#include "kernel_math.h"
#include "vec_split.h"

size_t fm_cpu_vec_scratch_floats(const FMVecArgs *a) {
    const size_t hkv = a->p.n_kv_heads, gqa = a->p.n_heads / a->p.n_kv_heads, L = (size_t)fm_vec_qrows(a);
    return hkv * L * gqa * 2 + gqa * FM_VEC_TILE; /* M, S of every head's rows, scores (vec_body.h) */
}

int fm_cpu_vec_key_major(const FMVecArgs *a) { return fm_vec_key_major(a); }

int64_t fm_cpu_vec_active_wgs(const FMVecArgs *a) {
    int64_t most = 0;
    for (int64_t b = 0; b < (a->seqlens ? a->batch : 1); b++) {
        int64_t lo, hi;
        fm_vec_visible(a, b, &lo, &hi);
        const int64_t n = fm_vec_busy_wgs(lo, hi, a->p.nwg);
        if (n > most) most = n;
    }
    return most;
}

void fm_cpu_vec_empty_partials(const FMVecArgs *a, int64_t wg_from) {
    for (int64_t r = 0; r < a->batch * fm_vec_qrows(a) * (int64_t)a->p.n_heads; r++)
        for (int64_t w = wg_from; w < a->p.nwg; w++) {
            float *sm = fm_vec_sm(a, r, w);
            sm[0] = 0.0f;
            sm[1] = FM_M_INIT;
        }
}

/* The items themselves are vec_body.h, compiled once per ISA: fn's
 * instance for this process's path (fm_cpu_isa). */
#if defined(__x86_64__)
#define FM_VEC_ROUTE(fn, ...)                                 \
    switch (fm_cpu_isa()) {                                   \
    case FM_ISA_AVX2: fn##_avx2(__VA_ARGS__); return;         \
    case FM_ISA_AVX512:                                       \
    case FM_ISA_AVX512VBMI:                                   \
    case FM_ISA_AVX512BF16: fn##_avx512(__VA_ARGS__); return; \
    default: fn##_portable(__VA_ARGS__); return;              \
    }
#elif defined(__aarch64__)
#define FM_VEC_ROUTE(fn, ...)                                 \
    switch (fm_cpu_isa()) {                                   \
    case FM_ISA_NEON: fn##_neon(__VA_ARGS__); return;         \
    default: fn##_portable(__VA_ARGS__); return;              \
    }
#else
#define FM_VEC_ROUTE(fn, ...) fn##_portable(__VA_ARGS__)
#endif

void fm_cpu_vec_item(const FMVecArgs *a, int64_t kvrow, int64_t wg, float *scratch) {
    FM_VEC_ROUTE(fm_vec_item, a, kvrow, wg, scratch);
}

void fm_cpu_vec_item_keys(const FMVecArgs *a, int64_t b, int64_t wg, float *scratch) {
    FM_VEC_ROUTE(fm_vec_item_keys, a, b, wg, scratch);
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

void fm_cpu_vec_reduce_row(const float *tmp, void *out, int32_t out_dtype, int64_t nrows, int32_t d, int32_t nwg,
                           int64_t row, int32_t fwht_undo, const uint8_t *signs, const float *sinks,
                           float *lse, int64_t head) {
    const float *sm = tmp + fm_vec_sm_offset(nrows, nwg, d, row, 0);
    float M = FM_M_INIT;
    for (int32_t w = 0; w < nwg; w++) if (sm[2 * w + 1] > M) M = sm[2 * w + 1];
    /* The sink joins the max, so e^{sink - M} cannot overflow; a row
     * without keys then gets S = 1 from the sink alone and outputs 0. A +inf
     * sink makes S = +inf: every weight below is 0, the row 0, the LSE +inf. */
    const float sink = sinks ? sinks[head] : -INFINITY;
    if (sink > M) M = sink;
    float S = sinks ? fm_sink_term(sink, M) : 0.0f;
    /* A float32 output is the working row itself; a 16-bit one is rounded
     * once from a float32 row on the stack. */
    float rounded[FM_VEC_ROUNDED_ROW_MAX];
    float *y = out_dtype == FM_DTYPE_F32 ? (float *)out + row * d : rounded;
    for (int32_t i = 0; i < d; i++) y[i] = 0.0f;
    for (int32_t w = 0; w < nwg; w++) {
        /* A workgroup that saw no key (S = 0; its O is not written) adds
         * exactly nothing; skipping it also avoids expf's slow underflow path. */
        if (sm[2 * w] == 0.0f) continue;
        const float f = expf(sm[2 * w + 1] - M);
        S += sm[2 * w] * f;
        const float *o = tmp + (row * nwg + w) * d;
        for (int32_t i = 0; i < d; i++) y[i] += o[i] * f;
    }
    if (lse) lse[row] = S == 0.0f ? -INFINITY : M + logf(S);
    const float inv = S == 0.0f ? 0.0f : 1.0f / S;
    for (int32_t i = 0; i < d; i++) y[i] *= inv;
    if (fwht_undo) {
        fwht(y, d);
        const float norm = 1.0f / sqrtf((float)d);
        for (int32_t i = 0; i < d; i++) {
            const int neg = signs ? (signs[i >> 3] >> (i & 7)) & 1 : 0;
            y[i] = neg ? -(y[i] * norm) : y[i] * norm;
        }
    }
    uint16_t *o16 = (uint16_t *)out + row * d;
    if (out_dtype == FM_DTYPE_BF16)
        for (int32_t i = 0; i < d; i++) o16[i] = fm_f32_to_bf16(y[i]);
    else if (out_dtype == FM_DTYPE_F16)
        for (int32_t i = 0; i < d; i++) o16[i] = fm_f32_to_f16(y[i]);
}
