// test_kernels.h — the conformance suite's own kernels, written in the
// portable dialect (they would compile for Metal too).
#include "../../Resources/shaders/dialect.h"
#include "flashmetal_kernels.h"  // the shaders' parameter structs, for dispatching them directly
using namespace metal;

struct TParams {
    uint n;
    uint m;
    int k;
    float f;
};

FUNCTION_CONSTANT(bool, t_flag, 10)
FUNCTION_CONSTANT(int, t_mul, 11)
FUNCTION_CONSTANT_EXPR(int, t_mul2, t_mul * 2)

// 1. threadgroup tree reduction with barriers: out[group] = sum(in[group*n .. +n])
template <int N>
kernel void k_tg_reduce(const device float *in [[buffer(0)]], device float *out [[buffer(1)]],
                        uint tid BUILTIN(thread_index_in_threadgroup),
                        uint g BUILTIN(threadgroup_position_in_grid)) {
    TG_ARRAY(float, buf, N);
    buf[tid] = in[g * N + tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = N / 2; s > 0; s /= 2) {
        if (tid < s) buf[tid] += buf[tid + s];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (tid == 0) out[g] = buf[0];
}
INSTANTIATE_KERNEL("t_tg_reduce", k_tg_reduce, 256)

// 2. every collective: out[op * nthreads + tid]
template <int D>
kernel void k_collectives(const device float *in [[buffer(0)]], device float *out [[buffer(1)]],
                          device uint *uout [[buffer(2)]],
                          uint tid BUILTIN(thread_index_in_threadgroup),
                          uint lane BUILTIN(thread_index_in_simdgroup),
                          uint n BUILTIN(threads_per_threadgroup)) {
    float x = in[tid];
    int o = 0;
    out[o++ * n + tid] = simd_sum(x);
    out[o++ * n + tid] = simd_max(x);
    out[o++ * n + tid] = simd_min(x);
    out[o++ * n + tid] = simd_product(x);
    out[o++ * n + tid] = simd_prefix_inclusive_sum(x);
    out[o++ * n + tid] = simd_prefix_exclusive_sum(x);
    out[o++ * n + tid] = simd_shuffle(x, ushort((lane * 7 + 3) % 32));
    out[o++ * n + tid] = simd_shuffle_xor(x, ushort(5));
    out[o++ * n + tid] = simd_shuffle_up(x, ushort(3));
    out[o++ * n + tid] = simd_shuffle_down(x, ushort(3));
    out[o++ * n + tid] = simd_broadcast(x, ushort(2));
    out[o++ * n + tid] = simd_broadcast_first(x);
    out[o++ * n + tid] = simd_shuffle_rotate_down(x, ushort(1));
    half h = simd_sum(half(x));
    out[o++ * n + tid] = float(h);
    float4 v = simd_sum(float4(x, 1.0f, 2.0f * x, -x));
    out[o++ * n + tid] = v.x + v.y * 1000.0f;
    uout[0 * n + tid] = uint(ulong(simd_ballot(x > 0.0f)));
    uout[1 * n + tid] = simd_any(x > 100.0f) ? 1u : 0u;
    uout[2 * n + tid] = simd_all(x > -100.0f) ? 1u : 0u;
    uout[3 * n + tid] = simd_max(tid);
}
INSTANTIATE_KERNEL("t_collectives", k_collectives, 0)

// 3. C[M,N] = A[M,K] * B[K,N] with one SIMD group per 8x8 output tile.
template <typename T>
kernel void k_mma(const device T *A [[buffer(0)]], const device T *B [[buffer(1)]], device T *C [[buffer(2)]],
                  constant TParams &p [[buffer(3)]],
                  uint sg BUILTIN(simdgroup_index_in_threadgroup)) {
    // p.n = M = N, p.m = K
    uint tiles = p.n / 8;
    uint ti = sg / tiles, tj = sg % tiles;
    simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint k = 0; k < p.m; k += 8) {
        simdgroup_matrix<T, 8, 8> a, b;
        simdgroup_load(a, A, p.m, ulong2(k, ti * 8));
        simdgroup_load(b, B, p.n, ulong2(tj * 8, k));
        simdgroup_matrix<float, 8, 8> af, bf;
        af.thread_elements()[0] = float(a.thread_elements()[0]);
        af.thread_elements()[1] = float(a.thread_elements()[1]);
        bf.thread_elements()[0] = float(b.thread_elements()[0]);
        bf.thread_elements()[1] = float(b.thread_elements()[1]);
        simdgroup_multiply_accumulate(acc, af, bf, acc);
    }
    simdgroup_matrix<T, 8, 8> r;
    r.thread_elements()[0] = T(acc.thread_elements()[0]);
    r.thread_elements()[1] = T(acc.thread_elements()[1]);
    simdgroup_store(r, C, p.n, ulong2(tj * 8, ti * 8));
}
INSTANTIATE_KERNEL("t_mma_float", k_mma, float)
INSTANTIATE_KERNEL("t_mma_half", k_mma, half)
INSTANTIATE_KERNEL("t_mma_bfloat", k_mma, bfloat)

// 3b. same-type MMA (T accumulators) and transposed load/store
template <typename T>
kernel void k_mma_t(const device T *A [[buffer(0)]], const device T *B [[buffer(1)]], device T *C [[buffer(2)]]) {
    simdgroup_matrix<T, 8, 8> a, b, c = make_filled_simdgroup_matrix<T, 8, 8>(T(0));
    simdgroup_load(a, A, 8);
    simdgroup_load(b, B, 8, ulong2(0, 0), true);  // B given transposed
    simdgroup_multiply_accumulate(c, a, b, c);
    simdgroup_store(c, C, 8, ulong2(0, 0), true); // store C^T
}
INSTANTIATE_KERNEL("t_mma_t_float", k_mma_t, float)

// 4. fragment layout: lane l writes (l*2 + k) into its elements, stored to 8x8
template <int D>
kernel void k_layout(device float *out [[buffer(0)]], uint lane BUILTIN(thread_index_in_simdgroup)) {
    simdgroup_matrix<float, 8, 8> m;
    m.thread_elements()[0] = float(lane * 2);
    m.thread_elements()[1] = float(lane * 2 + 1);
    simdgroup_store(m, out, 8);
}
INSTANTIATE_KERNEL("t_layout", k_layout, 0)

// 5. missing barrier: reads the neighbour's threadgroup slot without a barrier
template <bool WithBarrier>
kernel void k_neighbour(device float *out [[buffer(0)]], uint tid BUILTIN(thread_index_in_threadgroup),
                        uint n BUILTIN(threads_per_threadgroup)) {
    TG_ARRAY(float, buf, 256);
    buf[tid] = float(tid);
    if (WithBarrier) threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = tid > 0 ? buf[tid - 1] : 0.0f;
}
INSTANTIATE_KERNEL("t_missing_barrier", k_neighbour, false)
INSTANTIATE_KERNEL("t_with_barrier", k_neighbour, true)

// 6. divergent barrier
template <int D>
kernel void k_divergent(device float *out [[buffer(0)]], uint tid BUILTIN(thread_index_in_threadgroup)) {
    if (tid < 40) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    } else {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[tid] = 1.0f;
}
INSTANTIATE_KERNEL("t_divergent_barrier", k_divergent, 0)

// 7. deadlock: lane 0 waits at a threadgroup barrier, the rest at a collective
template <int D>
kernel void k_deadlock(device float *out [[buffer(0)]], uint lane BUILTIN(thread_index_in_simdgroup)) {
    float v = 1.0f;
    if (lane == 0) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    } else {
        v = simd_sum(v);
    }
    out[lane] = v;
}
INSTANTIATE_KERNEL("t_deadlock", k_deadlock, 0)

// 8. function constants
template <int D>
kernel void k_constants(device int *out [[buffer(0)]], uint tid BUILTIN(thread_index_in_threadgroup)) {
    if (tid == 0) {
        out[0] = t_flag ? 1 : 0;
        out[1] = t_mul;
        out[2] = t_mul2;
        out[3] = is_function_constant_defined(t_mul) ? 1 : 0;
    }
}
INSTANTIATE_KERNEL("t_constants", k_constants, 0)

// 9. threadgroup memory: poison on entry, 32 KiB limit, TG_BUFFER
template <int Floats>
kernel void k_tgmem(device float *out [[buffer(0)]], TG_BUFFER(float, dyn, 0),
                    uint tid BUILTIN(thread_index_in_threadgroup)) {
    TG_ARRAY(float, big, Floats);
    if (tid == 0) {
        out[0] = big[0];             // poison: NaN
        out[1] = big[Floats - 1];
        out[2] = dyn[0];             // poison: NaN
        big[0] = 5.0f;
        dyn[1] = 7.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 1) {
        out[3] = big[0] + dyn[1];
    }
}
INSTANTIATE_KERNEL("t_tgmem_ok", k_tgmem, 4096)
INSTANTIATE_KERNEL("t_tgmem_over", k_tgmem, 8192)

// 10. builtins in a 3-D grid
template <int D>
kernel void k_builtins(device uint *out [[buffer(0)]], constant TParams &p [[buffer(1)]],
                       uint3 gid BUILTIN(thread_position_in_grid),
                       uint3 tgp BUILTIN(threadgroup_position_in_grid),
                       uint3 tpos BUILTIN(thread_position_in_threadgroup),
                       uint3 grid BUILTIN(threads_per_grid),
                       ushort lane BUILTIN(thread_index_in_simdgroup),
                       uint nsg BUILTIN(simdgroups_per_threadgroup)) {
    uint idx = (gid.z * grid.y + gid.y) * grid.x + gid.x;
    out[idx * 4 + 0] = gid.x + 100 * gid.y + 10000 * gid.z;
    out[idx * 4 + 1] = tgp.x + 100 * tgp.y + 10000 * tgp.z;
    out[idx * 4 + 2] = tpos.x + 100 * tpos.y + 10000 * tpos.z;
    out[idx * 4 + 3] = uint(lane) + 1000 * nsg + p.n;
}
INSTANTIATE_KERNEL("t_builtins", k_builtins, 0)

// 11. numerics: half per-op rounding, vector constructors, as_type, select
template <int D>
kernel void k_numerics(device float *out [[buffer(0)]], device uint *uout [[buffer(1)]],
                       uint tid BUILTIN(thread_index_in_threadgroup)) {
    if (tid != 0) return;
    half a = 2048.0h, b = 1.0h;
    half c = a + b;           // 2049 is not a half: rounds to 2048
    out[0] = float(c);
    out[1] = float(a) + float(b);
    half4 h4 = half4(1.5h, 2.5h, -3.0h, 4.0h);
    float4 f4 = float4(h4);   // per-element conversion
    out[2] = f4.x + f4.y + f4.z + f4.w;
    float4 cat = float4(float2(1.0f, 2.0f), 3.0f, 4.0f);
    out[3] = cat.x * 1000.0f + cat.y * 100.0f + cat.z * 10.0f + cat.w;
    float4 sp = float4(0.5f);
    out[4] = sp.x + sp.w;
    int4 iv = int4(float4(1.7f, -1.7f, 2.5f, 3.9f));
    out[5] = float(iv.x + iv.y * 10 + iv.z * 100 + iv.w * 1000);
    uout[0] = as_type<uint>(1.0f);
    float4 s = select(float4(1.0f), float4(2.0f), float4(1.0f, 5.0f, 1.0f, 5.0f) > float4(3.0f));
    out[6] = s.x + s.y * 10.0f + s.z * 100.0f + s.w * 1000.0f;
    out[7] = any(float4(1.0f, 2.0f, 3.0f, 4.0f) > float4(3.5f)) ? 1.0f : 0.0f;
    out[8] = all(float4(1.0f, 2.0f, 3.0f, 4.0f) > float4(3.5f)) ? 1.0f : 0.0f;
    out[9] = fast::exp2(3.0f) + precise::exp(0.0f) + max(2.0f, 1.0f) + float(max(1.0h, 3.0h));
    bfloat bf = bfloat(1.00390625f);    // 1 + 2^-8: a tie, rounds to even (1.0)
    out[10] = float(bf);
    out[11] = float(as_type<ushort>(bfloat(-2.0f)));
    uint2 u2 = uint2(7u, 9u);
    uout[1] = u2.x * 10u + u2.y;
}
INSTANTIATE_KERNEL("t_numerics", k_numerics, 0)

// 12. device atomics across threadgroups and workers
template <int D>
kernel void k_atomics(device atomic_uint *counter [[buffer(0)]], device atomic_float *fsum [[buffer(1)]]) {
    atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
    atomic_fetch_add_explicit(fsum, 0.5f, memory_order_relaxed);
}
INSTANTIATE_KERNEL("t_atomics", k_atomics, 0)

// 13. early-returning lanes leave a collective to the live ones
template <int D>
kernel void k_early_exit(device float *out [[buffer(0)]], uint tid BUILTIN(thread_index_in_threadgroup)) {
    if (tid >= 20) return;
    float s = simd_sum(1.0f);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = s;
}
INSTANTIATE_KERNEL("t_early_exit", k_early_exit, 0)

// bench kernels
template <int D>
kernel void k_bench_barrier(constant TParams &p [[buffer(0)]]) {
    for (int i = 0; i < p.k; i++) threadgroup_barrier(mem_flags::mem_threadgroup);
}
INSTANTIATE_KERNEL("b_barrier", k_bench_barrier, 0)
template <int D>
kernel void k_bench_simd(device float *out [[buffer(0)]], constant TParams &p [[buffer(1)]],
                         uint tid BUILTIN(thread_index_in_threadgroup)) {
    float x = float(tid);
    for (int i = 0; i < p.k; i++) x = simd_sum(x) * 0.001f;
    out[tid] = x;
}
INSTANTIATE_KERNEL("b_simd", k_bench_simd, 0)
template <int D>
kernel void k_bench_mma(device float *out [[buffer(0)]], constant TParams &p [[buffer(1)]]) {
    simdgroup_matrix<float, 8, 8> a = make_filled_simdgroup_matrix<float, 8, 8>(0.01f), c(1.0f);
    for (int i = 0; i < p.k; i++) simdgroup_multiply_accumulate(c, a, a, c);
    simdgroup_store(c, out, 8);
}
INSTANTIATE_KERNEL("b_mma", k_bench_mma, 0)
