/* The key loop of attention over quantized caches, shared by kv_codec.c and
 * every ISA's instance of kv_codes_body.h. */
#ifndef FM_KV_CODES_KEYS_H
#define FM_KV_CODES_KEYS_H
#include <stdint.h>

#include "fm_kv_codec.h"

/* Keys per tile: each tile's K rows are decoded once into a stack buffer of
 * FM_KVQ_TILE * FM_KVQ_MAX_HEAD_DIM floats (32 KiB). */
#define FM_KVQ_TILE 16
/* The most query rows one run of keys serves (FMKVQKeys.heads). */
#define FM_KVQ_MAX_QUERIES 32
/* Keys per block when one work item reads every kv head of its keys
 * (fm_cpu_kv_codes_decode_row): a block of every head's rows stays cached
 * while each head takes its turn. */
#define FM_KVQ_ROW_BLOCK 64

/* Centroids by whole code bytes: by4[b] = (c4[b & 15], c4[b >> 4]), by2[b]
 * the four 2-bit codes of b, c8 the 8-bit table, c[bits] every table. */
typedef struct FMKVQTables {
    float by4[256][2];
    float by2[256][4];
    const float *c8;
    const float *c[9];
} FMKVQTables;

/* One run of keys [start, end) of kv head g of sequence b, for `heads`
 * (<= FM_KVQ_MAX_QUERIES) query heads: qz [heads, D] is the query in the K side's basis; mx, sum
 * and acc [heads, D] (the V side's basis, unnormalised) are the running
 * softmax state, updated in place. With lo and hi, query j sees only the
 * keys [lo[j], hi[j]) of the run (query rows of a prefill). */
typedef struct FMKVQKeys {
    const KVCodesDecodeParams *p;
    const FMCPUKVCodesAttnArgs *a;
    const FMKVQTables *tables;
    int64_t b, g;
    int32_t heads, start, end;
    const float *qz;
    float *mx, *sum, *acc;
    const int32_t *lo, *hi;
} FMKVQKeys;

#define FM_KVQ_DECLARE(sfx) void fm_kvq_keys_##sfx(const FMKVQKeys *k);
FM_KVQ_DECLARE(portable)
#if defined(__x86_64__)
FM_KVQ_DECLARE(avx2)
FM_KVQ_DECLARE(avx512)
#endif
#if defined(__aarch64__)
FM_KVQ_DECLARE(neon)
#endif
#endif
