/* Which keys a decode workgroup reads (vec.c and every ISA's vec_body.h). */
#ifndef FM_VEC_SPLIT_H
#define FM_VEC_SPLIT_H
#include "fm_cpu_kernels.h"

/* Keys per tile of a decode item (a multiple of every FM_VL): with 32 the K
 * and V tiles of a 16-bit cache stay in L1 (measured: 64 and 128 ran 10-25%
 * slower at D = 128; no difference for float32). */
#define FM_VEC_TILE 32

/* The per-ISA instances of vec_body.h that vec.c dispatches to. */
#define FM_VEC_DECLARE(sfx)                                                                  \
    void fm_vec_item_##sfx(const FMVecArgs *a, int64_t kvrow, int64_t wg, float *scratch); \
    void fm_vec_item_keys_##sfx(const FMVecArgs *a, int64_t b, int64_t wg, float *scratch);
FM_VEC_DECLARE(portable)
#if defined(__x86_64__)
FM_VEC_DECLARE(avx2)
FM_VEC_DECLARE(avx512)
#endif
#if defined(__aarch64__)
FM_VEC_DECLARE(neon)
#endif

/* Where row `row`'s (S, M) pair of workgroup wg sits in tmp, in floats
 * (vec.c's layout: O partials [nrows, nwg, d] (d: v's head dim), then (S, M) pairs
 * [nrows, nwg, 2]). */
static inline int64_t fm_vec_sm_offset(int64_t nrows, int64_t nwg, int64_t d, int64_t row, int64_t wg) {
    return nrows * nwg * d + (row * nwg + wg) * 2;
}

/* Query rows per sequence (1 for the decode). */
static inline int64_t fm_vec_qrows(const FMVecArgs *a) { return a->q_rows > 1 ? a->q_rows : 1; }

/* Rows between one query head's row and the next head's (q, tmp and out):
 * 1, or L when the rows are head-major ([B, H, L, D]). */
static inline int64_t fm_vec_head_rows(const FMVecArgs *a) { return a->head_major ? fm_vec_qrows(a) : 1; }

static inline float *fm_vec_sm(const FMVecArgs *a, int64_t row, int64_t wg) {
    return a->tmp + fm_vec_sm_offset(a->batch * fm_vec_qrows(a) * (int64_t)a->p.n_heads, a->p.nwg,
                                     a->p.head_dim_v, row, wg);
}

/* Items go by sequence, every head inside a tile (fm_vec_item_keys), when
 * the heads of one key sit closer together than one head's consecutive keys
 * (flash-attn's [B, cap, Hkv, D] and its pages); by kv head otherwise. */
static inline int fm_vec_key_major(const FMVecArgs *a) {
    return a->p.n_kv_heads > 1 && a->k_strides[1] < a->k_strides[2];
}

/* The keys [*lo, *hi) (*lo <= *hi) query row qi of sequence b sees: it sits
 * at t = kv_len_b - L + qi (L = fm_vec_qrows); keys before the sequence's
 * first key f_b are hidden, the window keeps p > t - w, its attention chunk
 * is [s, s + c) with s = f_b + (t - f_b) / c * c (none when t < f_b), and keys past
 * t + window_right are hidden. Both bounds grow with qi. */
static inline void fm_vec_row_visible(const FMVecArgs *a, int64_t b, int64_t qi, int64_t *lo, int64_t *hi) {
    const int64_t len = a->seqlens ? (int64_t)a->seqlens[b] : (int64_t)a->p.kv_seq_len;
    const int64_t first = a->key_starts ? (int64_t)a->key_starts[b] : 0;
    const int64_t t = len - fm_vec_qrows(a) + qi;
    int64_t l = first, h = len;
    if (a->p.mask_type == FM_VEC_MASK_WINDOW && t + 1 - (int64_t)a->p.sliding_window > l) {
        l = t + 1 - (int64_t)a->p.sliding_window;
    }
    if (a->attention_chunk > 0 && t >= first) {
        const int64_t start = first + (t - first) / a->attention_chunk * a->attention_chunk;
        if (start > l) l = start;
        if (start + a->attention_chunk < h) h = start + a->attention_chunk; /* keys right of t */
    } else if (a->attention_chunk > 0 && first < h) {
        h = first; /* empty, below every later row's keys: the union stays exact */
    }
    if (a->window_right >= 0 && t + 1 + a->window_right < h) h = t + 1 + a->window_right;
    if (h < 0) h = 0;
    *lo = l < h ? l : h;
    *hi = h;
}

/* The keys [*lo, *hi) any query row of sequence b sees: the union of its
 * rows' ranges. */
static inline void fm_vec_visible(const FMVecArgs *a, int64_t b, int64_t *lo, int64_t *hi) {
    int64_t l0, h0, l1, h1;
    fm_vec_row_visible(a, b, 0, &l0, &h0);
    fm_vec_row_visible(a, b, fm_vec_qrows(a) - 1, &l1, &h1);
    *lo = l0;
    *hi = h1 > l0 ? h1 : l0;
}

/* Workgroups with keys for the visible range [lo, hi): one per chunk, at
 * most nwg. */
static inline int64_t fm_vec_busy_wgs(int64_t lo, int64_t hi, int64_t nwg) {
    if (hi <= lo) return 0;
    const int64_t chunks = (hi + FM_VEC_CHUNK - 1) / FM_VEC_CHUNK - lo / FM_VEC_CHUNK;
    return chunks < nwg ? chunks : nwg;
}

/* Workgroup wg's keys [*s, *e) of [lo, hi): the chunks cut at absolute
 * multiples of FM_VEC_CHUNK, dealt evenly (to within one chunk) over the
 * first fm_vec_busy_wgs workgroups as contiguous runs; empty (*s == *e) for
 * the others. Contiguous runs keep the hardware prefetcher streaming. */
static inline void fm_vec_wg_keys(int64_t lo, int64_t hi, int64_t nwg, int64_t wg, int64_t *s, int64_t *e) {
    const int64_t busy = fm_vec_busy_wgs(lo, hi, nwg);
    *s = *e = 0;
    if (wg >= busy) return;
    const int64_t c0 = lo / FM_VEC_CHUNK, chunks = (hi + FM_VEC_CHUNK - 1) / FM_VEC_CHUNK - c0;
    const int64_t a = (c0 + chunks * wg / busy) * FM_VEC_CHUNK;
    const int64_t b = (c0 + chunks * (wg + 1) / busy) * FM_VEC_CHUNK;
    *s = a > lo ? a : lo;
    *e = b < hi ? b : hi;
}
#endif
