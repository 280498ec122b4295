/* float32 rows to and from the I/O dtypes, for kernels that compute on
 * float32 rows but take or give float16/bfloat16 tensors. */
#include <string.h>
#include "fm_cpu_kernels.h"
#include "half_convert.h"

void fm_cpu_widen_to_f32(const void *src, int32_t dtype, int64_t n, float *dst) {
    if (dtype == FM_DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else {
        fm_load_row(dst, (const uint16_t *)src, n, dtype == FM_DTYPE_BF16);
    }
}

void fm_cpu_round_from_f32(const float *src, int32_t dtype, int64_t n, void *dst) {
    uint16_t *d16 = (uint16_t *)dst;
    if (dtype == FM_DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == FM_DTYPE_BF16) {
        for (int64_t i = 0; i < n; i++) d16[i] = fm_f32_to_bf16(src[i]);
    } else {
        for (int64_t i = 0; i < n; i++) d16[i] = fm_f32_to_f16(src[i]);
    }
}
