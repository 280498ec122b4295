/* The key loops of attention over quantized caches, shared by kv_codec.c and
 * every ISA's instance of kv_codes_body.h (decode) and
 * kv_codes_prefill_body.h (prefill). */
#ifndef FM_KV_CODES_KEYS_H
#define FM_KV_CODES_KEYS_H
#include <stdint.h>

#include "fm_kv_codec.h"

/* Keys per tile of the decode: one online-softmax rescale and one vector
 * exp per head for each tile's scores (32 measured 7-15% faster per key
 * than 16 on AVX2 and AVX-512, every width: the per-tile work halves). */
#define FM_KVQ_TILE 32
/* Keys per block when one work item reads every kv head of its keys
 * (fm_cpu_kv_codes_decode_row), one tile: a block of every head's rows
 * (32 KiB of 4-bit codes at D 128, Hkv 8) is read while each head takes its
 * turn, close to memory order. */
#define FM_KVQ_ROW_BLOCK 32
/* How many keys ahead of a block fm_cpu_kv_codes_decode_row requests the
 * rows of every kv head, each pass a share of them: the requests are spread
 * over the work instead of one burst per block (a burst fills the load
 * queue and stalls the loop). */
#define FM_KVQ_ROW_AHEAD 64
/* The most lines a pass of fm_cpu_kv_codes_decode_row spreads over its keys
 * (a pass's share at D 128, Hkv 8, 8-bit codes: about 140). */
#define FM_KVQ_AHEAD_LINES 256
/* Keys per tile of the prefill, tiles starting at multiples of it. */
#define FM_KVQ_PREFILL_KEYS 64
/* Rows past the prefill's key tile and its items that a register block may
 * touch (at least the largest block's rows). */
#define FM_KVQ_PREFILL_PAD 8
/* Floats past D in each decoded K and V row of the prefill's tiles, so
 * consecutive rows do not sit a multiple of 512 bytes apart like the code
 * rows they are decoded from (stores and loads 4 KiB apart look alike to
 * the load unit). */
#define FM_KVQ_PREFILL_SKEW 16
/* How many keys ahead the prefill requests the rows it decodes next. */
#define FM_KVQ_PREFILL_AHEAD 8

/* Centroids by whole code bytes: by4[b] = (c4[b & 15], c4[b >> 4]), by2[b]
 * the four 2-bit codes of b, c8 the 8-bit table, c[bits] every table;
 * planes4[k][c] byte k (little-endian) of the float c4[c], for byte
 * shuffles that look up 16 codes at once; rep16[bits] the 2-, 3- and 4-bit
 * centroids repeated to 16 entries (table registers of vector permutes). */
typedef struct FMKVQTables {
    float by4[256][2];
    float by2[256][4];
    float rep16[5][16];
    uint8_t planes4[4][16];
    uint8_t planes8[4][128]; /* byte k of c8[128 + e]: the 8-bit table's upper half by planes */
    const float *c8;
    const float *c[9];
} FMKVQTables;

/* One run of keys [start, end) of kv head g of sequence b, for `heads`
 * queries: qz [heads, D] is the query in the K side's basis; mx, sum and
 * acc [heads, D] (the V side's basis, unnormalised) are the running softmax
 * state, updated in place.
 * Decode (fm_kvq_keys): heads <= FM_CPU_KVQ_HEAD_CHUNK query heads of one
 * query row, all seeing every key of the run; lo, hi and scratch are NULL.
 * Prefill (fm_kvq_prefill): heads <= FM_CPU_KVQ_PREFILL_ITEMS (query row,
 * head) items, item j seeing only the keys [lo[j], hi[j]) of the run; acc
 * has heads + FM_KVQ_PREFILL_PAD rows, all zero on entry;
 * scratch holds fm_kvq_prefill_tile_floats(D) floats, 64-byte aligned. */
typedef struct FMKVQKeys {
    const KVCodesDecodeParams *p;
    const FMCPUKVCodesAttnArgs *a;
    const FMKVQTables *tables;
    int64_t b, g;
    int32_t heads, start, end;
    const float *qz;
    float *mx, *sum, *acc;
    const int32_t *lo, *hi;
    float *scratch;
    /* Decode: nonzero requests the run's next tile of rows (norms
     * included) before each tile; 0 leaves the requests to the caller. */
    int32_t prefetch_next;
    /* Decode: cache lines the caller wants requested while the run goes,
     * spread over its keys (a burst of them would fill the load queue and
     * stall the loop); NULL none. */
    const char *const *ahead;
    int32_t ahead_n;
    /* ALiBi: head/item j's slope slopes[j] and query position pos[j] (the
     * keys' frame), its score of key t gaining -slopes[j] * |pos[j] - t|
     * after the softcap; NULL without ALiBi. */
    const float *slopes;
    const int32_t *pos;
} FMKVQKeys;

/* The prefill's tiles: the query panel [ITEMS][D], the K rows
 * [KEYS + PAD][D + SKEW], the V rows [KEYS][D + SKEW] and the scores
 * [KEYS + PAD][ITEMS + PAD]. */
static inline int64_t fm_kvq_prefill_tile_floats(int32_t d) {
    return (int64_t)FM_CPU_KVQ_PREFILL_ITEMS * d
           + (int64_t)(2 * FM_KVQ_PREFILL_KEYS + FM_KVQ_PREFILL_PAD) * (d + FM_KVQ_PREFILL_SKEW)
           + (int64_t)(FM_KVQ_PREFILL_KEYS + FM_KVQ_PREFILL_PAD) * (FM_CPU_KVQ_PREFILL_ITEMS + FM_KVQ_PREFILL_PAD);
}

/* Whether the AVX-512 decode keeps a side of 4-bit codes in row order: it
 * reads each 128 codes (64 bytes) of a row as one register and takes every
 * coordinate's nibble by a shift and a table permute, so vector n of each
 * 128 coordinates holds coordinates 8 l + n in its lanes l (position
 * 128 g + 16 n + l holds coordinate 128 g + 8 l + n). The query (K side) and
 * the accumulators (V side) are kept in that order between start_item and
 * the finish. Rows of D a multiple of 128 in one rotation block. */
static inline int fm_kvq_row_order(int avx512, int32_t bits, const void *dense, int32_t d, int32_t block) {
    return avx512 && dense == NULL && bits == 4 && d % 128 == 0 && block == d;
}

/* The position of coordinate c in row order. */
static inline int32_t fm_kvq_row_order_at(int32_t c) { return (c & ~127) | (c & 7) << 4 | (c & 127) >> 3; }

/* The storage row of key `key` of kv head g of sequence b: through the
 * block table when paged; else row `key` of sequence b's cache, or, packed
 * (cu_seqlens_k without pages: storage [1, total_k, Hkv], kv_strides[0] 0),
 * row cu_seqlens_k[b] + key. */
static inline int64_t fm_kvq_row(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t b, int64_t g,
                                 int32_t key) {
    int64_t r = g * p->kv_strides[1];
    if (a->block_table != NULL) {
        r += (int64_t)a->block_table[b * p->max_pages + key / p->page_size] * p->kv_strides[0]
             + (int64_t)(key % p->page_size) * p->kv_strides[2];
    } else {
        const int64_t first = a->cu_seqlens_k != NULL ? a->cu_seqlens_k[b] : 0;
        r += b * p->kv_strides[0] + (first + key) * p->kv_strides[2];
    }
    return r;
}

/* The storage rows of keys [key0, key0 + n) of kv head g of sequence b, into
 * rows: one row computation per page crossed, not a divide per key. */
static inline void fm_kvq_rows(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t b, int64_t g,
                               int32_t key0, int32_t n, int64_t *rows) {
    if (n <= 0) return;
    rows[0] = fm_kvq_row(p, a, b, g, key0);
    int32_t in_page = a->block_table != NULL ? key0 % p->page_size : 0;
    for (int32_t t = 1; t < n; t++) {
        if (a->block_table != NULL && ++in_page == p->page_size) {
            in_page = 0;
            rows[t] = fm_kvq_row(p, a, b, g, key0 + t);
        } else {
            rows[t] = rows[t - 1] + p->kv_strides[2];
        }
    }
}

/* Where the cache lines to request go: requested at once (lines NULL), or
 * listed in lines while n < cap (the rest requested at once). */
typedef struct FMKVQLines {
    const char **lines;
    int32_t n, cap;
} FMKVQLines;

static inline void fm_kvq_request(FMKVQLines *to, const char *at, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) {
        if (to != NULL && to->n < to->cap) {
            to->lines[to->n++] = at + o;
        } else {
            __builtin_prefetch(at + o);
        }
    }
}

/* Requests the cache lines of rows [r, r + count) of one side (codes, else
 * dense). */
static inline void fm_kvq_prefetch_side(FMKVQLines *to, const uint8_t *codes, const void *dense, int32_t dtype,
                                        int64_t r, int64_t count, int32_t row_bytes, int32_t d) {
    if (codes != NULL) {
        fm_kvq_request(to, (const char *)codes + r * row_bytes, row_bytes * count);
    } else {
        const int64_t esize = dtype == FM_DTYPE_F32 ? 4 : 2;
        fm_kvq_request(to, (const char *)dense + r * d * esize, d * esize * count);
    }
}

/* Requests every cache line attention reads of storage rows [r, r + count):
 * K and V (codes or dense) and their norms (at once, or into `to`). */
static inline void fm_kvq_prefetch_rows(FMKVQLines *to, const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a,
                                        int64_t r, int64_t count) {
    const int32_t d = p->head_dim, nb = d / p->block;
    fm_kvq_prefetch_side(to, a->k_codes, a->k_dense, a->dense_dtype, r, count, p->k_row_bytes, d);
    fm_kvq_prefetch_side(to, a->v_codes, a->v_dense, a->dense_dtype, r, count, p->v_row_bytes, d);
    if (a->k_norms != NULL) fm_kvq_request(to, (const char *)(a->k_norms + r * nb), count * nb * 4);
    if (a->v_norms != NULL) fm_kvq_request(to, (const char *)(a->v_norms + r * nb), count * nb * 4);
}

static inline void fm_kvq_prefetch_row(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t r) {
    fm_kvq_prefetch_rows(NULL, p, a, r, 1);
}

#define FM_KVQ_DECLARE(sfx)                           \
    void fm_kvq_keys_##sfx(const FMKVQKeys *k);       \
    void fm_kvq_prefill_##sfx(const FMKVQKeys *k);
FM_KVQ_DECLARE(portable)
#if defined(__x86_64__)
FM_KVQ_DECLARE(avx2)
FM_KVQ_DECLARE(avx512)
void fm_kvq_keys_avx512vbmi(const FMKVQKeys *k);
#endif
#if defined(__aarch64__)
FM_KVQ_DECLARE(neon)
#endif
#endif
