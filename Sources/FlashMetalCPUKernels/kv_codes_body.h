/* The decode's key loop over quantized caches (kv_codec.c), compiled once
 * per ISA like vec_body.h: the including file defines FM_SFX and the target.
 * Plain C whose inner loops the compiler vectorises at the target's width:
 * keys go in tiles of FM_KVQ_TILE, each tile's K rows decoded to float once
 * (whole bytes through lookup tables), every head's scores of the tile taken
 * before one online-softmax rescale per tile, then the V rows decoded and
 * accumulated. Dot products run in the ISA's vectors (simd.h). */
#include <math.h>
#include <string.h>

#include "fm_kv_codec.h"
#include "half_convert.h"
#include "kv_codes_keys.h"

static inline void FM_SFX(kvq_load_dense)(float *z, const void *x, int32_t dtype, int64_t row, int32_t d) {
    if (dtype == FM_DTYPE_F32) {
        memcpy(z, (const float *)x + row * d, (size_t)d * sizeof(float));
    } else {
        fm_load_row(z, (const uint16_t *)x + row * d, d, dtype == FM_DTYPE_BF16);
    }
}

#if defined(__x86_64__) && FM_VL == 8
#include <immintrin.h>
/* 8 codes of `bits` (2 or 4) bits, the low bits of w in coordinate order,
 * as their centroids c (16 entries for 4 bits, 4 for 2): each code picks
 * from the two 8-entry halves of the table by vpermps, bit 3 choosing. */
static inline __m256 FM_SFX(kvq_codes8)(uint32_t w, int32_t bits, __m256 lo, __m256 hi) {
    const __m256i shifts = bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                     : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts),
                                         _mm256_set1_epi32((1 << bits) - 1));
    const __m256 a = _mm256_permutevar8x32_ps(lo, idx);
    if (bits == 2) return a;
    return _mm256_blendv_ps(a, _mm256_permutevar8x32_ps(hi, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* One row of `bits`-bit codes as centroids: 8 codes per `bits` bytes,
 * little-endian. AVX2: 4- and 2-bit codes through vpermps, every other
 * width by gathers from its table. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_unpack)(const uint8_t *row, int32_t d, int32_t bits,
                                                                     const FMKVQTables *t, float *out) {
    if (bits == 8) {
        /* 8 codes widened to 32-bit indices, their centroids gathered from
         * the 1 KiB table (L1-resident). */
        for (int32_t i = 0; i < d; i += 8) {
            const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + i)));
            _mm256_storeu_ps(out + i, _mm256_i32gather_ps(t->c8, idx, 4));
        }
    } else if (bits == 4 || bits == 2) {
        float tab[16] = {0};
        memcpy(tab, t->c[bits], sizeof(float) << bits);
        const __m256 lo = _mm256_loadu_ps(tab), hi = _mm256_loadu_ps(tab + 8);
        if (bits == 4) {
            for (int32_t i = 0; i < d; i += 8) {
                uint32_t w;
                memcpy(&w, row + i / 2, 4);
                _mm256_storeu_ps(out + i, FM_SFX(kvq_codes8)(w, 4, lo, hi));
            }
        } else {
            for (int32_t i = 0; i < d; i += 8) {
                uint16_t w;
                memcpy(&w, row + i / 4, 2);
                _mm256_storeu_ps(out + i, FM_SFX(kvq_codes8)(w, 2, lo, hi));
            }
        }
    } else {
        /* 8 codes in `bits` (3, 5 or 6) bytes: codes 0-3 lie in the low 32
         * bits of the group, codes 4-7 in the 32 bits from 4 * bits up. */
        const __m256i shifts = _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 0, bits, 2 * bits, 3 * bits);
        const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
        for (int32_t g = 0; g < d / 8; g++) {
            uint64_t w = 0;
            memcpy(&w, row + g * bits, (size_t)bits);
            const __m256i words = _mm256_set_m128i(_mm_set1_epi32((int)(uint32_t)(w >> (4 * bits))),
                                                   _mm_set1_epi32((int)(uint32_t)w));
            const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(words, shifts), mask);
            _mm256_storeu_ps(out + g * 8, _mm256_i32gather_ps(t->c[bits], idx, 4));
        }
    }
}
#endif

#if !(defined(__x86_64__) && FM_VL == 8)
/* One row of `bits`-bit codes as centroids: 8 codes per `bits` bytes,
 * little-endian; 4-bit and 2-bit by whole bytes through t (the centroids of
 * every byte value), the rest code by code. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_unpack)(const uint8_t *row, int32_t d, int32_t bits,
                                                                     const FMKVQTables *t, float *out) {
    if (bits == 8) {
        for (int32_t i = 0; i < d; i++) out[i] = t->c8[row[i]];
    } else if (bits == 4) {
        for (int32_t i = 0; i < d / 2; i++) memcpy(out + 2 * i, t->by4[row[i]], 2 * sizeof(float));
    } else if (bits == 2) {
        for (int32_t i = 0; i < d / 4; i++) memcpy(out + 4 * i, t->by2[row[i]], 4 * sizeof(float));
    } else {
        const uint32_t mask = (1u << bits) - 1u;
        const float *c = t->c[bits];
        for (int32_t g = 0; g < d / 8; g++) {
            uint64_t w = 0;
            for (int32_t b = 0; b < bits; b++) w |= (uint64_t)row[g * bits + b] << (8 * b);
            for (int32_t j = 0; j < 8; j++) out[g * 8 + j] = c[(w >> (bits * j)) & mask];
        }
    }
}
#endif

/* sum x[i] * y[i] over n (a multiple of 16, so of FM_VL): one vector
 * accumulator, its lanes summed at the end. */
static inline float FM_SFX(kvq_dot)(const float *x, const float *y, int32_t n) {
    fm_v s = fm_v_splat(0.0f);
    for (int32_t i = 0; i < n; i += FM_VL) s += fm_v_load(x + i) * fm_v_load(y + i);
    return fm_v_sum(s);
}

/* kvq_dot of x with the 8 rows y, y + stride, ... at once (8 independent
 * accumulators keep the vector unit busy); each result has kvq_dot's bits. */
static inline void FM_SFX(kvq_dot8)(const float *x, const float *y, int32_t stride, int32_t n, float *out) {
    fm_v s[8];
    for (int32_t r = 0; r < 8; r++) s[r] = fm_v_splat(0.0f);
    for (int32_t i = 0; i < n; i += FM_VL) {
        const fm_v xv = fm_v_load(x + i);
        for (int32_t r = 0; r < 8; r++) s[r] += xv * fm_v_load(y + (int64_t)r * stride + i);
    }
    for (int32_t r = 0; r < 8; r++) out[r] = fm_v_sum(s[r]);
}

void FM_SFX(fm_kvq_keys)(const FMKVQKeys *k) {
    const KVCodesDecodeParams *p = k->p;
    const FMCPUKVCodesAttnArgs *a = k->a;
    const FMKVQTables *tab = k->tables;
    const int32_t d = p->head_dim, n = p->block, nb = d / n, heads = k->heads;
    const int32_t kn = a->k_dense != NULL ? d : n, vn = a->v_dense != NULL ? d : n;
    const float k_unit = (a->k_dense != NULL ? 1.0f : 1.0f / (float)n) * p->scale;
    float kc[FM_KVQ_TILE][FM_KVQ_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float s[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE];
    int64_t rows[FM_KVQ_TILE];
    for (int32_t t0 = k->start; t0 < k->end; t0 += FM_KVQ_TILE) {
        const int32_t nt = k->end - t0 < FM_KVQ_TILE ? k->end - t0 : FM_KVQ_TILE;
        /* The next tile's rows are requested now: a kv head's rows sit
         * Hkv rows apart, too sparse for the hardware prefetcher. */
        for (int32_t key = t0 + FM_KVQ_TILE; key < t0 + 2 * FM_KVQ_TILE && key < k->end; key++) {
            const int64_t r = fm_kvq_row(p, a, k->b, k->g, key);
            fm_kvq_prefetch_row(p, a, r);
        }
        for (int32_t t = 0; t < nt; t++) {
            const int64_t r = fm_kvq_row(p, a, k->b, k->g, t0 + t);
            rows[t] = r;
            if (a->k_dense != NULL) {
                FM_SFX(kvq_load_dense)(kc[t], a->k_dense, a->dense_dtype, r, d);
            } else {
                FM_SFX(kvq_unpack)(a->k_codes + r * p->k_row_bytes, d, p->k_bits, tab, kc[t]);
            }
        }
        for (int32_t j = 0; j < heads; j++) {
            const float *q = k->qz + (int64_t)j * d;
            float m_tile = k->mx[j];
            float dot[FM_KVQ_TILE], part[FM_KVQ_TILE];
            for (int32_t t = 0; t < nt; t++) dot[t] = 0.0f;
            for (int32_t blk = 0; blk < d / kn; blk++) {
                int32_t t = 0;
                for (; t + 8 <= nt; t += 8) FM_SFX(kvq_dot8)(q + blk * kn, kc[t] + blk * kn, FM_KVQ_MAX_HEAD_DIM, kn, part + t);
                for (; t < nt; t++) part[t] = FM_SFX(kvq_dot)(q + blk * kn, kc[t] + blk * kn, kn);
                for (t = 0; t < nt; t++) dot[t] += a->k_dense != NULL ? part[t] : part[t] * a->k_norms[rows[t] * nb + blk];
            }
            for (int32_t t = 0; t < nt; t++) {
                float sc = dot[t] * k_unit;
                if (p->softcap > 0.0f) sc = p->softcap * tanhf(sc / p->softcap);
                s[j][t] = sc;
                if (sc > m_tile) m_tile = sc;
            }
            const float corr = expf(k->mx[j] - m_tile);
            float tile_sum = 0.0f;
            for (int32_t t = 0; t < nt; t++) {
                s[j][t] = expf(s[j][t] - m_tile);
                tile_sum += s[j][t];
            }
            k->sum[j] = k->sum[j] * corr + tile_sum;
            k->mx[j] = m_tile;
            if (corr != 1.0f) {
                float *acc = k->acc + (int64_t)j * d;
                for (int32_t i = 0; i < d; i++) acc[i] *= corr;
            }
        }
        /* The tile's V rows are all decoded (into the K buffer, whose scores
         * are taken) before any is read back: reading a row right after its
         * narrow stores would stall on store forwarding. */
        for (int32_t t = 0; t < nt; t++) {
            if (a->v_dense != NULL) {
                FM_SFX(kvq_load_dense)(kc[t], a->v_dense, a->dense_dtype, rows[t], d);
            } else {
                FM_SFX(kvq_unpack)(a->v_codes + rows[t] * p->v_row_bytes, d, p->v_bits, tab, kc[t]);
            }
        }
        /* Per head, each vector of the accumulator stays in a register over
         * the tile's keys (added in key order, as one key at a time would). */
        for (int32_t j = 0; j < heads; j++) {
            float *acc = k->acc + (int64_t)j * d;
            for (int32_t blk = 0; blk < d / vn; blk++) {
                float wr[FM_KVQ_TILE];
                for (int32_t t = 0; t < nt; t++) {
                    wr[t] = a->v_dense != NULL ? s[j][t] : s[j][t] * a->v_norms[rows[t] * nb + blk];
                }
                const int32_t end = (blk + 1) * vn;
                int32_t i = blk * vn;
                for (; i + 4 * FM_VL <= end; i += 4 * FM_VL) {
                    fm_v x0 = fm_v_load(acc + i), x1 = fm_v_load(acc + i + FM_VL);
                    fm_v x2 = fm_v_load(acc + i + 2 * FM_VL), x3 = fm_v_load(acc + i + 3 * FM_VL);
                    for (int32_t t = 0; t < nt; t++) {
                        const fm_v w = fm_v_splat(wr[t]);
                        x0 += w * fm_v_load(kc[t] + i);
                        x1 += w * fm_v_load(kc[t] + i + FM_VL);
                        x2 += w * fm_v_load(kc[t] + i + 2 * FM_VL);
                        x3 += w * fm_v_load(kc[t] + i + 3 * FM_VL);
                    }
                    fm_v_store(acc + i, x0);
                    fm_v_store(acc + i + FM_VL, x1);
                    fm_v_store(acc + i + 2 * FM_VL, x2);
                    fm_v_store(acc + i + 3 * FM_VL, x3);
                }
                for (; i < end; i += FM_VL) {
                    fm_v x = fm_v_load(acc + i);
                    for (int32_t t = 0; t < nt; t++) x += fm_v_splat(wr[t]) * fm_v_load(kc[t] + i);
                    fm_v_store(acc + i, x);
                }
            }
        }
    }
}
