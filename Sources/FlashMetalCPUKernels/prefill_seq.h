/* Where a prefill's rows and keys are, and which keys each row sees: the
 * serving extension's rules (flashmetal_kernels.h, AttnSeqParams) in one place for
 * the portable tile kernel (prefill.c) and every ISA instance of the fast
 * one (prefill_body.h).
 *
 * Every visibility rule of a row is a bound on the key index, so the keys a
 * row sees form one range [lo, hi] (empty when lo > hi): kL_b, causal and
 * window_right bound hi, window_left and the sequence's first key bound lo,
 * the attention chunk of t bounds both. Both ends never decrease as t grows. Kernels skip key blocks
 * outside the range and kill the cells of the blocks they cut; the mask of
 * the plain prefill's path is applied on top. */
#ifndef FM_PREFILL_SEQ_H
#define FM_PREFILL_SEQ_H
#include <math.h>
#include "fm_cpu_kernels.h"
#include "kernel_math.h"

/* One sequence of a dispatch. */
typedef struct FMPfSeqDims {
    int64_t qL; /* its query rows */
    int64_t kL; /* its keys */
    int64_t qs; /* its first row in q/o/lse (varlen q), else 0 */
    int64_t t0; /* position of its row 0 */
    int64_t f0; /* its first key (cache_leftpad: keys before it are hidden), else 0 */
} FMPfSeqDims;

static inline int fm_pf_per_sequence(const FMPrefillArgs *a) {
    const FMPrefillSeq *s = &a->seq;
    return s->cu_seqlens_q || s->cu_seqlens_k || s->seqlens_k || s->block_table;
}

static inline FMPfSeqDims fm_pf_seq_dims(const FMPrefillArgs *a, int64_t b) {
    const FMPrefillSeq *s = &a->seq;
    FMPfSeqDims d = {a->p.qL, a->p.kL, 0, a->p.qL_off, 0};
    if (!fm_pf_per_sequence(a)) return d;
    if (s->cu_seqlens_q) {
        d.qs = s->cu_seqlens_q[b];
        d.qL = (int64_t)s->cu_seqlens_q[b + 1] - d.qs;
    }
    /* seqlens_k counts the keys even beside cu_seqlens_k (its start offsets): flash-attn 3's seqused_k. */
    if (s->seqlens_k) {
        d.kL = s->seqlens_k[b];
        if (s->sp.key_starts_at > 0) d.f0 = s->seqlens_k[s->sp.key_starts_at + b];
    } else if (s->cu_seqlens_k) {
        d.kL = (int64_t)s->cu_seqlens_k[b + 1] - s->cu_seqlens_k[b];
    }
    d.t0 = d.kL - d.qL;
    return d;
}

/* floor(x / c) for c > 0. */
static inline int64_t fm_floor_div(int64_t x, int64_t c) {
    return x >= 0 ? x / c : -((-x + c - 1) / c);
}

/* Keys [*lo, *hi] visible to the row at position t of sequence sd. */
static inline void fm_pf_row_keys(const FMPrefillArgs *a, int64_t t, const FMPfSeqDims *sd, int64_t *lo,
                                  int64_t *hi) {
    int64_t l = sd->f0, h = sd->kL - 1;
    if (a->causal && t < h) h = t;
    if (a->seq.window) {
        const int64_t wl = a->seq.sp.window_left, wr = a->seq.sp.window_right;
        if (wl >= 0 && t - wl > l) l = t - wl;
        if (wr >= 0 && t + wr < h) h = t + wr;
        const int64_t c = a->seq.sp.attention_chunk;
        if (c > 0) {
            /* chunks count from the first key; t < f0 (qL > kL) rounds down */
            const int64_t start = sd->f0 + fm_floor_div(t - sd->f0, c) * c;
            if (start > l) l = start;
            if (start + c - 1 < h) h = start + c - 1;
        }
    }
    *lo = l;
    *hi = h;
}

/* The ALiBi slope of head h of sequence b (0 without slopes), and the bias
 * it puts on key p of the row at position t: -slope * |t - p|, natural units,
 * added after the softcap. */
static inline float fm_pf_alibi_slope(const FMPrefillArgs *a, int64_t b, int64_t h) {
    return a->seq.alibi ? a->seq.alibi[b * a->p.H + h] : 0.0f;
}
static inline float fm_pf_alibi_bias(float slope, int64_t t, int64_t p) {
    return -slope * (float)(t >= p ? t - p : p - t);
}

/* Element offset of key p of kv head g of sequence b in K (strides, page
 * stride of K) or V. */
static inline int64_t fm_pf_key_offset(const FMPrefillArgs *a, int64_t b, int64_t g, int64_t p,
                                       const int64_t strides[3], int64_t page_stride) {
    const FMPrefillSeq *s = &a->seq;
    if (s->block_table) {
        const int64_t ps = s->sp.page_size;
        const int64_t page = s->block_table[b * s->sp.max_pages + p / ps];
        return page * page_stride + g * strides[1] + (p % ps) * strides[2];
    }
    if (s->cu_seqlens_k) return g * strides[1] + ((int64_t)s->cu_seqlens_k[b] + p) * strides[2];
    return b * strides[0] + g * strides[1] + p * strides[2];
}

/* Element offset of row i (of the sequence) of head h of sequence b in a
 * tensor with (batch, head, row) strides: q, o, lse. */
static inline int64_t fm_pf_row_offset(const FMPfSeqDims *d, int64_t b, int64_t h, int64_t i,
                                       const int64_t strides[3]) {
    return b * strides[0] + h * strides[1] + (d->qs + i) * strides[2];
}

/* The end of a row: 1/denominator for its accumulated output, and *lse.
 * m: running max, l: the sum the output's weights add up to, l_lse: the sum
 * for the LSE (l itself, or the unrounded sum where p was rounded to bf16);
 * natural units. The sink joins both without a value (a +inf sink takes all
 * the mass: factor 0, LSE +inf; fm_sink_term). A row with an empty
 * denominator outputs 0 and has LSE -inf; without a sink the factor is 1/l
 * exactly as before the extension. */
static inline float fm_pf_finish_row(const FMPrefillArgs *a, int64_t h, float m, float l, float l_lse, float *lse) {
    float mx = m, f = 1.0f, extra = 0.0f;
    if (a->seq.sinks) {
        const float sink = a->seq.sinks[h];
        if (sink > mx) mx = sink;
        f = expf(m - mx);
        extra = fm_sink_term(sink, mx);
    }
    const float tot = a->seq.sinks ? l * f + extra : l;
    const float tot_lse = a->seq.sinks ? l_lse * f + extra : l_lse;
    *lse = tot_lse == 0.0f ? -INFINITY : mx + logf(tot_lse);
    return tot == 0.0f ? 0.0f : f / tot;
}

/* Writes the LSE of row i of head h of sequence b when the dispatch asks. */
static inline void fm_pf_store_lse(const FMPrefillArgs *a, const FMPfSeqDims *d, int64_t b, int64_t h, int64_t i,
                                   float lse) {
    if (a->seq.lse) a->seq.lse[fm_pf_row_offset(d, b, h, i, a->seq.sp.lse_strides)] = lse;
}
#endif
