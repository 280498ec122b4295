/* bf16 / f16 <-> f32 conversions with round-to-nearest-even. */
#ifndef FM_HALF_CONVERT_H
#define FM_HALF_CONVERT_H
#include <stdint.h>
#include <string.h>

static inline float fm_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t fm_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float fm_f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}

static inline uint16_t fm_f32_to_f16(float f) {
    _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, 2);
    return h;
}

/* Converts n elements of a 16-bit float type (bf16 when is_bf16) to f32. */
static inline void fm_load_row(float *dst, const uint16_t *src, int64_t n, int is_bf16) {
    if (is_bf16) {
        for (int64_t i = 0; i < n; i++) dst[i] = fm_bf16_to_f32(src[i]);
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = fm_f16_to_f32(src[i]);
    }
}
#endif
