/* The portable instance of the shared decode (baseline x86-64 or arm64; the
 * portable prefill is prefill.c). */
#include "prefill_fast.h"
#define FM_VL 4
#define FM_HAS_F16CVT 0
#define FM_SFX(n) n##_portable
#include "simd.h"
#include "vec_body.h"
#include "kv_codes_body.h"
#include "kv_codes_prefill_body.h"
