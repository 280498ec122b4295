/* Native kernels of the cpu backend. Each call computes one independent work
 * item (e.g. one prefill query tile), so the Swift side can spread items over
 * threads. All index arithmetic is 64-bit. */
#ifndef FM_CPU_KERNELS_H
#define FM_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include "flashmetal.h"
#include "flashmetal_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif


/* The serving extension of a prefill dispatch (flashmetal_kernels.h, AttnSeqParams):
 * the tensors its function constants bind, NULL when unbound. Zeroed, the
 * dispatch is the plain prefill. Per-sequence mode is any of cu_seqlens_q,
 * cu_seqlens_k, seqlens_k, block_table bound; then row i of sequence b sits at
 * t = kL_b - qL_b + i, else at AttnParams.qL_off + i. */
typedef struct FMPrefillSeq {
    AttnSeqParams sp;
    const int32_t *cu_seqlens_q; /* [B+1], FM_FC_VARLEN_Q */
    const int32_t *cu_seqlens_k; /* [B+1], FM_FC_VARLEN_K */
    const int32_t *seqlens_k;    /* [B], FM_FC_KV_LENS */
    const int32_t *block_table;  /* [B, max_pages], FM_FC_PAGED: checked by the host */
    const float *sinks;          /* [H], FM_FC_HAS_SINKS */
    float *lse;                  /* FM_FC_HAS_LSE, at sp.lse_strides */
    const float *alibi;          /* [B, H] slopes, FM_FC_HAS_ALIBI: score -= slope * |t - p| */
    int32_t window;              /* FM_FC_WINDOW: sp.window_left/right apply */
    int32_t _pad;
} FMPrefillSeq;

typedef struct FMPrefillArgs {
    AttnParams p;
    AttnMaskParams mp;
    const void *q;
    const void *k;
    const void *v;
    void *o;
    const void *mask;
    const uint8_t *blk; /* NULL or [NQ, NK] tile classes */
    int32_t io_dtype;   /* FM_DTYPE_BF16, F16 (portable and fast) or F32 (fast only);
                           also the additive mask's */
    int32_t mask_kind;
    int32_t causal;
    int32_t bq;         /* tile geometry of the dispatch */
    int32_t bk;
    FMPrefillSeq seq;   /* zeroed: none of the serving extension */
    int64_t panel_blocks; /* fast path: key blocks packed per (sequence, kv head),
                             fm_cpu_prefill_panel_blocks; set by the driver */
} FMPrefillArgs;

/* Rows of sequence b (AttnParams.qL outside per-sequence mode). */
int64_t fm_cpu_prefill_seq_rows(const FMPrefillArgs *a, int64_t b);
/* Keys the rows [r0, r0 + n) of sequence b may see, counted over the union
 * of their visible ranges: the cost of a work item, for scheduling. */
int64_t fm_cpu_prefill_rows_keys(const FMPrefillArgs *a, int64_t b, int64_t r0, int64_t n);

/* Floats of scratch one prefill work item needs. */
size_t fm_cpu_prefill_scratch_floats(int32_t bq, int32_t bk, int32_t d);

/* One (batch, head, query tile) of flash attention with online softmax; a
 * tile past the sequence's rows does nothing. */
void fm_cpu_prefill_tile(const FMPrefillArgs *a, int64_t b, int64_t h, int64_t qtile,
                         float *scratch);


/* ---- run-time ISA selection (cpu_features.c) ---------------------------- */
enum {
    FM_ISA_PORTABLE = 0,   /* plain C for the baseline of the target */
    FM_ISA_AVX2 = 1,       /* x86-64 AVX2 + FMA + F16C */
    FM_ISA_AVX512 = 2,     /* + AVX-512 F/BW/DQ/VL */
    FM_ISA_AVX512VBMI = 3, /* + AVX512-VBMI (the decode over 8-bit codes) */
    FM_ISA_AVX512BF16 = 4, /* + AVX512-BF16 (VBMI where the CPU has it too) */
    FM_ISA_NEON = 5        /* arm64 Advanced SIMD */
};

/* The ISA the fast kernels use: detected once per process, capped by
 * FLASHMETAL_CPU_ISA (portable | avx2 | avx512 | avx512vbmi | avx512bf16 |
 * neon; never raised above what the CPU has; an unknown value or another
 * architecture's ISA warns on stderr and is ignored or means portable).
 * x86 levels rise in that order, but AVX512-BF16 does not imply VBMI (Cooper
 * Lake has one without the other): fm_cpu_vbmi says whether the path
 * includes it. */
int fm_cpu_isa(void);
/* Whether the selected x86 path may use AVX512-VBMI: the CPU has it and
 * fm_cpu_isa() is avx512vbmi or above. */
int fm_cpu_vbmi(void);
/* "portable", "avx2", "avx512", "avx512vbmi", "avx512bf16" or "neon". */
const char *fm_cpu_isa_name(int isa);
int64_t fm_atomic_fetch_add_i64(int64_t *p, int64_t v);

/* ---- prefill fast path (prefill_fast.c -> kernels_<isa>.c) --------------- *
 * K/V of one (batch, kv head) are packed once into panels of FM_PF_KB keys,
 * shared by the GQA heads and q items. A work item is
 * fm_cpu_prefill_item_rows(isa) query rows of one head; rows are independent
 * and key blocks start at absolute multiples of FM_PF_KB, so results do not
 * depend on the item split, the thread count or the dispatch's q offset. */
#define FM_PF_KB 64
/* Whether the fast path covers this call on `isa` (head dim, dtype, ISA). */
int fm_cpu_prefill_fast_covers(const FMPrefillArgs *a, int isa);
/* Key blocks the panels of one (b, kv head) hold: only blocks some row of
 * the sequence sees (its rows' visible ranges: length, causal, window), the
 * most over the dispatch's sequences. Set a->panel_blocks to it before
 * asking for pack bytes, packing or running items. */
int64_t fm_cpu_prefill_panel_blocks(const FMPrefillArgs *a);
/* Bytes of packed K+V for one (b, kv head): a->panel_blocks panels; 0 when
 * the fast path does not cover the call. */
size_t fm_cpu_prefill_pack_bytes(const FMPrefillArgs *a, int isa);
int32_t fm_cpu_prefill_item_rows(int isa);
/* Packs the j-th visible key block (FM_PF_KB keys) of (b, kvh) into
 * `packed` (gathered through the block table when paged); j past the
 * sequence's visible blocks, or a block no row sees, is left unpacked (no
 * item reads it). */
void fm_cpu_prefill_pack(const FMPrefillArgs *a, int isa, int64_t b, int64_t kvh, int64_t j,
                         void *packed);
/* Floats of scratch one fast work item needs. */
size_t fm_cpu_prefill_fast_scratch_floats(const FMPrefillArgs *a, int isa);
/* Rows [qi * item_rows, +item_rows) of head h of sequence b (rows past the
 * sequence's end are not written). */
void fm_cpu_prefill_fast_item(const FMPrefillArgs *a, int isa, int64_t b, int64_t h, int64_t qi,
                              const void *packed, float *scratch);

/* ---- blk pre-pass: one (q tile, k tile) of a [qL, kL] 16-bit additive mask.
 * Writes blk[qt * nk + kt]: 0 every cell -inf, 2 every cell 0, else 1 (a
 * partial right-edge K tile is 1, a tile wholly past kL is 0). */
void fm_cpu_blk_tile(const BlkParams *p, const uint16_t *mask, int32_t mask_is_bf16,
                     uint8_t *blk, int32_t bq, int32_t bk, int64_t nk, int64_t qt, int64_t kt);
/* The same for a bool mask (1 byte per cell, true = attend: 0, false: -inf). */
void fm_cpu_blk_tile_bool(const BlkParams *p, const uint8_t *mask, uint8_t *blk, int32_t bq, int32_t bk,
                          int64_t nk, int64_t qt, int64_t kt);
/* The same for a float32 additive mask. */
void fm_cpu_blk_tile_f32(const BlkParams *p, const float *mask, uint8_t *blk, int32_t bq, int32_t bk,
                         int64_t nk, int64_t qt, int64_t kt);

/* ---- mask builder: one row i of a [qL, kL] 16-bit mask (0 / -inf). */
void fm_cpu_mask_row(const MaskParams *p, uint16_t *out, int32_t is_bf16, int64_t i);

/* ---- decode (vec) -------------------------------------------------------
 * One call's decode, as the Swift backend reads it from a Dispatch. Rows
 * r = b * n_heads + h (b < batch) of q [rows, D]; row r reads kv head
 * g = h / (n_heads / n_kv_heads) of sequence b, key p at
 *   block_table: k + block_table[b*max_pages + p/page_size]*k_strides[0]
 *                  + g*k_strides[1] + (p % page_size)*k_strides[2]
 *   else:        k + b*k_strides[0] + g*k_strides[1] + p*k_strides[2]
 * (elements; V likewise). The plain decode's [(B,) Hkv, cap, D] call is batch 1
 * with n_heads = B*H, n_kv_heads = B*Hkv, strides (0, cap*D, D).
 * kv_len_b = seqlens ? seqlens[b] : p.kv_seq_len; the query sits at
 * kv_len_b - 1 and sees keys [lo_b, kv_len_b), lo_b = kv_len_b - w for the
 * sliding window w (mask_type 2), else 0, raised to the sequence's first key
 * f_b and to its chunk's start with attention_chunk. Every seqlens/block_table value
 * was validated by the host. */
typedef struct FMVecArgs {
    FlashAttnVecParams p;
    const float *q;
    const void *k;
    const void *v;
    float *tmp;                 /* partials: O [rows, nwg, D], then (S, M) [rows, nwg, 2] */
    const int32_t *seqlens;     /* NULL: p.kv_seq_len for every sequence */
    const int32_t *block_table; /* NULL: not paged */
    int64_t k_strides[3];
    int64_t v_strides[3];
    int64_t page_size;          /* with block_table */
    int64_t max_pages;          /* with block_table */
    int64_t batch;
    int32_t kv_dtype;           /* FMDType: f32, f16 or bf16 */
    int32_t attention_chunk;    /* c > 0: a row at t sees keys in [s, s + c), s = f_b + floor((t - f_b) / c) * c; 0 = off */
    const int32_t *key_starts;  /* NULL: f_b = 0, else f_b = key_starts[b] (cache_leftpad): keys < f_b hidden */
    const float *alibi;         /* NULL, or [B, H] ALiBi slopes: key p of head h of sequence b (query at t)
                                   scores -alibi[b * H + h] * |t - p| more, after the softcap */
    int64_t q_rows;             /* query rows L per sequence (0 or 1: one, at kv_len_b - 1); row i
                                   sits at t = kv_len_b - L + i; q/tmp rows are (b * L + i) * H + h */
    int64_t window_right;       /* keys p > t + window_right are hidden (causal: 0); -1 = unbounded */
    int64_t head_major;         /* 1: q/tmp rows are (b * H + h) * L + i instead */
} FMVecArgs;

/* The split of keys over workgroups: FM_VEC_CHUNK in flashmetal_kernels.h. */

/* The partials of one (kv row = b * n_kv_heads + g, workgroup) into tmp,
 * for every query row of that kv head's GQA group: K and V are read once
 * per group. A workgroup without keys writes S = 0 (its O is not read). */
void fm_cpu_vec_item(const FMVecArgs *a, int64_t kvrow, int64_t wg, float *scratch);
/* The same for every kv head of sequence b, a tile of keys at a time: the
 * item order for caches whose heads of one key are adjacent
 * (fm_cpu_vec_key_major); the same bits as fm_cpu_vec_item. */
void fm_cpu_vec_item_keys(const FMVecArgs *a, int64_t b, int64_t wg, float *scratch);
/* 1 when the heads of one key sit closer together than one head's
 * consecutive keys (k_strides[1] < k_strides[2]: flash-attn's
 * [B, cap, Hkv, D] and its pages): then items go by sequence. */
int fm_cpu_vec_key_major(const FMVecArgs *a);
/* Workgroups that have keys in the busiest sequence (<= p.nwg): the others
 * only write empty partials, so they need no worker. */
int64_t fm_cpu_vec_active_wgs(const FMVecArgs *a);
/* The empty partials (S = 0) of workgroups [wg_from, nwg) of every row. */
void fm_cpu_vec_empty_partials(const FMVecArgs *a, int64_t wg_from);
/* Floats of scratch one vec item of either order needs (heap: nothing
 * gqa-sized goes on a thread's stack). */
size_t fm_cpu_vec_scratch_floats(const FMVecArgs *a);
/* The longest row the reduce rounds into a 16-bit output (the decode's widest head dim). */
enum { FM_VEC_ROUNDED_ROW_MAX = 576 };
/* Reduce of one row: combines nwg partials of tmp into out[row], out of
 * out_dtype (FMDType: f32, or f16/bf16 rounded to nearest even from the
 * float32 result, d <= FM_VEC_ROUNDED_ROW_MAX). With fwht,
 * applies y = s * (H_D x) / sqrt(D); signs NULL means all +1. sinks (NULL:
 * none) is float32 [heads]: the row's sink logit sinks[head] joins the
 * denominator once, without a value. lse (NULL: none) receives
 * log(sum of e^s [+ e^sink]) in natural units, -inf for a row that sees no
 * key and has no sink. */
void fm_cpu_vec_reduce_row(const float *tmp, void *out, int32_t out_dtype, int64_t nrows, int32_t d, int32_t nwg,
                           int64_t row, int32_t fwht, const uint8_t *signs, const float *sinks,
                           float *lse, int64_t head);
/* n elements of dtype (FMDType: f32, f16 or bf16) as float32 (exact). */
void fm_cpu_widen_to_f32(const void *src, int32_t dtype, int64_t n, float *dst);
/* n float32 elements into dtype (FMDType: f32, f16 or bf16), each rounded to
 * nearest even. */
void fm_cpu_round_from_f32(const float *src, int32_t dtype, int64_t n, void *dst);

/* ---- sdpa: one (batch, head, 32-row q tile). dtype FM_DTYPE_F32, F16 or
 * BF16. ext: NULL (bottom-right positions) or the SdpaExtParams
 * of flashmetal_kernels.h; use_softcap reads ext->softcap. mask_kind FM_MASK_*: an
 * additive mask has Q's dtype; mp holds its (batch, head, row) strides. */
void fm_cpu_sdpa_tile(const SdpaParams *p, const SdpaExtParams *ext, int32_t use_softcap, const void *q,
                      const void *k, const void *v, void *o, int32_t dtype, const void *mask,
                      const AttnMaskParams *mp, int32_t mask_kind, int64_t b, int64_t h, int64_t qtile,
                      int32_t tile_q, float *scratch);
size_t fm_cpu_sdpa_scratch_floats(int32_t d);

/* ---- kv_append: row i of sequence b of k_new/v_new (all kv heads) into the
 * caches at row seqlens[b] + i (KVAppendParams; block_table NULL unless
 * paged). Bytes are copied unchanged; elem_bytes is the dtype's size. */
void fm_cpu_kv_append_row(const KVAppendParams *p, const void *k_new, const void *v_new, void *k_cache,
                          void *v_cache, const int32_t *seqlens, const int32_t *block_table,
                          int32_t elem_bytes, int64_t b, int64_t i);

/* ---- rotary: row i of sequence b of x [B, L, H, D] (every head) rotated
 * into out (RotaryParams); x_dtype and cs_dtype are FMDType f32/f16/bf16 of
 * x (and out) and of the cos/sin tables. */
void fm_cpu_rotary_row(const RotaryParams *p, const void *x, const void *cos_table, const void *sin_table,
                       const int32_t *offsets, void *out, int32_t x_dtype, int32_t cs_dtype, int64_t b,
                       int64_t i);

#ifdef __cplusplus
}
#endif
#endif
