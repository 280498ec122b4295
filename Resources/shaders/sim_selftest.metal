// sim_selftest.metal — a tiny kernel that proves the sim backend end to end:
// each threadgroup reduces one row of `in` (n floats) to out[row] =
// scale_num * sum(in[row, :]), through threadgroup memory, a barrier and
// simd_sum. Function constant 700 (int) is the multiplier.
#include "dialect.h"
using namespace metal;

FUNCTION_CONSTANT(int, selftest_scale, 700)
FUNCTION_CONSTANT_EXPR(float, selftest_scale_f, float(selftest_scale))

struct SelftestParams {
    uint n;
};

template <typename T>
kernel void selftest_reduce(
    const device T *in [[buffer(0)]],
    device float *out [[buffer(1)]],
    constant SelftestParams &p [[buffer(2)]],
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint row BUILTIN(threadgroup_position_in_grid),
    uint lane BUILTIN(thread_index_in_simdgroup),
    uint sg BUILTIN(simdgroup_index_in_threadgroup),
    uint nthreads BUILTIN(threads_per_threadgroup)) {
    TG_ARRAY(float, partial, 32);
    float acc = 0.0f;
    for (uint i = tid; i < p.n; i += nthreads) {
        acc += float(in[row * p.n + i]);
    }
    acc = simd_sum(acc);
    if (lane == 0) {
        partial[sg] = acc;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
        uint nsg = (nthreads + 31) / 32;
        float v = lane < nsg ? partial[lane] : 0.0f;
        v = simd_sum(v);
        if (lane == 0) {
            out[row] = v * selftest_scale_f;
        }
    }
}

INSTANTIATE_KERNEL("fm_selftest_reduce", selftest_reduce, float)
