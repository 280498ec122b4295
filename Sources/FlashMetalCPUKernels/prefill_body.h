/* The fast prefill, described once and compiled per ISA: kernels_<isa>.c
 * defines FM_VL (floats per vector), FM_PF_R x FM_PF_NC (register block:
 * rows x vectors), FM_PF_GROUPS (row blocks per work item), FM_SFX(name)
 * and, where the ISA has a bf16 pair dot product, FM_PF_BF16DP with
 * fm_dpbf16(acc, a_pairs, b_pairs); then includes simd.h and this file.
 *
 * K/V of one (batch, kv head) are packed once into panels of FM_PF_KB keys,
 * shared by the GQA heads and all q items: only the blocks some row of the
 * sequence sees (fm_pf_seq_blocks; a->panel_blocks panels, so a window over
 * a long cache packs the window, not the cache), each cut into the register
 * block's column blocks so that a micro-kernel reads one contiguous run
 * (CW = NC * FM_VL keys of K; a column block of w <= CW dims of V):
 *   f32 panels (any io dtype): K as [KB/CW][DP][CW] f32, V as column blocks
 *     [KB][w] f32;
 *   bf16 pair panels (FM_PF_BF16DP, bf16 io): K as [KB/CW][DP/2][CW] bf16
 *     pairs, V as column blocks [KB/2][w] bf16 pairs; P is rounded to bf16
 *     (RNE) and the row sum uses the rounded values.
 * DP is max(D, Dv) rounded up to a multiple of 16 (fm_pf_dp): q rows and K
 * panels hold zeros in dims [D, DP), V panels in [Dv, DP), read from nothing
 * past a row's D (Dv) elements, so the micro-kernels always see whole
 * vectors; the zeros add exactly +0 to every score, and the output stores
 * stop at Dv. QK^T runs over the first fm_pf_dk dims, P.V's column blocks
 * (and V's packed ones) over the first fm_pf_dv.
 * A work item is FM_PF_R * FM_PF_GROUPS query rows of one head of one
 * sequence. Where a sequence's rows and keys are and the key range [lo, hi]
 * each row sees (length, causal, window) come from prefill_seq.h; blocks
 * outside a row group's ranges are skipped, cells outside a row's range are
 * masked.
 *
 * Numerics (docs/ARCHITECTURE.md) and the bit-identity contract: a row's score is a dot
 * product in a fixed order over D; key blocks start at absolute multiples of
 * KB; the softmax over a block (max, exp, row sum in a fixed lane order)
 * depends only on the row's own scores, so a row's result depends neither on
 * the other rows of its item, the item's start row nor the thread count. A
 * masked cell is -inf and gets p = 0 exactly; a block in which a row sees
 * nothing leaves max unchanged, factor exp(0) = 1 and adds +0, so skipping it
 * (blk class 0, causal, kv_len) is bit-identical. A cell that is not masked
 * has its score raised to FM_M_INIT (the running max's start) when below it,
 * NaN kept: a row whose keys all carry a huge negative finite bias averages
 * them, as the reference does. NaN and +inf propagate as on the portable
 * path: the running max ignores NaN (s > m is false) and exp(NaN) is NaN. */
#include <math.h>

#define KB FM_PF_KB
#define R FM_PF_R
#define NC FM_PF_NC
#define QI (FM_PF_R * FM_PF_GROUPS)
#define CW (FM_PF_NC * FM_VL)

/* Width of V's column block starting at dc (the last one may be narrower:
 * FM_PF_FOR_COLUMN_BLOCKS). */
static inline int32_t FM_SFX(pf_cw)(int32_t D, int32_t dc) { return D - dc < CW ? D - dc : CW; }

#ifndef FM_PF_BF16DP
#define FM_PF_BF16DP 0
#endif
/* Rounds p to bf16 into 16-bit storage, returning the rounded values; an
 * ISA with a conversion instruction defines its own. */
#ifndef FM_PF_STORE_BF16
#define FM_PF_STORE_BF16 fm_v_store_bf16
#endif

static int FM_SFX(pf_bf16_panels)(const FMPrefillArgs *a) {
    return FM_PF_BF16DP && a->io_dtype == FM_DTYPE_BF16;
}

static size_t FM_SFX(pf_esz)(const FMPrefillArgs *a) { return a->io_dtype == FM_DTYPE_F32 ? 4 : 2; }

/* n elements of src as floats at dst, then zeros up to dp (a multiple of
 * FM_VL); nothing past src's element n - 1 is read. */
static void FM_SFX(pf_cvt_row)(float *dst, const void *src, int32_t n, int32_t dp, int32_t dtype) {
    int32_t i = 0;
    for (; i + FM_VL <= n; i += FM_VL) fm_v_store(dst + i, fm_v_load_any(src, i, dtype));
    if (i < n) {
        fm_v_store(dst + i, fm_v_load_any_n(src, i, n - i, dtype));
        i += FM_VL;
    }
    for (; i < dp; i += FM_VL) fm_v_store(dst + i, fm_v_splat(0.0f));
}

int32_t FM_SFX(fm_pf_item_rows)(void) { return QI; }

size_t FM_SFX(fm_pf_pack_bytes)(const FMPrefillArgs *a) {
    return 2 * (size_t)a->panel_blocks * KB * fm_pf_dp(a) * (FM_SFX(pf_bf16_panels)(a) ? 2 : 4);
}

size_t FM_SFX(fm_pf_scratch_floats)(const FMPrefillArgs *a) {
    /* O, Qf, S, P, then M, L, F, LX */
    return (size_t)QI * fm_pf_dp(a) * 2 + (size_t)QI * KB * 2 + QI * 4;
}

/* Key p of (b, kvh) in K or V (through the block table when paged). */
static inline const char *FM_SFX(pf_key)(const FMPrefillArgs *a, const void *base, int64_t b, int64_t kvh,
                                        int64_t p, const int64_t strides[3], int64_t page_stride) {
    return (const char *)base + FM_SFX(pf_esz)(a) * fm_pf_key_offset(a, b, kvh, p, strides, page_stride);
}

/* When a kv head's rows are not contiguous (flash-attn's [B, cap, Hkv, D]
 * caches and their pages: Hkv rows apart, a stride the hardware
 * prefetchers do not follow), the pack prefetches the K and V rows of the
 * key this far ahead, whole (measured 2 threads, qL = 16 over 32k keys,
 * Hkv = 8, D = 128 bf16: AVX2 93-101 -> 75-82 ms, AVX512-BF16 59-66 ->
 * 45-51 ms). Contiguous rows are left to the hardware. */
#define FM_PF_PACK_AHEAD 8

static inline int FM_SFX(pf_rows_strided)(const FMPrefillArgs *a) {
    return a->p.K_strides[2] > a->p.D || a->p.V_strides[2] > a->p.Dv;
}

static inline void FM_SFX(pf_prefetch_key)(const FMPrefillArgs *a, int64_t b, int64_t kvh, int64_t p) {
    const char *k = FM_SFX(pf_key)(a, a->k, b, kvh, p, a->p.K_strides, a->seq.sp.K_page_stride);
    const char *v = FM_SFX(pf_key)(a, a->v, b, kvh, p, a->p.V_strides, a->seq.sp.V_page_stride);
    for (size_t o = 0; o < (size_t)a->p.D * FM_SFX(pf_esz)(a); o += 64) __builtin_prefetch(k + o);
    for (size_t o = 0; o < (size_t)a->p.Dv * FM_SFX(pf_esz)(a); o += 64) __builtin_prefetch(v + o);
}

/* Packs key block kb of (b, kvh), its kc keys, as panel j. */
static void FM_SFX(pf_pack_f32)(const FMPrefillArgs *a, int64_t b, int64_t kvh, int64_t kb, int64_t j_panel,
                                int64_t kc, void *packed) {
    const AttnParams *p = &a->p;
    const int32_t D = p->D, Dv = p->Dv, DP = fm_pf_dp(a), DV = fm_pf_dv(a);
    const int64_t c0 = kb * KB;
    float *Kf = (float *)packed + (size_t)j_panel * DP * KB;
    float *Vf = (float *)packed + (size_t)a->panel_blocks * DP * KB + (size_t)j_panel * KB * DP;
    float row[FM_PF_DMAX];
    const int strided = FM_SFX(pf_rows_strided)(a);
    for (int64_t j = 0; j < KB; j++) {
        float *kj = Kf + (size_t)(j / CW) * CW * DP + j % CW; /* key j's column, stride CW */
        if (strided && j + FM_PF_PACK_AHEAD < kc) FM_SFX(pf_prefetch_key)(a, b, kvh, c0 + j + FM_PF_PACK_AHEAD);
        if (j < kc) {
            FM_SFX(pf_cvt_row)(row, FM_SFX(pf_key)(a, a->k, b, kvh, c0 + j, p->K_strides, a->seq.sp.K_page_stride),
                               D, DP, a->io_dtype);
            for (int32_t d = 0; d < DP; d++) kj[(size_t)d * CW] = row[d];
            FM_SFX(pf_cvt_row)(row, FM_SFX(pf_key)(a, a->v, b, kvh, c0 + j, p->V_strides, a->seq.sp.V_page_stride),
                               Dv, DP, a->io_dtype);
        } else {
            for (int32_t d = 0; d < DP; d++) kj[(size_t)d * CW] = 0.0f;
            memset(row, 0, sizeof(float) * DP);
        }
        for (int32_t dc = 0; dc < DV; dc += CW) {
            const int32_t w = FM_SFX(pf_cw)(DV, dc);
            memcpy(Vf + (size_t)dc * KB + (size_t)j * w, row + dc, sizeof(float) * w);
        }
    }
}

static void FM_SFX(pf_pack_pairs)(const FMPrefillArgs *a, int64_t b, int64_t kvh, int64_t kb, int64_t j_panel,
                                  int64_t kc, void *packed) {
    const AttnParams *p = &a->p;
    const int32_t D = p->D, Dv = p->Dv, DP = fm_pf_dp(a), DV = fm_pf_dv(a), D2 = DP / 2;
    const int64_t c0 = kb * KB;
    uint32_t *Kp = (uint32_t *)packed + (size_t)j_panel * D2 * KB;
    uint32_t *Vp = (uint32_t *)packed + (size_t)a->panel_blocks * D2 * KB + (size_t)j_panel * (KB / 2) * DP;
    uint32_t row[FM_PF_DMAX / 2];
    const int strided = FM_SFX(pf_rows_strided)(a);
    for (int64_t j = 0; j < KB; j++) {
        if (strided && j + FM_PF_PACK_AHEAD < kc) FM_SFX(pf_prefetch_key)(a, b, kvh, c0 + j + FM_PF_PACK_AHEAD);
        memset(row, 0, sizeof(uint16_t) * DP);
        if (j < kc)
            memcpy(row, FM_SFX(pf_key)(a, a->k, b, kvh, c0 + j, p->K_strides, a->seq.sp.K_page_stride),
                   sizeof(uint16_t) * D);
        for (int32_t q = 0; q < D2; q++) Kp[(size_t)(j / CW) * CW * D2 + (size_t)q * CW + j % CW] = row[q];
    }
    for (int64_t t = 0; t < KB / 2; t++) {
        const int64_t j0 = 2 * t, j1 = 2 * t + 1;
        const uint16_t *v0 = j0 < kc ? (const uint16_t *)FM_SFX(pf_key)(a, a->v, b, kvh, c0 + j0, p->V_strides,
                                                                          a->seq.sp.V_page_stride)
                                     : NULL;
        const uint16_t *v1 = j1 < kc ? (const uint16_t *)FM_SFX(pf_key)(a, a->v, b, kvh, c0 + j1, p->V_strides,
                                                                          a->seq.sp.V_page_stride)
                                     : NULL;
        for (int32_t d = 0; d < DV; d++) {
            const int32_t dc = d - d % CW, w = FM_SFX(pf_cw)(DV, dc);
            Vp[(size_t)dc * (KB / 2) + (size_t)t * w + d - dc] =
                (uint32_t)(v0 && d < Dv ? v0[d] : 0) | ((uint32_t)(v1 && d < Dv ? v1[d] : 0) << 16);
        }
    }
}

void FM_SFX(fm_pf_pack)(const FMPrefillArgs *a, int64_t b, int64_t kvh, int64_t j, void *packed) {
    const FMPfSeqDims sd = fm_pf_seq_dims(a, b);
    int64_t kb0, kb1;
    fm_pf_seq_blocks(a, &sd, &kb0, &kb1);
    const int64_t kb = kb0 + j;
    if (kb >= kb1 || j >= a->panel_blocks) return;
    const int64_t c0 = kb * KB, kc = (sd.kL - c0) < KB ? (sd.kL - c0) : KB;
    if (kc <= 0) return;
    if (FM_SFX(pf_bf16_panels)(a)) FM_SFX(pf_pack_pairs)(a, b, kvh, kb, j, kc, packed);
    else FM_SFX(pf_pack_f32)(a, b, kvh, kb, j, kc, packed);
}

/* ---- micro-kernels: R rows x (NC vectors) ------------------------------ */

/* S[r][0..KB) = Q[r] . K[key] over dims [0, DK) for the R rows of Q (stride DP). */
static void FM_SFX(pf_qk_f32)(const float *Q, const float *Kf, int32_t DP, int32_t DK, float *S) {
    for (int c0 = 0; c0 < KB; c0 += NC * FM_VL) {
        fm_v acc[R][NC];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < NC; i++) acc[r][i] = fm_v_splat(0.0f);
        for (int32_t d = 0; d < DK; d++) {
            fm_v k[NC];
            for (int i = 0; i < NC; i++) k[i] = fm_v_load(Kf + (size_t)c0 * DP + (size_t)d * CW + i * FM_VL);
            for (int r = 0; r < R; r++) {
                const fm_v qb = fm_v_splat(Q[(size_t)r * DP + d]);
                for (int i = 0; i < NC; i++) acc[r][i] = fm_v_fma(qb, k[i], acc[r][i]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < NC; i++) fm_v_store(S + r * KB + c0 + i * FM_VL, acc[r][i]);
    }
}

/* The column blocks of P.V: NC vectors while they fit, then the tail of a
 * head dim that is not a multiple of NC vectors (80, 96 on AVX-512) with
 * fewer. `cols(dc, nv)` must inline with nv constant. */
#define FM_PF_FOR_COLUMN_BLOCKS(D, cols)                                   \
    do {                                                                   \
        int32_t dc_ = 0;                                                   \
        for (; dc_ + NC * FM_VL <= (D); dc_ += NC * FM_VL) cols(dc_, NC);  \
        const int rem_ = ((D) - dc_) / FM_VL;                              \
        if (NC > 1 && rem_ == 1) cols(dc_, 1);                             \
        if (NC > 2 && rem_ == 2) cols(dc_, 2);                             \
        if (NC > 3 && rem_ == 3) cols(dc_, 3);                             \
    } while (0)

/* Columns [dc, dc + nv * FM_VL) of O[r] (rows DP apart) = O[r] * F[r] +
 * sum_j P[r][j] V[j] over the first nk keys. */
static inline __attribute__((always_inline)) void FM_SFX(pf_pv_cols_f32)(const float *P, const float *Vf, int32_t DP,
                                                                          int nk, const float *F, float *O,
                                                                          int32_t dc, const int nv) {
    fm_v acc[R][NC];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = fm_v_load(O + (size_t)r * DP + dc + i * FM_VL) * F[r];
    for (int j = 0; j < nk; j++) {
        fm_v v[NC];
        for (int i = 0; i < nv; i++) v[i] = fm_v_load(Vf + (size_t)dc * KB + (size_t)j * nv * FM_VL + i * FM_VL);
        for (int r = 0; r < R; r++) {
            const fm_v pb = fm_v_splat(P[r * KB + j]);
            for (int i = 0; i < nv; i++) acc[r][i] = fm_v_fma(pb, v[i], acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < nv; i++) fm_v_store(O + (size_t)r * DP + dc + i * FM_VL, acc[r][i]);
}

/* P.V into O's columns [0, DV) (rows DP apart). */
static void FM_SFX(pf_pv_f32)(const float *P, const float *Vf, int32_t DP, int32_t DV, int nk, const float *F,
                              float *O) {
#define FM_PF_COLS(dc, nv) FM_SFX(pf_pv_cols_f32)(P, Vf, DP, nk, F, O, dc, nv)
    FM_PF_FOR_COLUMN_BLOCKS(DV, FM_PF_COLS);
#undef FM_PF_COLS
}

#if FM_PF_BF16DP
static inline fm_vi FM_SFX(pf_pair)(const uint16_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return (fm_vi)(int32_t)w;
}

static void FM_SFX(pf_qk_pairs)(const uint16_t *const q[R], const uint32_t *Kp, int32_t DP, int32_t DK,
                                float *S) {
    for (int c0 = 0; c0 < KB; c0 += NC * FM_VL) {
        fm_v acc[R][NC];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < NC; i++) acc[r][i] = fm_v_splat(0.0f);
        for (int32_t pi = 0; pi < DK / 2; pi++) {
            fm_vi k[NC];
            for (int i = 0; i < NC; i++)
                memcpy(&k[i], Kp + (size_t)c0 * (DP / 2) + (size_t)pi * CW + i * FM_VL, sizeof k[i]);
            for (int r = 0; r < R; r++) {
                const fm_vi qb = FM_SFX(pf_pair)(q[r] + 2 * pi);
                for (int i = 0; i < NC; i++) acc[r][i] = fm_dpbf16(acc[r][i], qb, k[i]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < NC; i++) fm_v_store(S + r * KB + c0 + i * FM_VL, acc[r][i]);
    }
}

/* P: per row KB bf16 values at P + r * 2 * KB (uint16 units). */
static inline __attribute__((always_inline)) void FM_SFX(pf_pv_cols_pairs)(const uint16_t *P, const uint32_t *Vp,
                                                                            int32_t DP, int npairs, const float *F,
                                                                            float *O, int32_t dc, const int nv) {
    fm_v acc[R][NC];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < nv; i++) acc[r][i] = fm_v_load(O + (size_t)r * DP + dc + i * FM_VL) * F[r];
    for (int t = 0; t < npairs; t++) {
        fm_vi v[NC];
        for (int i = 0; i < nv; i++)
            memcpy(&v[i], Vp + (size_t)dc * (KB / 2) + (size_t)t * nv * FM_VL + i * FM_VL, sizeof v[i]);
        for (int r = 0; r < R; r++) {
            const fm_vi pb = FM_SFX(pf_pair)(P + (size_t)r * 2 * KB + 2 * t);
            for (int i = 0; i < nv; i++) acc[r][i] = fm_dpbf16(acc[r][i], pb, v[i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < nv; i++) fm_v_store(O + (size_t)r * DP + dc + i * FM_VL, acc[r][i]);
}

static void FM_SFX(pf_pv_pairs)(const uint16_t *P, const uint32_t *Vp, int32_t DP, int32_t DV, int npairs,
                                const float *F, float *O) {
#define FM_PF_COLS(dc, nv) FM_SFX(pf_pv_cols_pairs)(P, Vp, DP, npairs, F, O, dc, nv)
    FM_PF_FOR_COLUMN_BLOCKS(DV, FM_PF_COLS);
#undef FM_PF_COLS
}
#endif

/* ---- scores and the online softmax of one row over one key block -------- */

static fm_v FM_SFX(pf_mask_values)(const FMPrefillArgs *a, const char *mrow, int64_t k0, int n) {
    if (n == FM_VL) return fm_v_load_any(mrow, k0, a->io_dtype);
    float t[FM_VL];
    for (int i = 0; i < FM_VL; i++) {
        if (i >= n) { t[i] = 0.0f; continue; }
        if (a->io_dtype == FM_DTYPE_F32) t[i] = ((const float *)mrow)[k0 + i];
        else {
            const uint16_t h = ((const uint16_t *)mrow)[k0 + i];
            t[i] = a->io_dtype == FM_DTYPE_BF16 ? fm_bf16_to_f32(h) : fm_f16_to_f32(h);
        }
    }
    return fm_v_load(t);
}

/* Scores of FM_VL keys [j0, j0 + FM_VL) of one row from their raw dot
 * products: scale, softcap, the ALiBi bias of the row at position t (slope
 * 0: none), mask (per blk class), the floor, then -inf for masked cells (mask
 * -inf, bool false, blk class 0, outside the row's keys [c0 + jlo, c0 + jhi]:
 * past kL, causal, window). */
static inline fm_v FM_SFX(pf_scores)(const FMPrefillArgs *a, fm_v s, int64_t row, int64_t c0, int j0,
                                     int64_t kc, int32_t jlo, int32_t jhi, const char *mrow, float slope,
                                     int64_t t) {
    const AttnParams *p = &a->p;
    const float softcap = p->softcapping;
    s *= p->scale;
    if (softcap > 0) {
        for (int i = 0; i < FM_VL; i++) s[i] = softcap * tanhf(s[i] / softcap);
    }
    if (a->seq.alibi) {
        for (int i = 0; i < FM_VL; i++) s[i] += fm_pf_alibi_bias(slope, t, c0 + j0 + i);
    }
    fm_vi iota;
    for (int i = 0; i < FM_VL; i++) iota[i] = i;
    const fm_vi jj = iota + j0;
    fm_vi kill = (jj >= (int32_t)kc) | (jj < jlo) | (jj > jhi);
    const int nvalid = kc - j0 >= FM_VL ? FM_VL : (kc - j0 > 0 ? (int)(kc - j0) : 0);
    if (mrow && nvalid > 0) {
        const int64_t k0 = c0 + j0;
        fm_vi add = ~kill;
        if (a->blk) {
            const int64_t qt = row / a->bq;
            for (int i = 0; i < nvalid; i++) {
                const uint8_t cls = a->blk[qt * p->NK + (k0 + i) / a->bk];
                if (cls == 0) kill[i] = -1;
                if (cls != 1) add[i] = 0;
            }
        }
        if (a->mask_kind == FM_MASK_BOOL) {
            uint8_t mb[FM_VL] = {0};
            memcpy(mb, (const uint8_t *)mrow + k0, (size_t)nvalid);
            for (int i = 0; i < FM_VL; i++) if (add[i] && mb[i] == 0) kill[i] = -1;
        } else {
            const fm_v mv = FM_SFX(pf_mask_values)(a, mrow, k0, nvalid);
            kill |= add & (mv == -INFINITY);
            s = fm_v_sel(add, s + mv, s);
        }
    }
    s = fm_v_sel(s < FM_M_INIT, fm_v_splat(FM_M_INIT), s);
    return fm_v_sel(kill, fm_v_splat(-INFINITY), s);
}

/* Online softmax step of one row over one key block: S holds the raw dot
 * products on entry and p on exit; M, L are updated and F receives the
 * factor for O. The row sees keys [lo, hi]. With P16 (bf16 pair panels), p
 * is rounded to bf16 and stored there instead, and the row sum uses the
 * rounded values (so the weights of O sum to 1); LX, when given, sums the
 * unrounded values for the LSE. The running max ignores NaN (s > m is
 * false). */
static void FM_SFX(pf_row_softmax)(const FMPrefillArgs *a, float *S, int64_t row, int64_t c0, int64_t kc,
                                   int64_t lo, int64_t hi, const char *mrow, float slope, int64_t t, float *M,
                                   float *L, float *LX, float *F, uint16_t *P16) {
    fm_v s[KB / FM_VL];
    fm_v mv = fm_v_splat(*M);
    /* The common block (the row sees every key of it, no mask, no softcap)
     * needs only the scale and the floor. */
    const int plain = !mrow && !a->seq.alibi && a->p.softcapping == 0 && kc == KB && lo <= c0 && hi >= c0 + KB - 1;
    /* The row's range relative to c0, clamped into [-1, KB]. */
    const int32_t jlo = lo - c0 < 0 ? 0 : lo - c0 > KB ? KB : (int32_t)(lo - c0);
    const int32_t jhi = hi - c0 < -1 ? -1 : hi - c0 >= KB ? KB - 1 : (int32_t)(hi - c0);
    if (plain) {
        for (int c = 0; c < KB / FM_VL; c++) {
            const fm_v x = fm_v_load(S + c * FM_VL) * a->p.scale;
            s[c] = fm_v_sel(x < FM_M_INIT, fm_v_splat(FM_M_INIT), x);
            mv = fm_v_sel(s[c] > mv, s[c], mv);
        }
    } else {
        for (int c = 0; c < KB / FM_VL; c++) {
            s[c] = FM_SFX(pf_scores)(a, fm_v_load(S + c * FM_VL), row, c0, c * FM_VL, kc, jlo, jhi, mrow, slope,
                                     t);
            mv = fm_v_sel(s[c] > mv, s[c], mv);
        }
    }
    const float mold = *M, mx = fm_v_max(mv);
    const float factor = fm_v_exp(fm_v_splat(mold - mx))[0];
    fm_v sum = fm_v_splat(0.0f), exact = fm_v_splat(0.0f);
    for (int c = 0; c < KB / FM_VL; c++) {
        fm_v pv = fm_v_exp(s[c] - mx);
        if (LX) exact += pv;
        if (P16) pv = FM_PF_STORE_BF16(P16 + c * FM_VL, pv);
        else fm_v_store(S + c * FM_VL, pv);
        sum += pv;
    }
    *L = *L * factor + fm_v_sum(sum);
    if (LX) *LX = *LX * factor + fm_v_sum(exact);
    *M = mx;
    *F = factor;
}

/* pf_row_softmax for the R rows of a row group at once, when every one of
 * them is plain over this block (sees all of its keys; no mask, no
 * softcap): the common case of full and causal attention. The rows'
 * horizontal max, factor and sums then fold together (fm_v_max8, one
 * vector exp, fm_v_sum8: the same trees and lane-wise arithmetic as the
 * per-row path, so the same bits), which at small head dims was a third of
 * the time. Returns 0, having done nothing, when a row is not plain. */
_Static_assert(FM_PF_R <= 8, "pf_group_softmax folds at most 8 rows");
static int FM_SFX(pf_group_softmax)(const FMPrefillArgs *a, float *S, int64_t c0, int64_t kc, const int64_t *lo,
                                    const int64_t *hi, float *M, float *L, float *LX, float *F, uint16_t *P16) {
    if (a->mask_kind != FM_MASK_NONE || a->seq.alibi || a->p.softcapping != 0 || kc != KB) return 0;
    for (int r = 0; r < R; r++)
        if (lo[r] > c0 || hi[r] < c0 + KB - 1) return 0;
    fm_v fold[8];
    float mx[8], tot[8], ex[8];
    for (int r = 0; r < 8; r++) {
        fold[r] = fm_v_splat(r < R ? M[r] : 0.0f);
        if (r >= R) continue;
        for (int c = 0; c < KB / FM_VL; c++) {
            const fm_v x = fm_v_load(S + r * KB + c * FM_VL) * a->p.scale;
            const fm_v sc = fm_v_sel(x < FM_M_INIT, fm_v_splat(FM_M_INIT), x);
            fm_v_store(S + r * KB + c * FM_VL, sc);
            fold[r] = fm_v_sel(sc > fold[r], sc, fold[r]);
        }
    }
    fm_v_max8(fold, mx);
    /* The factors e^(M - mx) of all rows, FM_VL rows per vector exp. */
    float fac[8 + FM_VL] = {0};
    for (int r = 0; r < R; r++) fac[r] = M[r] - mx[r];
    for (int r = 0; r < R; r += FM_VL) fm_v_store(fac + r, fm_v_exp(fm_v_load(fac + r)));
    fm_v exact[8];
    for (int r = 0; r < 8; r++) {
        fold[r] = exact[r] = fm_v_splat(0.0f);
        if (r >= R) continue;
        for (int c = 0; c < KB / FM_VL; c++) {
            fm_v pv = fm_v_exp(fm_v_load(S + r * KB + c * FM_VL) - mx[r]);
            if (LX) exact[r] += pv;
            if (P16) pv = FM_PF_STORE_BF16(P16 + r * 2 * KB + c * FM_VL, pv);
            else fm_v_store(S + r * KB + c * FM_VL, pv);
            fold[r] += pv;
        }
    }
    fm_v_sum8(fold, tot);
    if (LX) fm_v_sum8(exact, ex);
    for (int r = 0; r < R; r++) {
        L[r] = L[r] * fac[r] + tot[r];
        if (LX) LX[r] = LX[r] * fac[r] + ex[r];
        M[r] = mx[r];
        F[r] = fac[r];
    }
    return 1;
}

/* ---- one work item: QI rows of head h ----------------------------------- */

void FM_SFX(fm_pf_item)(const FMPrefillArgs *a, int64_t b, int64_t h, int64_t qi, const void *packed,
                        float *scratch) {
    const AttnParams *p = &a->p;
    const int32_t D = p->D, Dv = p->Dv, DP = fm_pf_dp(a), DK = fm_pf_dk(a), DV = fm_pf_dv(a);
    const int bfp = FM_SFX(pf_bf16_panels)(a);
    const size_t esz = FM_SFX(pf_esz)(a);
    const FMPfSeqDims sd = fm_pf_seq_dims(a, b);
    const int64_t r0 = qi * QI;
    if (r0 >= sd.qL) return;
    const int64_t nrows = (sd.qL - r0) < QI ? (sd.qL - r0) : QI;
    const int64_t ngroups = (nrows + R - 1) / R;
    int64_t kb0, kb1; /* the sequence's packed blocks: panel i holds block kb0 + i */
    fm_pf_seq_blocks(a, &sd, &kb0, &kb1);

    float *O = scratch;
    float *Qf = O + (size_t)QI * DP; /* q rows as f32, or (bf16 pair panels) as bf16 */
    float *S = Qf + (size_t)QI * DP;
    float *P = S + (size_t)QI * KB;
    float *M = P + (size_t)QI * KB;
    float *L = M + QI;
    float *F = L + QI;
    float *LX = F + QI; /* unrounded row sums for the LSE of bf16 pair panels */
    const int exact_lse = bfp && a->seq.lse;
    const float slope = fm_pf_alibi_slope(a, b, h);

    const size_t msz = a->mask_kind == FM_MASK_BOOL ? 1 : esz;
    const char *mbase = a->mask_kind == FM_MASK_NONE ? NULL
        : (const char *)a->mask + msz * (b * a->mp.M_strides[0] + h * a->mp.M_strides[1]);

    const uint16_t *qrow[QI];
    const char *mrow[QI];
    int64_t rowid[QI], lo[QI], hi[QI];
    for (int64_t r = 0; r < ngroups * R; r++) {
        const int64_t rr = r < nrows ? r : nrows - 1; /* padding rows repeat the last */
        rowid[r] = r0 + rr;
        fm_pf_row_keys(a, sd.t0 + r0 + rr, &sd, &lo[r], &hi[r]);
        const void *qsrc = (const char *)a->q + esz * fm_pf_row_offset(&sd, b, h, r0 + rr, p->Q_strides);
        mrow[r] = mbase ? mbase + msz * (r0 + rr) * a->mp.M_strides[2] : NULL;
        if (bfp) {
            /* the row's D bf16 values, then zeros up to DP */
            uint16_t *qb = (uint16_t *)(Qf + (size_t)r * DP);
            memcpy(qb, qsrc, sizeof(uint16_t) * D);
            memset(qb + D, 0, sizeof(uint16_t) * (DP - D));
            qrow[r] = qb;
        } else {
            FM_SFX(pf_cvt_row)(Qf + (size_t)r * DP, qsrc, D, DP, a->io_dtype);
            qrow[r] = NULL;
        }
        memset(O + (size_t)r * DP, 0, sizeof(float) * DP);
        M[r] = FM_M_INIT;
        L[r] = 0.0f;
        LX[r] = 0.0f;
    }

    const size_t panel = (size_t)KB * DP * (bfp ? 2 : 4);
    const char *Kpan = (const char *)packed;
    const char *Vpan = Kpan + (size_t)a->panel_blocks * panel;
    /* Ranges grow with the row: the item's keys are [lo[0], hi[last]], a
     * group's [lo[first], hi[last]]; blocks outside them add nothing. */
    /* Within the sequence's packed blocks: a row that sees nothing (lo > hi)
     * may name a block outside them. */
    const int64_t kb_end = hi[nrows - 1] < 0 ? 0 : hi[nrows - 1] / KB + 1 < kb1 ? hi[nrows - 1] / KB + 1 : kb1;

    for (int64_t kb = lo[0] / KB > kb0 ? lo[0] / KB : kb0; kb < kb_end; kb++) {
        const int64_t c0 = kb * KB;
        const int64_t kc = (sd.kL - c0) < KB ? (sd.kL - c0) : KB;
        const void *Kb = Kpan + (size_t)(kb - kb0) * panel;
        const void *Vb = Vpan + (size_t)(kb - kb0) * panel;
        for (int64_t g = 0; g < ngroups; g++) {
            const int64_t ga = R * g;
            const int64_t glast = rowid[ga + R - 1];
            if (c0 > hi[ga + R - 1] || c0 + kc - 1 < lo[ga]) continue;
            if (a->blk && fm_pf_blk_all_skip(a, rowid[ga], glast, c0, kc)) continue;
            float *Sg = S + (size_t)ga * KB;
#if FM_PF_BF16DP
            if (bfp) FM_SFX(pf_qk_pairs)(qrow + ga, (const uint32_t *)Kb, DP, DK, Sg);
            else
#endif
                FM_SFX(pf_qk_f32)(Qf + (size_t)ga * DP, (const float *)Kb, DP, DK, Sg);
            /* bf16 pair panels: p goes to P as bf16, row r at P + (ga + r) * KB floats. */
            uint16_t *Pg = bfp ? (uint16_t *)(P + (size_t)ga * KB) : NULL;
            if (!FM_SFX(pf_group_softmax)(a, Sg, c0, kc, lo + ga, hi + ga, M + ga, L + ga,
                                          exact_lse ? LX + ga : NULL, F + ga, Pg))
                for (int r = 0; r < R; r++)
                    FM_SFX(pf_row_softmax)(a, Sg + (size_t)r * KB, rowid[ga + r], c0, kc, lo[ga + r], hi[ga + r],
                                           mrow[ga + r], slope, sd.t0 + rowid[ga + r], &M[ga + r], &L[ga + r], exact_lse ? &LX[ga + r] : NULL,
                                           &F[ga + r], Pg ? Pg + (size_t)r * 2 * KB : NULL);
#if FM_PF_BF16DP
            if (bfp) FM_SFX(pf_pv_pairs)((const uint16_t *)(P + (size_t)ga * KB), (const uint32_t *)Vb, DP, DV,
                                         (int)((kc + 1) / 2), F + ga, O + (size_t)ga * DP);
            else
#endif
                FM_SFX(pf_pv_f32)(Sg, (const float *)Vb, DP, DV, (int)kc, F + ga, O + (size_t)ga * DP);
        }
    }

    for (int64_t r = 0; r < nrows; r++) {
        float lse;
        const float inv = fm_pf_finish_row(a, h, M[r], L[r], exact_lse ? LX[r] : L[r], &lse);
        fm_pf_store_lse(a, &sd, b, h, r0 + r, lse);
        char *dst = (char *)a->o + esz * fm_pf_row_offset(&sd, b, h, r0 + r, p->O_strides);
        const float *o = O + (size_t)r * DP; /* its first Dv dims (v's head dim) */
        if (a->io_dtype == FM_DTYPE_F32) {
            for (int32_t d = 0; d < Dv; d++) ((float *)dst)[d] = o[d] * inv;
        } else if (a->io_dtype == FM_DTYPE_BF16) {
            for (int32_t d = 0; d < Dv; d++) ((uint16_t *)dst)[d] = fm_f32_to_bf16(o[d] * inv);
        } else {
            for (int32_t d = 0; d < Dv; d++) ((uint16_t *)dst)[d] = fm_f32_to_f16(o[d] * inv);
        }
    }
}

#undef KB
#undef R
#undef NC
#undef QI
#undef CW
#undef FM_PF_FOR_COLUMN_BLOCKS
