/* kv_append on the cpu: one new row (every kv head) of one sequence, copied
 * byte for byte (no conversion, so NaN payloads survive as on Metal). The
 * host checked seqlens, the capacity and every block-table entry used. */
#include <string.h>

#include "fm_cpu_kernels.h"

void fm_cpu_kv_append_row(const KVAppendParams *p, const void *k_new, const void *v_new, void *k_cache,
                          void *v_cache, const int32_t *seqlens, const int32_t *block_table,
                          int32_t elem_bytes, int64_t b, int64_t i) {
    const int64_t t = (int64_t)seqlens[b] + i;
    int64_t dst = 0;
    if (block_table) {
        const int64_t page = block_table[b * p->max_pages + t / p->page_size];
        dst = page * p->cache_strides[0] + (t % p->page_size) * p->cache_strides[1];
    } else {
        dst = b * p->cache_strides[0] + t * p->cache_strides[1];
    }
    const int64_t src = b * p->new_strides[0] + i * p->new_strides[1];
    const size_t row = (size_t)p->head_dim * (size_t)elem_bytes, vrow = (size_t)p->head_dim_v * (size_t)elem_bytes;
    for (int64_t g = 0; g < p->n_kv_heads; g++) {
        /* element offsets of k's rows; v's are the same row index, head_dim_v wide */
        const int64_t s = src + g * p->new_strides[2], d = dst + g * p->cache_strides[2];
        memcpy((char *)k_cache + d * elem_bytes, (const char *)k_new + s * elem_bytes, row);
        memcpy((char *)v_cache + d / p->head_dim * p->head_dim_v * elem_bytes,
               (const char *)v_new + s / p->head_dim * p->head_dim_v * elem_bytes, vrow);
    }
}
