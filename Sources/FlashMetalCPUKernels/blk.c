/* Tile-skip pre-pass on the cpu: classify one (BQ, BK) tile of an
 * additive [qL, kL] mask. Only -inf means masked: a tile of huge finite
 * negatives (-1e30, finfo(bf16).min) is mixed (1), because the kernels give
 * such cells weight (they are raised to the running max's start), and
 * skipping them would break the blk bit-identity. A NaN cell makes the tile
 * mixed, never skipped. A bool mask (true = attend) classifies as 0 / -inf.
 * Row offsets are 64-bit. */
#include "fm_cpu_kernels.h"
#include <math.h>
#include "half_convert.h"

enum { BLK_F16, BLK_BF16, BLK_BOOL, BLK_F32 };

/* Cell (r, j) of the mask as an additive value: a bool cell is 0 (attend) or -inf. */
static inline float blk_cell(const void *mask, int kind, int64_t i) {
    if (kind == BLK_BOOL) return ((const uint8_t *)mask)[i] ? 0.0f : -INFINITY;
    if (kind == BLK_F32) return ((const float *)mask)[i];
    const uint16_t x = ((const uint16_t *)mask)[i];
    return kind == BLK_BF16 ? fm_bf16_to_f32(x) : fm_f16_to_f32(x);
}

static void blk_tile(const BlkParams *p, const void *mask, int kind, uint8_t *blk, int32_t bq, int32_t bk,
                     int64_t nk, int64_t qt, int64_t kt) {
    const int64_t qL = p->seq_len_q, kL = p->seq_len_k, stride = p->mask_row_stride;
    const int64_t r0 = qt * bq, c0 = kt * bk;
    uint8_t *dst = blk + qt * nk + kt;
    if (c0 >= kL || r0 >= qL) { *dst = 0; return; }  /* wholly past the mask */
    if (c0 + bk > kL) { *dst = 1; return; }           /* partial right-edge K tile */
    const int64_t r1 = (r0 + bq) < qL ? (r0 + bq) : qL; /* only rows that exist */
    int all_masked = 1, all_zero = 1;
    for (int64_t r = r0; r < r1 && (all_masked || all_zero); r++) {
        for (int64_t j = 0; j < bk; j++) {
            const float x = blk_cell(mask, kind, r * stride + c0 + j);
            if (x != -INFINITY) all_masked = 0;
            if (!(x == 0.0f)) all_zero = 0;
        }
    }
    *dst = all_masked ? 0 : (all_zero ? 2 : 1);
}

void fm_cpu_blk_tile(const BlkParams *p, const uint16_t *mask, int32_t mask_is_bf16,
                     uint8_t *blk, int32_t bq, int32_t bk, int64_t nk, int64_t qt, int64_t kt) {
    blk_tile(p, mask, mask_is_bf16 ? BLK_BF16 : BLK_F16, blk, bq, bk, nk, qt, kt);
}

void fm_cpu_blk_tile_bool(const BlkParams *p, const uint8_t *mask, uint8_t *blk, int32_t bq, int32_t bk,
                          int64_t nk, int64_t qt, int64_t kt) {
    blk_tile(p, mask, BLK_BOOL, blk, bq, bk, nk, qt, kt);
}

void fm_cpu_blk_tile_f32(const BlkParams *p, const float *mask, uint8_t *blk, int32_t bq, int32_t bk,
                         int64_t nk, int64_t qt, int64_t kt) {
    blk_tile(p, mask, BLK_F32, blk, bq, bk, nk, qt, kt);
}
