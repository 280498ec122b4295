/* One attention over quantized caches set up for the cpu kernels of
 * fm_kv_codec.h, shared by tests/cpu_arm64/harness.c (checked against a
 * double reference) and bench/codes_decode_per_core.c (timed): K and V codes
 * of `kbits` / `vbits` for [kL, Hkv] rows (flash-attn's layout: a key's kv
 * heads side by side), the cpu codec's own dequantized rows beside them (the
 * reference's keys and values), qL query rows of H heads at the end of the
 * keys, causal (window > 0: each row sees its last `window` keys), one sink
 * per head and an LSE buffer. Every value is drawn from the caller's
 * normal generator, so each program keeps its own random stream. */
#ifndef FM_TESTS_CODES_CASE_H
#define FM_TESTS_CODES_CASE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "fm_kv_codec.h"

typedef struct CodesCase {
    int32_t D, H, Hkv, qL, kL, window, kbits, vbits;
    KVCodecParams kc, vc;
    uint8_t *kq, *vq;
    float *kn, *vn, *kd, *vd, *q, *o, *lse, *sinks;
} CodesCase;

/* The cpu codec's norm block of head dim D. */
static inline int32_t codes_block(int32_t D) { return D == 80 ? 16 : D == 96 ? 32 : D == 192 ? 64 : D; }

static inline CodesCase codes_case_new(int32_t D, int32_t H, int32_t Hkv, int32_t qL, int32_t kL, int32_t window,
                                       int32_t kbits, int32_t vbits, float (*nrand)(void)) {
    CodesCase c = {D, H, Hkv, qL, kL, window, kbits, vbits};
    const int32_t block = codes_block(D);
    c.kc = (KVCodecParams){5, D, kbits, block, (D * kbits / 8 + 15) & ~15, {0, 0}};
    c.vc = (KVCodecParams){6, D, vbits, block, (D * vbits / 8 + 15) & ~15, {0, 0}};
    const int64_t rows = (int64_t)kL * Hkv, nb = D / block, qn = (int64_t)qL * H * D;
    float *x = malloc(sizeof(float) * rows * D);
    c.kd = malloc(sizeof(float) * rows * D);
    c.vd = malloc(sizeof(float) * rows * D);
    c.q = malloc(sizeof(float) * qn);
    c.o = malloc(sizeof(float) * qn);
    c.lse = malloc(sizeof(float) * H * qL);
    c.sinks = malloc(sizeof(float) * H);
    c.kq = malloc((size_t)rows * c.kc.row_bytes);
    c.vq = malloc((size_t)rows * c.vc.row_bytes);
    c.kn = malloc(sizeof(float) * rows * nb);
    c.vn = malloc(sizeof(float) * rows * nb);
    for (int64_t i = 0; i < rows * D; i++) x[i] = nrand();
    fm_cpu_kv_encode_rows(&c.kc, x, FM_DTYPE_F32, c.kq, c.kn, 0, rows);
    for (int64_t i = 0; i < rows * D; i++) x[i] = nrand();
    fm_cpu_kv_encode_rows(&c.vc, x, FM_DTYPE_F32, c.vq, c.vn, 0, rows);
    fm_cpu_kv_dequantize_rows(&c.kc, c.kq, c.kn, c.kd, 0, rows);
    fm_cpu_kv_dequantize_rows(&c.vc, c.vq, c.vn, c.vd, 0, rows);
    for (int64_t i = 0; i < qn; i++) c.q[i] = nrand();
    for (int32_t h = 0; h < H; h++) c.sinks[h] = nrand();
    free(x);
    return c;
}

/* The kernels' parameters of a case: one sequence, causal, its window. */
static inline KVCodesDecodeParams codes_params(const CodesCase *c) {
    KVCodesDecodeParams p;
    memset(&p, 0, sizeof p);
    p.k_seed = c->kc.seed;
    p.v_seed = c->vc.seed;
    p.kv_strides[0] = (int64_t)c->kL * c->Hkv;
    p.kv_strides[1] = 1;
    p.kv_strides[2] = c->Hkv;
    p.n_heads = c->H;
    p.n_kv_heads = c->Hkv;
    p.head_dim = c->D;
    p.block = c->kc.block;
    p.k_bits = c->kbits;
    p.v_bits = c->vbits;
    p.k_row_bytes = c->kc.row_bytes;
    p.v_row_bytes = c->vc.row_bytes;
    p.kv_len = c->kL;
    p.q_len = c->qL;
    p.scale = 1.0f / sqrtf((float)c->D);
    p.causal = 1;
    p.window_left = c->window > 0 ? c->window - 1 : -1;
    p.window_right = -1;
    p.batch = 1;
    return p;
}

/* The kernels' buffers of a case, sinks and LSE bound. */
static inline FMCPUKVCodesAttnArgs codes_args(CodesCase *c) {
    return (FMCPUKVCodesAttnArgs){.q = c->q, .k_codes = c->kq, .k_norms = c->kn, .v_codes = c->vq,
                                  .v_norms = c->vn, .o = c->o, .sinks = c->sinks, .lse = c->lse};
}

static inline void codes_case_free(CodesCase *c) {
    free(c->kq); free(c->vq); free(c->kn); free(c->vn); free(c->kd); free(c->vd);
    free(c->q); free(c->o); free(c->lse); free(c->sinks);
}

#endif
