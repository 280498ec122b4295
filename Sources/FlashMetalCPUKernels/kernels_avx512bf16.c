/* AVX512-BF16 instance of the shared prefill: bf16 I/O runs QK^T and P.V on
 * vdpbf16ps over bf16 pair panels (other dtypes as on AVX-512). Register
 * block 8 rows x 2 vectors: a row group's softmax then folds all 8 lanes of
 * fm_v_max8/fm_v_sum8 (4 x 4 folded half: 2-5% slower at D = 64, the same
 * at D >= 128). Decode uses the AVX-512 instance. */
#if defined(__x86_64__)
#include "x86_intrin.h"
#include "prefill_fast.h"
#if !defined(FM_ISA_EMULATED) /* the emulated test build: portable code (x86_intrin.h) */
#pragma clang attribute push(                                                                  \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c,avx512bf16"))), apply_to = function)
#endif
#define FM_VL 16
#define FM_HAS_F16CVT 1
#define FM_PF_R 8
#define FM_PF_NC 2
#define FM_PF_GROUPS 4
#define FM_SFX(n) n##_avx512bf16
#include "simd.h"
#define FM_PF_BF16DP 1
/* acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1] over bf16 pairs. */
static inline fm_v fm_dpbf16(fm_v acc, fm_vi a, fm_vi b) {
    return (fm_v)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}
/* fm_v_store_bf16 in one instruction (vcvtneps2bf16: nearest even, as
 * fm_v_round_bf16, except that it flushes subnormal results to zero: a p
 * below 2^-126 then weighs 0). */
static inline fm_v fm_v_store_bf16_cvt(uint16_t *dst, fm_v x) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)x);
    _mm256_storeu_si256((__m256i *)dst, h);
    return (fm_v)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
#define FM_PF_STORE_BF16 fm_v_store_bf16_cvt
#include "prefill_body.h"
#if !defined(FM_ISA_EMULATED)
#pragma clang attribute pop
#endif
#endif
