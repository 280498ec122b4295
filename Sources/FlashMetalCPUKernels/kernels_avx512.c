/* AVX-512 (F/BW/DQ/VL) + FMA + F16C instance of the shared kernels: 32 zmm
 * registers, prefill register block 4 rows x 4 vectors (64 keys). */
#if defined(__x86_64__)
#include "prefill_fast.h"
#if !defined(FM_ISA_EMULATED) /* the emulated test build: portable code (x86_intrin.h) */
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c"))), \
                             apply_to = function)
#endif
#define FM_VL 16
#define FM_HAS_F16CVT 1
#define FM_PF_R 4
#define FM_PF_NC 4
#define FM_PF_GROUPS 8
#define FM_SFX(n) n##_avx512
#include "simd.h"
#include "prefill_body.h"
#include "vec_body.h"
#include "kv_codes_body.h"
#include "kv_codes_prefill_body.h"
#if !defined(FM_ISA_EMULATED)
#pragma clang attribute pop
#endif
#endif
