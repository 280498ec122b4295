/* AVX-512 + AVX512-VBMI instance of the decode over quantized caches
 * (kv_codes_body.h): the AVX-512 key loop with 8-bit codes turned into
 * centroids by byte lookups (vpermb, vpermi2b: kvq_bytes8) instead of
 * float permutes. Everything else runs on the AVX-512 instances. */
#if defined(__x86_64__)
#if !defined(FM_ISA_EMULATED) /* the emulated test build: portable code (x86_intrin.h) */
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,fma,f16c"))), \
                             apply_to = function)
#endif
#define FM_VL 16
#define FM_HAS_F16CVT 1
#define FM_KVQ_VBMI 1
#define FM_SFX(n) n##_avx512vbmi
#include "simd.h"
#include "kv_codes_body.h"
#if !defined(FM_ISA_EMULATED)
#pragma clang attribute pop
#endif
#endif
