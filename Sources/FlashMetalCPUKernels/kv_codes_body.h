/* The decode's key loop over quantized caches (kv_codec.c), compiled once
 * per ISA like vec_body.h: the including file defines FM_SFX and the target.
 * Plain C in the ISA's vectors (simd.h), with x86 or NEON intrinsics where they
 * turn codes into centroids: kvq_unpack decodes whole rows to float (the
 * prefill's tiles, kv_codes_prefill_body.h); fm_kvq_keys, the decode, turns
 * each vector's worth of codes into centroids in a register and uses them
 * there (see below). */
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

#if defined(__x86_64__) && FM_VL >= 8
#include "x86_intrin.h"
#endif
/* FM_KVQ_TBL (set by the arm64 NEON instance): 4- and 8-bit codes become
 * centroids by table lookups (kvq_tbl16), 16 at a time, in coordinate
 * order. */
#ifndef FM_KVQ_TBL
#define FM_KVQ_TBL 0
#endif
#if FM_KVQ_TBL
#include <arm_neon.h>
#endif
/* The `bits` (3, 5 or 6) bytes of a group of 8 codes, little-endian, read
 * by loads of constant size (a memcpy of `bits` bytes is a call) and none
 * past the group's last byte (a row of 3-bit codes at D 128 has no padding
 * after its last group). */
static inline __attribute__((always_inline)) uint64_t FM_SFX(kvq_group)(const uint8_t *g, int32_t bits) {
    if (bits == 3) {
        uint16_t lo;
        memcpy(&lo, g, 2);
        return lo | (uint64_t)g[2] << 16;
    }
    uint32_t lo;
    memcpy(&lo, g, 4);
    if (bits == 5) return lo | (uint64_t)g[4] << 32;
    uint16_t hi;
    memcpy(&hi, g + 4, 2);
    return lo | (uint64_t)hi << 32;
}

#if defined(__x86_64__) && FM_VL == 8
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
            const uint64_t w = FM_SFX(kvq_group)(row + g * bits, bits);
            const __m256i words = _mm256_set_m128i(_mm_set1_epi32((int)(uint32_t)(w >> (4 * bits))),
                                                   _mm_set1_epi32((int)(uint32_t)w));
            const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(words, shifts), mask);
            _mm256_storeu_ps(out + g * 8, _mm256_i32gather_ps(t->c[bits], idx, 4));
        }
    }
}
#endif

#if !(defined(__x86_64__) && FM_VL >= 8)
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
            const uint64_t w = FM_SFX(kvq_group)(row + g * bits, bits);
            for (int32_t j = 0; j < 8; j++) out[g * 8 + j] = c[(w >> (bits * j)) & mask];
        }
    }
}
#endif


/* The decode's key loop (fm_kvq_keys). No key row is written out as floats:
 * each FM_VL codes are turned into their centroids in a register
 * (kvq_vec) and used there, by every query head of the kv head at once
 * (fused multiply-adds where the ISA has them). Per tile of FM_KVQ_TILE
 * keys: the scores of every head, one online-softmax rescale and one
 * vector exp per head, then the V rows decoded the same way into the
 * accumulators, which stay in registers over the tile's keys. */
/* acc + a * b, fused where the ISA has the instruction (baseline x86-64
 * has not: a fused builtin would be a libm call per lane). */
#if defined(__x86_64__) && FM_VL == 4
static inline fm_v FM_SFX(kvq_mac)(fm_v acc, fm_v a, fm_v b) { return acc + a * b; }
#endif
#if !(defined(__x86_64__) && FM_VL == 4)
static inline fm_v FM_SFX(kvq_mac)(fm_v acc, fm_v a, fm_v b) { return fm_v_fma(a, b, acc); }
#endif

/* What kvq_vec needs for one side: the tables (and, on x86, the centroids of
 * 2-, 3- and 4-bit codes as registers for vpermps). */
typedef struct KVQLut {
    const FMKVQTables *t;
#if defined(__x86_64__) && FM_VL == 8
    __m256 lo, hi;
    __m256i planes[4]; /* planes4, the same 16 bytes in both 128-bit lanes */
#endif
#if defined(__x86_64__) && FM_VL == 16
    /* The table in whole registers for vpermps and vpermt2ps: 2-, 3- and
     * 4-bit centroids repeated to 16 entries (rep16), 5-bit in z[0..1],
     * 6-bit in z[0..3], 8-bit the upper half (codes 128-255) in z[0..7]. */
    __m512 z[8];
#endif
#if FM_KVQ_VBMI
    /* 8-bit codes by bytes (kvq_bytes8): planes8[k] in b8[2k], b8[2k + 1]. */
    __m512i b8[8];
#endif
#if FM_KVQ_TBL
    /* 4- and 8-bit codes by table lookups (kvq_tbl16): planes4[k] in t4[k],
     * planes8[k] in t8[k][0] (entries 0-63) and t8[k][1] (64-127). */
    uint8x16_t t4[4];
    uint8x16x4_t t8[4][2];
#endif
} KVQLut;

static inline KVQLut FM_SFX(kvq_lut)(const FMKVQTables *t, int32_t bits) {
    KVQLut l;
    l.t = t;
    (void)bits;
    /* Only the registers a width reads are filled (the lut is built for
     * every run of keys). */
#if defined(__x86_64__) && FM_VL == 16
    if (bits >= 2 && bits <= 4) {
        l.z[0] = _mm512_loadu_ps(t->rep16[bits]);
    } else if (bits == 5 || bits == 6) {
        for (int32_t k = 0; k < 4; k++) l.z[k] = _mm512_loadu_ps(t->c[bits] + (16 * k & ((1 << bits) - 1)));
    } else if (bits == 8) {
        for (int32_t k = 0; k < 8; k++) l.z[k] = _mm512_loadu_ps(t->c8 + 128 + 16 * k);
    }
#endif
#if FM_KVQ_VBMI
    if (bits == 8)
        for (int32_t k = 0; k < 8; k++) l.b8[k] = _mm512_loadu_si512((const void *)(t->planes8[k / 2] + 64 * (k % 2)));
#endif
#if FM_KVQ_TBL
    for (int32_t k = 0; k < 4; k++) {
        l.t4[k] = vld1q_u8(t->planes4[k]);
        l.t8[k][0] = vld1q_u8_x4(t->planes8[k]);
        l.t8[k][1] = vld1q_u8_x4(t->planes8[k] + 64);
    }
#endif
#if defined(__x86_64__) && FM_VL == 8
    /* 2-bit: the 4 centroids repeated, so a code's higher neighbours in the
     * index (vpermps reads 3 bits) do not matter. */
    const float *tab = t->rep16[bits >= 2 && bits <= 4 ? bits : 0];
    l.lo = _mm256_loadu_ps(tab);
    l.hi = _mm256_loadu_ps(tab + 8);
    for (int32_t k = 0; k < 4; k++)
        l.planes[k] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->planes4[k]));
#endif
    return l;
}

#if defined(__x86_64__) && FM_VL == 16
/* The centroids of codes [i, i + 16) (i a multiple of 16), in coordinate
 * order: each lane's code shifted to the bottom of its 32-bit lane, then
 * one table permute (vpermps reads the low 4 bits of the index, vpermt2ps
 * the low 5). Reads no byte past the one holding code i + 15's last bit. */
static inline __attribute__((always_inline)) __m512 FM_SFX(kvq_vec16)(const uint8_t *row, int32_t i, int32_t bits,
                                                                     const KVQLut *l) {
    if (bits == 8) {
        /* The 8-bit table mirrors exactly (c8[255 - x] = -c8[x], its design
         * is symmetric): code x >= 128 is upper-half entry x - 128, x < 128
         * entry 127 - x (x ^ 127) negated. Four 32-entry permutes and bits 5
         * and 6 of the entry pick it; bit 7 of x is never read as an index. */
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + i)));
        const uint16_t low = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(128), x);
        const __m512i e = _mm512_mask_xor_epi32(x, low, x, _mm512_set1_epi32(127));
        const uint16_t b5 = _mm512_test_epi32_mask(e, _mm512_set1_epi32(32));
        const uint16_t b6 = _mm512_test_epi32_mask(e, _mm512_set1_epi32(64));
        const __m512 lo = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(l->z[0], e, l->z[1]),
                                               _mm512_permutex2var_ps(l->z[2], e, l->z[3]));
        const __m512 hi = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(l->z[4], e, l->z[5]),
                                               _mm512_permutex2var_ps(l->z[6], e, l->z[7]));
        const __m512 c = _mm512_mask_blend_ps(b6, lo, hi);
        return _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(c), low, _mm512_castps_si512(c),
                                                         _mm512_set1_epi32((int)0x80000000u)));
    }
    if (bits == 4) {
        /* 16 nibbles in 8 bytes: lanes 0-7 shift the low 32 bits, 8-15 the high. */
        int64_t w;
        memcpy(&w, row + i / 2, 8);
        const __m512i x = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                   _mm512_castsi128_si512(_mm_cvtsi64_si128(w)));
        const __m512i idx = _mm512_srlv_epi32(x, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20,
                                                                   24, 28));
        return _mm512_permutexvar_ps(idx, l->z[0]);
    }
    if (bits == 2) {
        uint32_t w;
        memcpy(&w, row + i / 4, 4);
        const __m512i idx = _mm512_srlv_epi32(_mm512_set1_epi32((int)w), _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16,
                                                                                         18, 20, 22, 24, 26, 28, 30));
        return _mm512_permutexvar_ps(idx, l->z[0]);
    }
    /* 3, 5 or 6 bits: two groups of 8 codes in `bits` bytes each; a group's
     * codes 0-3 lie in its low 32 bits, codes 4-7 in the 32 bits from
     * 4 * bits up. */
    const uint8_t *g = row + i / 8 * bits;
    const uint64_t w0 = FM_SFX(kvq_group)(g, bits), w1 = FM_SFX(kvq_group)(g + bits, bits);
    const __m128i words = _mm_setr_epi32((int)(uint32_t)w0, (int)(uint32_t)(w0 >> (4 * bits)), (int)(uint32_t)w1,
                                         (int)(uint32_t)(w1 >> (4 * bits)));
    const __m512i x = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                               _mm512_castsi128_si512(words));
    const __m512i idx = _mm512_srlv_epi32(x, _mm512_setr_epi32(0, bits, 2 * bits, 3 * bits, 0, bits, 2 * bits,
                                                               3 * bits, 0, bits, 2 * bits, 3 * bits, 0, bits,
                                                               2 * bits, 3 * bits));
    if (bits == 3) return _mm512_permutexvar_ps(idx, l->z[0]);
    const __m512 a = _mm512_permutex2var_ps(l->z[0], idx, l->z[1]);
    if (bits == 5) return a;
    /* 6 bits: bit 5 of the code picks the table's upper 32 entries. */
    const __m512 b = _mm512_permutex2var_ps(l->z[2], idx, l->z[3]);
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), a, b);
}

/* One row of `bits`-bit codes as centroids, 16 codes at a time. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_unpack)(const uint8_t *row, int32_t d, int32_t bits,
                                                                     const FMKVQTables *t, float *out) {
    const KVQLut l = FM_SFX(kvq_lut)(t, bits);
    for (int32_t i = 0; i < d; i += 16) _mm512_storeu_ps(out + i, FM_SFX(kvq_vec16)(row, i, bits, &l));
}
#endif

#if defined(__x86_64__) && FM_VL == 8
/* The centroids of codes [i, i + 8) (i a multiple of 8). */
static inline __attribute__((always_inline)) __m256 FM_SFX(kvq_vec8)(const uint8_t *row, int32_t i, int32_t bits,
                                                                    const KVQLut *l) {
    if (bits == 4) {
        uint32_t w;
        memcpy(&w, row + i / 2, 4);
        const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        /* vpermps reads the low 3 bits; bit 3, moved to the sign, picks the half. */
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(l->lo, idx), _mm256_permutevar8x32_ps(l->hi, idx),
                                _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    }
    if (bits == 8) {
        /* Eight scalar loads from the 1 KiB table: faster than vgatherdps
         * on Zen 3 (measured); the codes read as two 32-bit words and
         * split by shifts, not loaded byte by byte (loads bound this). */
        const float *c = l->t->c8;
        uint32_t w0, w1;
        memcpy(&w0, row + i, 4);
        memcpy(&w1, row + i + 4, 4);
        return _mm256_set_m128(_mm_setr_ps(c[w1 & 255], c[(w1 >> 8) & 255], c[(w1 >> 16) & 255], c[w1 >> 24]),
                               _mm_setr_ps(c[w0 & 255], c[(w0 >> 8) & 255], c[(w0 >> 16) & 255], c[w0 >> 24]));
    }
    if (bits == 2) {
        uint16_t w;
        memcpy(&w, row + i / 4, 2);
        const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        return _mm256_permutevar8x32_ps(l->lo, idx);
    }
    /* 3, 5 or 6 bits: 8 codes in `bits` bytes, codes 0-3 in the low 32
     * bits of the group, codes 4-7 in the 32 bits from 4 * bits up. */
    const uint64_t w = FM_SFX(kvq_group)(row + i / 8 * bits, bits);
    const __m256i words = _mm256_set_m128i(_mm_set1_epi32((int)(uint32_t)(w >> (4 * bits))),
                                           _mm_set1_epi32((int)(uint32_t)w));
    const __m256i idx = _mm256_srlv_epi32(words, _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 0, bits, 2 * bits,
                                                                    3 * bits));
    if (bits == 3) return _mm256_permutevar8x32_ps(l->lo, idx);
    return _mm256_i32gather_ps(l->t->c[bits], _mm256_and_si256(idx, _mm256_set1_epi32((1 << bits) - 1)), 4);
}
#endif

/* FM_KVQ_PLANES: 4-bit codes become centroids by byte shuffles (kvq_planes),
 * 16 or 32 codes at a time, in plane order: within each 8 coordinates the
 * lanes hold coordinates 0, 2, 4, 6, 1, 3, 5, 7. The decode takes the
 * query (K side) and the accumulators (V side) into that order and back;
 * dot products and sums over keys do not depend on it. AVX2 only: AVX-512
 * turns 16 codes into centroids in coordinate order (kvq_vec16). */
#if defined(__x86_64__) && FM_VL == 8
#define FM_KVQ_PLANES 1
/* Codes [i, i + 8 * NV) (i a multiple of 16, NV 2 or 4) of a row of 4-bit
 * codes as centroids in plane order, 8 per f[v]: one shuffle per byte of
 * the float looks up 16 codes in a 16-byte table (low nibbles, the even
 * coordinates, in one 128-bit lane, high nibbles in the other), and byte
 * then 16-bit interleaves put each float's four bytes back together. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_planes)(const uint8_t *row, int32_t i, const int32_t NV,
                                                                    const KVQLut *l, __m256 f[4]) {
    __m256i x;
    if (NV == 4) {
        x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(row + i / 2)));
    } else {
        int64_t w;
        memcpy(&w, row + i / 2, 8);
        x = _mm256_set1_epi64x(w);
    }
    const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                         _mm256_set1_epi8(15));
    const __m256i y0 = _mm256_shuffle_epi8(l->planes[0], idx), y1 = _mm256_shuffle_epi8(l->planes[1], idx);
    const __m256i y2 = _mm256_shuffle_epi8(l->planes[2], idx), y3 = _mm256_shuffle_epi8(l->planes[3], idx);
    const __m256i lo01 = _mm256_unpacklo_epi8(y0, y1), lo23 = _mm256_unpacklo_epi8(y2, y3);
    f[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(lo01, lo23));
    f[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(lo01, lo23));
    if (NV == 4) {
        const __m256i hi01 = _mm256_unpackhi_epi8(y0, y1), hi23 = _mm256_unpackhi_epi8(y2, y3);
        f[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(hi01, hi23));
        f[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(hi01, hi23));
    }
}

/* The same as vectors: out[u] holds codes [i + 8 * u, ...), NC (16 or
 * 32) codes in all. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_planes_vecs)(const uint8_t *row, int32_t i, const int32_t NC,
                                                                         const KVQLut *l, fm_v *out) {
    __m256 f[4];
    FM_SFX(kvq_planes)(row, i, NC / 8, l, f);
    for (int32_t u = 0; u < NC / 8; u++) out[u] = (fm_v)f[u];
}

/* v (FM_VL consecutive coordinates) in plane order, and back. */
static inline fm_v FM_SFX(kvq_to_planes)(fm_v v) { return __builtin_shufflevector(v, v, 0, 2, 4, 6, 1, 3, 5, 7); }
static inline fm_v FM_SFX(kvq_from_planes)(fm_v v) { return __builtin_shufflevector(v, v, 0, 4, 1, 5, 2, 6, 3, 7); }
#endif
#if !(defined(__x86_64__) && FM_VL == 8)
#define FM_KVQ_PLANES 0
#endif

#if FM_KVQ_TBL
/* Codes [i, i + 16) (i a multiple of 16) of a row of `bits` (4 or 8) bit
 * codes as centroids, out[u] codes [i + 4 u, i + 4 u + 4): each byte of
 * the floats looked up in its plane of the table (TBL: 4-bit codes in one
 * 16-byte register; 8-bit in the upper half's 128 entries, a code x below
 * 128 as entry 127 - x with the sign bit set, as kvq_bytes8), then byte and
 * 16-bit zips put each float's four bytes together. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_tbl16)(const uint8_t *row, int32_t i, int32_t bits,
                                                                   const KVQLut *l, fm_v *out) {
    uint8x16_t y0, y1, y2, y3;
    if (bits == 4) {
        /* 16 nibbles in 8 bytes, the low nibble the even coordinate. */
        const uint8x8_t b = vld1_u8(row + i / 2), lo = vand_u8(b, vdup_n_u8(15)), hi = vshr_n_u8(b, 4);
        const uint8x16_t x = vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi));
        y0 = vqtbl1q_u8(l->t4[0], x);
        y1 = vqtbl1q_u8(l->t4[1], x);
        y2 = vqtbl1q_u8(l->t4[2], x);
        y3 = vqtbl1q_u8(l->t4[3], x);
    } else {
        const uint8x16_t x = vld1q_u8(row + i);
        const uint8x16_t e = vminq_u8(veorq_u8(x, vdupq_n_u8(0x80)), veorq_u8(x, vdupq_n_u8(0x7f)));
        /* Entries 64-127 by TBX over the first lookup (an index past 63 reads
         * 0 in TBL and leaves the lane in TBX). */
        const uint8x16_t e2 = vsubq_u8(e, vdupq_n_u8(64));
        y0 = vqtbx4q_u8(vqtbl4q_u8(l->t8[0][0], e), l->t8[0][1], e2);
        y1 = vqtbx4q_u8(vqtbl4q_u8(l->t8[1][0], e), l->t8[1][1], e2);
        y2 = vqtbx4q_u8(vqtbl4q_u8(l->t8[2][0], e), l->t8[2][1], e2);
        y3 = vorrq_u8(vqtbx4q_u8(vqtbl4q_u8(l->t8[3][0], e), l->t8[3][1], e2), vbicq_u8(vdupq_n_u8(0x80), x));
    }
    const uint16x8_t a = vreinterpretq_u16_u8(vzip1q_u8(y0, y1)), b = vreinterpretq_u16_u8(vzip2q_u8(y0, y1));
    const uint16x8_t c = vreinterpretq_u16_u8(vzip1q_u8(y2, y3)), d = vreinterpretq_u16_u8(vzip2q_u8(y2, y3));
    out[0] = (fm_v)vreinterpretq_f32_u16(vzip1q_u16(a, c));
    out[1] = (fm_v)vreinterpretq_f32_u16(vzip2q_u16(a, c));
    out[2] = (fm_v)vreinterpretq_f32_u16(vzip1q_u16(b, d));
    out[3] = (fm_v)vreinterpretq_f32_u16(vzip2q_u16(b, d));
}
#endif

/* One row of `bits`-bit codes as centroids (the prefill's tiles): 4- and
 * 8-bit codes 16 per lookup where FM_KVQ_TBL is, else kvq_unpack. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_row)(const uint8_t *row, int32_t d, int32_t bits,
                                                                 const FMKVQTables *t, float *out) {
#if FM_KVQ_TBL
    if (bits == 4 || bits == 8) {
        const KVQLut l = FM_SFX(kvq_lut)(t, bits);
        for (int32_t i = 0; i < d; i += 16) {
            fm_v v[4];
            FM_SFX(kvq_tbl16)(row, i, bits, &l, v);
            for (int32_t u = 0; u < 4; u++) fm_v_store(out + i + 4 * u, v[u]);
        }
        return;
    }
#endif
    FM_SFX(kvq_unpack)(row, d, bits, t, out);
}

/* FM_KVQ_VBMI (set by the including file where AVX512-VBMI is there): 8-bit
 * codes become centroids by byte lookups (kvq_bytes8), 16, 32 or 64 at a
 * time, in coordinate order. */
#ifndef FM_KVQ_VBMI
#define FM_KVQ_VBMI 0
#endif
#if FM_KVQ_VBMI
/* Codes [i, i + NC) (NC 16, 32 or 64) of a row of 8-bit codes as
 * centroids, out[u] codes [i + 16 u, i + 16 u + 16): each byte of the
 * floats looked up in its plane of the table's upper half (vpermi2b reads
 * 7 bits of the index: 128 entries in two registers), a code x below 128
 * as entry 127 - x with the sign bit set (the table mirrors exactly:
 * c8[255 - x] = -c8[x]), then byte and 16-bit interleaves put each
 * float's four bytes together. The interleaves stay within 128-bit lanes:
 * the codes are first moved (vpermb) to where they take each one from, so
 * the floats come out in coordinate order. Reads no byte past code
 * i + NC - 1. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_bytes8)(const uint8_t *row, int32_t i, const int32_t NC,
                                                                    const KVQLut *l, fm_v *out) {
    /* Byte p of a 128-bit lane L feeds out[u] lane 4 L + j for p = 4 u + j. */
    static const uint8_t order[64] __attribute__((aligned(64))) = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
        4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
        8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
        12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    __m512i x;
    if (NC == 64) {
        x = _mm512_loadu_si512((const void *)(row + i));
    } else if (NC == 32) {
        x = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_loadu_si256((const __m256i *)(row + i)), 0);
    } else {
        x = _mm512_inserti32x4(_mm512_setzero_si512(), _mm_loadu_si128((const __m128i *)(row + i)), 0);
    }
    x = _mm512_permutexvar_epi8(_mm512_load_si512((const void *)order), x);
    /* The entry: x - 128 (x ^ 0x80) for x >= 128, 127 - x (x ^ 0x7f) below,
     * each the smaller of the two. */
    const __m512i e = _mm512_min_epu8(_mm512_xor_si512(x, _mm512_set1_epi8((char)0x80)),
                                      _mm512_xor_si512(x, _mm512_set1_epi8(0x7f)));
    const __m512i y0 = _mm512_permutex2var_epi8(l->b8[0], e, l->b8[1]);
    const __m512i y1 = _mm512_permutex2var_epi8(l->b8[2], e, l->b8[3]);
    const __m512i y2 = _mm512_permutex2var_epi8(l->b8[4], e, l->b8[5]);
    const __m512i t3 = _mm512_permutex2var_epi8(l->b8[6], e, l->b8[7]);
    /* The top byte's sign bit: set where bit 7 of x is clear (the upper
     * half is >= 0): t3 | (~x & 0x80). */
    const __m512i y3 = _mm512_ternarylogic_epi32(t3, x, _mm512_set1_epi8((char)0x80), 0xF2);
    const __m512i lo01 = _mm512_unpacklo_epi8(y0, y1), lo23 = _mm512_unpacklo_epi8(y2, y3);
    out[0] = (fm_v)_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
    if (NC >= 32) out[1] = (fm_v)_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    if (NC == 64) {
        const __m512i hi01 = _mm512_unpackhi_epi8(y0, y1), hi23 = _mm512_unpackhi_epi8(y2, y3);
        out[2] = (fm_v)_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
        out[3] = (fm_v)_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
    }
}
#endif

/* FM_KVQ_MULTI(kind): whether a side of that kind turns several vectors of
 * codes into centroids at once (kvq_multi_vecs): AVX2's 4-bit planes,
 * AVX512-VBMI's 8-bit bytes, NEON's 4- and 8-bit lookups; FM_KVQ_MULTI_MAX
 * codes at most. */
#define FM_KVQ_MULTI(kind) \
    ((FM_KVQ_PLANES && (kind) == 4) || (FM_KVQ_VBMI && (kind) == 8) || (FM_KVQ_TBL && ((kind) == 4 || (kind) == 8)))
#define FM_KVQ_MULTI_MAX (FM_KVQ_VBMI ? 64 : FM_KVQ_TBL ? 16 : 32)
#if FM_KVQ_PLANES || FM_KVQ_VBMI || FM_KVQ_TBL
/* Codes [i, i + NC) of a row of a FM_KVQ_MULTI kind as NC / FM_VL vectors. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_multi_vecs)(const uint8_t *row, int32_t i,
                                                                        const int32_t NC, const int32_t kind,
                                                                        const KVQLut *l, fm_v *out) {
    (void)kind;
#if FM_KVQ_PLANES
    FM_SFX(kvq_planes_vecs)(row, i, NC, l, out);
#endif
#if FM_KVQ_VBMI
    FM_SFX(kvq_bytes8)(row, i, NC, l, out);
#endif
#if FM_KVQ_TBL
    FM_SFX(kvq_tbl16)(row, i, kind, l, out);
#endif
}
#endif

/* The centroids of codes [i, i + FM_VL) of a row of `bits`-bit codes (i a
 * multiple of FM_VL): on x86 by kvq_vec8; elsewhere whole bytes through the
 * tables of every byte value (4 and 2 bits), else code by code. */
#if defined(__x86_64__) && FM_VL == 8
static inline __attribute__((always_inline)) fm_v FM_SFX(kvq_vec)(const uint8_t *row, int32_t i, int32_t bits,
                                                                 const KVQLut *l) {
    return (fm_v)FM_SFX(kvq_vec8)(row, i, bits, l);
}
#endif
#if defined(__x86_64__) && FM_VL == 16
static inline __attribute__((always_inline)) fm_v FM_SFX(kvq_vec)(const uint8_t *row, int32_t i, int32_t bits,
                                                                 const KVQLut *l) {
    return (fm_v)FM_SFX(kvq_vec16)(row, i, bits, l);
}
#endif
#if !defined(__x86_64__) || FM_VL < 8
static inline __attribute__((always_inline)) fm_v FM_SFX(kvq_vec)(const uint8_t *row, int32_t i, int32_t bits,
                                                                 const KVQLut *l) {
    float o[FM_VL];
    const FMKVQTables *t = l->t;
    if (bits == 8) {
        for (int32_t j = 0; j < FM_VL; j++) o[j] = t->c8[row[i + j]];
    } else if (bits == 4) {
        for (int32_t j = 0; j < FM_VL / 2; j++) memcpy(o + 2 * j, t->by4[row[i / 2 + j]], 2 * sizeof(float));
    } else if (bits == 2) {
        for (int32_t j = 0; j < FM_VL / 4; j++) memcpy(o + 4 * j, t->by2[row[i / 4 + j]], 4 * sizeof(float));
    } else {
        /* 3, 5 or 6 bits: each group of 8 codes read once, split by shifts. */
        const uint32_t mask = (1u << bits) - 1u;
        uint64_t w = 0;
        for (int32_t j = 0; j < FM_VL; j++) {
            const int32_t code = i + j;
            if (j == 0 || code % 8 == 0) w = FM_SFX(kvq_group)(row + code / 8 * bits, bits);
            o[j] = t->c[bits][(w >> (bits * (code % 8))) & mask];
        }
    }
    return fm_v_load(o);
}
#endif

/* Codes [i, i + FM_VL) of a side's row as floats: centroids (kind > 0: the
 * width, a constant where it can be) or the dense row (kind 0). */
static inline __attribute__((always_inline)) fm_v FM_SFX(kvq_side_vec)(const void *row, int32_t i, int32_t kind,
                                                                      int32_t bits, int32_t dtype,
                                                                      const KVQLut *l) {
    if (kind == 0) return fm_v_load_any(row, i, dtype);
    return FM_SFX(kvq_vec)((const uint8_t *)row, i, kind == 1 ? bits : kind, l);
}

/* One tile of the decode: its keys' storage rows, what each side reads. */
typedef struct KVQTile {
    const FMKVQKeys *k;
    int32_t nt, d, n, nb, kbits, vbits, dtype;
    const float *qz; /* the item's query, in plane order when the K side uses planes */
    /* The caller's lines [ahead_lo, ahead_hi) to request over this tile's
     * keys, ahead_step of them per key in 16.16 fixed point. */
    const char *const *ahead;
    int32_t ahead_lo, ahead_hi, ahead_step;
    const void *krow[FM_KVQ_TILE], *vrow[FM_KVQ_TILE];
    const float *kn[FM_KVQ_TILE], *vn[FM_KVQ_TILE]; /* each key's block norms (NULL: a dense side) */
    KVQLut kl, vl;
} KVQTile;

#if FM_KVQ_PLANES || FM_KVQ_VBMI || FM_KVQ_TBL
/* a[u % S][j] += qz_j[v_u] * v_u over the NC codes from i, decoded by
 * kvq_multi_vecs (qz in plane order for planes). */
static inline __attribute__((always_inline)) void FM_SFX(kvq_multi_dot)(const void *row, int32_t i, const int32_t NC,
                                                                       const int32_t kind, const int32_t NH,
                                                                       const int32_t S, int32_t d, const float *qz,
                                                                       const KVQLut *l,
                                                                       fm_v a[2][FM_CPU_KVQ_HEAD_CHUNK]) {
    fm_v v[FM_KVQ_MULTI_MAX / FM_VL];
    FM_SFX(kvq_multi_vecs)((const uint8_t *)row, i, NC, kind, l, v);
    for (int32_t u = 0; u < NC / FM_VL; u++)
        for (int32_t j = 0; j < NH; j++)
            a[u % S][j] = FM_SFX(kvq_mac)(a[u % S][j], fm_v_load(qz + (int64_t)j * d + i + u * FM_VL), v[u]);
}
#endif

/* Keys per fold of kvq_scores_nb: 16 where one vector holds a tile's
 * scores (written by one store, so the softmax's vector loads of them do
 * not wait on store forwarding). */
#define FM_KVQ_FOLD (FM_VL == 16 ? 16 : 8)

/* dot[u] = the lane sum of part[u] for the FM_KVQ_FOLD keys of a fold. */
#if FM_VL == 16
static inline __attribute__((always_inline)) void FM_SFX(kvq_fold)(const fm_v *part, float *dot) {
    fm_v_store(dot, fm_v_sum16(part));
}
#endif
#if FM_VL != 16
static inline __attribute__((always_inline)) void FM_SFX(kvq_fold)(const fm_v *part, float *dot) { fm_v_sum8(part, dot); }
#endif

/* FM_KVQ_ROWS: 4-bit sides in row order (fm_kvq_row_order), AVX-512. */
#if defined(__x86_64__) && FM_VL == 16
#define FM_KVQ_ROWS 1
/* The centroids of nibble n of each 32-bit lane of w: coordinates
 * 128 g + 8 l + n of the 128 codes w holds. */
static inline __attribute__((always_inline)) fm_v FM_SFX(kvq_nibbles)(__m512i w, int32_t n, const KVQLut *l) {
    return (fm_v)_mm512_permutexvar_ps(n == 0 ? w : _mm512_srli_epi32(w, 4 * n), l->z[0]);
}

/* part[j][u] = qz_j . K for one key's row of 4-bit codes in row order (qz
 * in row order), NH heads. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_rows_dot)(const uint8_t *row, const int32_t NH,
                                                                      int32_t d, const float *qz, const KVQLut *l,
                                                                      fm_v part[][FM_KVQ_FOLD], int32_t u) {
    fm_v a[2][FM_CPU_KVQ_HEAD_CHUNK];
    for (int32_t j = 0; j < NH; j++) a[0][j] = a[1][j] = fm_v_splat(0.0f);
    for (int32_t g = 0; g < d; g += 128) {
        const __m512i w = _mm512_loadu_si512((const void *)(row + g / 2));
#pragma clang loop unroll(full)
        for (int32_t n = 0; n < 8; n++) {
            const fm_v v = FM_SFX(kvq_nibbles)(w, n, l);
            for (int32_t j = 0; j < NH; j++)
                a[n & 1][j] = FM_SFX(kvq_mac)(a[n & 1][j], fm_v_load(qz + (int64_t)j * d + g + 16 * n), v);
        }
    }
    for (int32_t j = 0; j < NH; j++) part[j][u] = a[0][j] + a[1][j];
}

/* kvq_values for a V side in row order: the accumulators (in row order)
 * NC vectors of 16 per head at a time, each key's 64 code bytes of those
 * coordinates read once per chunk. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_values_rows)(const KVQTile *x, const int32_t NH,
                                                                         const float *corr,
                                                                         float w[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE]) {
    enum { NC_MAX = 8 };
    const int32_t NC = NH <= 2 ? 8 : NH == 4 ? 4 : 2, d = x->d;
    float *acc = x->k->acc;
    for (int32_t g = 0; g < d; g += 128) {
#pragma clang loop unroll(full)
        for (int32_t n0 = 0; n0 < 8; n0 += NC) {
            fm_v o[NC_MAX][FM_CPU_KVQ_HEAD_CHUNK];
            for (int32_t c = 0; c < NC; c++)
                for (int32_t j = 0; j < NH; j++)
                    o[c][j] = fm_v_load(acc + (int64_t)j * d + g + 16 * (n0 + c)) * fm_v_splat(corr[j]);
            for (int32_t t = 0; t < x->nt; t++) {
                const __m512i cw = _mm512_loadu_si512((const void *)((const uint8_t *)x->vrow[t] + g / 2));
                for (int32_t c = 0; c < NC; c++) {
                    const fm_v v = FM_SFX(kvq_nibbles)(cw, n0 + c, &x->vl);
                    for (int32_t j = 0; j < NH; j++) o[c][j] = FM_SFX(kvq_mac)(o[c][j], fm_v_splat(w[j][t]), v);
                }
            }
            for (int32_t c = 0; c < NC; c++)
                for (int32_t j = 0; j < NH; j++) fm_v_store(acc + (int64_t)j * d + g + 16 * (n0 + c), o[c][j]);
        }
    }
}
#endif
#ifndef FM_KVQ_ROWS
#define FM_KVQ_ROWS 0
#endif

/* dot[j][t] = qz_j . K_t for NH heads (rows of qz past the item's heads
 * are zero) over the tile's keys, block norms applied when a row has more
 * than one block; the lanes of FM_KVQ_FOLD keys summed at once. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_scores_nb)(const KVQTile *x, const int32_t NH,
                                                                       const int32_t kind, const int32_t nb,
                                                                       float dot[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE]) {
    /* Two accumulator sets while few heads would leave the multiply-adds a
     * chain too short to hide their latency (four for the planes' 32 codes
     * measured slower: the table registers spill). */
    enum { S_MAX = 2 };
    const int32_t S = NH <= 4 ? 2 : 1, d = x->d, n = x->n;
    const float *qz = x->qz;
    for (int32_t t0 = 0; t0 < x->nt; t0 += FM_KVQ_FOLD) {
        fm_v part[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_FOLD];
        for (int32_t u = 0; u < FM_KVQ_FOLD; u++) {
            const int32_t t = t0 + u;
            if (t >= x->nt) {
                for (int32_t j = 0; j < NH; j++) part[j][u] = fm_v_splat(0.0f);
                continue;
            }
            if (x->ahead != NULL) {
                const int32_t l1 = x->ahead_lo + ((x->ahead_step * (t + 1)) >> 16);
                for (int32_t l = x->ahead_lo + ((x->ahead_step * t) >> 16); l < l1 && l < x->ahead_hi; l++)
                    __builtin_prefetch(x->ahead[l]);
            }
            const void *row = x->krow[t];
#if FM_KVQ_ROWS
            if (kind == 5) {
                FM_SFX(kvq_rows_dot)((const uint8_t *)row, NH, d, x->qz, &x->kl, part, u);
                continue;
            }
#endif
            fm_v tot[FM_CPU_KVQ_HEAD_CHUNK];
            for (int32_t blk = 0; blk < nb; blk++) {
                fm_v a[S_MAX][FM_CPU_KVQ_HEAD_CHUNK];
                for (int32_t s = 0; s < S; s++)
                    for (int32_t j = 0; j < NH; j++) a[s][j] = fm_v_splat(0.0f);
                const int32_t b1 = (blk + 1) * n;
                int32_t i = blk * n;
#if FM_KVQ_PLANES || FM_KVQ_VBMI || FM_KVQ_TBL
                if (FM_KVQ_MULTI(kind)) {
                    /* The most codes per step the blocks allow (blocks are
                     * 16, 32 or 64 codes, or the whole row). */
                    if (FM_KVQ_MULTI_MAX >= 64 && n % 64 == 0) {
                        for (; i < b1; i += 64) FM_SFX(kvq_multi_dot)(row, i, 64, kind, NH, S, d, qz, &x->kl, a);
                    } else if (FM_KVQ_MULTI_MAX >= 32 && n % 32 == 0) {
                        for (; i < b1; i += 32) FM_SFX(kvq_multi_dot)(row, i, 32, kind, NH, S, d, qz, &x->kl, a);
                    } else {
                        for (; i < b1; i += 16) FM_SFX(kvq_multi_dot)(row, i, 16, kind, NH, S, d, qz, &x->kl, a);
                    }
                }
#endif
                for (; i + S * FM_VL <= b1; i += S * FM_VL) {
                    for (int32_t s = 0; s < S; s++) {
                        const fm_v v = FM_SFX(kvq_side_vec)(row, i + s * FM_VL, kind, x->kbits, x->dtype, &x->kl);
                        for (int32_t j = 0; j < NH; j++)
                            a[s][j] = FM_SFX(kvq_mac)(a[s][j], fm_v_load(qz + (int64_t)j * d + i + s * FM_VL), v);
                    }
                }
                for (; i < b1; i += FM_VL) {
                    const fm_v v = FM_SFX(kvq_side_vec)(row, i, kind, x->kbits, x->dtype, &x->kl);
                    for (int32_t j = 0; j < NH; j++) a[0][j] = FM_SFX(kvq_mac)(a[0][j], fm_v_load(qz + (int64_t)j * d + i), v);
                }
                for (int32_t j = 0; j < NH; j++) {
                    const fm_v b = S == 2 ? a[0][j] + a[1][j] : a[0][j];
                    if (nb == 1 || x->kn[t] == NULL) {
                        tot[j] = blk == 0 ? b : tot[j] + b;
                    } else {
                        const fm_v r = fm_v_splat(x->kn[t][blk]);
                        tot[j] = blk == 0 ? b * r : FM_SFX(kvq_mac)(tot[j], b, r);
                    }
                }
            }
            for (int32_t j = 0; j < NH; j++) part[j][u] = tot[j];
        }
        for (int32_t j = 0; j < NH; j++) FM_SFX(kvq_fold)(part[j], dot[j] + t0);
    }
}

/* The scores with nb a constant where rows have one block. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_scores_body)(const KVQTile *x, const int32_t NH,
                                                                         const int32_t kind,
                                                                         float dot[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE]) {
    if (x->nb == 1) {
        FM_SFX(kvq_scores_nb)(x, NH, kind, 1, dot);
    } else {
        FM_SFX(kvq_scores_nb)(x, NH, kind, x->nb, dot);
    }
}

/* acc_j = acc_j * corr[j] + sum over the tile's keys of w[j][t] * V_t for
 * NH heads (V rows with several blocks scaled by each block's norm), the
 * accumulators of CF vectors of D per head in registers over the keys. */
static inline __attribute__((always_inline)) void FM_SFX(kvq_values_chunk)(const KVQTile *x, const int32_t NH,
                                                                          const int32_t kind, const int32_t CF,
                                                                          int32_t i, const float *corr,
                                                                          float w[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE]) {
    enum { CF_MAX = 4 };
    const int32_t d = x->d;
    float *acc = x->k->acc;
    const int multi = FM_KVQ_MULTI(kind);
#if FM_KVQ_PLANES
    /* kind 4 with planes: the accumulators in plane order while here. */
    const int planes = kind == 4;
#endif
    fm_v o[CF_MAX][FM_CPU_KVQ_HEAD_CHUNK];
    for (int32_t c = 0; c < CF; c++) {
        for (int32_t j = 0; j < NH; j++) {
            fm_v av = fm_v_load(acc + (int64_t)j * d + i + c * FM_VL);
#if FM_KVQ_PLANES
            if (planes) av = FM_SFX(kvq_to_planes)(av);
#endif
            o[c][j] = av * fm_v_splat(corr[j]);
        }
    }
    for (int32_t t = 0; t < x->nt; t++) {
        fm_v vs[CF_MAX];
#if FM_KVQ_PLANES || FM_KVQ_VBMI || FM_KVQ_TBL
        if (multi) {
            /* CF * FM_VL is 16, 32 or 64 codes, decoded at most FM_KVQ_MULTI_MAX at once. */
            const int32_t NC = CF * FM_VL < FM_KVQ_MULTI_MAX ? CF * FM_VL : FM_KVQ_MULTI_MAX;
            for (int32_t c = 0; c < CF; c += NC / FM_VL)
                FM_SFX(kvq_multi_vecs)((const uint8_t *)x->vrow[t], i + c * FM_VL, NC, kind, &x->vl, vs + c);
        }
#endif
        for (int32_t c = 0; c < CF; c++) {
            fm_v v = multi ? vs[c] : FM_SFX(kvq_side_vec)(x->vrow[t], i + c * FM_VL, kind, x->vbits, x->dtype, &x->vl);
            if (x->nb > 1 && x->vn[t] != NULL) v *= fm_v_splat(x->vn[t][(i + c * FM_VL) / x->n]);
            for (int32_t j = 0; j < NH; j++) o[c][j] = FM_SFX(kvq_mac)(o[c][j], fm_v_splat(w[j][t]), v);
        }
    }
    for (int32_t c = 0; c < CF; c++) {
        for (int32_t j = 0; j < NH; j++) {
            fm_v ov = o[c][j];
#if FM_KVQ_PLANES
            if (planes) ov = FM_SFX(kvq_from_planes)(ov);
#endif
            fm_v_store(acc + (int64_t)j * d + i + c * FM_VL, ov);
        }
    }
}

static inline __attribute__((always_inline)) void FM_SFX(kvq_values_body)(const KVQTile *x, const int32_t NH,
                                                                         const int32_t kind, const float *corr,
                                                                         float w[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE]) {
#if FM_KVQ_ROWS
    if (kind == 5) {
        FM_SFX(kvq_values_rows)(x, NH, corr, w);
        return;
    }
#endif
    int32_t CF = NH == 1 ? 4 : NH <= 4 ? 2 : 1, CF1 = 1;
    if (FM_KVQ_PLANES && kind == 4) {
        /* Planes decode 16 or 32 codes at once: whole ones per chunk, 32
         * while few heads leave registers for them. */
        CF = (NH <= 2 ? 32 : 16) / FM_VL;
        CF1 = 16 / FM_VL;
    }
    if (FM_KVQ_TBL && (kind == 4 || kind == 8)) {
        /* Lookups decode 16 codes at once: whole ones per chunk. */
        CF = CF1 = 16 / FM_VL;
    }
    if (FM_KVQ_VBMI && kind == 8) {
        /* Bytes decode up to 64 codes at once: as many as the accumulators
         * leave registers for (4 heads x 4 vectors measured faster than 2). */
        CF = NH <= 4 ? 4 : 2;
    }
    int32_t i = 0;
    for (; i + CF * FM_VL <= x->d; i += CF * FM_VL) FM_SFX(kvq_values_chunk)(x, NH, kind, CF, i, corr, w);
    for (; i < x->d; i += CF1 * FM_VL) FM_SFX(kvq_values_chunk)(x, NH, kind, CF1, i, corr, w);
}

/* The side's kind: 0 dense, 5 4-bit codes in row order, 4 or 8 (widths
 * with code of their own), 1 any other width. */
static inline int32_t FM_SFX(kvq_kind)(const void *dense, int32_t bits, int32_t d, int32_t block) {
    if (FM_KVQ_ROWS && fm_kvq_row_order(1, bits, dense, d, block)) return 5;
    return dense != NULL ? 0 : (bits == 4 || bits == 8) ? bits : 1;
}

/* Kind 5 exists only where FM_KVQ_ROWS does (elsewhere the case is never
 * taken and instantiates nothing). */
#if FM_KVQ_ROWS
#define FM_KVQ_ROWS_CASE(body, x, nh, ...) body(x, nh, 5, __VA_ARGS__)
#endif
#if !FM_KVQ_ROWS
#define FM_KVQ_ROWS_CASE(body, x, nh, ...) (void)0
#endif

#define FM_KVQ_BY_SHAPE(body, x, nh, kind, ...)                                   \
    switch ((nh) * 16 + (kind)) {                                                \
    case 1 * 16 + 0: body(x, 1, 0, __VA_ARGS__); break;                          \
    case 1 * 16 + 1: body(x, 1, 1, __VA_ARGS__); break;                          \
    case 1 * 16 + 4: body(x, 1, 4, __VA_ARGS__); break;                          \
    case 1 * 16 + 8: body(x, 1, 8, __VA_ARGS__); break;                          \
    case 2 * 16 + 0: body(x, 2, 0, __VA_ARGS__); break;                          \
    case 2 * 16 + 1: body(x, 2, 1, __VA_ARGS__); break;                          \
    case 2 * 16 + 4: body(x, 2, 4, __VA_ARGS__); break;                          \
    case 2 * 16 + 8: body(x, 2, 8, __VA_ARGS__); break;                          \
    case 4 * 16 + 0: body(x, 4, 0, __VA_ARGS__); break;                          \
    case 4 * 16 + 1: body(x, 4, 1, __VA_ARGS__); break;                          \
    case 4 * 16 + 4: body(x, 4, 4, __VA_ARGS__); break;                          \
    case 4 * 16 + 8: body(x, 4, 8, __VA_ARGS__); break;                          \
    case 8 * 16 + 0: body(x, 8, 0, __VA_ARGS__); break;                          \
    case 8 * 16 + 1: body(x, 8, 1, __VA_ARGS__); break;                          \
    case 8 * 16 + 4: body(x, 8, 4, __VA_ARGS__); break;                          \
    case 1 * 16 + 5: FM_KVQ_ROWS_CASE(body, x, 1, __VA_ARGS__); break;           \
    case 2 * 16 + 5: FM_KVQ_ROWS_CASE(body, x, 2, __VA_ARGS__); break;           \
    case 4 * 16 + 5: FM_KVQ_ROWS_CASE(body, x, 4, __VA_ARGS__); break;           \
    case 8 * 16 + 5: FM_KVQ_ROWS_CASE(body, x, 8, __VA_ARGS__); break;           \
    default: body(x, 8, 8, __VA_ARGS__); break;                                  \
    }

static void FM_SFX(kvq_scores)(const KVQTile *x, int32_t nh, int32_t kind,
                               float dot[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE]) {
    FM_KVQ_BY_SHAPE(FM_SFX(kvq_scores_body), x, nh, kind, dot)
}

static void FM_SFX(kvq_values)(const KVQTile *x, int32_t nh, int32_t kind, const float *corr,
                               float w[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE]) {
    FM_KVQ_BY_SHAPE(FM_SFX(kvq_values_body), x, nh, kind, corr, w)
}

void FM_SFX(fm_kvq_keys)(const FMKVQKeys *k) {
    enum { TV = FM_KVQ_TILE / FM_VL };
    _Static_assert(FM_KVQ_TILE % FM_VL == 0 && FM_KVQ_TILE % FM_KVQ_FOLD == 0, "a tile is whole vectors and folds");
    const KVCodesDecodeParams *p = k->p;
    const FMCPUKVCodesAttnArgs *a = k->a;
    const int32_t d = p->head_dim, heads = k->heads;
    /* Heads rounded up to 1, 2, 4 or 8 (the query rows past them are zero
     * and their weights zero). */
    const int32_t nh = heads <= 1 ? 1 : heads <= 2 ? 2 : heads <= 4 ? 4 : 8;
    const int32_t kkind = FM_SFX(kvq_kind)(a->k_dense, p->k_bits, d, p->block);
    const int32_t vkind = FM_SFX(kvq_kind)(a->v_dense, p->v_bits, d, p->block);
    const int64_t esize = a->dense_dtype == FM_DTYPE_F32 ? 4 : 2;
    const float k_unit = (a->k_dense != NULL ? 1.0f : 1.0f / (float)p->block) * p->scale;
    /* Each side's storage rows (codes, else dense) and block norms (NULL
     * for a dense side). */
    const char *kbase = a->k_dense != NULL ? (const char *)a->k_dense : (const char *)a->k_codes;
    const char *vbase = a->v_dense != NULL ? (const char *)a->v_dense : (const char *)a->v_codes;
    const int64_t kpitch = a->k_dense != NULL ? d * esize : p->k_row_bytes;
    const int64_t vpitch = a->v_dense != NULL ? d * esize : p->v_row_bytes;
    const float *knorms = a->k_dense == NULL ? a->k_norms : NULL;
    const float *vnorms = a->v_dense == NULL ? a->v_norms : NULL;
    KVQTile x;
    x.k = k;
    x.d = d;
    x.n = p->block;
    x.nb = d / p->block;
    x.kbits = p->k_bits;
    x.vbits = p->v_bits;
    x.dtype = a->dense_dtype;
    x.kl = FM_SFX(kvq_lut)(k->tables, p->k_bits);
    x.vl = FM_SFX(kvq_lut)(k->tables, p->v_bits);
    x.qz = k->qz;
#if FM_KVQ_PLANES
    float qzp[FM_CPU_KVQ_HEAD_CHUNK * FM_KVQ_MAX_HEAD_DIM] __attribute__((aligned(64)));
    if (kkind == 4) {
        for (int64_t o = 0; o < (int64_t)nh * d; o += FM_VL) fm_v_store(qzp + o, FM_SFX(kvq_to_planes)(fm_v_load(k->qz + o)));
        x.qz = qzp;
    }
#endif
    fm_v lane; /* lane i holds i */
    for (int32_t i = 0; i < FM_VL; i++) lane[i] = (float)i;
    for (int32_t t0 = k->start; t0 < k->end; t0 += FM_KVQ_TILE) {
        const int32_t nt = k->end - t0 < FM_KVQ_TILE ? k->end - t0 : FM_KVQ_TILE;
        int64_t rows[FM_KVQ_TILE];
        if (k->prefetch_next && t0 + FM_KVQ_TILE < k->end) {
            /* The run's next tile, requested now: a kv head's rows sit Hkv
             * rows apart, too sparse for the hardware prefetcher. */
            const int32_t na = k->end - t0 - FM_KVQ_TILE < FM_KVQ_TILE ? k->end - t0 - FM_KVQ_TILE : FM_KVQ_TILE;
            fm_kvq_rows(p, a, k->b, k->g, t0 + FM_KVQ_TILE, na, rows);
            for (int32_t t = 0; t < na; t++) fm_kvq_prefetch_row(p, a, rows[t]);
        }
        float kscale[FM_KVQ_TILE], vscale[FM_KVQ_TILE];
        for (int32_t t = nt; t < FM_KVQ_TILE; t++) kscale[t] = vscale[t] = 1.0f;
        x.nt = nt;
        x.ahead = k->ahead;
        if (k->ahead != NULL) {
            const int64_t len = k->end - k->start;
            x.ahead_lo = (int32_t)((t0 - k->start) * (int64_t)k->ahead_n / len);
            x.ahead_hi = (int32_t)((t0 + nt - k->start) * (int64_t)k->ahead_n / len);
            x.ahead_step = (int32_t)((((int64_t)(x.ahead_hi - x.ahead_lo) << 16) + nt - 1) / nt);
        }
        fm_kvq_rows(p, a, k->b, k->g, t0, nt, rows);
        /* Scalar: vectorised, the 64-bit products are vpmullq (three
         * micro-ops each, on the vector ports the key loops need). */
#pragma clang loop vectorize(disable)
        for (int32_t t = 0; t < nt; t++) {
            x.krow[t] = kbase + rows[t] * kpitch;
            x.vrow[t] = vbase + rows[t] * vpitch;
        }
        /* One block: its norm scales the whole score (and V row) at once;
         * several: the loops read each block's norm. Scalar loads: vectorised
         * these loops are gathers. */
        if (x.nb == 1) {
#pragma clang loop vectorize(disable)
            for (int32_t t = 0; t < nt; t++) kscale[t] = knorms != NULL ? knorms[rows[t]] * k_unit : k_unit;
#pragma clang loop vectorize(disable)
            for (int32_t t = 0; t < nt; t++) vscale[t] = vnorms != NULL ? vnorms[rows[t]] : 1.0f;
        } else {
            for (int32_t t = 0; t < nt; t++) {
                kscale[t] = k_unit;
                vscale[t] = 1.0f;
                x.kn[t] = knorms != NULL ? knorms + rows[t] * x.nb : NULL;
                x.vn[t] = vnorms != NULL ? vnorms + rows[t] * x.nb : NULL;
            }
        }
        float dot[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE] __attribute__((aligned(64)));
        float w[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_TILE] __attribute__((aligned(64)));
        FM_SFX(kvq_scores)(&x, nh, kkind, dot);
        /* Per head, the tile's scores as vectors (scaled, soft-capped,
         * ALiBi; -inf past its keys) and their lane max; then every head's
         * new running max and rescale at once (one vector exp), each head's
         * exponentials, and their sums folded together. The rows past
         * `heads` (padding) get weight 0 and rescale 1. */
        enum { HV = FM_CPU_KVQ_HEAD_CHUNK > FM_VL ? FM_CPU_KVQ_HEAD_CHUNK : FM_VL };
        fm_v sv[FM_CPU_KVQ_HEAD_CHUNK][TV], mv[FM_CPU_KVQ_HEAD_CHUNK], total[FM_CPU_KVQ_HEAD_CHUNK];
        for (int32_t j = 0; j < heads; j++) {
            for (int32_t u = 0; u < TV; u++) sv[j][u] = fm_v_load(dot[j] + u * FM_VL) * fm_v_load(kscale + u * FM_VL);
            if (p->softcap > 0.0f) {
                float s[FM_KVQ_TILE];
                for (int32_t u = 0; u < TV; u++) fm_v_store(s + u * FM_VL, sv[j][u]);
                for (int32_t t = 0; t < nt; t++) s[t] = p->softcap * tanhf(s[t] / p->softcap);
                for (int32_t u = 0; u < TV; u++) sv[j][u] = fm_v_load(s + u * FM_VL);
            }
            if (k->slopes != NULL) {
                /* ALiBi: -slope * |pos - key|, key t0 + u * FM_VL + lane. */
                const fm_v slope = fm_v_splat(k->slopes[j]), gap = fm_v_splat((float)((int64_t)k->pos[j] - t0));
                for (int32_t u = 0; u < TV; u++) {
                    const fm_v dist = gap - (lane + (float)(u * FM_VL));
                    sv[j][u] -= slope * fm_v_max2(dist, -dist);
                }
            }
            mv[j] = fm_v_splat(-INFINITY);
            for (int32_t u = 0; u < TV; u++) {
                if (nt < FM_KVQ_TILE)
                    sv[j][u] = fm_v_sel(lane + (float)(u * FM_VL) < (float)nt, sv[j][u], fm_v_splat(-INFINITY));
                mv[j] = fm_v_max2(mv[j], sv[j][u]);
            }
        }
        float tile_max[FM_CPU_KVQ_HEAD_CHUNK], m_tile[FM_CPU_KVQ_HEAD_CHUNK], sums[FM_CPU_KVQ_HEAD_CHUNK];
        float corr[HV] __attribute__((aligned(64)));
        /* More than two heads: their lanes' maxima and sums are folded
         * together (fm_v_max8, fm_v_sum8: about the shuffles two heads' own
         * reductions take); one or two heads reduce their own. */
        const int fold = heads > 2;
        if (fold) {
            for (int32_t j = heads; j < FM_CPU_KVQ_HEAD_CHUNK; j++) mv[j] = fm_v_splat(-INFINITY);
            fm_v_max8(mv, tile_max);
        } else {
            for (int32_t j = 0; j < heads; j++) tile_max[j] = fm_v_max(mv[j]);
        }
        for (int32_t j = 0; j < heads; j++) m_tile[j] = tile_max[j] > k->mx[j] ? tile_max[j] : k->mx[j];
        for (int32_t c = 0; c < nh; c += FM_VL) {
            /* Lane j - c: head j's old max less its new one, put in place
             * by selects (scalar stores read back as a vector would wait
             * on store forwarding); e^0 = 1 exactly, the padding's rescale. */
            fm_v shift = fm_v_splat(0.0f);
            for (int32_t j = c; j < heads && j < c + FM_VL; j++)
                shift = fm_v_sel(lane == (float)(j - c), fm_v_splat(k->mx[j] - m_tile[j]), shift);
            fm_v_store(corr + c, fm_v_exp(shift));
        }
        for (int32_t j = 0; j < heads; j++) {
            total[j] = fm_v_splat(0.0f);
            for (int32_t u = 0; u < TV; u++) {
                const fm_v e = fm_v_exp(sv[j][u] - fm_v_splat(m_tile[j]));
                total[j] += e;
                fm_v_store(w[j] + u * FM_VL, e * fm_v_load(vscale + u * FM_VL));
            }
        }
        for (int32_t j = heads; j < nh; j++)
            for (int32_t t = 0; t < FM_KVQ_TILE; t++) w[j][t] = 0.0f;
        if (fold) {
            for (int32_t j = heads; j < FM_CPU_KVQ_HEAD_CHUNK; j++) total[j] = fm_v_splat(0.0f);
            fm_v_sum8(total, sums);
        } else {
            for (int32_t j = 0; j < heads; j++) sums[j] = fm_v_sum(total[j]);
        }
        for (int32_t j = 0; j < heads; j++) {
            k->sum[j] = k->sum[j] * corr[j] + sums[j];
            k->mx[j] = m_tile[j];
        }
        FM_SFX(kvq_values)(&x, nh, vkind, corr, w);
    }
}
