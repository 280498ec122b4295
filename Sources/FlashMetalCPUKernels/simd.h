/* The vector vocabulary of the per-ISA kernels: clang vector extensions of
 * FM_VL floats. An ISA instance (kernels_<isa>.c) defines FM_VL and a
 * `#pragma clang attribute push(target(...))` before including this, so the
 * same source becomes ymm code for AVX2, zmm for AVX-512 and q-registers for
 * NEON. Every helper keeps NaN where a NaN came in (see fm_v_exp). */
#ifndef FM_SIMD_H
#define FM_SIMD_H
#include <float.h>
#include <stdint.h>
#include <string.h>

#ifndef FM_VL
#error "define FM_VL (floats per vector) before including simd.h"
#endif

typedef float fm_v __attribute__((ext_vector_type(FM_VL)));
typedef int32_t fm_vi __attribute__((ext_vector_type(FM_VL)));
typedef uint32_t fm_vu __attribute__((ext_vector_type(FM_VL)));
typedef uint16_t fm_vh16 __attribute__((ext_vector_type(FM_VL)));
typedef _Float16 fm_vf16 __attribute__((ext_vector_type(FM_VL)));
typedef uint8_t fm_vb __attribute__((ext_vector_type(FM_VL)));

static inline fm_v fm_v_load(const float *p) { fm_v v; memcpy(&v, p, sizeof v); return v; }
static inline void fm_v_store(float *p, fm_v v) { memcpy(p, &v, sizeof v); }
static inline fm_v fm_v_splat(float x) { return (fm_v)x; }
static inline fm_v fm_v_fma(fm_v a, fm_v b, fm_v c) { return __builtin_elementwise_fma(a, b, c); }
/* Lanes where m is all-ones take a, the others b (bitwise: NaN-transparent). */
static inline fm_v fm_v_sel(fm_vi m, fm_v a, fm_v b) { return m ? a : b; }

/* 16-bit floats -> f32 in registers. */
static inline fm_v fm_v_from_bf16(const uint16_t *p) {
    fm_vh16 h;
    memcpy(&h, p, sizeof h);
    return (fm_v)(__builtin_convertvector(h, fm_vu) << 16);
}
/* FM_HAS_F16CVT: the ISA converts f16 in hardware (F16C, NEON FCVTL);
 * otherwise exact integer ops and one multiply, which vectorise where the
 * _Float16 cast would be a library call per element: normals and
 * subnormals are rebiased by 2^112, inf/NaN keep all-ones exponents. */
static inline fm_v fm_v_from_f16(const uint16_t *p) {
#if FM_HAS_F16CVT
    fm_vf16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, fm_v);
#else
    fm_vh16 h;
    memcpy(&h, p, sizeof h);
    const fm_vu x = __builtin_convertvector(h, fm_vu);
    const fm_vu em = x & 0x7fffu;
    const fm_v scaled = (fm_v)(em << 13) * 0x1p112f;
    fm_vu u = em >= 0x7c00u ? ((em << 13) | 0x7f800000u) : (fm_vu)scaled;
    return (fm_v)(u | ((x & 0x8000u) << 16));
#endif
}
/* Loads FM_VL elements of dtype (FMDType: 0 f32, 1 f16, 2 bf16) as f32. */
static inline fm_v fm_v_load_any(const void *p, int64_t i, int32_t dtype) {
    if (dtype == 0) return fm_v_load((const float *)p + i);
    if (dtype == 1) return fm_v_from_f16((const uint16_t *)p + i);
    return fm_v_from_bf16((const uint16_t *)p + i);
}

/* The first n (0 < n <= FM_VL) elements at p, zeros in the lanes past them:
 * a row's last, partial vector when D is not a multiple of FM_VL. Nothing
 * past element n - 1 is read or written. */
static inline fm_v fm_v_load_n(const float *p, int32_t n) {
    float t[FM_VL] = {0};
    memcpy(t, p, sizeof(float) * (size_t)n);
    return fm_v_load(t);
}
static inline fm_v fm_v_load_any_n(const void *p, int64_t i, int32_t n, int32_t dtype) {
    if (dtype == 0) return fm_v_load_n((const float *)p + i, n);
    uint16_t t[FM_VL] = {0}; /* +0 in f16 and bf16 */
    memcpy(t, (const uint16_t *)p + i, sizeof(uint16_t) * (size_t)n);
    return dtype == 1 ? fm_v_from_f16(t) : fm_v_from_bf16(t);
}
static inline void fm_v_store_n(float *p, fm_v v, int32_t n) {
    float t[FM_VL];
    fm_v_store(t, v);
    memcpy(p, t, sizeof(float) * (size_t)n);
}

/* Round to bf16 (nearest even) and keep the value as f32; NaN stays NaN. */
static inline fm_v fm_v_round_bf16(fm_v x) {
    fm_vu u = (fm_vu)x;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (fm_v)u;
}

/* Rounds x to bf16 (nearest even), stores the FM_VL bf16 values at dst and
 * returns them as f32. */
static inline fm_v fm_v_store_bf16(uint16_t *dst, fm_v x) {
    const fm_v r = fm_v_round_bf16(x);
    const fm_vh16 top = __builtin_convertvector((fm_vu)r >> 16, fm_vh16);
    memcpy(dst, &top, sizeof top);
    return r;
}

/* Sum over the lanes as a fixed tree (halves added pairwise): deterministic
 * for a given ISA, and a short dependency chain. */
static inline float fm_v_sum(fm_v v) {
    float t[FM_VL];
    memcpy(t, &v, sizeof v);
    for (int w = FM_VL / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}

static inline fm_v fm_v_add2(fm_v a, fm_v b) { return a + b; }
static inline fm_v fm_v_max2(fm_v a, fm_v b) { return fm_v_sel(a > b, a, b); }
static inline float fm_v_sum(fm_v v);
static inline float fm_v_max(fm_v v);

#if FM_VL == 16
/* fm_v_fold8's tree on 16-lane vectors, left in a register: lane 2 i of the
 * result is the op-reduction of v[i]'s lanes. */
static inline __attribute__((always_inline)) fm_v fm_v_fold8_even(const fm_v v[8], fm_v (*op)(fm_v, fm_v)) {
    fm_v x[4], y[2];
    for (int i = 0; i < 4; i++)
        x[i] = op(__builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                          21, 22, 23),
                  __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                          28, 29, 30, 31));
    for (int i = 0; i < 2; i++)
        y[i] = op(__builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                                          25, 26, 27),
                  __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                          29, 30, 31));
    const fm_v z = op(__builtin_shufflevector(y[0], y[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29),
                      __builtin_shufflevector(y[0], y[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31));
    return op(z, __builtin_shufflevector(z, z, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
}
#endif
/* out[i] = the op-reduction of v[i]'s lanes for 8 vectors, by folding the
 * vectors into each other: ~8 shuffle+op pairs instead of 8 separate
 * horizontal reductions. With op fm_v_add2 each out[i] is fm_v_sum(v[i])
 * bit for bit (the same tree: halves combined pairwise). */
static inline __attribute__((always_inline)) void fm_v_fold8(const fm_v v[8], float out[8],
                                                             fm_v (*op)(fm_v, fm_v)) {
#if FM_VL == 16
    const fm_v w = fm_v_fold8_even(v, op);
    for (int i = 0; i < 8; i++) out[i] = w[2 * i];
#elif FM_VL == 8
    fm_v x[4], y[2];
    for (int i = 0; i < 4; i++)
        x[i] = op(__builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11),
                  __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15));
    for (int i = 0; i < 2; i++)
        y[i] = op(__builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13),
                  __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15));
    const fm_v z = op(__builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14),
                      __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15));
    memcpy(out, &z, sizeof z);
#elif FM_VL == 4
    fm_v x[4];
    for (int i = 0; i < 4; i++)
        x[i] = op(__builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 4, 5),
                  __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 6, 7));
    for (int i = 0; i < 2; i++) {
        const fm_v y = op(__builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 2, 4, 6),
                          __builtin_shufflevector(x[2 * i], x[2 * i + 1], 1, 3, 5, 7));
        memcpy(out + 4 * i, &y, sizeof y);
    }
#else
    for (int i = 0; i < 8; i++) out[i] = op == fm_v_add2 ? fm_v_sum(v[i]) : fm_v_max(v[i]);
#endif
}
static inline void fm_v_sum8(const fm_v v[8], float out[8]) { fm_v_fold8(v, out, fm_v_add2); }
#if FM_VL == 16
/* Lane t of the result is fm_v_sum(v[t]) bit for bit, for 16 vectors,
 * in a register: fm_v_fold8's tree on each half of v, the halves' results
 * gathered by one permute (8 stores of single lanes read back as a vector
 * would wait on store forwarding). */
static inline __attribute__((always_inline)) fm_v fm_v_sum16(const fm_v v[16]) {
    return __builtin_shufflevector(fm_v_fold8_even(v, fm_v_add2), fm_v_fold8_even(v + 8, fm_v_add2), 0, 2, 4, 6, 8,
                                   10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
}
#endif
/* The largest lane of each of 8 vectors without NaN (a max of any tree). */
static inline void fm_v_max8(const fm_v v[8], float out[8]) { fm_v_fold8(v, out, fm_v_max2); }

/* Largest lane of a vector without NaN. */
static inline float fm_v_max(fm_v v) {
    float t[FM_VL];
    memcpy(t, &v, sizeof v);
    for (int w = FM_VL / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] > t[i + w] ? t[i] : t[i + w];
    return t[0];
}

/* e^x for x <= 0 or NaN: e^-inf and anything below -87.3 give exactly 0,
 * e^0 gives exactly 1, NaN gives NaN (the clamp is a select, not a max, so
 * a NaN is never replaced). n = round(x / ln 2) comes from adding 1.5 * 2^23
 * (its low mantissa bits are then n), so no float -> int conversion is
 * needed; x = r + n ln 2 with a 2-term ln 2 and a degree-6 polynomial for
 * e^r on |r| <= ln 2 / 2 (relative error ~1e-7). */
static inline fm_v fm_v_exp(fm_v x) {
    const fm_vi tiny = x < -87.3f;
    const fm_v xc = fm_v_sel(tiny, fm_v_splat(-87.3f), x);
    const fm_v magic = fm_v_splat(12582912.0f); /* 1.5 * 2^23 */
    const fm_v t = fm_v_fma(xc, fm_v_splat(1.44269504088896341f), magic);
    const fm_v n = t - magic;
    fm_v r = fm_v_fma(n, fm_v_splat(-0.693145751953125f), xc);
    r = fm_v_fma(n, fm_v_splat(-1.428606765330187045e-06f), r);
    fm_v y = fm_v_splat(1.0f / 720.0f);
    y = fm_v_fma(y, r, fm_v_splat(1.0f / 120.0f));
    y = fm_v_fma(y, r, fm_v_splat(1.0f / 24.0f));
    y = fm_v_fma(y, r, fm_v_splat(1.0f / 6.0f));
    y = fm_v_fma(y, r, fm_v_splat(0.5f));
    y = fm_v_fma(y, r, fm_v_splat(1.0f));
    y = fm_v_fma(y, r, fm_v_splat(1.0f));
    /* n in [-126, 0] for the clamped range, in t's low mantissa bits:
     * 2^n = (n + 127) << 23. A NaN lane keeps y = NaN. */
    const fm_v two_n = (fm_v)(((fm_vu)t + (127u - 0x4B400000u)) << 23);
    return fm_v_sel(tiny, fm_v_splat(0.0f), y * two_n);
}
#endif
