// rotary.metal — rotary position embedding (flash_attn_with_kvcache's
// rotary_cos/rotary_sin) of x [B, L, H, D] into out, same shape and dtype
// (RotaryParams in flashmetal_kernels.h has the formula).
//
// Row i of sequence b sits at t = offsets[b] + (per_row ? i : 0); the host
// checked every t against seqlen_ro, so no index is checked again. The
// rotation runs in float32 and each output element is rounded once to T
// (flash-attn's kernels do the same); dims past the rotary ones are copied.
//
// Grid (L, H, B), any number of threads along x (loops cover the pairs and
// the copied tail). Buffers: 0 RotaryParams, 1 x, 2 cos, 3 sin, 4 offsets
// (int32 [B]), 5 out.
#include "dialect.h"
#include "flashmetal_kernels.h"
using namespace metal;

template <typename T, typename C>
kernel void rotary(
    constant RotaryParams &p [[buffer(0)]],
    const device T *x [[buffer(1)]],
    const device C *cos_table [[buffer(2)]],
    const device C *sin_table [[buffer(3)]],
    const device int *offsets [[buffer(4)]],
    device T *out [[buffer(5)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup)) {
    const long i = tgid.x;
    const long h = tgid.y;
    const long b = tgid.z;
    const long d_len = long(p.head_dim);
    const long half_len = long(p.rotary_half);
    const long row = ((b * long(p.n_rows) + i) * long(p.n_heads) + h) * d_len;
    const long t = long(offsets[b]) + (p.per_row != 0 ? i : long(0));
    const long table_row = t * half_len;
    for (long j = tid; j < half_len; j += long(tpg.x)) {
        const long a = p.interleaved != 0 ? 2 * j : j;
        const long c = p.interleaved != 0 ? 2 * j + 1 : j + half_len;
        const float x1 = float(x[row + a]);
        const float x2 = float(x[row + c]);
        const float cs = float(cos_table[table_row + j]);
        const float sn = float(sin_table[table_row + j]);
        const float y1 = x1 * cs - x2 * sn;
        const float y2 = x1 * sn + x2 * cs;
        out[row + a] = T(y1);
        out[row + c] = T(y2);
    }
    for (long d = 2 * half_len + long(tid); d < d_len; d += long(tpg.x)) {
        out[row + d] = x[row + d];
    }
}

// BEGIN GENERATED INSTANTIATIONS: rotary
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("rotary_f32_f32", rotary, float, float)
INSTANTIATE_KERNEL("rotary_f32_f16", rotary, float, half)
INSTANTIATE_KERNEL("rotary_f32_bf16", rotary, float, bfloat)
INSTANTIATE_KERNEL("rotary_f16_f32", rotary, half, float)
INSTANTIATE_KERNEL("rotary_f16_f16", rotary, half, half)
INSTANTIATE_KERNEL("rotary_f16_bf16", rotary, half, bfloat)
INSTANTIATE_KERNEL("rotary_bf16_f32", rotary, bfloat, float)
INSTANTIATE_KERNEL("rotary_bf16_f16", rotary, bfloat, half)
INSTANTIATE_KERNEL("rotary_bf16_bf16", rotary, bfloat, bfloat)
// END GENERATED INSTANTIATIONS
