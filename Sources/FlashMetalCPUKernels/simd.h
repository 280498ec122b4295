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

/* Round to bf16 (nearest even) and keep the value as f32; NaN stays NaN. */
static inline fm_v fm_v_round_bf16(fm_v x) {
    fm_vu u = (fm_vu)x;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (fm_v)u;
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
