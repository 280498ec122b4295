// kv_codes_decode.metal — decode over quantized K and V caches
// (KVCodesDecodeParams of flashmetal_kernels.h): a split-KV grid, then
// kv_codes_reduce, the structure of flash_attn_vec for codes.
//
// Threadgroup (u, w): one SIMD group serving the HG = heads_per_group query
// heads of one kv head of one token, over split w of the token's keys. Each
// key's code row is read once, unpacked once into registers (centroid ·
// norm, still in the rotated basis) and used by all HG heads: lane l owns
// the coordinates [l*P, l*P + P) of D (P = ceil(D / 32); its bytes are one
// contiguous run of the packed row). Keys go in chunks of CK = 32 / HG:
// part[j * CK + t] is the lane's share of head j's dot with key t, and one
// reduce-scatter (31 shuffles) leaves head j's score of key t in lane
// j * CK + t; each head's CK lanes keep its online softmax (natural units;
// the running max starts at the finite FM_RUNNING_MAX_START, so a key
// outside the row's range (score -inf) weighs exp(-inf) = 0, never NaN),
// and each lane accumulates its coordinates of V for every head with the
// probabilities shuffled from their lanes. No key outside the row's range is
// read.
//
// The query is rotated like the keys (K's signs, then its Hadamard blocks)
// in threadgroup memory; the output is rotated back with V's. With nwg == 1
// the threadgroup finishes the row itself (sinks, LSE, rotation undone);
// with FM_FC_KVQ_SPLIT it writes its unnormalised accumulator and (S, M) to
// tmp and kv_codes_reduce merges the splits (weights exp(M_w - M), 0 for a
// split without keys), then finishes the same way. Either side may be a
// dense cache of KV (kvq_k_dense / kvq_v_dense): the query is then not
// rotated (dense K), or the accumulator is already in the output basis
// (dense V).
#include "dialect.h"
#include "flashmetal_kernels.h"
#include "kv_codec.h"
using namespace metal;
#include "kv_codes_attn.h"
#include "simd_scatter.h"

FUNCTION_CONSTANT(bool, kvq_split, 811)
FUNCTION_CONSTANT_EXPR(bool, kvq_whole, !kvq_split)

#define KVQ_LF FM_KVQ_DECODE_LANE_FLOATS
// Threadgroup floats for the HG rotated queries / outputs (HG * D <= KVQ_LF * 32).
#define KVQ_Z_FLOATS (FM_KVQ_DECODE_LANE_FLOATS * FM_KVQ_DECODE_THREADS)

// The lane's coordinates [i0, i0 + cnt) of one stored row, as floats in the
// rotated basis: centroid · norm of the codes (each byte of the lane's run
// read once, the norm once per rotation block), or the dense row's values.
// x[k] = 0 for k >= cnt.
inline void kvq_lane_codes(thread float *x, const device uchar *row, const device float *norms, uint bits, uint i0,
                           uint cnt, uint block) {
    const uint mask = (1u << bits) - 1u, bit = i0 * bits;
    uint byte = bit >> 3, w = 0, have = 0;
    if (cnt > 0) {
        w = uint(row[byte++]) >> (bit & 7u);
        have = 8u - (bit & 7u);
    }
    float nrm = 0.0f;
    for (uint k = 0; k < uint(KVQ_LF); k++) {
        float v = 0.0f;
        if (k < cnt) {
            if (have < bits) {  // bits <= 8: one more byte always suffices
                w |= uint(row[byte++]) << have;
                have += 8u;
            }
            const uint i = i0 + k;
            if (k == 0 || i % block == 0) nrm = norms[i / block];
            v = fm_kvq_centroid(int(bits), w & mask) * nrm;
            w >>= bits;
            have -= bits;
        }
        x[k] = v;
    }
}

template <typename KV>
inline void kvq_lane_dense(thread float *x, const device KV *row, uint i0, uint cnt) {
    for (uint k = 0; k < uint(KVQ_LF); k++) x[k] = k < cnt ? float(row[i0 + k]) : 0.0f;
}

// Folds a sink logit into one head's (m, sum) without a value; returns the
// factor the head's accumulator takes. A +inf sink takes the whole row.
inline float kvq_fold_sink(thread float &m, thread float &sum, float s) {
    const float m_new = max(m, s);
    const float corr = s == INFINITY ? 0.0f : exp(m - m_new);
    sum = s == INFINITY ? INFINITY : sum * corr + exp(s - m_new);
    m = m_new;
    return corr;
}

// Where row (token, head h) of a call keeps its LSE: [B, H, q_len], or
// [H, total_q] with varlen queries.
inline long kvq_lse_at(constant KVCodesDecodeParams &p, uint token, uint h) {
    if (kvq_varlen_q) return long(h) * long(p.q_len) + long(token);
    const uint b = token / uint(p.q_len), qi = token - b * uint(p.q_len);
    return (long(b) * long(p.n_heads) + long(h)) * long(p.q_len) + long(qi);
}

// Rows z[j * d ...] (j < hg, the accumulators of consecutive heads, V's
// rotated basis) to the output rows o[j * d ...]: the Hadamard blocks of V
// undone, scaled by norm[j] (1 / n / sum, or 1 / sum for a dense V) and V's
// signs. Starts after a barrier that published z.
template <typename T>
inline void kvq_finish_rows(constant KVCodesDecodeParams &p, threadgroup float *z, uint hg, thread const float *norm,
                            device T *o, uint tid, uint nt) {
    const uint d = uint(p.head_dim);
    if (kvq_v_codes) kvq_hadamard(z, hg * d, uint(p.block), tid, nt);
    for (uint j = 0; j < hg; j++) {
        for (uint i = tid; i < d; i += nt) {
            const float v = z[j * d + i] * norm[j];
            o[long(j) * long(d) + long(i)] = T((kvq_v_codes && fm_kvq_sign_bit(p.v_seed, i) != 0u) ? -v : v);
        }
    }
}

// The token's sequence and row: b, qi and its sequence's rows; false for a
// varlen token past the last sequence (no row to write).
inline bool kvq_token_row(constant KVCodesDecodeParams &p, const device int *cu_q, uint token, thread uint &b,
                          thread uint &qi, thread uint &rows_b) {
    b = token / uint(p.q_len);
    qi = token - b * uint(p.q_len);
    rows_b = uint(p.q_len);
    if (kvq_varlen_q) {
        // The sequence holding the token: the last b with cu_q[b] <= token.
        if (token >= uint(cu_q[p.batch])) return false;
        uint lo_b = 0, hi_b = uint(p.batch);
        while (hi_b - lo_b > 1) {
            const uint mid = (lo_b + hi_b) / 2;
            if (uint(cu_q[mid]) <= token) lo_b = mid; else hi_b = mid;
        }
        b = lo_b;
        qi = token - uint(cu_q[b]);
        rows_b = uint(cu_q[b + 1] - cu_q[b]);
    }
    return true;
}

template <typename T, typename KV>
[[max_total_threads_per_threadgroup(FM_KVQ_DECODE_THREADS)]]
kernel void kv_codes_decode(
    constant KVCodesDecodeParams &p [[buffer(0)]],
    const device T *q [[buffer(1)]],
    const device uchar *k_codes [[buffer(2), function_constant(kvq_k_codes)]],
    const device float *k_norms [[buffer(3), function_constant(kvq_k_codes)]],
    const device uchar *v_codes [[buffer(4), function_constant(kvq_v_codes)]],
    const device float *v_norms [[buffer(5), function_constant(kvq_v_codes)]],
    device T *o [[buffer(6), function_constant(kvq_whole)]],
    const device int *seqlens [[buffer(7), function_constant(kvq_lens)]],
    const device int *block_table [[buffer(8), function_constant(kvq_paged)]],
    const device float *sinks [[buffer(9), function_constant(kvq_sinks)]],
    device float *lse [[buffer(10), function_constant(kvq_lse)]],
    const device KV *k_dense [[buffer(11), function_constant(kvq_k_dense)]],
    const device KV *v_dense [[buffer(12), function_constant(kvq_v_dense)]],
    const device int *cu_q [[buffer(13), function_constant(kvq_varlen_q)]],
    const device int *cu_k [[buffer(14), function_constant(kvq_varlen_k)]],
    const device float *alibi [[buffer(15), function_constant(kvq_alibi)]],
    device float *tmp [[buffer(16), function_constant(kvq_split)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    TG_ARRAY(float, z, KVQ_Z_FLOATS);
    const uint heads = uint(p.n_heads), group = heads / uint(p.n_kv_heads), hg = uint(p.heads_per_group);
    const uint units = heads / hg, ck = 32u / hg;
    const uint token = tgid.x / units, h0 = (tgid.x - token * units) * hg, g = h0 / group;
    const uint w = tgid.y, nwg = uint(p.nwg);
    uint b = 0, qi = 0, rows_b = 0;
    if (!kvq_token_row(p, kvq_varlen_q ? cu_q : nullptr, token, b, qi, rows_b)) return;  // uniform: one token
    const uint d = uint(p.head_dim), n = uint(p.block), per = (d + 31u) / 32u;
    const uint i0 = lane * per, cnt = i0 < d ? min(per, d - i0) : 0u;
    const uint kbits = uint(p.k_bits), vbits = uint(p.v_bits);
    const float inv_n = 1.0f / float(n);
    const long row0 = long(token) * long(heads) + long(h0);  // the first head's row of q and out

    // The HG queries, rotated with K's signs and Hadamard blocks.
    for (uint j = 0; j < hg; j++) {
        for (uint i = lane; i < d; i += 32u) {
            const float v = float(q[(row0 + long(j)) * long(d) + long(i)]);
            z[j * d + i] = (kvq_k_codes && fm_kvq_sign_bit(p.k_seed, i) != 0u) ? -v : v;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (kvq_k_codes) kvq_hadamard(z, hg * d, n, lane, 32u);
    float qz[KVQ_LF], acc[KVQ_LF], x[KVQ_LF];
    for (uint e = 0; e < uint(KVQ_LF); e++) {
        const uint j = e / per, k = e - j * per;
        qz[e] = j < hg && k < cnt ? z[j * d + i0 + k] : 0.0f;
        acc[e] = 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float score_scale = (kvq_k_codes ? inv_n : 1.0f) * p.scale;

    // The keys this token sees, [lo, hi), and this split's chunks of them.
    int kl = p.kv_len;
    if (kvq_varlen_k) kl = cu_k[b + 1] - cu_k[b];
    if (kvq_lens) kl = seqlens[b];  // beside cu_k: flash-attn 3's seqused_k
    const KVQKeyRange range = kvq_key_range(p, kl, int(rows_b), int(qi));
    const int c_lo = range.lo / int(ck);
    const int chunks = range.hi > range.lo ? (range.hi + int(ck) - 1) / int(ck) - c_lo : 0;
    const int busy = min(chunks, int(nwg));
    const int c_begin = int(w) < busy ? c_lo + chunks * int(w) / busy : 0;
    const int c_end = int(w) < busy ? c_lo + chunks * (int(w) + 1) / busy : 0;

    // Lane l's head is l / CK: its (m, sum), the same in each of its CK lanes.
    const uint jl = lane / ck, tl = lane - jl * ck;
    const float slope = kvq_alibi && jl < hg ? alibi[long(b) * long(heads) + long(h0 + jl)] : 0.0f;
    const int pos = kvq_row_position(kl, int(rows_b), int(qi));
    float m = FM_RUNNING_MAX_START, sum = 0.0f;
    for (int c = c_begin; c < c_end; c++) {
        const int k0 = c * int(ck);
        float part[32];
        for (uint e = 0; e < 32u; e++) part[e] = 0.0f;
        for (uint t = 0; t < ck; t++) {
            const int key = k0 + int(t);
            if (key < range.lo || key >= range.hi) continue;  // uniform over the SIMD group
            const long r = kvq_storage_row(p, kvq_paged ? block_table : nullptr, kvq_varlen_k ? cu_k : nullptr, b, g, key);
            if (kvq_k_codes) {
                kvq_lane_codes(x, k_codes + r * long(p.k_row_bytes), k_norms + r * long(d / n), kbits, i0, cnt, n);
            }
            if (kvq_k_dense) kvq_lane_dense(x, k_dense + r * long(d), i0, cnt);
            for (uint e = 0; e < uint(KVQ_LF); e++) {
                const uint j = e / per, k = e - j * per;
                if (j < hg) part[j * ck + t] = fma(qz[e], x[k], part[j * ck + t]);
            }
        }
        const float dot = simd_reduce_scatter32(part, lane);  // head jl's dot with key k0 + tl
        const int key = k0 + int(tl);
        float s = -INFINITY;
        if (key >= range.lo && key < range.hi) {
            s = dot * score_scale;
            if (p.softcap > 0.0f) s = p.softcap * tanh(s / p.softcap);
            if (kvq_alibi) s += kvq_alibi_bias(slope, pos, key);
        }
        float smax = s;
        for (uint off = ck / 2u; off >= 1u; off >>= 1) smax = max(smax, simd_shuffle_xor(smax, ushort(off)));
        const float m_new = max(m, smax);
        const float corr = exp(m - m_new), pr = exp(s - m_new);
        float psum = pr;
        for (uint off = ck / 2u; off >= 1u; off >>= 1) psum += simd_shuffle_xor(psum, ushort(off));
        sum = sum * corr + psum;
        m = m_new;
        for (uint e = 0; e < uint(KVQ_LF); e++) {
            const uint j = e / per;
            acc[e] *= simd_shuffle(corr, ushort(min(j, hg - 1u) * ck));
        }
        for (uint t = 0; t < ck; t++) {
            const int key2 = k0 + int(t);
            if (key2 < range.lo || key2 >= range.hi) continue;  // uniform
            const long r = kvq_storage_row(p, kvq_paged ? block_table : nullptr, kvq_varlen_k ? cu_k : nullptr, b, g, key2);
            if (kvq_v_codes) {
                kvq_lane_codes(x, v_codes + r * long(p.v_row_bytes), v_norms + r * long(d / n), vbits, i0, cnt, n);
            }
            if (kvq_v_dense) kvq_lane_dense(x, v_dense + r * long(d), i0, cnt);
            float pj[KVQ_LF];
            for (uint j = 0; j < uint(KVQ_LF); j++) pj[j] = j < hg ? simd_shuffle(pr, ushort(j * ck + t)) : 0.0f;
            for (uint e = 0; e < uint(KVQ_LF); e++) {
                const uint j = e / per, k = e - j * per;
                if (j < hg) acc[e] = fma(pj[j], x[k], acc[e]);
            }
        }
    }

    if (kvq_split) {
        // This split's partials of each head, for kv_codes_reduce.
        const long rows = long(kvq_varlen_q ? uint(p.q_len) : uint(p.batch) * uint(p.q_len)) * long(heads);
        for (uint e = 0; e < uint(KVQ_LF); e++) {
            const uint j = e / per, k = e - j * per;
            if (j < hg && k < cnt) tmp[((row0 + long(j)) * long(nwg) + long(w)) * long(d) + long(i0 + k)] = acc[e];
        }
        if (tl == 0) {
            device float *sm = tmp + rows * long(nwg) * long(d) + ((row0 + long(jl)) * long(nwg) + long(w)) * 2;
            sm[0] = sum;
            sm[1] = m;
        }
        return;
    }
    if (kvq_sinks) {
        const float corr = kvq_fold_sink(m, sum, sinks[h0 + jl]);
        for (uint e = 0; e < uint(KVQ_LF); e++) acc[e] *= simd_shuffle(corr, ushort(min(e / per, hg - 1u) * ck));
    }
    if (kvq_lse && tl == 0) lse[kvq_lse_at(p, token, h0 + jl)] = sum > 0.0f ? m + precise::log(sum) : -INFINITY;
    const float nrm = sum > 0.0f ? (kvq_v_codes ? inv_n : 1.0f) / sum : 0.0f;
    float norm[KVQ_LF];
    for (uint j = 0; j < uint(KVQ_LF); j++) norm[j] = simd_shuffle(nrm, ushort(min(j, hg - 1u) * ck));
    for (uint e = 0; e < uint(KVQ_LF); e++) {
        const uint j = e / per, k = e - j * per;
        if (j < hg && k < cnt) z[j * d + i0 + k] = acc[e];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    kvq_finish_rows(p, z, hg, norm, kvq_whole ? o + row0 * long(d) : nullptr, lane, 32u);
}

// Row r = token * H + h of a split decode: the nwg partials merged (each
// lane folds splits lane, lane + 32, ...), the sink, LSE, then the rotation
// undone as the whole-row decode does.
template <typename T>
[[max_total_threads_per_threadgroup(FM_KVQ_DECODE_THREADS)]]
kernel void kv_codes_reduce(
    constant KVCodesDecodeParams &p [[buffer(0)]],
    const device float *tmp [[buffer(1)]],
    device T *o [[buffer(2)]],
    const device float *sinks [[buffer(3), function_constant(kvq_sinks)]],
    device float *lse [[buffer(4), function_constant(kvq_lse)]],
    const device int *cu_q [[buffer(5), function_constant(kvq_varlen_q)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    TG_ARRAY(float, z, FM_KVQ_MAX_HEAD_DIM);
    TG_ARRAY(float, weights, FM_KVQ_MAX_SPLITS);
    const uint heads = uint(p.n_heads), row = tgid.x, token = row / heads, h = row - token * heads;
    uint b = 0, qi = 0, rows_b = 0;
    if (!kvq_token_row(p, kvq_varlen_q ? cu_q : nullptr, token, b, qi, rows_b)) return;
    const uint d = uint(p.head_dim), nwg = uint(p.nwg);
    const long rows = long(kvq_varlen_q ? uint(p.q_len) : uint(p.batch) * uint(p.q_len)) * long(heads);
    const device float *sm = tmp + rows * long(nwg) * long(d) + long(row) * long(nwg) * 2;
    float ml = FM_RUNNING_MAX_START;
    for (uint w = lane; w < nwg; w += 32u) ml = max(ml, sm[2 * w + 1]);
    float m = simd_max(ml), sl = 0.0f;
    for (uint w = lane; w < nwg; w += 32u) {
        const float s_w = sm[2 * w];
        // A split without keys (S = 0) has weight 0: its accumulator is not read.
        const float f = s_w != 0.0f ? exp(sm[2 * w + 1] - m) : 0.0f;
        weights[w] = f;
        sl += s_w * f;
    }
    float sum = simd_sum(sl);
    float a = 1.0f;
    if (kvq_sinks) a = kvq_fold_sink(m, sum, sinks[h]);
    if (kvq_lse && lane == 0) lse[kvq_lse_at(p, token, h)] = sum > 0.0f ? m + precise::log(sum) : -INFINITY;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const device float *part = tmp + long(row) * long(nwg) * long(d);
    for (uint i = lane; i < d; i += 32u) {
        float y = 0.0f;
        for (uint w = 0; w < nwg; w++) {
            if (weights[w] != 0.0f) y = fma(part[long(w) * long(d) + long(i)], weights[w], y);
        }
        z[i] = y * a;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float norm = sum > 0.0f ? (kvq_v_codes ? 1.0f / float(p.block) : 1.0f) / sum : 0.0f;
    kvq_finish_rows(p, z, 1u, &norm, o + long(row) * long(d), lane, 32u);
}

// BEGIN GENERATED INSTANTIATIONS: kv_codes_decode kv_codes_reduce
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("kv_codes_decode_f32", kv_codes_decode, float, float)
INSTANTIATE_KERNEL("kv_codes_decode_f16kv", kv_codes_decode, float, half)
INSTANTIATE_KERNEL("kv_codes_decode_bf16kv", kv_codes_decode, float, bfloat)
INSTANTIATE_KERNEL("kv_codes_decode_f16", kv_codes_decode, half, half)
INSTANTIATE_KERNEL("kv_codes_decode_bf16", kv_codes_decode, bfloat, bfloat)
INSTANTIATE_KERNEL("kv_codes_reduce_f32", kv_codes_reduce, float)
INSTANTIATE_KERNEL("kv_codes_reduce_f16", kv_codes_reduce, half)
INSTANTIATE_KERNEL("kv_codes_reduce_bf16", kv_codes_reduce, bfloat)
// END GENERATED INSTANTIATIONS
