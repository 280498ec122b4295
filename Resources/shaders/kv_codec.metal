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
#include "flashmetal_kernels.h"
#include "kv_codec.h"
using namespace metal;
#include "kv_codes_attn.h"

// Encodes the row x (D values of T) into `out` (row_bytes codes) and
// `norms_out` (D / block norms): the codec of kv_codec.h, every thread of
// the threadgroup taking part. z, t and r are threadgroup scratch of D, D/2
// and D/16 floats; the function starts and ends at a barrier.
template <typename T>
inline void kvq_encode_row(constant KVCodecParams &p, const device T *x, device uchar *out, device float *norms_out,
                           threadgroup float *z, threadgroup float *t, threadgroup float *r, uint tid, uint nt) {
    const uint d = uint(p.head_dim), n = uint(p.block), half_n = n / 2, nb = d / n;
    const int bits = p.bits;
    for (uint i = tid; i < d; i += nt) {
        const float v = float(x[i]);
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
        norms_out[k] = rk;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Codes, 8 coordinates (one block's) to `bits` bytes per item.
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
    threadgroup_barrier(mem_flags::mem_threadgroup);
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
    const long d = long(p.head_dim), nb = d / long(p.block);
    kvq_encode_row(p, x + row * d, codes + row * long(p.row_bytes), norms + row * nb, z, t, r, tid, tpg.x);
}

FUNCTION_CONSTANT(bool, kvq_append_paged, 804)
FUNCTION_CONSTANT(bool, kvq_append_k_dense, 807)
FUNCTION_CONSTANT(bool, kvq_append_v_dense, 808)
FUNCTION_CONSTANT_EXPR(bool, kvq_append_k_codes, !kvq_append_k_dense)
FUNCTION_CONSTANT_EXPR(bool, kvq_append_v_codes, !kvq_append_v_dense)

// The row's D values copied as their bits W (never converted), from src to
// dst: a dense side of a cache beside a quantized one.
template <typename W>
inline void kvq_copy_row(const device W *src, device W *dst, long d, uint tid, uint nt) {
    for (long i = tid; i < d; i += long(nt)) dst[i] = src[i];
}

// kv_codes_append (KVCodesAppendParams): new row i of kv head g of sequence b
// (the threadgroup (i, g, b)) encoded into the K and the V code caches at
// key seqlens[b] + i; a dense side (kvq_append_k_dense / _v_dense, a cache
// of T with the codes' rows) receives the row's bits instead. The host
// checked every key against the capacity and every table entry used
// against the pages.
template <typename T, typename W>
kernel void kv_codes_append(
    constant KVCodesAppendParams &p [[buffer(0)]],
    const device T *k_new [[buffer(1)]],
    const device T *v_new [[buffer(2)]],
    device uchar *k_codes [[buffer(3), function_constant(kvq_append_k_codes)]],
    device float *k_norms [[buffer(4), function_constant(kvq_append_k_codes)]],
    device uchar *v_codes [[buffer(5), function_constant(kvq_append_v_codes)]],
    device float *v_norms [[buffer(6), function_constant(kvq_append_v_codes)]],
    const device int *seqlens [[buffer(7)]],
    const device int *block_table [[buffer(8), function_constant(kvq_append_paged)]],
    device W *k_dense [[buffer(9), function_constant(kvq_append_k_dense)]],
    device W *v_dense [[buffer(10), function_constant(kvq_append_v_dense)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup)) {
    static_assert(sizeof(T) == sizeof(W), "W holds T's bits");
    TG_ARRAY(float, z, FM_KVQ_MAX_HEAD_DIM);
    TG_ARRAY(float, t, FM_KVQ_MAX_HEAD_DIM / 2);
    TG_ARRAY(float, r, FM_KVQ_MAX_HEAD_DIM / 16);
    const long i = long(tgid.x), g = long(tgid.y), b = long(tgid.z);
    const long key = long(seqlens[b]) + i;
    long row = 0;
    if (kvq_append_paged) {
        const long page = long(block_table[b * long(p.max_pages) + key / long(p.page_size)]);
        row = page * p.cache_strides[0] + (key % long(p.page_size)) * p.cache_strides[1];
    } else {
        row = b * p.cache_strides[0] + key * p.cache_strides[1];
    }
    row += g * p.cache_strides[2];
    const long src = b * p.new_strides[0] + i * p.new_strides[1] + g * p.new_strides[2];
    const long d = long(p.k.head_dim);
    if (kvq_append_k_dense) {
        kvq_copy_row(reinterpret_cast<const device W *>(k_new) + src, k_dense + row * d, d, tid, tpg.x);
    }
    if (kvq_append_k_codes) {
        kvq_encode_row(p.k, k_new + src, k_codes + row * long(p.k.row_bytes), k_norms + row * (d / long(p.k.block)),
                       z, t, r, tid, tpg.x);
    }
    if (kvq_append_v_dense) {
        kvq_copy_row(reinterpret_cast<const device W *>(v_new) + src, v_dense + row * d, d, tid, tpg.x);
    }
    if (kvq_append_v_codes) {
        kvq_encode_row(p.v, v_new + src, v_codes + row * long(p.v.row_bytes), v_norms + row * (d / long(p.v.block)),
                       z, t, r, tid, tpg.x);
    }
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

// BEGIN GENERATED INSTANTIATIONS: kv_encode kv_dequantize kv_codes_append
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("kv_encode_f32", kv_encode, float)
INSTANTIATE_KERNEL("kv_encode_f16", kv_encode, half)
INSTANTIATE_KERNEL("kv_encode_bf16", kv_encode, bfloat)
INSTANTIATE_KERNEL("kv_dequantize_f32", kv_dequantize, float)
INSTANTIATE_KERNEL("kv_codes_append_f32", kv_codes_append, float, uint)
INSTANTIATE_KERNEL("kv_codes_append_f16", kv_codes_append, half, ushort)
INSTANTIATE_KERNEL("kv_codes_append_bf16", kv_codes_append, bfloat, ushort)
// END GENERATED INSTANTIATIONS
