// flash_attn_prefill_blk.metal — the tile-skip pre-pass (seed 001).
//
// One SIMD group (32 threads) classifies one (BQ, BK) tile of an additive
// [qL, kL] mask for the prefill that consumes it:
//   0  every cell <= -1e30   (the prefill skips the tile)
//   2  every cell exactly 0  (the prefill skips the mask add)
//   1  anything else, and always a partial right-edge K tile.
// The comparisons are written so that a NaN cell fails both tests and makes
// the tile mixed: a NaN must reach the prefill, never be skipped. That is
// also why the reduction is a vote (simd_all) and not simd_max / simd_min,
// whose fmax semantics would drop a NaN.
//
// Grid (NK, NQ, 1): threadgroup (kt, qt) writes blk[qt * NK + kt].
// Buffers: 0 mask (bf16 or f16, row stride mask_row_stride elements),
// 1 blk (uchar), 2 BlkParams. Function constants 400 BQ, 401 BK.
#include "dialect.h"
#include "flashmetal.h"
using namespace metal;

FUNCTION_CONSTANT(int, blk_bq, 400)
FUNCTION_CONSTANT(int, blk_bk, 401)

#define BLK_SKIP_BELOW (-1e30f)

template <typename MaskT>
kernel void flash_attn_prefill_blk(
    const device MaskT *mask [[buffer(0)]],
    device uchar *blk [[buffer(1)]],
    constant BlkParams &p [[buffer(2)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    const int bq = blk_bq;
    const int bk = blk_bk;
    const long kt = tgid.x;
    const long qt = tgid.y;
    const long q_len = p.seq_len_q;
    const long k_len = p.seq_len_k;
    const long nk = (k_len + bk - 1) / bk;
    const long r0 = qt * bq;
    const long c0 = kt * bk;
    device uchar *dst = blk + qt * nk + kt;

    // Both exits are uniform over the SIMD group, so no lane is left behind
    // at the votes below.
    if (r0 >= q_len || c0 >= k_len) {  // wholly past the mask
        if (lane == 0) *dst = 0;
        return;
    }
    if (c0 + bk > k_len) {  // partial right-edge K tile
        if (lane == 0) *dst = 1;
        return;
    }

    // Only rows that exist: the last Q tile may be short.
    const long rows = min(r0 + long(bq), q_len) - r0;
    const long cells = rows * bk;
    bool all_masked = true;
    bool all_zero = true;
    for (long i = long(lane); i < cells; i += 32) {
        const long r = r0 + i / bk;
        const long c = c0 + i % bk;
        const float x = float(mask[r * long(p.mask_row_stride) + c]);  // 64-bit offset
        all_masked = all_masked && (x <= BLK_SKIP_BELOW);
        all_zero = all_zero && (x == 0.0f);
    }
    all_masked = simd_all(all_masked);
    all_zero = simd_all(all_zero);
    if (lane == 0) *dst = all_masked ? uchar(0) : (all_zero ? uchar(2) : uchar(1));
}

INSTANTIATE_KERNEL("flash_attn_prefill_blk_bf16", flash_attn_prefill_blk, bfloat)
INSTANTIATE_KERNEL("flash_attn_prefill_blk_f16", flash_attn_prefill_blk, half)
