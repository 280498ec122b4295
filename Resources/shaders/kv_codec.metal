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

// Code i of a packed row of `bits`-bit codes (a code spans at most two bytes).
inline uint kvq_code_at(const device uchar *row, uint i, uint bits) {
    const uint bit = i * bits, byte = bit / 8, shift = bit % 8;
    uint w = uint(row[byte]);
    if (shift + bits > 8) w |= uint(row[byte + 1]) << 8;
    return (w >> shift) & ((1u << bits) - 1u);
}

// Decode over quantized caches (KVCodesDecodeParams): one query row per
// threadgroup of one SIMD group. The query is rotated like the keys (in
// threadgroup memory), each thread keeps its coordinates of the rotated
// query and of the output accumulator, scores are reduced with simd_sum, and
// the accumulator (in V's rotated basis) is rotated back once at the end.
template <typename T>
kernel void kv_codes_decode(
    constant KVCodesDecodeParams &p [[buffer(0)]],
    const device T *q [[buffer(1)]],
    const device uchar *k_codes [[buffer(2)]],
    const device float *k_norms [[buffer(3)]],
    const device uchar *v_codes [[buffer(4)]],
    const device float *v_norms [[buffer(5)]],
    device T *o [[buffer(6)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup)) {
    TG_ARRAY(float, z, FM_KVQ_MAX_HEAD_DIM);
    const uint row = tgid.x, heads = uint(p.n_heads);
    const uint d = uint(p.head_dim), n = uint(p.block), nt = tpg.x, nb = d / n, per = (d + nt - 1) / nt;
    const uint b = row / heads, h = row - b * heads, g = h / (heads / uint(p.n_kv_heads));
    const uint kbits = uint(p.k_bits), vbits = uint(p.v_bits);
    const float inv_n = 1.0f / float(n);
    for (uint i = tid; i < d; i += nt) {
        const float v = float(q[long(row) * long(d) + long(i)]);
        z[i] = fm_kvq_sign_bit(p.k_seed, i) != 0u ? -v : v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    kvq_hadamard(z, d, n, tid, nt);
    float qz[int(FM_KVQ_MAX_HEAD_DIM) / int(FM_KVQ_DECODE_THREADS)];
    float acc[int(FM_KVQ_MAX_HEAD_DIM) / int(FM_KVQ_DECODE_THREADS)];
    for (uint m = 0; m < per; m++) {
        const uint i = tid + m * nt;
        qz[m] = i < d ? z[i] : 0.0f;
        acc[m] = 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float mx = FM_RUNNING_MAX_START, sum = 0.0f;
    const long base = long(b) * p.kv_strides[0] + long(g) * p.kv_strides[1];
    const int lo = p.window > 0 ? max(0, p.kv_len - p.window) : 0;
    for (int t = lo; t < p.kv_len; t++) {
        const long r = base + long(t) * p.kv_strides[2];
        const device uchar *kc = k_codes + r * long(p.k_row_bytes);
        const device uchar *vc = v_codes + r * long(p.v_row_bytes);
        float part = 0.0f;
        for (uint m = 0; m < per; m++) {
            const uint i = tid + m * nt;
            if (i < d) {
                part += qz[m] * (fm_kvq_centroid(int(kbits), kvq_code_at(kc, i, kbits)) * k_norms[r * long(nb) + long(i / n)]);
            }
        }
        float s = simd_sum(part) * inv_n * p.scale;
        if (p.softcap > 0.0f) s = p.softcap * tanh(s / p.softcap);
        const float m_new = max(mx, s);
        const float corr = exp(mx - m_new), w = exp(s - m_new);
        sum = sum * corr + w;
        for (uint m = 0; m < per; m++) {
            const uint i = tid + m * nt;
            if (i < d) {
                acc[m] = acc[m] * corr + w * (fm_kvq_centroid(int(vbits), kvq_code_at(vc, i, vbits)) * v_norms[r * long(nb) + long(i / n)]);
            }
        }
        mx = m_new;
    }

    for (uint m = 0; m < per; m++) {
        const uint i = tid + m * nt;
        if (i < d) z[i] = acc[m];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    kvq_hadamard(z, d, n, tid, nt);
    const float norm = sum > 0.0f ? inv_n / sum : 0.0f;
    for (uint i = tid; i < d; i += nt) {
        const float v = z[i] * norm;
        o[long(row) * long(d) + long(i)] = T(fm_kvq_sign_bit(p.v_seed, i) != 0u ? -v : v);
    }
}

INSTANTIATE_KERNEL("kv_codes_decode_f32", kv_codes_decode, float)
