// kv_codec.metal — the quantized-KV codec (kv_codec.h has the math): rows
// encoded to packed Lloyd–Max codes and per-block norms, and decoded back.
//
// One row per threadgroup, any number of threads. The row lives in
// threadgroup memory; the Hadamard butterflies run stage by stage between
// barriers, and each block's sum of squares is a fixed pairwise tree
// (level 0 fma(a, a, b * b) over the block's two halves, then halving), so
// the bits match the cpu kernels (kv_codec.c), which follow the same order.
//
// Buffers (KVCodecParams at 0): kv_encode 1 x [R, D], 2 codes [R, row_bytes],
// 3 norms [R, D / block]; kv_dequantize 1 codes, 2 norms, 3 out float [R, D].
#include "dialect.h"
#include "flashmetal.h"
#include "kv_codec.h"
using namespace metal;

// z[i], z[i + h] <- z[i] + z[i + h], z[i] - z[i + h] for every i with bit h
// clear: one stage of the unnormalised Hadamard transform of every block.
inline void kvq_hadamard(threadgroup float *z, uint d, uint block, uint tid, uint nt) {
    for (uint h = 1; h < block; h <<= 1) {
        for (uint q = tid; q < d / 2; q += nt) {
            const uint i = ((q & ~(h - 1)) << 1) | (q & (h - 1));
            const float a = z[i];
            const float b = z[i + h];
            z[i] = a + b;
            z[i + h] = a - b;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
}

template <typename T>
kernel void kv_encode(
    constant KVCodecParams &p [[buffer(0)]],
    const device T *x [[buffer(1)]],
    device uchar *codes [[buffer(2)]],
    device float *norms [[buffer(3)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup)) {
    TG_ARRAY(float, z, FM_KVQ_MAX_HEAD_DIM);
    TG_ARRAY(float, t, FM_KVQ_MAX_HEAD_DIM / 2);
    TG_ARRAY(float, r, FM_KVQ_MAX_HEAD_DIM / 16);
    const long row = long(tgid.x);
    const uint d = uint(p.head_dim), n = uint(p.block), nt = tpg.x, half_n = n / 2, nb = d / n;
    const int bits = p.bits;
    for (uint i = tid; i < d; i += nt) {
        const float v = float(x[row * long(d) + long(i)]);
        z[i] = fm_kvq_sign_bit(p.seed, i) != 0u ? -v : v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    kvq_hadamard(z, d, n, tid, nt);

    // Sum of squares per block: t[k*half_n + i], i < half_n, then halving.
    for (uint q = tid; q < d / 2; q += nt) {
        const uint k = q / half_n, i = q - k * half_n;
        const float a = z[k * n + i];
        const float b = z[k * n + i + half_n];
        t[q] = fma(a, a, b * b);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = half_n / 2; s >= 1; s >>= 1) {
        for (uint q = tid; q < nb * s; q += nt) {
            const uint k = q / s, i = q - k * s;
            t[k * half_n + i] = t[k * half_n + i] + t[k * half_n + i + s];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const float inv_n = 1.0f / float(n);
    for (uint k = tid; k < nb; k += nt) {
        const float rk = sqrt(t[k * half_n] * inv_n);
        r[k] = rk;
        norms[row * long(nb) + long(k)] = rk;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Codes, 8 coordinates (one block's) to `bits` bytes per item.
    device uchar *out = codes + row * long(p.row_bytes);
    for (uint g = tid; g < d / 8; g += nt) {
        const float rk = r[(g * 8) / n];
        ulong w = 0;
        for (uint j = 0; j < 8; j++) {
            const float u = rk > 0.0f ? z[g * 8 + j] / rk : 0.0f;
            w |= ulong(fm_kvq_code(bits, u)) << (uint(bits) * j);
        }
        for (uint b = 0; b < uint(bits); b++) out[g * uint(bits) + b] = uchar(w >> (8 * b));
    }
    for (uint b = d * uint(bits) / 8 + tid; b < uint(p.row_bytes); b += nt) out[b] = uchar(0);
}

template <typename T>
kernel void kv_dequantize(
    constant KVCodecParams &p [[buffer(0)]],
    const device uchar *codes [[buffer(1)]],
    const device float *norms [[buffer(2)]],
    device T *out [[buffer(3)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup)) {
    TG_ARRAY(float, z, FM_KVQ_MAX_HEAD_DIM);
    const long row = long(tgid.x);
    const uint d = uint(p.head_dim), n = uint(p.block), nt = tpg.x, nb = d / n;
    const uint bits = uint(p.bits), mask = (1u << bits) - 1u;
    const device uchar *in = codes + row * long(p.row_bytes);
    for (uint i = tid; i < d; i += nt) {
        const uint g = i / 8;
        ulong w = 0;
        for (uint b = 0; b < bits; b++) w |= ulong(in[g * bits + b]) << (8 * b);
        z[i] = fm_kvq_centroid(int(bits), uint(w >> (bits * (i % 8))) & mask);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    kvq_hadamard(z, d, n, tid, nt);
    const float inv_n = 1.0f / float(n);
    for (uint i = tid; i < d; i += nt) {
        const float v = z[i] * (norms[row * long(nb) + long(i / n)] * inv_n);
        out[row * long(d) + long(i)] = T(fm_kvq_sign_bit(p.seed, i) != 0u ? -v : v);
    }
}

INSTANTIATE_KERNEL("kv_encode_f32", kv_encode, float)
INSTANTIATE_KERNEL("kv_encode_f16", kv_encode, half)
INSTANTIATE_KERNEL("kv_encode_bf16", kv_encode, bfloat)
INSTANTIATE_KERNEL("kv_dequantize_f32", kv_dequantize, float)
