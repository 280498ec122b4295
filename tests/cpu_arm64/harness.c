/* The cpu kernels on arm64: cross-built with clang --target=aarch64-linux-gnu
 * and run under qemu-aarch64 (mk/cpu-arm64.mk), once per ISA path
 * (FLASHMETAL_CPU_ISA=portable, then the native neon path). Each kernel runs
 * the way the Swift backend drives it (pack, then items; decode partials,
 * then the reduce) and is checked against a double-precision reference
 * written here from the math. Speed is not measured: qemu emulates.
 * mk/cpu-harness.mk builds the same file natively on x86-64 and runs it on
 * each x86 ISA path (portable, avx2, avx512, avx512vbmi, avx512bf16), and
 * once more with the AVX-512 instances as portable code (FM_ISA_EMULATED,
 * isa_emulated.h) on the avx512, avx512vbmi and avx512bf16 paths.
 *
 *   harness [expected isa name]     exit 0 when every check passes */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "fm_cpu_kernels.h"
#include "fm_kv_codec.h"
#include "codes_case.h"
#include "half_convert.h"

static int failures = 0;

#define CHECK(cond, ...)                                  \
    do {                                                  \
        if (!(cond)) {                                    \
            failures++;                                   \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                 \
            fprintf(stderr, "\n");                        \
        }                                                 \
    } while (0)

static uint64_t rng_state = 88172645463325252ull;
static double urand(void) { /* xorshift64*, uniform in [0, 1) */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}
static float nrand(void) { /* Box-Muller */
    const double u = urand() + 1e-12, v = urand();
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* Buffers of one dtype, with the values the kernels see kept as double. */
typedef struct { void *raw; double *val; int32_t dtype; size_t n; } Buf;

static double to_double(int32_t dtype, const void *raw, size_t i) {
    if (dtype == FM_DTYPE_F32) return ((const float *)raw)[i];
    const uint16_t h = ((const uint16_t *)raw)[i];
    return dtype == FM_DTYPE_BF16 ? fm_bf16_to_f32(h) : fm_f16_to_f32(h);
}

static void put(Buf *b, size_t i, float x) {
    if (b->dtype == FM_DTYPE_F32) ((float *)b->raw)[i] = x;
    else ((uint16_t *)b->raw)[i] = b->dtype == FM_DTYPE_BF16 ? fm_f32_to_bf16(x) : fm_f32_to_f16(x);
    b->val[i] = to_double(b->dtype, b->raw, i);
}

static Buf buf_new(int32_t dtype, size_t n, int random) {
    Buf b = {calloc(n, dtype == FM_DTYPE_F32 ? 4 : 2), calloc(n, sizeof(double)), dtype, n};
    for (size_t i = 0; i < n; i++) put(&b, i, random ? nrand() : 0.0f);
    return b;
}
static void buf_free(Buf *b) { free(b->raw); free(b->val); }

/* Reference attention of one row: scores from the rule every path shares
 * (masked -inf; others floored at -FLT_MAX/2), softmax in double. */
/* q/K rows of D elements, V rows and out of Dv. */
static void ref_row(const double *q, const double *K, const double *V, int64_t kL, int32_t D, int32_t Dv,
                    double scale, const double *bias, const int *visible, double *out) {
    double *s = malloc(sizeof(double) * (size_t)kL), mx = -INFINITY;
    for (int64_t j = 0; j < kL; j++) {
        double dot = 0;
        for (int32_t d = 0; d < D; d++) dot += q[d] * K[j * D + d];
        double x = scale * dot;
        if (bias) x += bias[j];
        if (!visible[j] || (bias && bias[j] == -INFINITY)) x = -INFINITY;
        else if (x < -FLT_MAX / 2) x = -FLT_MAX / 2;
        s[j] = x;
        if (x > mx) mx = x;
    }
    double sum = 0;
    for (int32_t d = 0; d < Dv; d++) out[d] = 0;
    if (mx == -INFINITY) { free(s); return; } /* no visible key: zeros */
    for (int64_t j = 0; j < kL; j++) {
        const double p = exp(s[j] - mx);
        sum += p;
        for (int32_t d = 0; d < Dv; d++) out[d] += p * V[j * Dv + d];
    }
    for (int32_t d = 0; d < Dv; d++) out[d] /= sum;
    free(s);
}

static double tol_atol(int32_t dt) { return dt == FM_DTYPE_F32 ? 2e-5 : dt == FM_DTYPE_F16 ? 2e-3 : 8e-3; }

/* ---- prefill ------------------------------------------------------------- */

typedef struct {
    int32_t D, qL, kL, qoff, H, Hkv, dtype, causal, mask_kind, use_blk, nan_q_row, huge_row;
    int32_t Dv; /* v's and the output's head dim; 0 = D */
} PrefillCase;

static void run_prefill(const PrefillCase *c, int fast) {
    const int32_t D = c->D, Dv = c->Dv ? c->Dv : D, W = D > Dv ? D : Dv, H = c->H, Hkv = c->Hkv, qL = c->qL,
                  kL = c->kL;
    const int32_t bq = W >= 512 ? 8 : 32, bk = W >= 512 ? 8 : 16;
    const int64_t NQ = (qL + bq - 1) / bq, NK = (kL + bk - 1) / bk;
    Buf q = buf_new(c->dtype, (size_t)H * qL * D, 1), k = buf_new(c->dtype, (size_t)Hkv * kL * D, 1);
    Buf v = buf_new(c->dtype, (size_t)Hkv * kL * Dv, 1), o = buf_new(c->dtype, (size_t)H * qL * Dv, 0);
    if (c->nan_q_row >= 0) put(&q, (size_t)c->nan_q_row * D + 3, NAN);
    /* additive mask: a window, a band of finite biases, one row of huge negatives */
    Buf m = buf_new(c->dtype, (size_t)qL * kL, 0);
    uint8_t *bm = calloc((size_t)qL * kL, 1);
    double *bias = calloc((size_t)kL, sizeof(double));
    int *vis = calloc((size_t)kL, sizeof(int));
    for (int32_t i = 0; i < qL; i++)
        for (int32_t j = 0; j < kL; j++) {
            const int64_t t = c->qoff + i;
            const int win = j <= t && t - j < 57;
            float x = win ? 0.0f : -INFINITY;
            if (win && j >= 40 && j < 70) x = (float)(urand() - 0.7);
            if (i == c->huge_row) x = c->dtype == FM_DTYPE_F16 ? -65504.0f : -3.0e38f;
            put(&m, (size_t)i * kL + j, x);
            bm[(size_t)i * kL + j] = (uint8_t)(win || i == c->huge_row);
        }
    uint8_t *blk = NULL;
    if (c->use_blk && c->mask_kind == FM_MASK_ADDITIVE && c->dtype != FM_DTYPE_F32) {
        blk = malloc((size_t)(NQ * NK));
        BlkParams bp = {qL, kL, kL, 0};
        for (int64_t qt = 0; qt < NQ; qt++)
            for (int64_t kt = 0; kt < NK; kt++)
                fm_cpu_blk_tile(&bp, (const uint16_t *)m.raw, c->dtype == FM_DTYPE_BF16, blk, bq, bk, NK, qt, kt);
    }
    FMPrefillArgs a;
    memset(&a, 0, sizeof a);
    a.p.B = 1; a.p.H = H; a.p.D = D; a.p.Dv = Dv; a.p.qL = qL; a.p.kL = kL; a.p.gqa_factor = H / Hkv;
    a.p.scale = 1.0f / sqrtf((float)D);
    a.p.NQ = (int32_t)NQ; a.p.NK = (int32_t)NK; a.p.qL_off = c->qoff;
    const int64_t qs[3] = {(int64_t)H * qL * D, (int64_t)qL * D, D}, ks[3] = {(int64_t)Hkv * kL * D, (int64_t)kL * D, D};
    const int64_t os[3] = {(int64_t)H * qL * Dv, (int64_t)qL * Dv, Dv};
    const int64_t vs[3] = {(int64_t)Hkv * kL * Dv, (int64_t)kL * Dv, Dv};
    memcpy(a.p.Q_strides, qs, sizeof qs); memcpy(a.p.O_strides, os, sizeof os);
    memcpy(a.p.K_strides, ks, sizeof ks); memcpy(a.p.V_strides, vs, sizeof vs);
    const int64_t ms[3] = {0, 0, kL};
    memcpy(a.mp.M_strides, ms, sizeof ms);
    a.q = q.raw; a.k = k.raw; a.v = v.raw; a.o = o.raw;
    a.mask = c->mask_kind == FM_MASK_BOOL ? (const void *)bm : m.raw;
    a.mask_kind = c->mask_kind; a.blk = blk; a.io_dtype = c->dtype; a.causal = c->causal;
    a.bq = bq; a.bk = bk;

    const int isa = fm_cpu_isa();
    if (fast) {
        a.panel_blocks = fm_cpu_prefill_panel_blocks(&a);
        const size_t pb = fm_cpu_prefill_pack_bytes(&a, isa);
        CHECK(pb > 0, "%s: no fast path for D=%d dtype=%d", fm_cpu_isa_name(isa), D, c->dtype);
        if (pb == 0) goto done;
        const int64_t nkb = a.panel_blocks, rows = fm_cpu_prefill_item_rows(isa);
        char *packed = malloc(pb * Hkv);
        float *scratch = malloc(sizeof(float) * fm_cpu_prefill_fast_scratch_floats(&a, isa));
        for (int32_t g = 0; g < Hkv; g++)
            for (int64_t kb = 0; kb < nkb; kb++) fm_cpu_prefill_pack(&a, isa, 0, g, kb, packed + g * pb);
        for (int32_t h = 0; h < H; h++)
            for (int64_t qi = (qL + rows - 1) / rows - 1; qi >= 0; qi--)
                fm_cpu_prefill_fast_item(&a, isa, 0, h, qi, packed + (h / (H / Hkv)) * pb, scratch);
        free(packed);
        free(scratch);
    } else {
        float *scratch = malloc(sizeof(float) * fm_cpu_prefill_scratch_floats(bq, bk, W));
        for (int32_t h = 0; h < H; h++)
            for (int64_t qt = 0; qt < NQ; qt++) fm_cpu_prefill_tile(&a, 0, h, qt, scratch);
        free(scratch);
    }
    double worst = 0, *ref = malloc(sizeof(double) * (size_t)Dv);
    for (int32_t h = 0; h < H; h++) {
        const int32_t kvh = h / (H / Hkv);
        for (int32_t i = 0; i < qL; i++) {
            for (int32_t j = 0; j < kL; j++) {
                vis[j] = !c->causal || j <= c->qoff + i;
                if (c->mask_kind == FM_MASK_BOOL && !bm[(size_t)i * kL + j]) vis[j] = 0;
                bias[j] = c->mask_kind == FM_MASK_ADDITIVE ? m.val[(size_t)i * kL + j] : 0.0;
            }
            const double *qr = q.val + ((size_t)h * qL + i) * D;
            ref_row(qr, k.val + (size_t)kvh * kL * D, v.val + (size_t)kvh * kL * Dv, kL, D, Dv, a.p.scale,
                    bias, vis, ref);
            const size_t base = ((size_t)h * qL + i) * Dv;
            const int nan_row = c->nan_q_row == (int32_t)(h * qL + i);
            for (int32_t d = 0; d < Dv; d++) {
                const double got = to_double(c->dtype, o.raw, base + d);
                if (nan_row) { CHECK(isnan(got), "NaN q row: element %d is %g, not NaN", d, got); continue; }
                const double err = fabs(got - ref[d]) / (tol_atol(c->dtype) + 0.02 * fabs(ref[d]));
                if (!(err <= worst)) worst = err; /* NaN makes worst NaN */
            }
        }
    }
    CHECK(worst <= 1.0, "prefill %s %s D=%d Dv=%d dtype=%d causal=%d mask=%d blk=%d: error %.3gx tolerance",
          fm_cpu_isa_name(isa), fast ? "fast" : "portable", D, Dv, c->dtype, c->causal, c->mask_kind,
          blk != NULL, worst);
    free(ref);
done:
    free(blk); free(bm); free(bias); free(vis);
    buf_free(&q); buf_free(&k); buf_free(&v); buf_free(&o); buf_free(&m);
}

/* ---- prefill, serving extension (flashmetal_kernels.h AttnSeqParams) ------------- */

/* One case: B sequences with their own q and k lengths. Layouts are
 * flash-attn's: q/o [B, qmax, H, D] or packed [total_q, H, D] (varlen_q);
 * k/v [B, kcap, Hkv, D], packed [total_k, Hkv, D] (varlen_k) or pages
 * [num_pages, page_size, Hkv, D] through a shuffled block table (paged,
 * with seqlens_k). per_seq = 0 is the plain mode (B = 1, row i at qoff + i)
 * with the in-kernel window. chunk > 0 (with window = 1): the attention
 * chunk, keys p with floor((p - f) / chunk) == floor((t - f) / chunk).
 * first[b] (with kv_lens): sequence b's first key f (cache_leftpad), passed
 * after the lengths in seqlens_k; keys before it are hidden. */
typedef struct {
    int32_t D, dtype, H, Hkv, B;
    int32_t varlen_q, varlen_k, kv_lens, paged, page_size;
    int32_t causal, window, wl, wr, sinks, lse, qoff;
    float softcap;
    int32_t qlens[4], klens[4];
    int32_t chunk;
    int32_t first[4];
    int32_t alibi; /* ALiBi slopes [B, H]: key p of the row at t scores -slope * |t - p| more */
} ServeCase;

static int64_t floor_div(int64_t x, int64_t c) { return x >= 0 ? x / c : -((-x + c - 1) / c); }

static int serve_visible(const ServeCase *c, int64_t t, int64_t p, int64_t kL, int64_t f) {
    if (p >= kL || p < f) return 0;
    if (c->causal && p > t) return 0;
    if (c->window && c->wl >= 0 && p < t - c->wl) return 0;
    if (c->window && c->wr >= 0 && p > t + c->wr) return 0;
    if (c->window && c->chunk > 0 && floor_div(p - f, c->chunk) != floor_div(t - f, c->chunk)) return 0;
    return 1;
}

/* Softmax attention of one row (at position t) in double with softcap, the
 * ALiBi bias of `slope`, an optional sink (NAN: none) and the natural-log LSE
 * (-inf when nothing is seen). */
static double ref_row_serving(const double *q, const double *const *K, const double *const *V, const int *vis,
                              int64_t kL, int32_t D, double scale, double softcap, double slope, int64_t t,
                              double sink, double *out) {
    double mx = isnan(sink) ? -INFINITY : sink, sum = 0;
    double *s = malloc(sizeof(double) * (size_t)(kL + 1));
    for (int64_t j = 0; j < kL; j++) {
        double dot = 0;
        for (int32_t d = 0; d < D; d++) dot += q[d] * K[j][d];
        double x = scale * dot;
        if (softcap > 0) x = softcap * tanh(x / softcap);
        x -= slope * fabs((double)(t - j));
        s[j] = vis[j] ? x : -INFINITY;
        if (s[j] > mx) mx = s[j];
    }
    for (int32_t d = 0; d < D; d++) out[d] = 0;
    if (mx == -INFINITY) { free(s); return -INFINITY; }
    for (int64_t j = 0; j < kL; j++) {
        if (!vis[j]) continue;
        const double p = exp(s[j] - mx);
        sum += p;
        for (int32_t d = 0; d < D; d++) out[d] += p * V[j][d];
    }
    if (!isnan(sink)) sum += exp(sink - mx);
    for (int32_t d = 0; d < D; d++) out[d] /= sum;
    free(s);
    return mx + log(sum);
}

static void run_serving(const ServeCase *c, int fast) {
    const int32_t D = c->D, H = c->H, Hkv = c->Hkv, B = c->B, ps = c->page_size;
    const int per_seq = c->varlen_q || c->varlen_k || c->kv_lens || c->paged;
    int32_t cuq[5] = {0}, cuk[5] = {0}, qmax = 0, kmax = 0, max_pages = 0, npages = 0;
    for (int32_t b = 0; b < B; b++) {
        cuq[b + 1] = cuq[b] + c->qlens[b];
        cuk[b + 1] = cuk[b] + c->klens[b];
        if (c->qlens[b] > qmax) qmax = c->qlens[b];
        if (c->klens[b] > kmax) kmax = c->klens[b];
        if (c->paged && (c->klens[b] + ps - 1) / ps > max_pages) max_pages = (c->klens[b] + ps - 1) / ps;
    }
    const int32_t kcap = kmax + 5; /* non-paged cache rows past every length */
    int32_t *table = NULL;
    if (c->paged) { /* every sequence gets max_pages pages, handed out in a shuffled order */
        npages = B * max_pages + 1;
        table = malloc(sizeof(int32_t) * (size_t)(B * max_pages));
        int32_t *perm = malloc(sizeof(int32_t) * (size_t)npages);
        for (int32_t i = 0; i < npages; i++) perm[i] = i;
        for (int32_t i = npages - 1; i > 0; i--) {
            const int32_t j = (int32_t)(urand() * (i + 1)), t = perm[i];
            perm[i] = perm[j]; perm[j] = t;
        }
        for (int32_t i = 0; i < B * max_pages; i++) table[i] = perm[i];
        free(perm);
    }
    const size_t qrows = c->varlen_q ? (size_t)cuq[B] : (size_t)B * qmax;
    const size_t krows = c->paged ? (size_t)npages * ps : c->varlen_k ? (size_t)cuk[B] : (size_t)B * kcap;
    Buf q = buf_new(c->dtype, qrows * H * D, 1), o = buf_new(c->dtype, qrows * H * D, 0);
    Buf k = buf_new(c->dtype, krows * Hkv * D, 1), v = buf_new(c->dtype, krows * Hkv * D, 1);
    for (size_t i = 0; i < o.n; i++) put(&o, i, 7.0f); /* rows the kernel must write */
    float *lse = malloc(sizeof(float) * qrows * H), sinks[16];
    for (size_t i = 0; i < qrows * H; i++) lse[i] = 7.0f;
    for (int32_t h = 0; h < H; h++) sinks[h] = h == 0 ? -INFINITY : (float)(urand() * 3.0 - 1.0);
    float slopes[64];
    for (int32_t i = 0; i < B * H; i++) slopes[i] = (float)(urand() * 0.5);

    FMPrefillArgs a;
    memset(&a, 0, sizeof a);
    a.p.B = B; a.p.H = H; a.p.D = D; a.p.Dv = D; a.p.qL = qmax; a.p.kL = c->varlen_k || c->kv_lens ? kmax : kcap;
    if (!per_seq) a.p.kL = c->klens[0];
    a.p.gqa_factor = H / Hkv;
    a.p.scale = 1.0f / sqrtf((float)D);
    a.p.softcapping = c->softcap;
    a.p.qL_off = c->qoff;
    a.bq = D >= 512 ? 8 : 32; a.bk = D >= 512 ? 8 : 16;
    a.p.NQ = (qmax + a.bq - 1) / a.bq; a.p.NK = (a.p.kL + a.bk - 1) / a.bk;
    const int64_t qs[3] = {c->varlen_q ? 0 : (int64_t)qmax * H * D, D, (int64_t)H * D};
    const int64_t ks[3] = {c->varlen_k || c->paged ? 0 : (int64_t)kcap * Hkv * D, D, (int64_t)Hkv * D};
    memcpy(a.p.Q_strides, qs, sizeof qs); memcpy(a.p.O_strides, qs, sizeof qs);
    memcpy(a.p.K_strides, ks, sizeof ks); memcpy(a.p.V_strides, ks, sizeof ks);
    a.q = q.raw; a.k = k.raw; a.v = v.raw; a.o = o.raw;
    a.io_dtype = c->dtype; a.causal = c->causal; a.mask_kind = FM_MASK_NONE;
    a.seq.sp.window_left = c->wl; a.seq.sp.window_right = c->wr;
    a.seq.sp.attention_chunk = c->chunk;
    a.seq.sp.page_size = ps; a.seq.sp.max_pages = max_pages;
    a.seq.sp.K_page_stride = a.seq.sp.V_page_stride = (int64_t)ps * Hkv * D;
    const int64_t ls[3] = {c->varlen_q ? 0 : (int64_t)H * qmax, c->varlen_q ? (int64_t)cuq[B] : qmax, 1};
    memcpy(a.seq.sp.lse_strides, ls, sizeof ls);
    a.seq.cu_seqlens_q = c->varlen_q ? cuq : NULL;
    a.seq.cu_seqlens_k = c->varlen_k ? cuk : NULL;
    int32_t ktab[8]; /* lengths, then first keys */
    int has_first = 0;
    for (int32_t b = 0; b < B; b++) {
        ktab[b] = c->klens[b];
        ktab[B + b] = c->first[b];
        has_first |= c->first[b] != 0;
    }
    a.seq.seqlens_k = c->kv_lens ? ktab : NULL;
    a.seq.sp.key_starts_at = c->kv_lens && has_first ? B : 0;
    a.seq.block_table = table;
    a.seq.sinks = c->sinks ? sinks : NULL;
    a.seq.lse = c->lse ? lse : NULL;
    a.seq.alibi = c->alibi ? slopes : NULL;
    a.seq.window = c->window;

    const int isa = fm_cpu_isa();
    if (fast) {
        a.panel_blocks = fm_cpu_prefill_panel_blocks(&a);
        const size_t pb = fm_cpu_prefill_pack_bytes(&a, isa);
        CHECK(pb > 0, "%s: no fast path for serving D=%d dtype=%d", fm_cpu_isa_name(isa), D, c->dtype);
        if (pb == 0) goto done;
        const int64_t nkb = a.panel_blocks, rows = fm_cpu_prefill_item_rows(isa);
        char *packed = malloc(pb * Hkv);
        float *scratch = malloc(sizeof(float) * fm_cpu_prefill_fast_scratch_floats(&a, isa));
        for (int32_t b = 0; b < B; b++) {
            for (int32_t g = 0; g < Hkv; g++)
                for (int64_t kb = 0; kb < nkb; kb++) fm_cpu_prefill_pack(&a, isa, b, g, kb, packed + g * pb);
            const int64_t n = fm_cpu_prefill_seq_rows(&a, b);
            for (int32_t h = 0; h < H; h++)
                for (int64_t qi = 0; qi < (n + rows - 1) / rows; qi++)
                    fm_cpu_prefill_fast_item(&a, isa, b, h, qi, packed + (h / (H / Hkv)) * pb, scratch);
        }
        free(packed);
        free(scratch);
    } else {
        float *scratch = malloc(sizeof(float) * fm_cpu_prefill_scratch_floats(a.bq, a.bk, D));
        for (int32_t b = 0; b < B; b++)
            for (int32_t h = 0; h < H; h++)
                for (int64_t qt = 0; qt < a.p.NQ; qt++) fm_cpu_prefill_tile(&a, b, h, qt, scratch);
        free(scratch);
    }

    double worst = 0, worst_lse = 0, *ref = malloc(sizeof(double) * (size_t)D);
    const double **Kr = malloc(sizeof(double *) * (size_t)(kcap + 1)), **Vr = malloc(sizeof(double *) * (size_t)(kcap + 1));
    int *vis = malloc(sizeof(int) * (size_t)(kcap + 1)), untouched = 0;
    for (int32_t b = 0; b < B; b++) {
        const int32_t qL = per_seq ? c->qlens[b] : qmax, kL = c->klens[b];
        const int64_t t0 = per_seq ? (int64_t)kL - qL : c->qoff;
        for (int32_t h = 0; h < H; h++) {
            const int32_t g = h / (H / Hkv);
            for (int32_t p = 0; p < kL; p++) { /* the logical cache row p, by the layout's own formula */
                size_t row = c->paged ? (size_t)table[b * max_pages + p / ps] * ps + p % ps
                           : c->varlen_k ? (size_t)cuk[b] + p : (size_t)b * kcap + p;
                Kr[p] = k.val + (row * Hkv + g) * D;
                Vr[p] = v.val + (row * Hkv + g) * D;
            }
            for (int32_t i = 0; i < qL; i++) {
                const size_t qrow = c->varlen_q ? (size_t)cuq[b] + i : (size_t)b * qmax + i;
                for (int32_t p = 0; p < kL; p++) vis[p] = serve_visible(c, t0 + i, p, kL, c->kv_lens ? c->first[b] : 0);
                const double l = ref_row_serving(q.val + (qrow * H + h) * D, Kr, Vr, vis, kL, D, a.p.scale,
                                                 c->softcap, c->alibi ? slopes[b * H + h] : 0.0, t0 + i,
                                                 c->sinks ? sinks[h] : NAN, ref);
                for (int32_t d = 0; d < D; d++) {
                    const double got = to_double(c->dtype, o.raw, (qrow * H + h) * D + d);
                    const double err = fabs(got - ref[d]) / (tol_atol(c->dtype) + 0.02 * fabs(ref[d]));
                    if (!(err <= worst)) worst = err;
                }
                if (c->lse) {
                    const size_t li = c->varlen_q ? (size_t)h * cuq[B] + qrow : ((size_t)b * H + h) * qmax + i;
                    const double e = l == -INFINITY ? (lse[li] == -INFINITY ? 0 : INFINITY)
                                                    : fabs(lse[li] - l) / (1e-4 + 1e-5 * fabs(l));
                    if (!(e <= worst_lse)) worst_lse = e;
                }
            }
            if (!c->varlen_q) /* padding rows past the sequence stay untouched */
                for (int32_t i = qL; i < qmax; i++) untouched += o.val[(((size_t)b * qmax + i) * H + h) * D] != 7.0;
        }
    }
    CHECK(worst <= 1.0 && worst_lse <= 1.0 && untouched == 0,
          "serving %s %s D=%d dtype=%d B=%d varlen=%d/%d kv_lens=%d paged=%d(ps %d) causal=%d window=%d(%d,%d) "
          "chunk=%d softcap=%g sinks=%d lse=%d alibi=%d: error %.3gx, lse %.3gx tolerance, %d padding rows written",
          fm_cpu_isa_name(isa), fast ? "fast" : "portable", D, c->dtype, B, c->varlen_q, c->varlen_k, c->kv_lens,
          c->paged, ps, c->causal, c->window, c->wl, c->wr, c->chunk, c->softcap, c->sinks, c->lse, c->alibi, worst,
          worst_lse, untouched);
    free(ref); free(Kr); free(Vr); free(vis);
done:
    free(table); free(lse);
    buf_free(&q); buf_free(&k); buf_free(&v); buf_free(&o);
}

static void run_serving_cases(int fast) {
    const int32_t dims[] = {64, 80, 96, 128, 192, 256};
    for (int di = 0; di < 6; di++) {
        const int32_t D = dims[di];
        const int32_t dt = di % 2 ? FM_DTYPE_F16 : FM_DTYPE_BF16;
        /* varlen q and k, ragged (1, a tile +- 1, longer), causal + window + softcap + sinks + lse */
        const ServeCase varlen = {D, dt, 4, 2, 4, 1, 1, 0, 0, 0, 1, 1, 40, 3, 1, 1, 0, 30.0f,
                                  {1, 31, 65, 70}, {1, 33, 130, 70}};
        run_serving(&varlen, fast);
        /* a paged cache with per-sequence lengths (chunked prefill), page 16: a 64-key block spans pages */
        const ServeCase paged = {D, dt, 4, 1, 3, 0, 0, 1, 1, 16, 1, 0, -1, -1, 0, 1, 0, 0.0f,
                                 {17, 17, 17}, {17, 100, 150}};
        run_serving(&paged, fast);
    }
    /* pages of 3 keys (any page size): every key block and row block spans pages */
    const ServeCase paged3 = {128, FM_DTYPE_BF16, 4, 1, 3, 0, 0, 1, 1, 3, 1, 0, -1, -1, 0, 1, 0, 0.0f,
                              {17, 17, 17}, {17, 100, 150}};
    run_serving(&paged3, fast);
    /* varlen q over a paged cache, window only (no causal), empty sequences, sinks */
    const ServeCase mixed = {128, FM_DTYPE_BF16, 4, 2, 4, 1, 0, 1, 1, 32, 0, 1, 10, 20, 1, 1, 0, 0.0f,
                             {5, 0, 40, 3}, {70, 9, 40, 0}};
    run_serving(&mixed, fast);
    /* the plain mode with the in-kernel window (fm_dispatch_prefill window=): row i at qoff + i */
    const ServeCase seedwin = {64, FM_DTYPE_F16, 4, 2, 1, 0, 0, 0, 0, 0, 1, 1, 56, -1, 0, 0, 80, 0.0f,
                               {70}, {150}};
    run_serving(&seedwin, fast);
    /* attention chunks: 7 (cuts every tile) with causal + window + sinks, varlen with more rows than keys
     * (negative positions); 16 over a paged cache, no causal */
    const ServeCase chunked = {64, FM_DTYPE_BF16, 4, 2, 4, 1, 1, 0, 0, 0, 1, 1, 20, -1, 1, 1, 0, 0.0f,
                               {9, 40, 3, 20}, {50, 45, 0, 6}, 7};
    run_serving(&chunked, fast);
    const ServeCase chunked_paged = {128, FM_DTYPE_F16, 4, 1, 3, 0, 0, 1, 1, 16, 0, 1, -1, -1, 0, 1, 0, 0.0f,
                                     {17, 17, 17}, {17, 100, 150}, 16};
    run_serving(&chunked_paged, fast);
    /* first keys (cache_leftpad) after the lengths: causal + window + chunk 7 (counted from the first key) +
     * sinks over a cache, one sequence whose first key is its length (sees nothing); and over a paged cache */
    const ServeCase leftpad = {64, FM_DTYPE_BF16, 4, 2, 4, 0, 0, 1, 0, 0, 1, 1, 30, -1, 1, 1, 0, 0.0f,
                               {9, 9, 9, 9}, {50, 45, 20, 70}, 7, {13, 0, 20, 69}};
    run_serving(&leftpad, fast);
    const ServeCase leftpad_paged = {128, FM_DTYPE_F16, 4, 1, 3, 0, 0, 1, 1, 16, 1, 0, -1, -1, 0, 1, 0, 0.0f,
                                     {17, 17, 17}, {17, 100, 150}, 0, {5, 33, 149}};
    run_serving(&leftpad_paged, fast);
    /* ALiBi: varlen (more rows than keys: |t - p| both ways) with causal + window + softcap + sinks; a paged
     * cache with first keys and no causal; the plain mode at qoff; every head dim class */
    for (int di = 0; di < 6; di++) {
        const ServeCase alibi = {dims[di], di % 2 ? FM_DTYPE_F16 : FM_DTYPE_BF16, 4, 2, 4, 1, 1, 0, 0, 0, 1, 1,
                                 20, -1, 1, 1, 0, 30.0f, {9, 40, 3, 20}, {50, 45, 0, 6}, 0, {0}, 1};
        run_serving(&alibi, fast);
    }
    const ServeCase alibi_paged = {128, FM_DTYPE_F16, 4, 1, 3, 0, 0, 1, 1, 16, 0, 1, 12, 4, 0, 1, 0, 0.0f,
                                   {17, 17, 17}, {17, 100, 150}, 0, {5, 33, 0}, 1};
    run_serving(&alibi_paged, fast);
    const ServeCase alibi_plain = {64, FM_DTYPE_BF16, 4, 2, 1, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 1, 80, 0.0f,
                                   {70}, {150}, 0, {0}, 1};
    run_serving(&alibi_plain, fast);
    if (fast) { /* float32 (sdpa's fast route) through the same code */
        const ServeCase f32 = {96, FM_DTYPE_F32, 4, 2, 3, 1, 1, 0, 0, 0, 1, 1, 40, 3, 1, 1, 0, 30.0f,
                               {31, 65, 70}, {33, 130, 70}};
        run_serving(&f32, fast);
    }
}

/* ---- decode -------------------------------------------------------------- */

typedef struct {
    int32_t D, dtype, window; /* window 0: none, else keys p with (len - 1) - p < window */
    int32_t paged, sinks, lse;
    float softcap;
    int32_t leftpad; /* sequences start at first keys {0, 1, 30, 5} (cache_leftpad) */
    int32_t alibi;   /* ALiBi slopes per row: key p scores -slope * (len - 1 - p) more */
} DecodeCase;

/* B sequences of the lengths below, H = 4 query heads over Hkv = 2 kv heads,
 * each (b, h) checked against a double reference; the same values run once
 * from a contiguous [B, cap, Hkv, D] cache and, with c->paged, once more
 * from a paged one whose table is shuffled, which must give the same bits. */
static void run_decode(const DecodeCase *c) {
    enum { B = 4, H = 4, Hkv = 2, PS = 16, MAXP = 6, CAP = PS * MAXP, NWG = 32 };
    const int32_t lens[B] = {0, 1, 77, CAP};
    const int32_t D = c->D, dt = c->dtype;
    const size_t row = (size_t)Hkv * D; /* elements per cache position */
    Buf k = buf_new(dt, (size_t)B * CAP * row, 1), v = buf_new(dt, (size_t)B * CAP * row, 1);
    Buf q = buf_new(FM_DTYPE_F32, (size_t)B * H * D, 1);
    float sinks[H];
    for (int h = 0; h < H; h++) sinks[h] = 2.0f * nrand();
    float slopes[B * H];
    for (int r = 0; r < B * H; r++) slopes[r] = (float)(urand() * 0.5);
    FMVecArgs a;
    memset(&a, 0, sizeof a);
    a.p = (FlashAttnVecParams){H, Hkv, (uint32_t)D, 0, CAP, 1.0f / sqrtf((float)D), c->window ? 2 : 1,
                               (uint32_t)c->window, c->softcap, NWG, (uint32_t)D, 0};
    a.q = (const float *)q.raw;
    const int32_t starts[B] = {0, 1, 30, 5};
    a.seqlens = lens;
    a.key_starts = c->leftpad ? starts : NULL;
    a.alibi = c->alibi ? slopes : NULL;
    a.batch = B;
    a.kv_dtype = dt;
    for (int i = 0; i < 2; i++) {
        int64_t *st = i ? a.v_strides : a.k_strides;
        st[0] = (int64_t)CAP * row; st[1] = D; st[2] = (int64_t)row;
    }
    const size_t nout = (size_t)B * H * D;
    float *tmp = calloc((size_t)B * H * NWG * (D + 2), sizeof(float));
    /* [2 * run + order]: run 0 contiguous, 1 paged; order 0 head-major
     * (fm_cpu_vec_item), 1 key-major (fm_cpu_vec_item_keys). */
    float *out[4], *lse[4];
    for (int i = 0; i < 4; i++) out[i] = calloc(nout, sizeof(float)), lse[i] = calloc(B * H, sizeof(float));
    float *scratch = malloc(sizeof(float) * fm_cpu_vec_scratch_floats(&a));
    /* The paged copy: page j of sequence b at table[b][j], pages shuffled. */
    const int32_t npages = B * MAXP + 3;
    int32_t table[B * MAXP];
    for (int i = 0; i < B * MAXP; i++) table[i] = (i * 7 + 3) % npages;
    const size_t esz = dt == FM_DTYPE_F32 ? 4 : 2, page_bytes = (size_t)PS * row * esz;
    char *kp = calloc((size_t)npages, page_bytes), *vp = calloc((size_t)npages, page_bytes);
    for (int b = 0; b < B; b++)
        for (int j = 0; j < MAXP; j++) {
            const size_t src = ((size_t)b * CAP + (size_t)j * PS) * row * esz;
            memcpy(kp + (size_t)table[b * MAXP + j] * page_bytes, (char *)k.raw + src, page_bytes);
            memcpy(vp + (size_t)table[b * MAXP + j] * page_bytes, (char *)v.raw + src, page_bytes);
        }
    for (int run = 0; run < (c->paged ? 2 : 1); run++) {
        a.k = run ? (const void *)kp : k.raw;
        a.v = run ? (const void *)vp : v.raw;
        a.block_table = run ? table : NULL;
        a.page_size = PS;
        a.max_pages = MAXP;
        a.tmp = tmp;
        for (int i = 0; i < 2; i++) (i ? a.v_strides : a.k_strides)[0] = run ? (int64_t)PS * row : (int64_t)CAP * row;
        for (int order = 0; order < 2; order++) {
            memset(tmp, 0xff, sizeof(float) * (size_t)B * H * NWG * (D + 2)); /* NaN: every partial is written */
            for (int64_t w = 0; w < NWG; w++) {
                if (order)
                    for (int64_t b = 0; b < B; b++) fm_cpu_vec_item_keys(&a, b, w, scratch);
                else
                    for (int64_t r = 0; r < (int64_t)B * Hkv; r++) fm_cpu_vec_item(&a, r, w, scratch);
            }
            for (int64_t r = 0; r < (int64_t)B * H; r++)
                fm_cpu_vec_reduce_row(tmp, out[2 * run + order], FM_DTYPE_F32, (int64_t)B * H, D, NWG, r, 0, NULL,
                                      c->sinks ? sinks : NULL, c->lse ? lse[2 * run + order] : NULL, r % H);
        }
    }
    double worst = 0, worst_lse = 0, *ref = malloc(sizeof(double) * (size_t)D), *s = malloc(sizeof(double) * CAP);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int g = h / (H / Hkv), len = lens[b];
            int lo = c->window && len - c->window > 0 ? len - c->window : 0;
            if (c->leftpad && starts[b] > lo) lo = starts[b];
            double mx = c->sinks ? sinks[h] : -INFINITY, sum = 0;
            for (int p = lo; p < len; p++) {
                double dot = 0;
                for (int d = 0; d < D; d++) dot += q.val[((size_t)b * H + h) * D + d] * k.val[((size_t)b * CAP + p) * row + (size_t)g * D + d];
                double x = a.p.scale * dot;
                if (c->softcap > 0) x = c->softcap * tanh(x / c->softcap);
                if (c->alibi) x -= slopes[b * H + h] * (double)(len - 1 - p);
                s[p] = x;
                if (x > mx) mx = x;
            }
            for (int d = 0; d < D; d++) ref[d] = 0;
            if (c->sinks) sum = exp(sinks[h] - mx);
            for (int p = lo; p < len; p++) {
                const double e = exp(s[p] - mx);
                sum += e;
                for (int d = 0; d < D; d++) ref[d] += e * v.val[((size_t)b * CAP + p) * row + (size_t)g * D + d];
            }
            for (int d = 0; d < D; d++) {
                if (sum > 0) ref[d] /= sum;
                const double err = fabs(out[0][((size_t)b * H + h) * D + d] - ref[d]) / (1e-5 + 1e-4 * fabs(ref[d]));
                if (!(err <= worst)) worst = err;
            }
            if (c->lse) {
                const double want = sum > 0 ? mx + log(sum) : -INFINITY, got = lse[0][b * H + h];
                const double err = want == -INFINITY ? (got == -INFINITY ? 0 : INFINITY) : fabs(got - want) / 1e-5;
                if (!(err <= worst_lse)) worst_lse = err;
            }
        }
    CHECK(worst <= 1.0 && worst_lse <= 1.0,
          "decode %s D=%d dtype=%d window=%d sinks=%d softcap=%g leftpad=%d alibi=%d: error %.3gx tolerance (lse %.3gx)",
          fm_cpu_isa_name(fm_cpu_isa()), D, dt, c->window, c->sinks, (double)c->softcap, c->leftpad, c->alibi, worst,
          worst_lse);
    for (int i = 1; i < (c->paged ? 4 : 2); i++)
        CHECK(memcmp(out[0], out[i], nout * sizeof(float)) == 0 && memcmp(lse[0], lse[i], B * H * sizeof(float)) == 0,
              "decode %s D=%d dtype=%d: %s %s differs in its bits from contiguous head-major",
              fm_cpu_isa_name(fm_cpu_isa()), D, dt, i >= 2 ? "paged" : "contiguous", i % 2 ? "key-major" : "head-major");
    for (int i = 0; i < 4; i++) free(out[i]), free(lse[i]);
    free(tmp); free(scratch); free(ref); free(s);
    free(kp); free(vp);
    buf_free(&k); buf_free(&v); buf_free(&q);
}

/* ---- rotary ------------------------------------------------------------- */

/* x [B, L, H, D] rotated by fm_cpu_rotary_row against the double rotation:
 * pairs (j, j + half) or (2j, 2j+1) of the first 2*half dims, the rest
 * copied bit for bit; positions offsets[b] + (per_row ? i : 0). */
static void run_rotary(int32_t xdt, int32_t cdt, int32_t interleaved, int32_t per_row) {
    const int32_t B = 2, L = 3, H = 2, D = 80, half = 24, R = 20;
    const int32_t offsets[2] = {4, 17};
    const size_t n = (size_t)B * L * H * D;
    Buf x = buf_new(xdt, n, 1), out = buf_new(xdt, n, 0);
    Buf cs = buf_new(cdt, (size_t)R * half, 0), sn = buf_new(cdt, (size_t)R * half, 0);
    for (size_t k = 0; k < (size_t)R * half; k++) {
        const double a = urand() * 6.283185307179586;
        put(&cs, k, (float)cos(a));
        put(&sn, k, (float)sin(a));
    }
    const RotaryParams p = {L, H, D, half, interleaved, per_row};
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < L; i++) fm_cpu_rotary_row(&p, x.raw, cs.raw, sn.raw, offsets, out.raw, xdt, cdt, b, i);
    const size_t elem = xdt == FM_DTYPE_F32 ? 4 : 2;
    const double rel = xdt == FM_DTYPE_F32 ? 1e-6 : xdt == FM_DTYPE_F16 ? 1e-3 : 8e-3;
    int bad = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < L; i++)
            for (int64_t h = 0; h < H; h++) {
                const size_t row = (size_t)(((b * L + i) * H + h) * D);
                const int64_t t = offsets[b] + (per_row ? i : 0);
                for (int64_t j = 0; j < half; j++) {
                    const size_t ia = row + (size_t)(interleaved ? 2 * j : j);
                    const size_t ic = row + (size_t)(interleaved ? 2 * j + 1 : j + half);
                    const double c = cs.val[t * half + j], s = sn.val[t * half + j];
                    const double y1 = x.val[ia] * c - x.val[ic] * s, y2 = x.val[ia] * s + x.val[ic] * c;
                    /* float32 products, then one rounding: the error scales with the terms */
                    const double scale = fabs(x.val[ia]) + fabs(x.val[ic]) + 1e-30;
                    bad += fabs(to_double(xdt, out.raw, ia) - y1) > rel * scale;
                    bad += fabs(to_double(xdt, out.raw, ic) - y2) > rel * scale;
                }
                bad += memcmp((char *)out.raw + (row + 2 * half) * elem, (char *)x.raw + (row + 2 * half) * elem,
                              (size_t)(D - 2 * half) * elem) != 0;
            }
    CHECK(bad == 0, "rotary x dtype %d tables %d interleaved %d per_row %d: %d elements off", xdt, cdt, interleaved,
          per_row, bad);
    buf_free(&x); buf_free(&out); buf_free(&cs); buf_free(&sn);
}

/* ---- blk and mask builder ------------------------------------------------ */

static void run_blk_and_mask(void) {
    const int32_t qL = 40, kL = 50, bq = 8, bk = 8;
    const int64_t NQ = 5, NK = 7;
    uint16_t *m = calloc((size_t)qL * kL, 2);
    for (int32_t i = 0; i < qL; i++)
        for (int32_t j = 0; j < kL; j++) {
            float x = 0.0f;
            if (j < 8) x = -INFINITY;             /* tile column 0: all -inf -> 0 */
            else if (j < 16) x = -1e30f;          /* finite: mixed -> 1 */
            else if (j < 24 && i == 3) x = 0.5f;  /* one cell -> 1 in tile row 0 */
            m[i * kL + j] = fm_f32_to_bf16(x);
        }
    uint8_t blk[5 * 7];
    BlkParams bp = {qL, kL, kL, 0};
    for (int64_t qt = 0; qt < NQ; qt++)
        for (int64_t kt = 0; kt < NK; kt++) fm_cpu_blk_tile(&bp, m, 1, blk, bq, bk, NK, qt, kt);
    for (int64_t qt = 0; qt < NQ; qt++) {
        CHECK(blk[qt * NK + 0] == 0, "blk all -inf tile (%ld,0) = %d", (long)qt, blk[qt * NK]);
        CHECK(blk[qt * NK + 1] == 1, "blk -1e30 tile (%ld,1) = %d, want 1", (long)qt, blk[qt * NK + 1]);
        CHECK(blk[qt * NK + 2] == (qt == 0 ? 1 : 2), "blk tile (%ld,2) = %d", (long)qt, blk[qt * NK + 2]);
        CHECK(blk[qt * NK + 6] == 1, "blk partial right-edge tile (%ld,6) = %d", (long)qt, blk[qt * NK + 6]);
    }
    MaskParams mp = {qL, kL, 5, 7, 1, 0};
    uint16_t *row = calloc((size_t)qL * kL, 2);
    for (int64_t i = 0; i < qL; i++) fm_cpu_mask_row(&mp, row, 0, i);
    int bad = 0;
    for (int32_t i = 0; i < qL; i++)
        for (int32_t j = 0; j < kL; j++) {
            const int64_t t = 5 + i;
            const int vis = j <= t && t - j < 7;
            bad += row[i * kL + j] != (vis ? 0x0000u : 0xFC00u);
        }
    CHECK(bad == 0, "mask builder: %d cells differ", bad);
    free(m); free(row);
}

/* ---- attention over quantized caches ------------------------------------- */

/* One case over quantized caches (codes_case.h): H query heads over Hkv kv
 * heads, 70 query rows at the end of 150 keys. dense: 1 K, 2 V, 3 both
 * sides stored as rows of dtype (the codec's dequantized rows rounded to it)
 * instead of codes. v_inf: one dense V value of kv head 0 is +inf at key
 * 120, which rows before it must never see. alibi > 0: head h's ALiBi slope
 * is alibi * (h + 1) / H. */
typedef struct {
    int32_t D, H, Hkv, kbits, vbits, window;
    float softcap;
    int32_t dense, dtype, v_inf;
    float alibi;
} CodesRun;

typedef struct {
    CodesCase c;
    CodesRun r;
    Buf kraw, vraw;
    float *slopes;
    KVCodesDecodeParams p;
    FMCPUKVCodesAttnArgs a;
} CodesSetup;

/* The dequantized rows x of one side as a dense cache of dtype: x becomes
 * the values the kernel reads. */
static Buf codes_dense(float *x, int64_t n, int32_t dtype) {
    Buf b = buf_new(dtype, (size_t)n, 0);
    for (int64_t i = 0; i < n; i++) {
        put(&b, (size_t)i, x[i]);
        x[i] = (float)b.val[i];
    }
    return b;
}

static CodesSetup codes_setup(const CodesRun *r) {
    CodesSetup s;
    memset(&s, 0, sizeof s);
    s.r = *r;
    s.c = codes_case_new(r->D, r->H, r->Hkv, 70, 150, r->window, r->kbits, r->vbits, nrand);
    const int64_t n = (int64_t)s.c.kL * s.c.Hkv * s.c.D;
    s.p = codes_params(&s.c);
    s.p.softcap = r->softcap;
    s.a = codes_args(&s.c);
    s.a.dense_dtype = r->dtype;
    if (r->alibi > 0) {
        s.slopes = malloc(sizeof(float) * r->H);
        for (int32_t h = 0; h < r->H; h++) s.slopes[h] = r->alibi * (float)(h + 1) / (float)r->H;
        s.a.alibi = s.slopes;
    }
    if (r->dense & 1) {
        s.kraw = codes_dense(s.c.kd, n, r->dtype);
        s.a.k_dense = s.kraw.raw;
        s.a.k_codes = NULL;
        s.a.k_norms = NULL;
    }
    if (r->dense & 2) {
        if (r->v_inf) s.c.vd[(size_t)120 * s.c.Hkv * s.c.D + 5] = INFINITY;
        s.vraw = codes_dense(s.c.vd, n, r->dtype);
        s.a.v_dense = s.vraw.raw;
        s.a.v_codes = NULL;
        s.a.v_norms = NULL;
    }
    return s;
}

/* Checks o and lse against double attention over the keys and values the
 * kernel reads (softcap, the sink in each denominator without a value; an
 * output the reference makes non-finite must not be finite), then frees the
 * case. */
static void codes_check(CodesSetup *s, const char *what) {
    CodesCase *c = &s->c;
    const int32_t D = c->D, H = c->H, Hkv = c->Hkv, qL = c->qL, group = H / Hkv;
    const int64_t kL = c->kL;
    const double scale = 1.0f / sqrtf((float)D), softcap = s->r.softcap;
    double worst = 0, worst_lse = 0, acc[512];
    double *sc = malloc(sizeof(double) * kL);
    int finite_bad = 0;
    for (int32_t h = 0; h < H; h++) {
        const int32_t g = h / group;
        for (int32_t i = 0; i < qL; i++) {
            const int64_t pos = kL - qL + i;
            const float *q = c->q + ((int64_t)i * H + h) * D;
            double mx = c->sinks[h];
            for (int64_t j = 0; j < kL; j++) {
                const int vis = j <= pos && (c->window <= 0 || j > pos - c->window);
                double dot = 0;
                for (int32_t d = 0; vis && d < D; d++) dot += (double)q[d] * c->kd[(j * Hkv + g) * D + d];
                double x = scale * dot;
                if (softcap > 0) x = softcap * tanh(x / softcap);
                if (s->slopes != NULL) x -= (double)s->slopes[h] * (double)(pos >= j ? pos - j : j - pos);
                sc[j] = vis ? x : -INFINITY;
                if (sc[j] > mx) mx = sc[j];
            }
            double den = exp(c->sinks[h] - mx);
            for (int32_t d = 0; d < D; d++) acc[d] = 0;
            for (int64_t j = 0; j < kL; j++) {
                if (sc[j] == -INFINITY) continue;
                const double e = exp(sc[j] - mx);
                den += e;
                for (int32_t d = 0; d < D; d++) acc[d] += e * c->vd[(j * Hkv + g) * D + d];
            }
            for (int32_t d = 0; d < D; d++) {
                const double want = acc[d] / den, got = c->o[((int64_t)i * H + h) * D + d];
                if (!isfinite(want)) {
                    finite_bad += isfinite(got);
                    continue;
                }
                const double err = fabs(got - want) / (1e-5 + 1e-4 * fabs(want));
                if (!(err <= worst)) worst = err;
            }
            const double el = fabs(c->lse[(int64_t)h * qL + i] - (mx + log(den))) / 1e-5;
            if (!(el <= worst_lse)) worst_lse = el;
        }
    }
    CHECK(worst <= 1.0 && worst_lse <= 1.0 && finite_bad == 0,
          "%s %s D=%d H=%d/%d K%d/V%d window=%d softcap=%g dense=%d(dtype %d) v_inf=%d alibi=%g: error %.3gx "
          "tolerance (lse %.3gx), %d finite where the reference is not",
          what, fm_cpu_isa_name(fm_cpu_isa()), D, H, Hkv, c->kbits, c->vbits, c->window, softcap, s->r.dense,
          s->r.dtype, s->r.v_inf, s->r.alibi, worst, worst_lse, finite_bad);
    free(sc);
    free(s->slopes);
    codes_case_free(c);
    if (s->r.dense & 1) buf_free(&s->kraw);
    if (s->r.dense & 2) buf_free(&s->vraw);
}

/* The prefill over codes in work items of `n_items` items of each kv head,
 * as the Swift backend drives them. */
static void run_codes_prefill(const CodesRun *r, int32_t n_items) {
    CodesSetup s = codes_setup(r);
    const size_t floats = (size_t)fm_cpu_kv_codes_prefill_scratch_floats(&s.p);
    float *scratch = aligned_alloc(64, (sizeof(float) * floats + 63) & ~(size_t)63);
    for (int32_t g = 0; g < s.c.Hkv; g++)
        for (int32_t first = 0; first < s.c.qL * (s.c.H / s.c.Hkv); first += n_items)
            fm_cpu_kv_codes_prefill_items(&s.p, &s.a, first, n_items, g, 0, scratch);
    free(scratch);
    char what[32];
    snprintf(what, sizeof what, "codes prefill items=%d", n_items);
    codes_check(&s, what);
}

/* The decode's work items over codes (every row of the case), each item's
 * keys split `nsplit` ways and merged when nsplit > 1; by_row: a query
 * row's items at once (fm_cpu_kv_codes_decode_row), always merged. */
static void run_codes_decode(const CodesRun *r, int32_t nsplit, int by_row) {
    CodesSetup s = codes_setup(r);
    const int32_t chunks = (s.c.H / s.c.Hkv + FM_CPU_KVQ_HEAD_CHUNK - 1) / FM_CPU_KVQ_HEAD_CHUNK;
    const int64_t items = (int64_t)s.c.qL * s.c.Hkv * chunks;
    const int merge = nsplit > 1 || by_row;
    float *parts = merge ? malloc(sizeof(float) * items * nsplit * fm_cpu_kv_codes_part_floats(&s.p)) : NULL;
    for (int64_t bi = 0; by_row && bi < s.c.qL; bi++)
        for (int32_t sp = 0; sp < nsplit; sp++) fm_cpu_kv_codes_decode_row(&s.p, &s.a, bi, sp, nsplit, parts);
    for (int64_t item = 0; !by_row && item < items; item++)
        for (int32_t sp = 0; sp < nsplit; sp++) fm_cpu_kv_codes_decode_item(&s.p, &s.a, item, sp, nsplit, parts);
    for (int64_t item = 0; merge && item < items; item++) fm_cpu_kv_codes_decode_merge(&s.p, &s.a, item, nsplit, parts);
    free(parts);
    char what[40];
    snprintf(what, sizeof what, "codes decode splits=%d%s", nsplit, by_row ? " by row" : "");
    codes_check(&s, what);
}

/* Every code width on each side (every unpack branch of each ISA), head
 * dims of one norm block and of several (80, 96, 192), query heads per kv
 * head 1, 2, 3 (a zero row in the decode's 4), 4, 8 and 10 (two head
 * chunks), softcap, windows, and dense sides of each dtype, one holding
 * +inf. */
static void run_codes_cases(void) {
    const CodesRun pf[] = {
        {128, 4, 2, 4, 8, 0},
        {128, 4, 2, 8, 4, 0},
        {80, 4, 2, 3, 5, 0},
        {192, 4, 2, 6, 2, 90},
        {64, 4, 2, 4, 4, 70},
        {96, 6, 2, 8, 4, 0, 20.0f},
        {64, 10, 1, 2, 6, 50},
        {128, 4, 1, 4, 2, 0, 0.0f, 1, FM_DTYPE_BF16},
        {64, 2, 2, 5, 4, 0, 0.0f, 2, FM_DTYPE_F32, 1},
        {80, 3, 1, 4, 4, 40, 0.0f, 3, FM_DTYPE_F16},
        /* ALiBi, with and without a softcap and a window. */
        {128, 4, 2, 8, 4, 0, 0.0f, 0, 0, 0, 0.3f},
        {64, 10, 1, 2, 6, 50, 20.0f, 0, 0, 0, 0.1f},
    };
    const int32_t pf_items[] = {256, 64, 64, 256, 64, 64, 256, 256, 64, 64, 64, 256};
    for (size_t i = 0; i < sizeof pf / sizeof *pf; i++) run_codes_prefill(&pf[i], pf_items[i]);
    const CodesRun dec[] = {
        {128, 4, 2, 4, 8, 0},
        {192, 4, 2, 6, 2, 90},
        {80, 4, 2, 3, 5, 0},
        {96, 6, 2, 8, 4, 0, 20.0f},
        {64, 10, 1, 2, 6, 50},
        {128, 2, 2, 5, 3, 0},
        {128, 8, 1, 4, 4, 0, 0.0f, 1, FM_DTYPE_BF16},
        {80, 3, 1, 8, 4, 0, 0.0f, 2, FM_DTYPE_F16},
        {64, 4, 1, 4, 4, 30, 30.0f, 3, FM_DTYPE_F32},
        /* 8-bit sides at each head count and norm block (the byte lookups
         * of 16, 32 and 64 codes at once). */
        {192, 8, 1, 8, 8, 0},
        {80, 8, 2, 6, 8, 0},
        {96, 2, 2, 8, 8, 0},
        /* ALiBi: item and row layouts, split and whole. */
        {128, 4, 2, 4, 8, 0, 0.0f, 0, 0, 0, 0.3f},
        {64, 10, 1, 2, 6, 50, 20.0f, 0, 0, 0, 0.1f},
        {128, 8, 2, 8, 4, 0, 0.0f, 0, 0, 0, 0.2f},
    };
    const int32_t dec_split[] = {1, 3, 2, 2, 1, 1, 2, 1, 3, 2, 1, 1, 3, 1, 2};
    const int32_t dec_row[] = {0, 0, 0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 0, 1, 1};
    for (size_t i = 0; i < sizeof dec / sizeof *dec; i++) run_codes_decode(&dec[i], dec_split[i], dec_row[i]);
}

int main(int argc, char **argv) {
    const int isa = fm_cpu_isa();
    printf("cpu-arm64: ISA path %s\n", fm_cpu_isa_name(isa));
    if (argc > 1) CHECK(strcmp(argv[1], fm_cpu_isa_name(isa)) == 0, "expected ISA %s, got %s", argv[1],
                        fm_cpu_isa_name(isa));
    const int fast = isa != FM_ISA_PORTABLE;
    const int32_t dts[3] = {FM_DTYPE_BF16, FM_DTYPE_F16, FM_DTYPE_F32};
    for (int di = 0; di < 3; di++) {
        const int32_t dt = dts[di];
        if (dt == FM_DTYPE_F32 && !fast) continue; /* f32 prefill is fast-path only */
        /* 40 and 59: head dims the fast path pads to 48 and 64 (59 odd: a half bf16 pair) */
        const int32_t pdims[4] = {40, 59, 64, 128};
        for (int pi = 0; pi < 4; pi++) {
            const int32_t D = pdims[pi];
            const PrefillCase full = {D, 70, 150, 0, 4, 2, dt, 0, FM_MASK_NONE, 0, -1, -1};
            run_prefill(&full, fast);
            PrefillCase causal = full;
            causal.causal = 1; causal.qoff = 80; causal.nan_q_row = 75;
            run_prefill(&causal, fast);
            PrefillCase masked = full;
            masked.mask_kind = FM_MASK_ADDITIVE; masked.qoff = 80; masked.use_blk = 1; masked.huge_row = 9;
            run_prefill(&masked, fast);
            PrefillCase boolm = full;
            boolm.mask_kind = FM_MASK_BOOL; boolm.qoff = 80;
            run_prefill(&boolm, fast);
        }
        /* v of its own head dim: MLA's 192/128 and a narrower q/k (40) with an odd v (59) */
        const int32_t dvs[2][2] = {{192, 128}, {40, 59}};
        for (int pi = 0; pi < 2; pi++) {
            PrefillCase c = {dvs[pi][0], 70, 150, 80, 4, 2, dt, 1, FM_MASK_NONE, 0, -1, -1, dvs[pi][1]};
            run_prefill(&c, fast);
            c.mask_kind = FM_MASK_ADDITIVE; c.use_blk = 1; c.huge_row = 9;
            run_prefill(&c, fast);
        }
    }
    const PrefillCase d512 = {512, 20, 40, 20, 2, 1, FM_DTYPE_BF16, 1, FM_MASK_NONE, 0, -1, -1};
    run_prefill(&d512, fast);
    /* MLA: q/k of 576 over v of 512, causal; then float16 with an additive mask and its blk */
    PrefillCase mla = {576, 20, 40, 20, 2, 1, FM_DTYPE_BF16, 1, FM_MASK_NONE, 0, -1, -1, 512};
    run_prefill(&mla, fast);
    mla.dtype = FM_DTYPE_F16; mla.mask_kind = FM_MASK_ADDITIVE; mla.use_blk = 1; mla.huge_row = 9;
    run_prefill(&mla, fast);
    const int32_t dec_dims[7] = {64, 80, 96, 128, 192, 256, 512};
    for (int di = 0; di < 3; di++)
        for (int i = 0; i < 7; i++) {
            const DecodeCase plain = {dec_dims[i], dts[di], 0, i % 2, 0, 0, 0.0f};
            run_decode(&plain);
            const DecodeCase serving = {dec_dims[i], dts[di], i % 3 ? 20 : 0, 1, 1, 1, i == 3 ? 5.0f : 0.0f};
            run_decode(&serving);
            const DecodeCase leftpad = {dec_dims[i], dts[di], i % 2 ? 40 : 0, 1, 1, 1, 0.0f, 1};
            run_decode(&leftpad);
            const DecodeCase alibi = {dec_dims[i], dts[di], i % 2 ? 30 : 0, 1, i % 2, 1, i == 2 ? 4.0f : 0.0f, i % 3 == 0, 1};
            run_decode(&alibi);
        }
    run_serving_cases(fast);
    run_codes_cases();
    run_blk_and_mask();
    for (int xi = 0; xi < 3; xi++)
        for (int ci = 0; ci < 3; ci++) run_rotary(dts[xi], dts[ci], (xi + ci) % 2, xi != 1);
    printf("cpu-arm64: %s: %s\n", fm_cpu_isa_name(isa), failures ? "FAILED" : "all checks passed");
    return failures ? 1 : 0;
}
