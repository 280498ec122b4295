/* The x86 intrinsics of the emulated harness build (FM_ISA_EMULATED,
 * mk/cpu-harness.mk): SIMDe's portable versions under the native names, so
 * the AVX-512 and AVX512-BF16 instances of the kernels compile without their
 * target attribute and run on any x86-64 machine. SIMDe 0.7.4 lacks
 * _mm512_cvtneps_pbh, _mm512_cvtepu16_epi32, _mm512_cvtepu8_epi32 and
 * _mm512_i32gather_ps; they are written here from
 * the instruction set reference, as is _mm512_dpbf16_ps, whose SIMDe version
 * adds the two products before the accumulator where vdpbf16ps adds them to
 * it one after the other (odd element first), each a fused multiply-add with
 * subnormal inputs read as zero and subnormal results flushed to zero. */
#ifndef FM_TESTS_ISA_EMULATED_H
#define FM_TESTS_ISA_EMULATED_H
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <math.h>
#include <stdint.h>
#include <string.h>
/* Clang's own SSE2 header (which SIMDe includes) declares a __m128bh of its
 * own; it is renamed here so that SIMDe's stays the only one. */
#define __m128bh fm_emu_clang_m128bh
#include <emmintrin.h>
#undef __m128bh
#include <simde/x86/avx512.h>

static inline float fm_emu_bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* Subnormals as zero of their sign (vdpbf16ps's DAZ and FTZ). */
static inline float fm_emu_flush(float x) { return fpclassify(x) == FP_SUBNORMAL ? copysignf(0.0f, x) : x; }

static inline simde__m512 fm_emu_mm512_dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b) {
    float acc[16];
    uint16_t x[32], y[32];
    memcpy(acc, &src, sizeof acc);
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    for (int i = 0; i < 16; i++) {
        float r = fm_emu_flush(acc[i]);
        r = fm_emu_flush(fmaf(fm_emu_flush(fm_emu_bf16_f32(x[2 * i + 1])), fm_emu_flush(fm_emu_bf16_f32(y[2 * i + 1])), r));
        r = fm_emu_flush(fmaf(fm_emu_flush(fm_emu_bf16_f32(x[2 * i])), fm_emu_flush(fm_emu_bf16_f32(y[2 * i])), r));
        acc[i] = r;
    }
    simde__m512 out;
    memcpy(&out, acc, sizeof out);
    return out;
}
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) fm_emu_mm512_dpbf16_ps(src, a, b)

/* vcvtneps2bf16: nearest even; zeros and subnormals to zero of their sign,
 * infinities truncated, NaN truncated and made quiet. */
static inline simde__m256bh fm_emu_mm512_cvtneps_pbh(simde__m512 a) {
    uint32_t u[16];
    uint16_t h[16];
    memcpy(u, &a, sizeof u);
    for (int i = 0; i < 16; i++) {
        const uint32_t e = u[i] & 0x7f800000u, m = u[i] & 0x007fffffu;
        if (e == 0) h[i] = (uint16_t)((u[i] >> 16) & 0x8000u);
        else if (e == 0x7f800000u && m == 0) h[i] = (uint16_t)(u[i] >> 16);
        else if (e == 0x7f800000u) h[i] = (uint16_t)((u[i] >> 16) | 0x0040u);
        else h[i] = (uint16_t)((u[i] + 0x7fffu + ((u[i] >> 16) & 1u)) >> 16);
    }
    simde__m256bh out;
    memcpy(&out, h, sizeof out);
    return out;
}
#define _mm512_cvtneps_pbh(a) fm_emu_mm512_cvtneps_pbh(a)

/* 16 unsigned lanes of `size` bytes (1 or 2) at src widened to 32 bits
 * (vpmovzxbd, vpmovzxwd). */
static inline simde__m512i fm_emu_widen_u32(const void *src, int size) {
    uint32_t w[16];
    for (int i = 0; i < 16; i++) {
        uint16_t x = 0;
        memcpy(&x, (const char *)src + i * size, (size_t)size); /* little-endian */
        w[i] = x;
    }
    simde__m512i out;
    memcpy(&out, w, sizeof out);
    return out;
}
static inline simde__m512i fm_emu_mm512_cvtepu16_epi32(simde__m256i a) { return fm_emu_widen_u32(&a, 2); }
#define _mm512_cvtepu16_epi32(a) fm_emu_mm512_cvtepu16_epi32(a)
static inline simde__m512i fm_emu_mm512_cvtepu8_epi32(simde__m128i a) { return fm_emu_widen_u32(&a, 1); }
#define _mm512_cvtepu8_epi32(a) fm_emu_mm512_cvtepu8_epi32(a)

/* vgatherdps: lane i loads the float at base + index[i] * scale bytes
 * (signed 32-bit indices). */
static inline simde__m512 fm_emu_mm512_i32gather_ps(simde__m512i index, const void *base, int scale) {
    int32_t idx[16];
    float out[16];
    memcpy(idx, &index, sizeof idx);
    for (int i = 0; i < 16; i++) memcpy(&out[i], (const char *)base + (int64_t)idx[i] * scale, sizeof(float));
    simde__m512 r;
    memcpy(&r, out, sizeof r);
    return r;
}
#define _mm512_i32gather_ps(index, base, scale) fm_emu_mm512_i32gather_ps(index, base, scale)
#endif
