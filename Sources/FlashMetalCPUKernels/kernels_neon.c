/* arm64 NEON instance of the shared kernels: 32 q-registers, prefill register
 * block 6 rows x 4 vectors (24 accumulators); f16 converts with FCVTL, bf16
 * with shifts; the decode over 4- and 8-bit codes by TBL lookups
 * (FM_KVQ_TBL). (BFDOT/BFMMLA are not used: its speed cannot be measured
 * where this is built, only its numerics under qemu.) */
#if defined(__aarch64__)
#include "prefill_fast.h"
#define FM_VL 4
#define FM_HAS_F16CVT 1
#define FM_PF_R 6
#define FM_PF_NC 4
#define FM_PF_GROUPS 6
#define FM_SFX(n) n##_neon
#define FM_KVQ_TBL 1
#include "simd.h"
#include "prefill_body.h"
#include "vec_body.h"
#include "kv_codes_body.h"
#include "kv_codes_prefill_body.h"
#endif
