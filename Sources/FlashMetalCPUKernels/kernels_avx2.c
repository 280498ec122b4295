/* AVX2 + FMA + F16C instance of the shared kernels: 16 ymm registers, so the
 * prefill register block is 6 rows x 2 vectors (12 accumulators). */
#if defined(__x86_64__)
#include "prefill_fast.h"
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#define FM_VL 8
#define FM_HAS_F16CVT 1
#define FM_PF_R 6
#define FM_PF_NC 2
#define FM_PF_GROUPS 6
#define FM_VEC_KEYS_SIDE_BY_SIDE 1
#define FM_SFX(n) n##_avx2
#include "simd.h"
#include "prefill_body.h"
#include "vec_body.h"
#include "kv_codes_body.h"
#include "kv_codes_prefill_body.h"
#pragma clang attribute pop
#endif
