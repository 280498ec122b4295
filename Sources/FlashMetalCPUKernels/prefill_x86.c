/* Prefill fast path for x86-64 with AVX-512 (run-time selected, see
 * cpu_features.c). Compiled for every target; the vector code carries
 * per-function target attributes so the library itself stays portable.
 *
 * Design: K/V of one (batch, kv head) are packed once into panels of
 * FM_PF_KB = 64 keys:
 *   bf16 on AVX512-BF16:  K as [D/2][64] bf16 pairs (VNNI layout), V as
 *                         [32 key pairs][D] bf16 pairs; QK^T and PV run on
 *                         vdpbf16ps with f32 accumulation; P is rounded to
 *                         bf16 (RNE) and the row sum uses the rounded P.
 *   f16 (and bf16 on plain AVX-512): K as [D][64] f32, V as [64][D] f32,
 *                         f32 FMA.
 * A work item is 32 query rows of one head, handled 4 rows at a time.
 *
 * Numerics (DESIGN §2) and the bit-identity contract: each row's score is a
 * dot product in a fixed order over D; key blocks start at absolute
 * multiples of 64, and the softmax over a block (max, exp, row sum in a
 * fixed lane order) depends only on the row's own scores, so a row's result
 * does not depend on the other rows of its item, on the item's start row or
 * on the thread count. A masked key gets p = 0 exactly; a block in which a
 * row sees nothing has max = the old max, factor exp(0) = 1 and adds +0, so
 * skipping it (blk class 0 on every (BQ, BK) tile it covers, causal, kv_len)
 * leaves the output bit-identical. blk classes are honoured per dispatch
 * tile inside a block: class 0 lanes are -inf, class 2 lanes skip the add. */
#include <float.h>
#include <math.h>
#include <string.h>
#include "fm_cpu_kernels.h"
#include "half_convert.h"
#include "kernel_math.h"

#define KB FM_PF_KB
#define QI FM_PF_QI

static int fm_pf_bf16_panels(const FMPrefillArgs *a, int isa) {
    return isa >= FM_ISA_AVX512BF16 && a->io_dtype == FM_DTYPE_BF16;
}

static int64_t fm_pf_nkb(const FMPrefillArgs *a) { return ((int64_t)a->p.kL + KB - 1) / KB; }

/* Bytes of one key block's K panel (the V panel has the same size). */
static size_t fm_pf_panel_bytes(const FMPrefillArgs *a, int bfp) {
    return (size_t)KB * a->p.D * (bfp ? 2 : 4);
}

#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#include <immintrin.h>

#define FM_T_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c,fma")))
#define FM_T_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c,fma,avx512bf16")))

size_t fm_cpu_prefill_pack_bytes(const FMPrefillArgs *a, int isa) {
    if (isa <= FM_ISA_PORTABLE) return 0;
    return 2 * (size_t)fm_pf_nkb(a) * fm_pf_panel_bytes(a, fm_pf_bf16_panels(a, isa));
}

size_t fm_cpu_prefill_fast_scratch_floats(const FMPrefillArgs *a) {
    const size_t D = (size_t)a->p.D;
    /* O, Qf, S, P, M, L, F */
    return QI * D * 2 + (size_t)QI * KB * 2 + QI * 3 + 16;
}

FM_T_AVX512 static inline void fm_load_row_f32(float *dst, const uint16_t *src, int32_t n, int is_bf16) {
    int32_t i = 0;
    if (is_bf16) {
        for (; i + 16 <= n; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
    } else {
        for (; i + 16 <= n; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
        }
    }
    for (; i < n; i++) dst[i] = is_bf16 ? fm_bf16_to_f32(src[i]) : fm_f16_to_f32(src[i]);
}

FM_T_AVX512 static void fm_pack_f32(const FMPrefillArgs *a, int64_t b, int64_t kvh, int64_t kb,
                                    void *packed) {
    const AttnParams *p = &a->p;
    const int32_t D = p->D;
    const int is_bf16 = a->io_dtype == FM_DTYPE_BF16;
    const int64_t c0 = kb * KB, kc = (p->kL - c0) < KB ? (p->kL - c0) : KB;
    const uint16_t *kbase = (const uint16_t *)a->k + b * p->K_strides[0] + kvh * p->K_strides[1];
    const uint16_t *vbase = (const uint16_t *)a->v + b * p->V_strides[0] + kvh * p->V_strides[1];
    float *Kf = (float *)packed + (size_t)kb * D * KB;
    float *Vf = (float *)packed + (size_t)fm_pf_nkb(a) * D * KB + (size_t)kb * KB * D;
    float tmp[512];
    for (int64_t j = 0; j < KB; j++) {
        if (j < kc) {
            fm_load_row_f32(tmp, kbase + (c0 + j) * p->K_strides[2], D, is_bf16);
            for (int32_t d = 0; d < D; d++) Kf[(size_t)d * KB + j] = tmp[d];
            fm_load_row_f32(Vf + (size_t)j * D, vbase + (c0 + j) * p->V_strides[2], D, is_bf16);
        } else {
            for (int32_t d = 0; d < D; d++) Kf[(size_t)d * KB + j] = 0.0f;
            memset(Vf + (size_t)j * D, 0, sizeof(float) * D);
        }
    }
}

static void fm_pack_bf16(const FMPrefillArgs *a, int64_t b, int64_t kvh, int64_t kb, void *packed) {
    const AttnParams *p = &a->p;
    const int32_t D = p->D, D2 = D / 2;
    const int64_t c0 = kb * KB, kc = (p->kL - c0) < KB ? (p->kL - c0) : KB;
    const uint16_t *kbase = (const uint16_t *)a->k + b * p->K_strides[0] + kvh * p->K_strides[1];
    const uint16_t *vbase = (const uint16_t *)a->v + b * p->V_strides[0] + kvh * p->V_strides[1];
    uint32_t *Kp = (uint32_t *)packed + (size_t)kb * D2 * KB;
    uint32_t *Vp = (uint32_t *)packed + (size_t)fm_pf_nkb(a) * D2 * KB + (size_t)kb * (KB / 2) * D;
    uint32_t row[256];
    for (int64_t j = 0; j < KB; j++) {
        if (j < kc) memcpy(row, kbase + (c0 + j) * p->K_strides[2], sizeof(uint16_t) * D);
        else memset(row, 0, sizeof(uint16_t) * D);
        for (int32_t q = 0; q < D2; q++) Kp[(size_t)q * KB + j] = row[q];
    }
    for (int64_t t = 0; t < KB / 2; t++) {
        const int64_t j0 = 2 * t, j1 = 2 * t + 1;
        const uint16_t *v0 = j0 < kc ? vbase + (c0 + j0) * p->V_strides[2] : NULL;
        const uint16_t *v1 = j1 < kc ? vbase + (c0 + j1) * p->V_strides[2] : NULL;
        uint32_t *dst = Vp + (size_t)t * D;
        for (int32_t d = 0; d < D; d++)
            dst[d] = (uint32_t)(v0 ? v0[d] : 0) | ((uint32_t)(v1 ? v1[d] : 0) << 16);
    }
}

void fm_cpu_prefill_pack(const FMPrefillArgs *a, int isa, int64_t b, int64_t kvh, int64_t kb,
                         void *packed) {
    if (fm_pf_bf16_panels(a, isa)) fm_pack_bf16(a, b, kvh, kb, packed);
    else fm_pack_f32(a, b, kvh, kb, packed);
}

/* e^x for x <= 0 (x = -inf is clamped; callers zero masked lanes).
 * exp(0) is exactly 1. */
FM_T_AVX512 static inline __m512 fm_exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 y = _mm512_set1_ps(1.0f / 720.0f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* Turns the raw dot products of one row over one key block into masked
 * scores: scale, softcap, additive/bool mask (per blk class), causal,
 * keys past kL. */
FM_T_AVX512 static void fm_row_scores(const FMPrefillArgs *a, float *S, int64_t row, int64_t c0,
                                      int64_t kc, const char *mrow) {
    const AttnParams *p = &a->p;
    const __m512 vscale = _mm512_set1_ps(p->scale);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const float softcap = p->softcapping;
    const int64_t qpos = (int64_t)p->qL_off + row;
    const int64_t qt = row / a->bq;
    const int g = a->bk < 16 ? a->bk : 16;
    for (int c = 0; c < KB / 16; c++) {
        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(S + 16 * c), vscale);
        if (softcap > 0) {
            float t[16];
            _mm512_storeu_ps(t, s);
            for (int i = 0; i < 16; i++) t[i] = softcap * tanhf(t[i] / softcap);
            s = _mm512_loadu_ps(t);
        }
        const int64_t k0 = c0 + 16 * c;
        const int64_t nvalid = kc - 16 * c;
        __mmask16 valid = nvalid >= 16 ? (__mmask16)0xffff
                        : nvalid <= 0 ? (__mmask16)0 : (__mmask16)((1u << nvalid) - 1);
        __mmask16 kill = (__mmask16)~valid;
        if (mrow && valid) {
            __mmask16 add = valid;
            if (a->blk) {
                add = 0;
                for (int s0 = 0; s0 < 16 && s0 < nvalid; s0 += g) {
                    const uint8_t cls = a->blk[qt * p->NK + (k0 + s0) / a->bk];
                    const __mmask16 m = (__mmask16)(((1u << g) - 1) << s0);
                    if (cls == 0) kill |= m;
                    else if (cls != 2) add |= m;
                }
                add &= valid;
            }
            if (add) {
                if (a->mask_kind == FM_MASK_BOOL) {
                    const __m128i mb = _mm_maskz_loadu_epi8(add, (const uint8_t *)mrow + k0);
                    kill |= _mm_mask_cmpeq_epi8_mask(add, mb, _mm_setzero_si128());
                } else {
                    const __m256i mh = _mm256_maskz_loadu_epi16(add, (const uint16_t *)mrow + k0);
                    const __m512 mv = a->io_dtype == FM_DTYPE_BF16
                        ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(mh), 16))
                        : _mm512_cvtph_ps(mh);
                    s = _mm512_mask_add_ps(s, add, s, mv);
                }
            }
        }
        if (a->causal) {
            const int64_t lim = qpos - k0; /* lanes > lim are in the future */
            if (lim < 0) kill = 0xffff;
            else if (lim < 15) kill |= (__mmask16)(0xffffu << (lim + 1));
        }
        _mm512_storeu_ps(S + 16 * c, _mm512_mask_mov_ps(s, kill, ninf));
    }
}

/* Online softmax step of one row: S holds the scores on entry and p on
 * exit; M, L are updated and F receives the factor for O. With round_bf16,
 * p is rounded to bf16 (RNE) and the sum uses the rounded values. */
FM_T_AVX512 static void fm_row_softmax(float *S, float *M, float *L, float *F, int round_bf16) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 s[KB / 16];
    __m512 mx4 = ninf;
    for (int c = 0; c < KB / 16; c++) {
        s[c] = _mm512_loadu_ps(S + 16 * c);
        mx4 = _mm512_max_ps(mx4, s[c]);
    }
    const float bm = _mm512_reduce_max_ps(mx4);
    const float mold = *M;
    const float mx = bm > mold ? bm : mold;
    const __m512 vmx = _mm512_set1_ps(mx);
    const float factor = _mm512_cvtss_f32(fm_exp512(_mm512_set1_ps(mold - mx)));
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < KB / 16; c++) {
        const __mmask16 live = _mm512_cmp_ps_mask(s[c], ninf, _CMP_NEQ_OQ);
        __m512 pv = _mm512_maskz_mov_ps(live, fm_exp512(_mm512_sub_ps(s[c], vmx)));
        if (round_bf16) {
            __m512i u = _mm512_castps_si512(pv);
            u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
            pv = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
        }
        sum = _mm512_add_ps(sum, pv);
        _mm512_storeu_ps(S + 16 * c, pv);
    }
    *L = *L * factor + _mm512_reduce_add_ps(sum);
    *M = mx;
    *F = factor;
}

/* ---- f32 micro-kernels: 4 rows x 64 keys, 4 rows x 64 dims ---------------- */

FM_T_AVX512 static void fm_qk_f32(const float *const q[4], const float *Kf, int32_t D, float *S) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int32_t d = 0; d < D; d++) {
        const float *kr = Kf + (size_t)d * KB;
        const __m512 k0 = _mm512_loadu_ps(kr), k1 = _mm512_loadu_ps(kr + 16),
                     k2 = _mm512_loadu_ps(kr + 32), k3 = _mm512_loadu_ps(kr + 48);
        for (int r = 0; r < 4; r++) {
            const __m512 qb = _mm512_set1_ps(q[r][d]);
            acc[r][0] = _mm512_fmadd_ps(qb, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(qb, k1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(qb, k2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(qb, k3, acc[r][3]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(S + r * KB + 16 * c, acc[r][c]);
}

FM_T_AVX512 static void fm_pv_f32(const float *P, const float *Vf, int32_t D, int npairs,
                                  const float *F, float *O) {
    const int nk = 2 * npairs;
    for (int32_t dc = 0; dc < D; dc += 64) {
        __m512 acc[4][4];
        for (int r = 0; r < 4; r++) {
            const __m512 f = _mm512_set1_ps(F[r]);
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(O + (size_t)r * D + dc + 16 * c), f);
        }
        for (int j = 0; j < nk; j++) {
            const float *vr = Vf + (size_t)j * D + dc;
            const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16),
                         v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
            for (int r = 0; r < 4; r++) {
                const __m512 pb = _mm512_set1_ps(P[r * KB + j]);
                acc[r][0] = _mm512_fmadd_ps(pb, v0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(pb, v1, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(pb, v2, acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(pb, v3, acc[r][3]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(O + (size_t)r * D + dc + 16 * c, acc[r][c]);
    }
}

/* ---- bf16 micro-kernels on vdpbf16ps ---------------------------------------- */

FM_T_BF16 static void fm_qk_bf16(const uint16_t *const q[4], const uint32_t *Kp, int32_t D, float *S) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    uint32_t qw[4];
    for (int32_t pi = 0; pi < D / 2; pi++) {
        const uint32_t *kr = Kp + (size_t)pi * KB;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr), k1 = (__m512bh)_mm512_loadu_si512(kr + 16),
                       k2 = (__m512bh)_mm512_loadu_si512(kr + 32), k3 = (__m512bh)_mm512_loadu_si512(kr + 48);
        for (int r = 0; r < 4; r++) memcpy(&qw[r], q[r] + 2 * pi, 4);
        for (int r = 0; r < 4; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qw[r]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qb, k2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qb, k3);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(S + r * KB + 16 * c, acc[r][c]);
}

/* P: per row KB bf16 values (32 key pairs) as uint16 at P + r * 2 * KB. */
FM_T_BF16 static void fm_pv_bf16(const uint16_t *P, const uint32_t *Vp, int32_t D, int npairs,
                                 const float *F, float *O) {
    for (int32_t dc = 0; dc < D; dc += 64) {
        __m512 acc[4][4];
        for (int r = 0; r < 4; r++) {
            const __m512 f = _mm512_set1_ps(F[r]);
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(O + (size_t)r * D + dc + 16 * c), f);
        }
        uint32_t pw[4];
        for (int t = 0; t < npairs; t++) {
            const uint32_t *vr = Vp + (size_t)t * D + dc;
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vr), v1 = (__m512bh)_mm512_loadu_si512(vr + 16),
                           v2 = (__m512bh)_mm512_loadu_si512(vr + 32), v3 = (__m512bh)_mm512_loadu_si512(vr + 48);
            for (int r = 0; r < 4; r++) memcpy(&pw[r], P + (size_t)r * 2 * KB + 2 * t, 4);
            for (int r = 0; r < 4; r++) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pw[r]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pb, v0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pb, v1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pb, v2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pb, v3);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(O + (size_t)r * D + dc + 16 * c, acc[r][c]);
    }
}

/* True when every (BQ, BK) tile that rows [ra, rb] x block kb touch is class 0. */
static int fm_blk_all_skip(const FMPrefillArgs *a, int64_t ra, int64_t rb, int64_t c0, int64_t kc) {
    const int64_t nk = a->p.NK;
    const int64_t ka = c0 / a->bk, kz = (c0 + kc - 1) / a->bk;
    for (int64_t qt = ra / a->bq; qt <= rb / a->bq; qt++)
        for (int64_t kt = ka; kt <= kz && kt < nk; kt++)
            if (a->blk[qt * nk + kt] != 0) return 0;
    return 1;
}

FM_T_AVX512 void fm_cpu_prefill_fast_item(const FMPrefillArgs *a, int isa, int64_t b, int64_t h,
                                          int64_t qi, const void *packed, float *scratch) {
    const AttnParams *p = &a->p;
    const int32_t D = p->D;
    const int bfp = fm_pf_bf16_panels(a, isa);
    const int is_bf16 = a->io_dtype == FM_DTYPE_BF16;
    const int64_t qL = p->qL, kL = p->kL;
    const int64_t r0 = qi * QI;
    const int64_t nrows = (qL - r0) < QI ? (qL - r0) : QI;
    const int64_t ngroups = (nrows + 3) / 4;
    const int64_t nkb = fm_pf_nkb(a);

    float *O = scratch;
    float *Qf = O + (size_t)QI * D;
    float *S = Qf + (size_t)QI * D;
    float *P = S + (size_t)QI * KB;
    float *M = P + (size_t)QI * KB;
    float *L = M + QI;
    float *F = L + QI;

    const uint16_t *qbase = (const uint16_t *)a->q + b * p->Q_strides[0] + h * p->Q_strides[1];
    uint16_t *obase = (uint16_t *)a->o + b * p->O_strides[0] + h * p->O_strides[1];
    const size_t msz = a->mask_kind == FM_MASK_BOOL ? 1 : 2;
    const char *mbase = a->mask_kind == FM_MASK_NONE ? NULL
        : (const char *)a->mask + msz * (b * a->mp.M_strides[0] + h * a->mp.M_strides[1]);

    const uint16_t *qrow[QI];
    const char *mrow[QI];
    int64_t rowid[QI];
    for (int64_t r = 0; r < ngroups * 4; r++) {
        const int64_t rr = r < nrows ? r : nrows - 1;
        rowid[r] = r0 + rr;
        qrow[r] = qbase + (r0 + rr) * p->Q_strides[2];
        mrow[r] = mbase ? mbase + msz * (r0 + rr) * a->mp.M_strides[2] : NULL;
        if (!bfp) fm_load_row_f32(Qf + (size_t)r * D, qrow[r], D, is_bf16);
        memset(O + (size_t)r * D, 0, sizeof(float) * D);
        M[r] = FM_M_INIT;
        L[r] = 0.0f;
    }

    const size_t panel = fm_pf_panel_bytes(a, bfp);
    const char *Kpan = (const char *)packed;
    const char *Vpan = Kpan + (size_t)nkb * panel;
    const int64_t causal_last = p->qL_off + r0 + nrows - 1;

    for (int64_t kb = 0; kb < nkb; kb++) {
        const int64_t c0 = kb * KB;
        if (a->causal && c0 > causal_last) break;
        const int64_t kc = (kL - c0) < KB ? (kL - c0) : KB;
        const int npairs = (int)((kc + 1) / 2);
        const void *Kb = Kpan + (size_t)kb * panel;
        const void *Vb = Vpan + (size_t)kb * panel;
        for (int64_t g = 0; g < ngroups; g++) {
            const int64_t ga = 4 * g;
            const int64_t glast = rowid[ga + 3];
            if (a->causal && c0 > p->qL_off + glast) continue;
            if (a->blk && fm_blk_all_skip(a, rowid[ga], glast, c0, kc)) continue;
            float *Sg = S + (size_t)ga * KB;
            if (bfp) fm_qk_bf16(qrow + ga, (const uint32_t *)Kb, D, Sg);
            else {
                const float *qf[4] = {Qf + (size_t)ga * D, Qf + (size_t)(ga + 1) * D,
                                      Qf + (size_t)(ga + 2) * D, Qf + (size_t)(ga + 3) * D};
                fm_qk_f32(qf, (const float *)Kb, D, Sg);
            }
            for (int r = 0; r < 4; r++) {
                float *Sr = Sg + (size_t)r * KB;
                fm_row_scores(a, Sr, rowid[ga + r], c0, kc, mrow[ga + r]);
                fm_row_softmax(Sr, &M[ga + r], &L[ga + r], &F[ga + r], bfp);
                if (bfp) {
                    uint16_t *Pr = (uint16_t *)(P + (size_t)(ga + r) * KB);
                    for (int c = 0; c < KB / 16; c++) {
                        const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(Sr + 16 * c)), 16);
                        _mm256_storeu_si256((__m256i *)(Pr + 16 * c), _mm512_cvtepi32_epi16(u));
                    }
                }
            }
            if (bfp) fm_pv_bf16((const uint16_t *)(P + (size_t)ga * KB), (const uint32_t *)Vb, D, npairs,
                                F + ga, O + (size_t)ga * D);
            else fm_pv_f32(Sg, (const float *)Vb, D, npairs, F + ga, O + (size_t)ga * D);
        }
    }

    for (int64_t r = 0; r < nrows; r++) {
        const float inv = L[r] == 0.0f ? 0.0f : 1.0f / L[r];
        uint16_t *dst = obase + (r0 + r) * p->O_strides[2];
        const float *o = O + (size_t)r * D;
        if (is_bf16) {
            for (int32_t d = 0; d < D; d++) dst[d] = fm_f32_to_bf16(o[d] * inv);
        } else {
            for (int32_t d = 0; d < D; d++) dst[d] = fm_f32_to_f16(o[d] * inv);
        }
    }
}

#else /* no x86-64: the fast path does not exist; callers use the portable kernel */

size_t fm_cpu_prefill_pack_bytes(const FMPrefillArgs *a, int isa) {
    (void)a; (void)isa;
    return 0;
}
size_t fm_cpu_prefill_fast_scratch_floats(const FMPrefillArgs *a) { (void)a; return 0; }
void fm_cpu_prefill_pack(const FMPrefillArgs *a, int isa, int64_t b, int64_t kvh, int64_t kb,
                         void *packed) {
    (void)a; (void)isa; (void)b; (void)kvh; (void)kb; (void)packed;
}
void fm_cpu_prefill_fast_item(const FMPrefillArgs *a, int isa, int64_t b, int64_t h, int64_t qi,
                              const void *packed, float *scratch) {
    (void)a; (void)isa; (void)b; (void)h; (void)qi; (void)packed; (void)scratch;
}
#endif
