/* The quantized-KV codec on the cpu (kv_codec.c): the rows [begin, end) of
 * one kv_encode / kv_dequantize dispatch (KVCodecParams of flashmetal_kernels.h),
 * and the query heads of one kv head of a decode over quantized caches. */
#ifndef FM_KV_CODEC_CPU_H
#define FM_KV_CODEC_CPU_H

#include <stdint.h>
#include "flashmetal.h"
#include "flashmetal_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x [R, D] of dtype FM_DTYPE_F32, _F16 or _BF16 -> codes [R, row_bytes], norms [R, D / block]. */
void fm_cpu_kv_encode_rows(const KVCodecParams *p, const void *x, int32_t dtype, uint8_t *codes, float *norms,
                           int64_t begin, int64_t end);

/* codes, norms -> out float32 [R, D]. */
void fm_cpu_kv_dequantize_rows(const KVCodecParams *p, const uint8_t *codes, const float *norms, float *out,
                               int64_t begin, int64_t end);

/* Attention over quantized caches (KVCodesDecodeParams): work item `item`
 * is up to FM_CPU_KVQ_HEAD_CHUNK query heads of one kv head of one query row
 * of one sequence, which share every key's decoded codes; items = B * q_len
 * * Hkv * ceil((H / Hkv) / FM_CPU_KVQ_HEAD_CHUNK), ordered (sequence, query
 * row, kv head, chunk). seqlens, block_table, sinks and lse are NULL when
 * not bound. */
enum { FM_CPU_KVQ_HEAD_CHUNK = 8 };
typedef struct FMCPUKVCodesAttnArgs {
    const float *q;
    const uint8_t *k_codes;
    const float *k_norms;
    const uint8_t *v_codes;
    const float *v_norms;
    float *o;
    const int32_t *seqlens;
    const int32_t *block_table;
    const float *sinks;
    float *lse;
    const void *k_dense;  /* a dense K cache [rows, D] of dense_dtype instead of codes, or NULL */
    const void *v_dense;  /* likewise for V */
    int32_t dense_dtype;  /* FM_DTYPE_F32, _F16 or _BF16 */
    const int32_t *cu_seqlens_q;  /* varlen q (q_len = total_q), or NULL */
    const int32_t *cu_seqlens_k;  /* key counts of varlen sequences, or NULL */
    const float *alibi;           /* [B, H] ALiBi slopes: key t's score at row position r gains
                                   * -alibi[b, h] * |r - t| after the softcap; or NULL */
} FMCPUKVCodesAttnArgs;
/* nsplit == 1: the item whole, its output rows written. nsplit > 1: share
 * `split` of the item's keys (contiguous, split-major within the item), its
 * softmax state written to parts [items * nsplit, part_floats]; then
 * fm_cpu_kv_codes_decode_merge combines the item's nsplit shares and writes
 * its rows. */
int64_t fm_cpu_kv_codes_part_floats(const KVCodesDecodeParams *p);
void fm_cpu_kv_codes_decode_item(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t item,
                                 int32_t split, int32_t nsplit, float *parts);
/* The same for every item of query row bi (its kv heads and head chunks,
 * items bi * per .. (bi + 1) * per - 1) at once, key block by key block, so
 * a cache whose kv heads sit side by side is read in order; always writes
 * parts (nsplit may be 1), finished by fm_cpu_kv_codes_decode_merge. */
void fm_cpu_kv_codes_decode_row(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t bi,
                                int32_t split, int32_t nsplit, float *parts);
void fm_cpu_kv_codes_decode_merge(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t item,
                                  int32_t nsplit, const float *parts);

/* kv_codes_prefill on the cpu: items [first, first + n_items) of kv head g
 * of sequence b (item = query row * (H / Hkv) + head of the group; those
 * past the sequence's rows skipped; n_items at most
 * FM_CPU_KVQ_PREFILL_ITEMS) over one run of the keys any of them sees, each
 * key tile's codes decoded once for all of them. n_items a multiple of
 * FM_CPU_KVQ_PREFILL_STEP (whole threadgroups of the dispatch's grid) keeps
 * the kernel's vectors full. scratch: the calling worker's
 * fm_cpu_kv_codes_prefill_scratch_floats floats, 64-byte aligned. */
enum { FM_CPU_KVQ_PREFILL_ITEMS = 256, FM_CPU_KVQ_PREFILL_STEP = 64 };
int64_t fm_cpu_kv_codes_prefill_scratch_floats(const KVCodesDecodeParams *p);
void fm_cpu_kv_codes_prefill_items(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t first,
                                   int32_t n_items, int64_t g, int64_t b, float *scratch);

/* kv_codes_append (KVCodesAppendParams): work item `item` = (b * n_new + i)
 * * Hkv + g encodes new row i of kv head g of sequence b into both code
 * caches. block_table is NULL when not paged. */
typedef struct FMCPUKVCodesAppendArgs {
    const void *k_new;
    const void *v_new;
    int32_t dtype;
    uint8_t *k_codes;
    float *k_norms;
    uint8_t *v_codes;
    float *v_norms;
    const int32_t *seqlens;
    const int32_t *block_table;
    void *k_dense;  /* a dense K cache of dtype instead of codes (the row's bits copied), or NULL */
    void *v_dense;  /* likewise for V */
} FMCPUKVCodesAppendArgs;
void fm_cpu_kv_codes_append_item(const KVCodesAppendParams *p, const FMCPUKVCodesAppendArgs *a, int32_t n_kv_heads,
                                 int64_t item);

#ifdef __cplusplus
}
#endif

#endif
