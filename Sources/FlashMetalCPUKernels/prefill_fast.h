/* Private to the fast prefill: helpers shared by every ISA instance of
 * prefill_body.h and the per-ISA entry points prefill_fast.c dispatches to. */
#ifndef FM_PREFILL_FAST_H
#define FM_PREFILL_FAST_H
#include "fm_cpu_kernels.h"
#include "half_convert.h"
#include "kernel_math.h"
#include "prefill_seq.h"

/* Largest head dim of the fast path (MLA's q/k 576; row buffers on the stack are this big). */
#define FM_PF_DMAX 576

/* The head dim of the packed panels, q rows and O accumulators: the larger
 * of D (q's and k's) and Dv (v's) rounded up to a multiple of 16 (the widest
 * vector), zeros past D in q rows and K panels and past Dv in V panels, so
 * any pair runs on whole vectors. */
static inline int32_t fm_pf_dp(const FMPrefillArgs *a) {
    return ((a->p.D > a->p.Dv ? a->p.D : a->p.Dv) + 15) & ~15;
}

/* The dims of DP each side computes over: QK^T reads q rows and K panels
 * below D rounded up to 16 (fm_pf_dk), P.V's column blocks span Dv rounded
 * up to 16 (fm_pf_dv); past them the panels hold only zeros, which would
 * add exact zeros (576 over 512, MLA: 64 columns of P.V saved). */
static inline int32_t fm_pf_dk(const FMPrefillArgs *a) { return (a->p.D + 15) & ~15; }
static inline int32_t fm_pf_dv(const FMPrefillArgs *a) { return (a->p.Dv + 15) & ~15; }

/* Key blocks [*kb0, *kb1) some row of sequence `sd` sees: a row's range
 * grows with its position, so the union runs from row 0's lo to the last
 * row's hi (empty: kb0 == kb1). */
static inline void fm_pf_seq_blocks(const FMPrefillArgs *a, const FMPfSeqDims *sd, int64_t *kb0, int64_t *kb1) {
    *kb0 = *kb1 = 0;
    if (sd->qL <= 0 || sd->kL <= 0) return;
    int64_t lo, hi, lo2, hi2;
    fm_pf_row_keys(a, sd->t0, sd, &lo, &hi);
    fm_pf_row_keys(a, sd->t0 + sd->qL - 1, sd, &lo2, &hi2);
    if (lo > hi2) return;
    *kb0 = lo / FM_PF_KB;
    *kb1 = hi2 / FM_PF_KB + 1;
}

/* True when every (BQ, BK) tile that rows [ra, rb] x keys [c0, c0 + kc) touch is class 0. */
int fm_pf_blk_all_skip(const FMPrefillArgs *a, int64_t ra, int64_t rb, int64_t c0, int64_t kc);

#define FM_PF_DECLARE(sfx)                                                                          \
    int32_t fm_pf_item_rows_##sfx(void);                                                            \
    size_t fm_pf_pack_bytes_##sfx(const FMPrefillArgs *a);                                          \
    size_t fm_pf_scratch_floats_##sfx(const FMPrefillArgs *a);                                      \
    void fm_pf_pack_##sfx(const FMPrefillArgs *a, int64_t b, int64_t kvh, int64_t j, void *packed);  \
    void fm_pf_item_##sfx(const FMPrefillArgs *a, int64_t b, int64_t h, int64_t qi,                 \
                          const void *packed, float *scratch);

#if defined(__x86_64__)
FM_PF_DECLARE(avx2)
FM_PF_DECLARE(avx512)
FM_PF_DECLARE(avx512bf16)
#endif
#if defined(__aarch64__)
FM_PF_DECLARE(neon)
#endif
#endif
