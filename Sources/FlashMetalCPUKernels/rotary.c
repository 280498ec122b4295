/* rotary on the cpu: row i of sequence b of x [B, L, H, D] (every head)
 * rotated into out, as rotary.metal does (RotaryParams in flashmetal_kernels.h):
 * float32 arithmetic, one rounding to x's dtype, the tail dims copied
 * bit for bit. The host checked every position against the tables. */
#include <string.h>

#include "fm_cpu_kernels.h"
#include "half_convert.h"

static float fm_rot_load(const void *p, int64_t k, int32_t dtype) {
    switch (dtype) {
    case FM_DTYPE_F16: return fm_f16_to_f32(((const uint16_t *)p)[k]);
    case FM_DTYPE_BF16: return fm_bf16_to_f32(((const uint16_t *)p)[k]);
    default: return ((const float *)p)[k];
    }
}

static void fm_rot_store(void *p, int64_t k, int32_t dtype, float v) {
    switch (dtype) {
    case FM_DTYPE_F16: ((uint16_t *)p)[k] = fm_f32_to_f16(v); break;
    case FM_DTYPE_BF16: ((uint16_t *)p)[k] = fm_f32_to_bf16(v); break;
    default: ((float *)p)[k] = v; break;
    }
}

void fm_cpu_rotary_row(const RotaryParams *p, const void *x, const void *cos_table, const void *sin_table,
                       const int32_t *offsets, void *out, int32_t x_dtype, int32_t cs_dtype, int64_t b,
                       int64_t i) {
    const int64_t d_len = p->head_dim, half_len = p->rotary_half;
    const int64_t t = (int64_t)offsets[b] + (p->per_row ? i : 0);
    const int64_t table_row = t * half_len;
    const size_t elem = x_dtype == FM_DTYPE_F32 ? 4 : 2;
    for (int64_t h = 0; h < p->n_heads; h++) {
        const int64_t row = ((b * p->n_rows + i) * p->n_heads + h) * d_len;
        for (int64_t j = 0; j < half_len; j++) {
            const int64_t a = p->interleaved ? 2 * j : j;
            const int64_t c = p->interleaved ? 2 * j + 1 : j + half_len;
            const float x1 = fm_rot_load(x, row + a, x_dtype), x2 = fm_rot_load(x, row + c, x_dtype);
            const float cs = fm_rot_load(cos_table, table_row + j, cs_dtype);
            const float sn = fm_rot_load(sin_table, table_row + j, cs_dtype);
            fm_rot_store(out, row + a, x_dtype, x1 * cs - x2 * sn);
            fm_rot_store(out, row + c, x_dtype, x1 * sn + x2 * cs);
        }
        const int64_t tail = d_len - 2 * half_len;
        if (tail > 0) {
            memcpy((char *)out + (size_t)(row + 2 * half_len) * elem,
                   (const char *)x + (size_t)(row + 2 * half_len) * elem, (size_t)tail * elem);
        }
    }
}
