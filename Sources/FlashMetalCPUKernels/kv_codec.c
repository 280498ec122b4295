/* The quantized-KV codec on the cpu. Encode and dequantize are bit for bit
 * the kv_codec.metal kernels:
 * the same Hadamard butterflies, the same pairwise tree for each block's sum
 * of squares (level 0 fmaf(a, a, b * b) over the two halves of the block,
 * then halving), the same divisions and the shared tables and code search of
 * kv_codec.h. Built with -ffp-contract=off, so no other product is fused.
 * The decode over codes follows the kernel's math, not its summation order
 * (it is held to a tolerance, not to bits). */
#include <math.h>
#include <string.h>

#include "fm_kv_codec.h"
#include "half_convert.h"
#include "fm_cpu_kernels.h"
#include "kv_codes_keys.h"
#include "../../Resources/shaders/kv_codec.h"

/* The sign bits (1 = -1) of coordinates [0, d) for `seed`, cached per
 * thread: every row and query of one cache shares them, and splitmix64 per
 * coordinate for each of them cost as much as a short decode's key loop. Bit
 * i depends on (seed, i) only, so a longer cached prefix serves a shorter d;
 * d <= FM_KVQ_MAX_HEAD_DIM (every codec head dim). */
static const uint8_t *kvq_signs(uint64_t seed, int32_t d) {
    static _Thread_local uint64_t cached_seed;
    static _Thread_local int32_t cached_d; /* 0: nothing cached */
    static _Thread_local uint8_t bits[FM_KVQ_MAX_HEAD_DIM];
    if (cached_d < d || cached_seed != seed) {
        for (int32_t i = 0; i < d; i++) bits[i] = (uint8_t)fm_kvq_sign_bit(seed, (uint32_t)i);
        cached_seed = seed;
        cached_d = d;
    }
    return bits;
}

/* The unnormalised Hadamard transform of every block of z. */
static void hadamard(float *z, int32_t d, int32_t block) {
    for (int32_t h = 1; h < block; h <<= 1) {
        for (int32_t base = 0; base < d; base += 2 * h) {
            for (int32_t i = base; i < base + h; i++) {
                const float a = z[i], b = z[i + h];
                z[i] = a + b;
                z[i + h] = a - b;
            }
        }
    }
}

/* sqrt(sum z^2 / n) of one block, summed in the kernels' tree order. */
static float block_norm(const float *z, int32_t n) {
    float t[FM_KVQ_MAX_HEAD_DIM / 2];
    const int32_t half_n = n / 2;
    for (int32_t i = 0; i < half_n; i++) t[i] = fmaf(z[i], z[i], z[i + half_n] * z[i + half_n]);
    for (int32_t s = half_n / 2; s >= 1; s >>= 1) {
        for (int32_t i = 0; i < s; i++) t[i] = t[i] + t[i + s];
    }
    return sqrtf(t[0] * (1.0f / (float)n));
}

static void load_row(float *z, const void *x, int32_t dtype, int64_t row, int32_t d) {
    if (dtype == FM_DTYPE_F32) {
        memcpy(z, (const float *)x + row * d, (size_t)d * sizeof(float));
    } else {
        fm_load_row(z, (const uint16_t *)x + row * d, d, dtype == FM_DTYPE_BF16);
    }
}

/* The centroids of a row of packed `bits`-bit codes (8 codes in `bits`
 * bytes, little-endian), with the width a constant after inlining. */
static inline __attribute__((always_inline)) void unpack_width(const uint8_t *row, int32_t d, const float *table,
                                                              int32_t bits, float *out) {
    const uint32_t mask = (1u << bits) - 1u;
    for (int32_t g = 0; g < d / 8; g++) {
        uint64_t w = 0;
        for (int32_t b = 0; b < bits; b++) w |= (uint64_t)row[g * bits + b] << (8 * b);
        for (int32_t j = 0; j < 8; j++) out[g * 8 + j] = table[(w >> (bits * j)) & mask];
    }
}

static void unpack_centroids(const uint8_t *row, int32_t d, int32_t bits, float *out) {
    switch (bits) {
    case 2: unpack_width(row, d, FM_KVQ_C2, 2, out); break;
    case 3: unpack_width(row, d, FM_KVQ_C3, 3, out); break;
    case 4: unpack_width(row, d, FM_KVQ_C4, 4, out); break;
    case 5: unpack_width(row, d, FM_KVQ_C5, 5, out); break;
    case 6: unpack_width(row, d, FM_KVQ_C6, 6, out); break;
    default: unpack_width(row, d, FM_KVQ_C8, 8, out); break;
    }
}

/* Encodes the signed, loaded row z (transformed in place) into one row of
 * codes and norms. */
static void encode_row(const KVCodecParams *p, float *z, uint8_t *out, float *norms) {
    const int32_t d = p->head_dim, n = p->block, bits = p->bits, nb = d / n;
    const uint8_t *neg = kvq_signs(p->seed, d);
    for (int32_t i = 0; i < d; i++) {
        if (neg[i]) z[i] = -z[i];
    }
    hadamard(z, d, n);
    for (int32_t k = 0; k < nb; k++) {
        const float r = block_norm(z + k * n, n);
        norms[k] = r;
        for (int32_t g = k * n / 8; g < (k + 1) * n / 8; g++) {
            uint64_t w = 0;
            for (int32_t j = 0; j < 8; j++) {
                const float u = r > 0.0f ? z[g * 8 + j] / r : 0.0f;
                w |= (uint64_t)fm_kvq_code(bits, u) << (bits * j);
            }
            for (int32_t b = 0; b < bits; b++) out[g * bits + b] = (uint8_t)(w >> (8 * b));
        }
    }
    const int32_t used = d * bits / 8;
    memset(out + used, 0, (size_t)(p->row_bytes - used));
}

void fm_cpu_kv_encode_rows(const KVCodecParams *p, const void *x, int32_t dtype, uint8_t *codes, float *norms,
                           int64_t begin, int64_t end) {
    const int32_t d = p->head_dim, nb = d / p->block;
    float z[FM_KVQ_MAX_HEAD_DIM];
    for (int64_t row = begin; row < end; row++) {
        load_row(z, x, dtype, row, d);
        encode_row(p, z, codes + row * p->row_bytes, norms + row * nb);
    }
}

void fm_cpu_kv_codes_append_item(const KVCodesAppendParams *p, const FMCPUKVCodesAppendArgs *a, int32_t n_kv_heads,
                                 int64_t item) {
    const int64_t g = item % n_kv_heads, bi = item / n_kv_heads, i = bi % p->n_new, b = bi / p->n_new;
    const int64_t key = (int64_t)a->seqlens[b] + i;
    int64_t row;
    if (a->block_table != NULL) {
        const int64_t page = a->block_table[b * p->max_pages + key / p->page_size];
        row = page * p->cache_strides[0] + (key % p->page_size) * p->cache_strides[1];
    } else {
        row = b * p->cache_strides[0] + key * p->cache_strides[1];
    }
    row += g * p->cache_strides[2];
    const int64_t src = b * p->new_strides[0] + i * p->new_strides[1] + g * p->new_strides[2];
    const int32_t d = p->k.head_dim;
    const size_t esize = a->dtype == FM_DTYPE_F32 ? 4 : 2;
    float z[FM_KVQ_MAX_HEAD_DIM];
    /* src is a multiple of d, so it is a row index of the [*, D] view. */
    if (a->k_dense != NULL) {
        memcpy((char *)a->k_dense + (size_t)(row * d) * esize, (const char *)a->k_new + (size_t)src * esize,
               (size_t)d * esize);
    } else {
        load_row(z, a->k_new, a->dtype, src / d, d);
        encode_row(&p->k, z, a->k_codes + row * p->k.row_bytes, a->k_norms + row * (d / p->k.block));
    }
    if (a->v_dense != NULL) {
        memcpy((char *)a->v_dense + (size_t)(row * d) * esize, (const char *)a->v_new + (size_t)src * esize,
               (size_t)d * esize);
    } else {
        load_row(z, a->v_new, a->dtype, src / d, d);
        encode_row(&p->v, z, a->v_codes + row * p->v.row_bytes, a->v_norms + row * (d / p->v.block));
    }
}

void fm_cpu_kv_dequantize_rows(const KVCodecParams *p, const uint8_t *codes, const float *norms, float *out,
                               int64_t begin, int64_t end) {
    const int32_t d = p->head_dim, n = p->block, bits = p->bits, nb = d / n;
    const float inv_n = 1.0f / (float)n;
    float z[FM_KVQ_MAX_HEAD_DIM];
    for (int64_t row = begin; row < end; row++) {
        unpack_centroids(codes + row * p->row_bytes, d, bits, z);
        hadamard(z, d, n);
        float *o = out + row * d;
        const uint8_t *neg = kvq_signs(p->seed, d);
        for (int32_t i = 0; i < d; i++) {
            const float v = z[i] * (norms[row * nb + i / n] * inv_n);
            o[i] = neg[i] ? -v : v;
        }
    }
}

static int32_t floor_div(int32_t a, int32_t b) {
    const int32_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

static void build_tables(FMKVQTables *t) {
    for (int32_t v = 0; v < 256; v++) {
        t->by4[v][0] = FM_KVQ_C4[v & 15];
        t->by4[v][1] = FM_KVQ_C4[v >> 4];
        for (int32_t j = 0; j < 4; j++) t->by2[v][j] = FM_KVQ_C2[(v >> (2 * j)) & 3];
    }
    t->c8 = FM_KVQ_C8;
    for (int32_t b = 0; b < 9; b++) t->c[b] = NULL;
    t->c[2] = FM_KVQ_C2;
    t->c[3] = FM_KVQ_C3;
    t->c[4] = FM_KVQ_C4;
    t->c[5] = FM_KVQ_C5;
    t->c[6] = FM_KVQ_C6;
    t->c[8] = FM_KVQ_C8;
    for (int32_t b = 0; b < 5; b++) {
        for (int32_t j = 0; j < 16; j++) t->rep16[b][j] = b >= 2 ? t->c[b][j & ((1 << b) - 1)] : 0.0f;
    }
    for (int32_t c = 0; c < 16; c++) {
        uint32_t u;
        memcpy(&u, &FM_KVQ_C4[c], sizeof u);
        for (int32_t k = 0; k < 4; k++) t->planes4[k][c] = (uint8_t)(u >> (8 * k));
    }
    for (int32_t e = 0; e < 128; e++) {
        uint32_t u;
        memcpy(&u, &FM_KVQ_C8[128 + e], sizeof u);
        for (int32_t k = 0; k < 4; k++) t->planes8[k][e] = (uint8_t)(u >> (8 * k));
    }
}

static void keys_route(const FMKVQKeys *k) {
#if defined(__x86_64__)
    switch (fm_cpu_isa()) {
    case FM_ISA_AVX2: fm_kvq_keys_avx2(k); return;
    case FM_ISA_AVX512:
    case FM_ISA_AVX512VBMI:
    case FM_ISA_AVX512BF16:
        if (fm_cpu_vbmi()) fm_kvq_keys_avx512vbmi(k); else fm_kvq_keys_avx512(k);
        return;
    default: fm_kvq_keys_portable(k); return;
    }
#elif defined(__aarch64__)
    if (fm_cpu_isa() == FM_ISA_NEON) fm_kvq_keys_neon(k); else fm_kvq_keys_portable(k);
#else
    fm_kvq_keys_portable(k);
#endif
}

/* The keys of sequence b: its length (beside cu_seqlens_k, flash-attn 3's
 * seqused_k), else its cu_seqlens_k count, else kv_len. */
static int32_t key_count(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t b) {
    if (a->seqlens != NULL) return a->seqlens[b];
    return a->cu_seqlens_k != NULL ? a->cu_seqlens_k[b + 1] - a->cu_seqlens_k[b] : p->kv_len;
}

/* The position of query row qi of rows_b among kl keys (bottom-right
 * aligned). */
static inline int32_t row_position(int32_t kl, int32_t rows_b, int32_t qi) { return kl - rows_b + qi; }

/* The keys [lo, hi) (hi >= lo) query row qi of rows_b sees among kl keys
 * (at row_position). In 64 bits: a window or chunk near INT32_MAX must not
 * wrap around the row's position. */
static void key_range(const KVCodesDecodeParams *p, int32_t kl, int32_t rows_b, int32_t qi, int32_t *lo_out,
                      int32_t *hi_out) {
    const int32_t pos = row_position(kl, rows_b, qi);
    int64_t lo = 0, hi = kl;
    if (p->causal && (int64_t)pos + 1 < hi) hi = (int64_t)pos + 1;
    if (p->window_left >= 0 && (int64_t)pos - p->window_left > lo) lo = (int64_t)pos - p->window_left;
    if (p->window_right >= 0 && (int64_t)pos + p->window_right + 1 < hi) hi = (int64_t)pos + p->window_right + 1;
    if (p->attention_chunk > 0) {
        const int64_t c0 = (int64_t)floor_div(pos, p->attention_chunk) * p->attention_chunk;
        if (c0 > lo) lo = c0;
        if (c0 + p->attention_chunk < hi) hi = c0 + p->attention_chunk;
    }
    *lo_out = (int32_t)lo;
    *hi_out = (int32_t)(hi < lo ? lo : hi);
}

/* Where a work item sits: sequence b, its query row qi of rows_b, kv head
 * g, its query heads [h0, h0 + heads) of the group, and the keys [lo, hi)
 * the row sees. 0 when the item is past the last varlen sequence. */
/* Items of one query row whose places fm_cpu_kv_codes_decode_row keeps. */
#define FM_KVQ_ROW_PLACES 64

typedef struct ItemPlace {
    int64_t b, qi, bi, g, row0;
    int32_t h0, heads, lo, hi;
    int32_t pos; /* the row's position among its keys (bottom-right aligned) */
} ItemPlace;

static int place_item(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t item, ItemPlace *o) {
    const int32_t group = p->n_heads / p->n_kv_heads;
    const int32_t chunks = (group + FM_CPU_KVQ_HEAD_CHUNK - 1) / FM_CPU_KVQ_HEAD_CHUNK;
    const int64_t big = item / chunks, bi = big / p->n_kv_heads, g = big % p->n_kv_heads;
    int64_t b = bi / p->q_len, qi = bi % p->q_len, rows_b = p->q_len;
    if (a->cu_seqlens_q != NULL) {
        /* The sequence holding token bi: the last b with cu_q[b] <= bi. */
        if (bi >= a->cu_seqlens_q[p->batch]) return 0;  /* past the last sequence: no row to write */
        int64_t lo = 0, hi = p->batch;
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (a->cu_seqlens_q[mid] <= bi) lo = mid; else hi = mid;
        }
        b = lo;
        qi = bi - a->cu_seqlens_q[b];
        rows_b = a->cu_seqlens_q[b + 1] - a->cu_seqlens_q[b];
    }
    o->b = b;
    o->qi = qi;
    o->bi = bi;
    o->g = g;
    o->h0 = (int32_t)(item % chunks) * FM_CPU_KVQ_HEAD_CHUNK;
    o->heads = group - o->h0 < FM_CPU_KVQ_HEAD_CHUNK ? group - o->h0 : FM_CPU_KVQ_HEAD_CHUNK;
    o->row0 = bi * p->n_heads + g * group + o->h0;
    const int32_t kl = key_count(p, a, b);
    o->pos = row_position(kl, (int32_t)rows_b, (int32_t)qi);
    key_range(p, kl, (int32_t)rows_b, (int32_t)qi, &o->lo, &o->hi);
    return 1;
}

int64_t fm_cpu_kv_codes_part_floats(const KVCodesDecodeParams *p) {
    return (int64_t)FM_CPU_KVQ_HEAD_CHUNK * (2 * p->head_dim + 2);
}

/* Query row `row` of a->q in the K side's basis, into out [D]: signed and
 * transformed as the keys were when the K side holds codes, else copied. */
static void rotate_query(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t row, float *out) {
    const int32_t d = p->head_dim;
    const uint8_t *neg = a->k_dense == NULL ? kvq_signs(p->k_seed, d) : NULL;
    for (int32_t i = 0; i < d; i++) {
        const float v = a->q[row * d + i];
        out[i] = neg != NULL && neg[i] ? -v : v;
    }
    if (a->k_dense == NULL) hadamard(out, d, p->block);
}

/* Whether the decode's key loop (the ISA fm_cpu_isa() picks) keeps a side
 * in row order (fm_kvq_row_order). */
static int side_row_order(const KVCodesDecodeParams *p, int32_t bits, const void *dense) {
#if defined(__x86_64__)
    const int isa = fm_cpu_isa();
    const int avx512 = isa == FM_ISA_AVX512 || isa == FM_ISA_AVX512VBMI || isa == FM_ISA_AVX512BF16;
#else
    const int avx512 = 0;
#endif
    return fm_kvq_row_order(avx512, bits, dense, p->head_dim, p->block);
}

/* rows [count, D] from natural order into row order (to_rows) or back. */
static void reorder_rows(float *z, int64_t count, int32_t d, int to_rows) {
    float t[FM_KVQ_MAX_HEAD_DIM];
    for (int64_t r = 0; r < count; r++) {
        float *row = z + r * d;
        for (int32_t c = 0; c < d; c++) {
            const int32_t at = fm_kvq_row_order_at(c);
            if (to_rows) t[at] = row[c]; else t[c] = row[at];
        }
        memcpy(row, t, sizeof(float) * (size_t)d);
    }
}

/* The query of an item's heads in the K side's basis, and its softmax state
 * zeroed, in `state`: acc [CHUNK, D], mx [CHUNK], sum [CHUNK], qz [CHUNK, D]. */
static void start_item(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, const ItemPlace *at,
                       float *state) {
    const int32_t d = p->head_dim;
    float *acc = state, *mx = state + FM_CPU_KVQ_HEAD_CHUNK * d, *sum = mx + FM_CPU_KVQ_HEAD_CHUNK;
    float *qz = sum + FM_CPU_KVQ_HEAD_CHUNK;
    /* Rows past the item's heads are zero: the key loop may run them. */
    memset(acc, 0, sizeof(float) * FM_CPU_KVQ_HEAD_CHUNK * (size_t)d);
    memset(qz, 0, sizeof(float) * FM_CPU_KVQ_HEAD_CHUNK * (size_t)d);
    for (int32_t j = 0; j < at->heads; j++) {
        rotate_query(p, a, at->row0 + j, qz + (int64_t)j * d);
        mx[j] = FM_RUNNING_MAX_START;
        sum[j] = 0.0f;
    }
    if (side_row_order(p, p->k_bits, a->k_dense)) reorder_rows(qz, at->heads, d, 1);
}

/* The keys [start, end) of one item (prefetch_next, ahead: FMKVQKeys's). */
static void run_keys(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, const FMKVQTables *tables,
                     const ItemPlace *at, float *state, int32_t start, int32_t end, int32_t prefetch_next,
                     const FMKVQLines *ahead) {
    const int32_t d = p->head_dim;
    float *mx = state + FM_CPU_KVQ_HEAD_CHUNK * d, *sum = mx + FM_CPU_KVQ_HEAD_CHUNK;
    FMKVQKeys k = {.p = p, .a = a, .tables = tables, .b = at->b, .g = at->g, .heads = at->heads, .start = start,
                   .end = end, .qz = sum + FM_CPU_KVQ_HEAD_CHUNK, .mx = mx, .sum = sum, .acc = state,
                   .prefetch_next = prefetch_next,
                   .ahead = ahead != NULL ? (const char *const *)ahead->lines : NULL,
                   .ahead_n = ahead != NULL ? ahead->n : 0};
    int32_t pos[FM_CPU_KVQ_HEAD_CHUNK];
    if (a->alibi != NULL) {
        for (int32_t j = 0; j < at->heads; j++) pos[j] = at->pos;
        k.slopes = a->alibi + at->b * p->n_heads + at->g * (p->n_heads / p->n_kv_heads) + at->h0;
        k.pos = pos;
    }
    keys_route(&k);
}

/* Requests every kv head's rows (codes or dense rows, and norms) of keys
 * [k0, k1) of sequence b, into `to`: the kv heads of one key lie within one
 * run of rows in fm_cpu_kv_codes_decode_row's layouts (a head stride below
 * the key stride), so each side is one run of lines per key. */
static void prefetch_keys(FMKVQLines *to, const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t b,
                          int32_t k0, int32_t k1) {
    int64_t rows[FM_KVQ_ROW_BLOCK];
    const int64_t heads_span = (p->n_kv_heads - 1) * p->kv_strides[1] + 1;
    for (int32_t c0 = k0; c0 < k1; c0 += FM_KVQ_ROW_BLOCK) {
        const int32_t n = k1 - c0 < FM_KVQ_ROW_BLOCK ? k1 - c0 : FM_KVQ_ROW_BLOCK;
        fm_kvq_rows(p, a, b, 0, c0, n, rows);
        for (int32_t t = 0; t < n; t++) fm_kvq_prefetch_rows(to, p, a, rows[t], heads_span);
    }
}

void fm_cpu_kv_codes_decode_row(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t bi,
                                int32_t split, int32_t nsplit, float *parts) {
    const int32_t group = p->n_heads / p->n_kv_heads;
    const int64_t per = (int64_t)p->n_kv_heads * ((group + FM_CPU_KVQ_HEAD_CHUNK - 1) / FM_CPU_KVQ_HEAD_CHUNK);
    const int64_t stride = fm_cpu_kv_codes_part_floats(p);
    ItemPlace at;
    if (!place_item(p, a, bi * per, &at)) return;
    /* Every item of the row sees the same keys; this share of them. */
    const int64_t len = at.hi - at.lo;
    const int32_t s0 = (int32_t)(at.lo + len * split / nsplit), s1 = (int32_t)(at.lo + len * (split + 1) / nsplit);
    /* The places of the row's first items, kept for every block. */
    ItemPlace places[FM_KVQ_ROW_PLACES];
    for (int64_t item = bi * per; item < (bi + 1) * per; item++) {
        place_item(p, a, item, &at);
        if (item - bi * per < FM_KVQ_ROW_PLACES) places[item - bi * per] = at;
        start_item(p, a, &at, parts + (item * nsplit + split) * stride);
    }
    FMKVQTables tables;
    build_tables(&tables);
    /* Blocks of keys, every kv head's rows of a block read before the next
     * block: the heads of one key sit side by side in memory. Each pass
     * requests its share of the rows of every head FM_KVQ_ROW_AHEAD keys
     * ahead, so the requests spread over the work. */
    for (int32_t k0 = s0; k0 < s1; k0 += FM_KVQ_ROW_BLOCK) {
        const int32_t k1 = s1 - k0 < FM_KVQ_ROW_BLOCK ? s1 : k0 + FM_KVQ_ROW_BLOCK;
        for (int64_t item = bi * per; item < (bi + 1) * per; item++) {
            const int64_t local = item - bi * per;
            const ItemPlace *it = &at;
            if (local < FM_KVQ_ROW_PLACES) {
                it = &places[local];
            } else {
                place_item(p, a, item, &at);
            }
            /* This pass's share of the keys FM_KVQ_ROW_AHEAD ahead, requested
             * while the pass runs (lines past the list's room at once). */
            const int32_t a0 = k0 + FM_KVQ_ROW_AHEAD, a1 = k1 + FM_KVQ_ROW_AHEAD < s1 ? k1 + FM_KVQ_ROW_AHEAD : s1;
            const char *lines[FM_KVQ_AHEAD_LINES];
            FMKVQLines ahead = {lines, 0, FM_KVQ_AHEAD_LINES};
            if (a1 > a0) {
                prefetch_keys(&ahead, p, a, at.b, a0 + (int32_t)((a1 - a0) * local / per),
                              a0 + (int32_t)((a1 - a0) * (local + 1) / per));
            }
            run_keys(p, a, &tables, it, parts + (item * nsplit + split) * stride, k0, k1, 0, &ahead);
        }
    }
}

/* Sinks, LSE, the V rotation undone and the output rows of one item, from
 * its softmax state. */
static void finish_item(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, const ItemPlace *at, float *mx,
                        float *sum, float *acc) {
    const int32_t d = p->head_dim, n = p->block, group = p->n_heads / p->n_kv_heads;
    const float inv_n = 1.0f / (float)n;
    for (int32_t j = 0; j < at->heads; j++) {
        float *aj = acc + (int64_t)j * d;
        const int32_t h = (int32_t)(at->g * group + at->h0 + j);
        if (a->sinks != NULL) {
            /* The sink joins the denominator without a value; +inf takes the row. */
            const float s = a->sinks[h];
            const float m_new = s > mx[j] ? s : mx[j];
            const float c = s == INFINITY ? 0.0f : expf(mx[j] - m_new);
            sum[j] = s == INFINITY ? INFINITY : sum[j] * c + expf(s - m_new);
            for (int32_t i = 0; i < d; i++) aj[i] *= c;
            mx[j] = m_new;
        }
        if (a->lse != NULL) {
            const int64_t o = a->cu_seqlens_q != NULL ? (int64_t)h * p->q_len + at->bi
                                                      : (at->b * p->n_heads + h) * p->q_len + at->qi;
            a->lse[o] = sum[j] > 0.0f ? mx[j] + logf(sum[j]) : -INFINITY;
        }
        const int v_codes = a->v_dense == NULL;
        if (v_codes) hadamard(aj, d, n);
        const float norm = sum[j] > 0.0f ? (v_codes ? inv_n : 1.0f) / sum[j] : 0.0f;
        const uint8_t *neg = v_codes ? kvq_signs(p->v_seed, d) : NULL;
        for (int32_t i = 0; i < d; i++) {
            const float v = aj[i] * norm;
            a->o[(at->row0 + j) * d + i] = neg != NULL && neg[i] ? -v : v;
        }
    }
}

void fm_cpu_kv_codes_decode_item(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t item,
                                 int32_t split, int32_t nsplit, float *parts) {
    ItemPlace at;
    if (!place_item(p, a, item, &at)) return;
    const int32_t d = p->head_dim;
    float local[FM_CPU_KVQ_HEAD_CHUNK * (2 * FM_KVQ_MAX_HEAD_DIM + 2)] __attribute__((aligned(64)));
    float *state = nsplit > 1 ? parts + (item * nsplit + split) * fm_cpu_kv_codes_part_floats(p) : local;
    start_item(p, a, &at, state);
    /* Split `split` of nsplit: a contiguous share of [lo, hi). */
    const int64_t len = at.hi - at.lo;
    FMKVQTables tables;
    build_tables(&tables);
    run_keys(p, a, &tables, &at, state, (int32_t)(at.lo + len * split / nsplit),
             (int32_t)(at.lo + len * (split + 1) / nsplit), 1, NULL);
    if (nsplit == 1) {
        float *mx = state + FM_CPU_KVQ_HEAD_CHUNK * d;
        if (side_row_order(p, p->v_bits, a->v_dense)) reorder_rows(state, at.heads, d, 0);
        finish_item(p, a, &at, mx, mx + FM_CPU_KVQ_HEAD_CHUNK, state);
    }
}

void fm_cpu_kv_codes_decode_merge(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t item,
                                  int32_t nsplit, const float *parts) {
    ItemPlace at;
    if (!place_item(p, a, item, &at)) return;
    const int32_t d = p->head_dim;
    const int64_t stride = fm_cpu_kv_codes_part_floats(p);
    float acc[FM_CPU_KVQ_HEAD_CHUNK * FM_KVQ_MAX_HEAD_DIM], mx[FM_CPU_KVQ_HEAD_CHUNK], sum[FM_CPU_KVQ_HEAD_CHUNK];
    const float *first = parts + item * nsplit * stride;
    for (int32_t j = 0; j < at.heads; j++) {
        float m = FM_RUNNING_MAX_START;
        for (int32_t s = 0; s < nsplit; s++) {
            const float ms = first[s * stride + FM_CPU_KVQ_HEAD_CHUNK * d + j];
            if (ms > m) m = ms;
        }
        float total = 0.0f;
        for (int32_t i = 0; i < d; i++) acc[j * d + i] = 0.0f;
        for (int32_t s = 0; s < nsplit; s++) {
            const float *part = first + s * stride;
            const float c = expf(part[FM_CPU_KVQ_HEAD_CHUNK * d + j] - m);
            total += part[FM_CPU_KVQ_HEAD_CHUNK * (d + 1) + j] * c;
            for (int32_t i = 0; i < d; i++) acc[j * d + i] += part[j * d + i] * c;
        }
        mx[j] = m;
        sum[j] = total;
    }
    if (side_row_order(p, p->v_bits, a->v_dense)) reorder_rows(acc, at.heads, d, 0);
    finish_item(p, a, &at, mx, sum, acc);
}

_Static_assert(FM_CPU_KVQ_PREFILL_STEP % FM_KVQ_PREFILL_ROWS == 0 && FM_CPU_KVQ_PREFILL_ITEMS % FM_CPU_KVQ_PREFILL_STEP == 0,
               "prefill work items are whole threadgroups");

static void prefill_route(const FMKVQKeys *k) {
#if defined(__x86_64__)
    switch (fm_cpu_isa()) {
    case FM_ISA_AVX2: fm_kvq_prefill_avx2(k); return;
    case FM_ISA_AVX512:
    case FM_ISA_AVX512VBMI:
    case FM_ISA_AVX512BF16: fm_kvq_prefill_avx512(k); return;
    default: fm_kvq_prefill_portable(k); return;
    }
#elif defined(__aarch64__)
    if (fm_cpu_isa() == FM_ISA_NEON) fm_kvq_prefill_neon(k); else fm_kvq_prefill_portable(k);
#else
    fm_kvq_prefill_portable(k);
#endif
}

int64_t fm_cpu_kv_codes_prefill_scratch_floats(const KVCodesDecodeParams *p) {
    const int64_t d = p->head_dim;
    return FM_CPU_KVQ_PREFILL_ITEMS * d + (FM_CPU_KVQ_PREFILL_ITEMS + FM_KVQ_PREFILL_PAD) * d
           + fm_kvq_prefill_tile_floats(p->head_dim);
}

void fm_cpu_kv_codes_prefill_items(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t first,
                                   int32_t n_items, int64_t g, int64_t b, float *scratch) {
    enum { ROWS = FM_CPU_KVQ_PREFILL_ITEMS };
    const int32_t d = p->head_dim, group = p->n_heads / p->n_kv_heads;
    int64_t rows_b = p->q_len, tok0 = b * p->q_len;
    if (a->cu_seqlens_q != NULL) {
        tok0 = a->cu_seqlens_q[b];
        rows_b = a->cu_seqlens_q[b + 1] - tok0;
    }
    const int64_t items = rows_b * group;
    if (first >= items) return;
    const int32_t most = n_items < ROWS ? n_items : ROWS;
    const int32_t count = items - first < most ? (int32_t)(items - first) : most;
    const int32_t kl = key_count(p, a, b);
    /* The rotated queries [ROWS, D], the accumulators [ROWS + PAD, D], then
     * the tiles of the ISA's key loop. */
    float *qz = scratch, *acc = qz + (int64_t)ROWS * d;
    float mx[ROWS], sum[ROWS];
    int32_t lo[ROWS], hi[ROWS], pos[ROWS];
    float slopes[ROWS];
    ItemPlace at[ROWS];
    int32_t t_lo = INT32_MAX, t_hi = 0;
    memset(acc, 0, sizeof(float) * (size_t)(count + FM_KVQ_PREFILL_PAD) * (size_t)d);
    for (int32_t s = 0; s < count; s++) {
        const int64_t item = first + s, qi = item / group, j = item % group;
        ItemPlace *o = &at[s];
        o->b = b;
        o->qi = qi;
        o->bi = tok0 + qi;
        o->g = g;
        o->h0 = (int32_t)j;
        o->heads = 1;
        o->row0 = o->bi * p->n_heads + g * group + j;
        key_range(p, kl, (int32_t)rows_b, (int32_t)qi, &lo[s], &hi[s]);
        pos[s] = row_position(kl, (int32_t)rows_b, (int32_t)qi);
        slopes[s] = a->alibi != NULL ? a->alibi[b * p->n_heads + g * group + j] : 0.0f;
        if (lo[s] < hi[s]) {
            if (lo[s] < t_lo) t_lo = lo[s];
            if (hi[s] > t_hi) t_hi = hi[s];
        }
        rotate_query(p, a, o->row0, qz + (int64_t)s * d);
        mx[s] = FM_RUNNING_MAX_START;
        sum[s] = 0.0f;
    }
    if (t_lo < t_hi) {
        FMKVQTables tables;
        build_tables(&tables);
        const FMKVQKeys k = {.p = p, .a = a, .tables = &tables, .b = b, .g = g, .heads = count, .start = t_lo,
                             .end = t_hi, .qz = qz, .mx = mx, .sum = sum, .acc = acc, .lo = lo, .hi = hi,
                             .scratch = acc + (int64_t)(ROWS + FM_KVQ_PREFILL_PAD) * d,
                             .slopes = a->alibi != NULL ? slopes : NULL, .pos = pos};
        prefill_route(&k);
    }
    for (int32_t s = 0; s < count; s++) finish_item(p, a, &at[s], &mx[s], &sum[s], acc + (int64_t)s * d);
}
