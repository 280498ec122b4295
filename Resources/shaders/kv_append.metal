// kv_append.metal — writes new K/V rows into a cache (flash_attn_with_kvcache's
// k/v), contiguous [B, cap, Hkv, D] or paged [num_pages, page_size, Hkv, D]
// through a block table (function constant 700).
//
// Row i of sequence b of k_new/v_new [B, n_new, Hkv, D] goes to cache row
// t = seqlens[b] + i (KVAppendParams in flashmetal_kernels.h). The host checked every
// seqlens[b] + n_new against the capacity and every table entry used against
// the pages, so no index here is checked again.
//
// The kernel moves the element's bits W (uint for float32, ushort for
// float16/bfloat16), never the value T: a copy, not a conversion, so every
// bit pattern (NaN payloads, subnormals) arrives unchanged. T only names the
// instantiation (half and bfloat share W).
//
// Grid (n_new, Hkv, B), any number of threads along x (a loop covers D).
// Buffers: 0 KVAppendParams, 1 k_new, 2 v_new, 3 k_cache, 4 v_cache,
// 5 seqlens (int32 [B]), 6 block_table (int32 [B, max_pages], when paged).
#include "dialect.h"
#include "flashmetal_kernels.h"
using namespace metal;

FUNCTION_CONSTANT(bool, append_paged, 700)

template <typename T, typename W>
kernel void kv_append(
    constant KVAppendParams &p [[buffer(0)]],
    const device W *k_new [[buffer(1)]],
    const device W *v_new [[buffer(2)]],
    device W *k_cache [[buffer(3)]],
    device W *v_cache [[buffer(4)]],
    const device int *seqlens [[buffer(5)]],
    const device int *block_table [[buffer(6), function_constant(append_paged)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup)) {
    static_assert(sizeof(T) == sizeof(W), "W holds T's bits");
    const long i = tgid.x;
    const long g = tgid.y;
    const long b = tgid.z;
    const long t = long(seqlens[b]) + i;
    long dst = 0;
    if (append_paged) {
        const long page = block_table[b * long(p.max_pages) + t / long(p.page_size)];
        dst = page * p.cache_strides[0] + (t % long(p.page_size)) * p.cache_strides[1];
    } else {
        dst = b * p.cache_strides[0] + t * p.cache_strides[1];
    }
    dst += g * p.cache_strides[2];
    const long src = b * p.new_strides[0] + i * p.new_strides[1] + g * p.new_strides[2];
    for (long d = tid; d < long(p.head_dim); d += long(tpg.x)) k_cache[dst + d] = k_new[src + d];
    // v's rows: the same row index, head_dim_v elements each (every stride is a multiple of head_dim).
    const long dk = long(p.head_dim), dv = long(p.head_dim_v);
    const long vsrc = src / dk * dv, vdst = dst / dk * dv;
    for (long d = tid; d < dv; d += long(tpg.x)) v_cache[vdst + d] = v_new[vsrc + d];
}

// BEGIN GENERATED INSTANTIATIONS: kv_append
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("kv_append_f32", kv_append, float, uint)
INSTANTIATE_KERNEL("kv_append_f16", kv_append, half, ushort)
INSTANTIATE_KERNEL("kv_append_bf16", kv_append, bfloat, ushort)
// END GENERATED INSTANTIATIONS
