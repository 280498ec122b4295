/* Native kernels of the cpu backend. Each call computes one independent work
 * item (e.g. one prefill query tile), so the Swift side can spread items over
 * threads. All index arithmetic is 64-bit. */
#ifndef FM_CPU_KERNELS_H
#define FM_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include "flashmetal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Mask kinds of a prefill call. */
enum { FM_MASK_NONE = 0, FM_MASK_ADDITIVE = 1, FM_MASK_BOOL = 2 };

typedef struct FMPrefillArgs {
    AttnParams p;
    AttnMaskParams mp;
    const void *q;
    const void *k;
    const void *v;
    void *o;
    const void *mask;
    const uint8_t *blk; /* NULL or [NQ, NK] tile classes */
    int32_t io_dtype;   /* FM_DTYPE_BF16 or FM_DTYPE_F16 (also the additive mask's) */
    int32_t mask_kind;
    int32_t causal;
    int32_t bq;         /* tile geometry of the dispatch */
    int32_t bk;
} FMPrefillArgs;

/* Floats of scratch one prefill work item needs. */
size_t fm_cpu_prefill_scratch_floats(int32_t bq, int32_t bk, int32_t d);

/* One (batch, head, query tile) of flash attention with online softmax. */
void fm_cpu_prefill_tile(const FMPrefillArgs *a, int64_t b, int64_t h, int64_t qtile,
                         float *scratch);

#ifdef __cplusplus
}
#endif
#endif
