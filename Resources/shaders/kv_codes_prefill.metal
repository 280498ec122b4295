// kv_codes_prefill.metal — attention of many query rows over quantized K
// and V caches (KVCodesDecodeParams of flashmetal.h, the buffers and
// function constants of kv_codes_decode): a tile of keys is decoded from its
// codes into threadgroup memory once (centroid · norm, still in the rotated
// basis) and read by every query row of the threadgroup.
//
// Threadgroup (x, g, b): FM_KVQ_PREFILL_ROWS SIMD groups, each one item of
// sequence b's kv head g: item x * FM_KVQ_PREFILL_ROWS + simdgroup = query
// row qi * (H / Hkv) + head j of the group, so the query heads sharing a kv
// head and consecutive query rows share every decoded tile. Each item
// rotates its query with K's signs and Hadamard blocks, keeps an online
// softmax per key (lane i + 32 m holds coordinate i + 32 m) and rotates the
// accumulator back with V's. (The one-row decode, kv_codes_decode, scores
// chunks of keys and splits them over threadgroups: the same attention in
// another order of sums.)
#include "dialect.h"
#include "flashmetal_kernels.h"
#include "kv_codec.h"
using namespace metal;
#include "kv_codes_attn.h"

template <typename T, typename KV>
[[max_total_threads_per_threadgroup(FM_KVQ_PREFILL_ROWS * FM_KVQ_DECODE_THREADS)]]
kernel void kv_codes_prefill(
    constant KVCodesDecodeParams &p [[buffer(0)]],
    const device T *q [[buffer(1)]],
    const device uchar *k_codes [[buffer(2), function_constant(kvq_k_codes)]],
    const device float *k_norms [[buffer(3), function_constant(kvq_k_codes)]],
    const device uchar *v_codes [[buffer(4), function_constant(kvq_v_codes)]],
    const device float *v_norms [[buffer(5), function_constant(kvq_v_codes)]],
    device T *o [[buffer(6)]],
    const device int *seqlens [[buffer(7), function_constant(kvq_lens)]],
    const device int *block_table [[buffer(8), function_constant(kvq_paged)]],
    const device float *sinks [[buffer(9), function_constant(kvq_sinks)]],
    device float *lse [[buffer(10), function_constant(kvq_lse)]],
    const device KV *k_dense [[buffer(11), function_constant(kvq_k_dense)]],
    const device KV *v_dense [[buffer(12), function_constant(kvq_v_dense)]],
    const device int *cu_q [[buffer(13), function_constant(kvq_varlen_q)]],
    const device int *cu_k [[buffer(14), function_constant(kvq_varlen_k)]],
    const device float *alibi [[buffer(15), function_constant(kvq_alibi)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint sg BUILTIN(simdgroup_index_in_threadgroup),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    // The rotated queries [rows, D] at the start, then each tile's K rows
    // [bk, D] and V rows [bk, D], then the accumulators [rows, D].
    TG_ARRAY(float, buf, FM_KVQ_PREFILL_TILE_FLOATS);
    TG_ARRAY(long, tile_rows, FM_KVQ_PREFILL_TILE_FLOATS / 2 / 64);
    TG_ARRAY(int, ranges, 2 * FM_KVQ_PREFILL_ROWS);
    const uint nt = uint(FM_KVQ_PREFILL_ROWS) * 32u, lanes = 32u;
    const uint heads = uint(p.n_heads), group = heads / uint(p.n_kv_heads);
    const uint d = uint(p.head_dim), n = uint(p.block), nb = d / n, per = (d + lanes - 1) / lanes;
    const uint b = tgid.z, g = tgid.y;
    uint rows_b = uint(p.q_len), tok0 = b * uint(p.q_len);
    if (kvq_varlen_q) {
        tok0 = uint(cu_q[b]);
        rows_b = uint(cu_q[b + 1]) - tok0;
    }
    const uint first = tgid.x * uint(FM_KVQ_PREFILL_ROWS);
    if (first >= rows_b * group) return;  // the whole threadgroup is past the sequence's rows
    const uint x = first + sg;
    const bool active = x < rows_b * group;
    const uint qi = active ? x / group : 0u, h = g * group + x % group;
    const long row = (long(tok0) + long(qi)) * long(heads) + long(h);
    int kl = p.kv_len;
    if (kvq_varlen_k) kl = cu_k[b + 1] - cu_k[b];
    if (kvq_lens) kl = seqlens[b];  // beside cu_k: flash-attn 3's seqused_k
    KVQKeyRange range;
    range.lo = 0;
    range.hi = 0;
    if (active) range = kvq_key_range(p, kl, int(rows_b), int(qi));
    const float slope = kvq_alibi && active ? alibi[long(b) * long(heads) + long(h)] : 0.0f;
    const int pos = kvq_row_position(kl, int(rows_b), int(qi));

    const uint kbits = uint(p.k_bits), vbits = uint(p.v_bits);
    const float inv_n = 1.0f / float(n);
    threadgroup float *z = buf + sg * d;
    for (uint i = lane; i < d; i += lanes) {
        const float v = active ? float(q[row * long(d) + long(i)]) : 0.0f;
        z[i] = (kvq_k_codes && fm_kvq_sign_bit(p.k_seed, i) != 0u) ? -v : v;
    }
    if (lane == 0) {
        ranges[2 * sg] = range.lo;
        ranges[2 * sg + 1] = range.hi;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (kvq_k_codes) kvq_hadamard(buf, uint(FM_KVQ_PREFILL_ROWS) * d, n, tid, nt);
    const float k_unit = kvq_k_codes ? inv_n : 1.0f;
    float qz[int(FM_KVQ_MAX_HEAD_DIM) / int(FM_KVQ_DECODE_THREADS)];
    float acc[int(FM_KVQ_MAX_HEAD_DIM) / int(FM_KVQ_DECODE_THREADS)];
    for (uint m = 0; m < per; m++) {
        const uint i = lane + m * lanes;
        qz[m] = i < d ? z[i] : 0.0f;
        acc[m] = 0.0f;
    }
    // The keys any item of the threadgroup sees: [t_lo, t_hi).
    int t_lo = 0x7fffffff, t_hi = 0;
    for (uint s = 0; s < uint(FM_KVQ_PREFILL_ROWS); s++) {
        if (ranges[2 * s] < ranges[2 * s + 1]) {
            t_lo = min(t_lo, ranges[2 * s]);
            t_hi = max(t_hi, ranges[2 * s + 1]);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const int bk = int(FM_KVQ_PREFILL_TILE_FLOATS) / 2 / int(d);
    threadgroup float *kt = buf, *vt = buf + bk * int(d);
    float mx = FM_RUNNING_MAX_START, sum = 0.0f;
    for (int t0 = t_lo; t0 < t_hi; t0 += bk) {
        const int nk = min(bk, t_hi - t0);
        for (int t = int(tid); t < nk; t += int(nt)) tile_rows[t] =
            kvq_storage_row(p, kvq_paged ? block_table : nullptr, kvq_varlen_k ? cu_k : nullptr, b, g, t0 + t);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint e = tid; e < uint(nk) * d; e += nt) {
            const uint t = e / d, i = e - t * d;
            const long r = tile_rows[t];
            float kx = 0.0f, vx = 0.0f;
            if (kvq_k_dense) kx = float(k_dense[r * long(d) + long(i)]);
            if (kvq_k_codes) {
                kx = fm_kvq_centroid(int(kbits), kvq_code_at(k_codes + r * long(p.k_row_bytes), i, kbits))
                     * k_norms[r * long(nb) + long(i / n)];
            }
            if (kvq_v_dense) vx = float(v_dense[r * long(d) + long(i)]);
            if (kvq_v_codes) {
                vx = fm_kvq_centroid(int(vbits), kvq_code_at(v_codes + r * long(p.v_row_bytes), i, vbits))
                     * v_norms[r * long(nb) + long(i / n)];
            }
            kt[e] = kx;
            vt[e] = vx;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const int a1 = min(t0 + nk, range.hi);
        for (int t = max(t0, range.lo); t < a1; t++) {
            const threadgroup float *kr = kt + (t - t0) * int(d);
            const threadgroup float *vr = vt + (t - t0) * int(d);
            float part = 0.0f;
            for (uint m = 0; m < per; m++) {
                const uint i = lane + m * lanes;
                if (i < d) part += qz[m] * kr[i];
            }
            float s = simd_sum(part) * k_unit * p.scale;
            if (p.softcap > 0.0f) s = p.softcap * tanh(s / p.softcap);
            if (kvq_alibi) s += kvq_alibi_bias(slope, pos, t);
            const float m_new = max(mx, s);
            const float corr = exp(mx - m_new), w = exp(s - m_new);
            sum = sum * corr + w;
            for (uint m = 0; m < per; m++) {
                const uint i = lane + m * lanes;
                if (i < d) acc[m] = acc[m] * corr + w * vr[i];
            }
            mx = m_new;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (kvq_sinks && active) {
        // The sink joins the denominator without a value.
        // A +inf sink takes the whole row: output 0, lse +inf.
        const float s = sinks[h];
        const float m_new = max(mx, s);
        const float corr = s == INFINITY ? 0.0f : exp(mx - m_new);
        sum = s == INFINITY ? INFINITY : sum * corr + exp(s - m_new);
        for (uint m = 0; m < per; m++) acc[m] *= corr;
        mx = m_new;
    }
    if (kvq_lse && active && lane == 0) {
        const long at = kvq_varlen_q ? long(h) * long(p.q_len) + long(tok0) + long(qi)
                                     : (long(b) * long(heads) + long(h)) * long(p.q_len) + long(qi);
        lse[at] = sum > 0.0f ? mx + precise::log(sum) : -INFINITY;
    }

    for (uint m = 0; m < per; m++) {
        const uint i = lane + m * lanes;
        if (i < d) z[i] = acc[m];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (kvq_v_codes) kvq_hadamard(buf, uint(FM_KVQ_PREFILL_ROWS) * d, n, tid, nt);
    if (!active) return;
    const float norm = sum > 0.0f ? (kvq_v_codes ? inv_n : 1.0f) / sum : 0.0f;
    for (uint i = lane; i < d; i += lanes) {
        const float v = z[i] * norm;
        o[row * long(d) + long(i)] = T((kvq_v_codes && fm_kvq_sign_bit(p.v_seed, i) != 0u) ? -v : v);
    }
}

// BEGIN GENERATED INSTANTIATIONS: kv_codes_prefill
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("kv_codes_prefill_f32", kv_codes_prefill, float, float)
INSTANTIATE_KERNEL("kv_codes_prefill_f16kv", kv_codes_prefill, float, half)
INSTANTIATE_KERNEL("kv_codes_prefill_bf16kv", kv_codes_prefill, float, bfloat)
INSTANTIATE_KERNEL("kv_codes_prefill_f16", kv_codes_prefill, half, half)
INSTANTIATE_KERNEL("kv_codes_prefill_bf16", kv_codes_prefill, bfloat, bfloat)
// END GENERATED INSTANTIATIONS
