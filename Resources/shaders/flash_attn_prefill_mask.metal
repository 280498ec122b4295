// flash_attn_prefill_mask.metal — builds an additive [qL, kL] mask: 0 where
// a key is visible, -inf where it is masked (the prefill's convention).
//
// Query row i sits at absolute position t = q_offset + i and sees key p iff
//   (!causal || p <= t) && (window == 0 || t - p < window)
// (llama.cpp sliding window). Positions are 64-bit so q_offset + i and the
// cell offset i * kL cannot overflow.
//
// Grid (ceil(kL / 256), qL, 1), 256 threads, one cell per thread.
// Buffers: 0 out (bf16 or f16), 1 MaskParams.
#include "dialect.h"
#include "flashmetal_kernels.h"
using namespace metal;

template <typename T>
kernel void flash_attn_prefill_mask(
    device T *out [[buffer(0)]],
    constant MaskParams &p [[buffer(1)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup)) {
    const long col = long(tgid.x) * long(tpg.x) + long(tid);
    const long row = tgid.y;
    const long k_len = p.seq_len_k;
    if (col >= k_len || row >= long(p.seq_len_q)) return;
    const long t = long(p.q_offset) + row;
    bool visible = true;
    if (p.causal != 0 && col > t) visible = false;
    if (p.window > 0 && t - col >= long(p.window)) visible = false;
    out[row * k_len + col] = visible ? T(0.0f) : T(-INFINITY);
}

// BEGIN GENERATED INSTANTIATIONS: flash_attn_prefill_mask
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("flash_attn_prefill_mask_bf16", flash_attn_prefill_mask, bfloat)
INSTANTIATE_KERNEL("flash_attn_prefill_mask_f16", flash_attn_prefill_mask, half)
// END GENERATED INSTANTIATIONS
