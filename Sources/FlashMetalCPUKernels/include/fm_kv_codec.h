/* The quantized-KV codec on the cpu (kv_codec.c): the rows [begin, end) of
 * one kv_encode / kv_dequantize dispatch (KVCodecParams of flashmetal.h),
 * and one query row of a decode over quantized caches. */
#ifndef FM_KV_CODEC_CPU_H
#define FM_KV_CODEC_CPU_H

#include <stdint.h>
#include "flashmetal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x [R, D] of dtype FM_DTYPE_F32, _F16 or _BF16 -> codes [R, row_bytes], norms [R, D / block]. */
void fm_cpu_kv_encode_rows(const KVCodecParams *p, const void *x, int32_t dtype, uint8_t *codes, float *norms,
                           int64_t begin, int64_t end);

/* codes, norms -> out float32 [R, D]. */
void fm_cpu_kv_dequantize_rows(const KVCodecParams *p, const uint8_t *codes, const float *norms, float *out,
                               int64_t begin, int64_t end);

/* Decode over quantized caches: query row `row` of q [B*H, D] (KVCodesDecodeParams). */
void fm_cpu_kv_codes_decode_row(const KVCodesDecodeParams *p, const float *q, const uint8_t *k_codes,
                                const float *k_norms, const uint8_t *v_codes, const float *v_norms, float *o,
                                int64_t row);

#ifdef __cplusplus
}
#endif

#endif
