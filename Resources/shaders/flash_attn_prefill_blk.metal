// flash_attn_prefill_blk.metal — the tile-skip pre-pass (mlx-native's flash_attn_prefill_blk).
//
// One SIMD group (32 threads) classifies one (BQ, BK) tile of an additive
// [qL, kL] mask (or a bool one: true = 0, false = -inf) for the prefill that
// consumes it:
//   0  every cell -inf       (the prefill skips the tile)
//   2  every cell exactly 0  (the prefill skips the mask add)
//   1  anything else, and always a partial right-edge K tile.
// Only -inf is masked: a finite bias, however negative (-1e30,
// finfo(bfloat16).min), still gets weight in the prefill (its score is
// floored at the running max's start), so a tile of them must be computed
// or blk would change the result. The comparisons are written so that a NaN
// cell fails both tests and makes the tile mixed: a NaN must reach the
// prefill, never be skipped. That is also why the reduction is a vote
// (simd_all) and not simd_max / simd_min, whose fmax semantics would drop a NaN.
//
// Indices are 32-bit in the loop (a tile has at most BQ * BK cells; the GPU
// has no native 64-bit divide); only the row offset into the mask is 64-bit.
//
// Grid (NK, NQ, 1): threadgroup (kt, qt) writes blk[qt * NK + kt].
// Buffers: 0 mask (bf16, f16, f32 or bool, row stride mask_row_stride elements),
// 1 blk (uchar), 2 BlkParams. Function constants 400 BQ, 401 BK.
#include "dialect.h"
#include "flashmetal_kernels.h"
using namespace metal;

FUNCTION_CONSTANT(int, blk_bq, 400)
FUNCTION_CONSTANT(int, blk_bk, 401)

// Cell i of a mask as an additive value. A bool cell is read as its byte
// (any nonzero byte attends, as on the cpu), never as a bool whose bytes
// other than 0/1 the compilers treat differently.
inline float blk_cell(const device uchar *m, long i) { return m[i] != 0 ? 0.0f : -INFINITY; }
inline float blk_cell(const device half *m, long i) { return float(m[i]); }
inline float blk_cell(const device bfloat *m, long i) { return float(m[i]); }
inline float blk_cell(const device float *m, long i) { return m[i]; }

template <typename MaskT>
kernel void flash_attn_prefill_blk(
    const device MaskT *mask [[buffer(0)]],
    device uchar *blk [[buffer(1)]],
    constant BlkParams &p [[buffer(2)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    const uint bq = uint(blk_bq);
    const uint bk = uint(blk_bk);
    const uint kt = tgid.x;
    const uint qt = tgid.y;
    const uint q_len = uint(p.seq_len_q);
    const uint k_len = uint(p.seq_len_k);
    const uint nk = (k_len + bk - 1) / bk;
    const uint r0 = qt * bq;
    const uint c0 = kt * bk;
    device uchar *dst = blk + long(qt) * long(nk) + kt;

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
    const uint cells = (min(r0 + bq, q_len) - r0) * bk;
    const device MaskT *tile = mask + long(r0) * long(p.mask_row_stride) + c0;  // 64-bit offset
    bool all_masked = true;
    bool all_zero = true;
    for (uint i = lane; i < cells; i += 32) {
        const uint r = i / bk;
        const float x = blk_cell(tile, long(r) * long(p.mask_row_stride) + (i - r * bk));
        all_masked = all_masked && (x == -INFINITY);
        all_zero = all_zero && (x == 0.0f);
    }
    all_masked = simd_all(all_masked);
    all_zero = simd_all(all_zero);
    if (lane == 0) *dst = all_masked ? uchar(0) : (all_zero ? uchar(2) : uchar(1));
}

// BEGIN GENERATED INSTANTIATIONS: flash_attn_prefill_blk
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("flash_attn_prefill_blk_bf16", flash_attn_prefill_blk, bfloat)
INSTANTIATE_KERNEL("flash_attn_prefill_blk_f16", flash_attn_prefill_blk, half)
INSTANTIATE_KERNEL("flash_attn_prefill_blk_f32", flash_attn_prefill_blk, float)
INSTANTIATE_KERNEL("flash_attn_prefill_blk_bool", flash_attn_prefill_blk, uchar)
// END GENERATED INSTANTIATIONS
