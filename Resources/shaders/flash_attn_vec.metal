// flash_attn_vec.metal — split-KV decode (mlx-native's flash_attn_vec and its reduce): one query row per
// head, the KV range split over NWG = 32 workgroups, then a reduce.
//
// Main kernel, grid (1, rows, NWG), one SIMD group (32 threads) per
// (row, workgroup). Workgroup wg takes a contiguous run of 32-key chunks
// (FM_VEC_CHUNK: the split flashmetal.h defines for every backend). Per chunk:
//   every lane dots its dims (l, l + 32, ...) of q with each of the chunk's
//   32 keys (coalesced K reads), then a butterfly reduce-scatter over the
//   SIMD group (31 shuffles) leaves the full q.k of key c + j in lane j;
//   lane j scores key c + j: s = scale * q.k, softcap, then s * log2(e);
//   online softmax in the exp2 domain (the running max starts at the finite
//   -FLT_MAX / 2, so a masked key (-inf) gives exp2(-inf) = 0, never NaN);
//   the 32 probabilities go through threadgroup memory and lane l
//   accumulates output dims l, l + 32, ... over the chunk's V rows.
// Each lane reads its dims of q (float32) straight into registers: q is
// never narrowed (staging it in half would lose ~3 digits and make
// |q| > 65504 infinite), so decode meets the float32 tolerance. The query sits at position
// kv_len - 1: causal (mask_type 1) sees every valid key; a sliding window w
// (mask_type 2) sees keys p with (kv_len - 1) - p < w. No key at or past
// kv_len is ever read.
//
// tmp (f32): partial outputs [rows, NWG, D] (unnormalised), then (S, M)
// pairs [rows, NWG, 2] with M in natural-log units, exactly as the cpu
// kernel writes them, so the two backends' tmp buffers mean the same thing.
//
// Buffers: 0 FlashAttnVecParams, 1 q (f32), 2 k, 3 v (f32, f16 or bf16),
// 4 tmp. Threadgroup buffer 0: PK + SH + 2 * PV halfs (VecDispatcher); this
// kernel uses only the chunk's 32 probabilities (floats) at its start.
//
// Serving extension (FlashAttnVecSeqParams in flashmetal.h). With
// function constant 501 (vec_seq) row r = b * H + h reads kv head
// g = h / (H / Hkv) of sequence b through the strides at buffer 5, and the
// grid's y is the row count (n_heads is H then). 502 (vec_kv_lens): sequence
// b holds seqlens_k[b] keys (buffer 6) instead of kv_seq_len; 0 sees nothing.
// 503 (vec_paged): key p lives in page block_table[b * max_pages + p /
// page_size] (buffer 7). page_size is a multiple of 16, so a chunk of 32
// keys spans at most two pages: the table is read once per half chunk, and
// only for halves that start before kv_len_b (entries past it are never
// checked by the host and never read here); chunks start at multiples of 32,
// so each half lies in one page. The window and the attention chunk apply
// per sequence.
//
// Head dims that are not a multiple of 32 (80): lane l still owns dims
// l, l + 32, ...; the last of them exist only for l < D % 32.
//
// Reduce, grid (rows, 1, 1), 32 * NWG threads: rescales partial w by
// exp(M_w - M) (0 for a workgroup with S_w = 0, whose O is never read),
// normalises by the combined S (S == 0: a row that sees no key outputs
// zeros). The fused variant then applies the inverse normalised
// Walsh-Hadamard transform y = H_D x / sqrt(D) (Sylvester, natural order) in
// threadgroup memory and flips the signs given by the bitmask at buffer 4
// when function constant 500 (has_signs) is true. Buffers: 0
// FlashAttnVecReduceParams, 1 tmp, 2 out (f32), 3 nwg (uint), 4 signs.
// The plain reduce's serving extension: sinks (504, buffer 5, float32 [H])
// join the combined denominator once, as a logit without a value; lse (505,
// buffer 6) receives M + log(S [+ e^{sink - M}]) in natural units, -inf for
// a row that sees nothing and has no sink; FlashAttnVecReduceExtParams at
// buffer 7 give H (row r has head r % H). Its buffer 4 is never bound (the
// dispatcher sets 500 false): it only keeps the buffer positions.
#include "dialect.h"
#include "flashmetal.h"
using namespace metal;

FUNCTION_CONSTANT(bool, vec_has_signs, 500)
FUNCTION_CONSTANT(bool, vec_seq, 501)
FUNCTION_CONSTANT(bool, vec_kv_lens, 502)
FUNCTION_CONSTANT(bool, vec_paged, 503)
FUNCTION_CONSTANT(bool, vec_sinks, 504)
FUNCTION_CONSTANT(bool, vec_lse, 505)
FUNCTION_CONSTANT_EXPR(bool, vec_reduce_ext, vec_sinks || vec_lse)

#define VEC_LN2 0.693147180559945309f

// Threadgroup memory of the main kernel as VecDispatcher sizes it, in halfs.
template <int D>
constexpr int vec_tg_halfs() {
    return ((D + 127) & ~127) * 3 + 4 * 32;
}

// The chunk's partial dots: part[j] over this lane's dims of key j. After
// the reduce-scatter lane j holds sum over lanes of part[j]: at the stage of
// distance h a lane keeps the half of its indices whose bit h equals its own
// lane bit h and adds its partner's (lane ^ h) copy of them. Every lane of
// the SIMD group calls this (the shuffles are collectives).
inline float vec_reduce_scatter(thread float *part, uint lane) {
    for (ushort h = 16; h >= 1; h >>= 1) {
        const bool upper = (lane & h) != 0;
        for (ushort i = 0; i < h; i++) {
            const float send = upper ? part[i] : part[i + h];
            const float keep = upper ? part[i + h] : part[i];
            part[i] = keep + simd_shuffle_xor(send, h);
        }
    }
    return part[0];
}

// Lane `lane`'s i-th dim (lane + 32 i) exists: always when D % 32 == 0.
template <int D>
inline bool vec_lane_dim(uint lane, int i) {
    return D % 32 == 0 || int(lane) + 32 * i < D;
}

// Element offset of the row of key c + 16 * half's page start (the keys of a
// half chunk are consecutive rows of one page), or of c + 16 * half itself
// when K/V are not paged. `s` are the (sequence or page, kv head, row) strides.
inline long vec_half_offset(long c, int half, long b, long g, constant FlashAttnVecSeqParams *sp,
                            const device int *block_table, thread const long *s) {
    const long p = c + 16 * half;
    if (vec_paged) {
        const long ps = long(sp->page_size);
        const long page = block_table[b * long(sp->max_pages) + p / ps];
        return page * s[0] + g * s[1] + (p % ps) * s[2];
    }
    return b * s[0] + g * s[1] + p * s[2];
}

template <typename KV, int D>
kernel void flash_attn_vec(
    constant FlashAttnVecParams &p [[buffer(0)]],
    const device float *q [[buffer(1)]],
    const device KV *k [[buffer(2)]],
    const device KV *v [[buffer(3)]],
    device float *tmp [[buffer(4)]],
    constant FlashAttnVecSeqParams *sp [[buffer(5), function_constant(vec_seq)]],
    const device int *seqlens_k [[buffer(6), function_constant(vec_kv_lens)]],
    const device int *block_table [[buffer(7), function_constant(vec_paged)]],
    TG_BUFFER(float, probs, 0),  // the chunk's 32 probabilities
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint3 ngroups BUILTIN(threadgroups_per_grid),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    constexpr int NE = (D + 31) / 32;  // output dims per lane (the last maybe partial)
    static_assert(FM_VEC_CHUNK == 32, "one key of a chunk per lane");
    static_assert(32 * 4 <= vec_tg_halfs<D>() * 2, "uses no more than the dispatcher binds");
    static_assert(vec_tg_halfs<D>() * 2 <= 32768, "threadgroup memory over 32 KiB");

    const long row = tgid.y;
    const long wg = tgid.z;
    const long nrows = vec_seq ? long(ngroups.y) : long(p.n_heads);
    const long nwg = p.nwg;
    const long gqa = long(p.n_heads) / long(p.n_kv_heads);
    // (sequence, kv head) of the row and the (sequence or page, kv head, row)
    // strides of K and V. Without vec_seq the call is one sequence of B * Hkv kv heads.
    long b = 0;
    long g = row / gqa;
    long ks[3] = {0, long(p.kv_capacity) * D, D};
    long vs[3] = {0, long(p.kv_capacity) * D, D};
    if (vec_seq) {
        b = row / long(p.n_heads);
        g = (row % long(p.n_heads)) / gqa;
        for (int i = 0; i < 3; i++) {
            ks[i] = sp->K_strides[i];
            vs[i] = sp->V_strides[i];
        }
    }
    const long kv_len = vec_kv_lens ? long(seqlens_k[b]) : long(p.kv_seq_len);
    // An argument whose constant is false is not there: never read, only null.
    constant FlashAttnVecSeqParams *seq = vec_seq ? sp : nullptr;
    const device int *table = vec_paged ? block_table : nullptr;

    float qv[NE];  // this lane's dims of q: l, l + 32, ...
    for (int i = 0; i < NE; i++) qv[i] = vec_lane_dim<D>(lane, i) ? q[row * D + int(lane) + 32 * i] : 0.0f;

    // Visible keys: [lo, kv_len), from the sequence's first key f (cache_leftpad,
    // after the lengths in seqlens_k).
    const long first = vec_seq && vec_kv_lens && sp->key_starts_at > 0
        ? long(seqlens_k[long(sp->key_starts_at) + b]) : 0L;
    long lo = first;
    if (p.mask_type == 2) lo = max(kv_len - long(p.sliding_window), lo);
    // The attention chunk of the query (at kv_len - 1) starts at f + (kv_len - 1 - f) / c * c.
    if (vec_seq && sp->attention_chunk > 0 && kv_len > first) {
        const long c = long(sp->attention_chunk);
        lo = max(lo, first + (kv_len - 1 - first) / c * c);
    }

    float o[NE];
    for (int i = 0; i < NE; i++) o[i] = 0.0f;
    float m = FM_RUNNING_MAX_START;  // log2 domain
    float s_sum = 0.0f;

    // This workgroup's contiguous run of chunks (FM_VEC_CHUNK in flashmetal.h).
    const long c0 = lo / FM_VEC_CHUNK;
    const long chunks = kv_len > lo ? (kv_len + FM_VEC_CHUNK - 1) / FM_VEC_CHUNK - c0 : 0;
    const long busy = min(chunks, nwg);
    const long c_begin = wg < busy ? (c0 + chunks * wg / busy) * FM_VEC_CHUNK : 0;
    const long c_end = wg < busy ? (c0 + chunks * (wg + 1) / busy) * FM_VEC_CHUNK : 0;
    for (long c = c_begin; c < c_end; c += FM_VEC_CHUNK) {
        // Row offsets of the chunk's two half chunks (uniform over the SIMD group).
        long koff[2] = {0, 0};
        long voff[2] = {0, 0};
        for (int hf = 0; hf < 2; hf++) {
            if (c + 16 * hf >= kv_len) continue;
            koff[hf] = vec_half_offset(c, hf, b, g, seq, table, ks);
            voff[hf] = vec_half_offset(c, hf, b, g, seq, table, vs);
        }
        float part[FM_VEC_CHUNK];
        for (int j = 0; j < FM_VEC_CHUNK; j++) {
            part[j] = 0.0f;
            const long pj = c + j;
            if (pj >= kv_len || pj < lo) continue;  // uniform over the SIMD group
            const device KV *kr = k + koff[j >> 4] + long(j & 15) * ks[2] + lane;
            for (int i = 0; i < NE; i++) {
                if (vec_lane_dim<D>(lane, i)) part[j] = fma(qv[i], float(kr[32 * i]), part[j]);
            }
        }
        const float dot = vec_reduce_scatter(part, lane);
        const long pos = c + long(lane);
        float s = -INFINITY;
        if (pos < kv_len && pos >= lo) {
            s = p.scale * dot;
            if (p.softcap > 0.0f) s = p.softcap * precise::tanh(s / p.softcap);
            s *= FM_LOG2E;
        }
        const float m_new = max(m, simd_max(s));
        const float factor = exp2(m - m_new);
        const float pr = exp2(s - m_new);
        s_sum = s_sum * factor + simd_sum(pr);
        m = m_new;

        probs[lane] = pr;
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (int i = 0; i < NE; i++) o[i] *= factor;
        const long j0 = max(lo - c, 0L);
        const long j1 = min(long(FM_VEC_CHUNK), kv_len - c);
        for (long j = j0; j < j1; j++) {
            const float pj = probs[j];
            const device KV *vr = v + voff[j >> 4] + (j & 15) * vs[2] + lane;
            for (int i = 0; i < NE; i++) {
                if (vec_lane_dim<D>(lane, i)) o[i] = fma(pj, float(vr[32 * i]), o[i]);
            }
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);  // probs is rewritten next chunk
    }

    device float *o_part = tmp + (row * nwg + wg) * D;
    for (int i = 0; i < NE; i++) {
        if (vec_lane_dim<D>(lane, i)) o_part[int(lane) + 32 * i] = o[i];
    }
    if (lane == 0) {
        device float *sm = tmp + nrows * nwg * D + (row * nwg + wg) * 2;
        sm[0] = s_sum;
        sm[1] = m * VEC_LN2;  // natural-log units, like the cpu kernel
    }
}

// Simdgroup 0 combines the (S, M) pairs of a row: weights[w] = exp(M_w - M)
// and weights[32] = 1 / S (0 when S == 0: a row that sees no key outputs
// zeros). With a sink logit (natural units; NaN = none) it joins M and S once
// without a value; with `lse` lane 0 writes M + log(S) (-inf when S == 0).
// Called by every thread; ends with the barrier that publishes the weights.
template <int D>
inline void vec_reduce_weights(const device float *tmp, long nrows, long row, uint nwg, uint sg, uint lane,
                               threadgroup float *weights, bool has_sink, float sink, device float *lse) {
    if (sg == 0) {  // uniform per SIMD group: all 32 lanes reach the collectives
        const device float *sm = tmp + nrows * long(nwg) * D + row * long(nwg) * 2;
        const bool has = lane < nwg;
        const float m_w = has ? sm[2 * lane + 1] : FM_RUNNING_MAX_START;
        const float s_w = has ? sm[2 * lane] : 0.0f;
        float m = simd_max(m_w);
        // A workgroup without keys (S = 0) has weight 0: its O is not read.
        float f = s_w != 0.0f ? exp2((m_w - m) * FM_LOG2E) : 0.0f;
        float s = simd_sum(s_w * f);
        if (has_sink) {  // uniform: every lane folds the sink in the same way
            const float m_all = max(m, sink);
            const float a = exp2((m - m_all) * FM_LOG2E);
            f *= a;
            // A +inf sink takes all the mass: s = +inf (not exp2(inf - inf),
            // NaN): every weight is 0, 1/s = 0 and the LSE +inf, the limit.
            s = s * a + (sink == INFINITY ? INFINITY : exp2((sink - m_all) * FM_LOG2E));
            m = m_all;
        }
        weights[lane] = f;
        if (lane == 0) {
            weights[32] = s == 0.0f ? 0.0f : 1.0f / s;
            if (lse) lse[row] = s == 0.0f ? -INFINITY : m + precise::log(s);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Output dim d of a row: the weighted sum of the partials, normalised.
// Partials of weight 0 are skipped (a workgroup without keys leaves its O
// unspecified, flashmetal.h); for a finite partial fma(x, 0, y) == y, so
// skipping changes no bits.
template <int D>
inline float vec_reduce_dim(const device float *tmp, long row, uint nwg, uint d, const threadgroup float *weights) {
    float y = 0.0f;
    for (uint w = 0; w < nwg; w++) {
        if (weights[w] != 0.0f) y = fma(tmp[(row * long(nwg) + long(w)) * D + d], weights[w], y);
    }
    return y * weights[32];
}

template <int D>
kernel void flash_attn_vec_reduce(
    constant FlashAttnVecReduceParams &p [[buffer(0)]],
    const device float *tmp [[buffer(1)]],
    device float *out [[buffer(2)]],
    constant uint &nwg [[buffer(3)]],
    const device uchar *unused_signs [[buffer(4), function_constant(vec_has_signs)]],
    const device float *sinks [[buffer(5), function_constant(vec_sinks)]],
    device float *lse [[buffer(6), function_constant(vec_lse)]],
    constant FlashAttnVecReduceExtParams *ext [[buffer(7), function_constant(vec_reduce_ext)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup),
    uint sg BUILTIN(simdgroup_index_in_threadgroup),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    TG_ARRAY(float, weights, 33);
    const long row = tgid.x;
    const float sink = vec_sinks ? sinks[row % long(ext->n_heads)] : 0.0f;
    device float *lse_out = nullptr;
    if (vec_lse) lse_out = lse;
    vec_reduce_weights<D>(tmp, long(p.nrows), row, nwg, sg, lane, weights, vec_sinks, sink, lse_out);
    for (uint d = tid; d < uint(D); d += tpg.x) out[row * D + d] = vec_reduce_dim<D>(tmp, row, nwg, d, weights);
}

template <int D>
kernel void flash_attn_vec_reduce_tq_hb_undo(
    constant FlashAttnVecReduceParams &p [[buffer(0)]],
    const device float *tmp [[buffer(1)]],
    device float *out [[buffer(2)]],
    constant uint &nwg [[buffer(3)]],
    const device uchar *signs [[buffer(4), function_constant(vec_has_signs)]],
    TG_BUFFER(float, yb, 0),
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup),
    uint sg BUILTIN(simdgroup_index_in_threadgroup),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    static_assert((D & (D - 1)) == 0, "the Hadamard transform needs a power of two");
    static_assert(D * 4 + 33 * 4 <= 32768, "threadgroup memory over 32 KiB");
    TG_ARRAY(float, weights, 33);
    const long row = tgid.x;
    const uint nthreads = tpg.x;
    threadgroup float *ys = yb;  // D floats (VecDispatcher binds D * 4 bytes)
    vec_reduce_weights<D>(tmp, long(p.nrows), row, nwg, sg, lane, weights, false, 0.0f, nullptr);
    for (uint d = tid; d < uint(D); d += nthreads) ys[d] = vec_reduce_dim<D>(tmp, row, nwg, d, weights);

    // In-place butterflies, natural (Sylvester) order: stage h pairs i, i + h.
    for (uint h = 1; h < uint(D); h <<= 1) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint t = tid; t < uint(D) / 2; t += nthreads) {
            const uint i = (t / h) * 2 * h + t % h;
            const float a = ys[i];
            const float b = ys[i + h];
            ys[i] = a + b;
            ys[i + h] = a - b;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const float norm = 1.0f / sqrt(float(D));
    for (uint d = tid; d < uint(D); d += nthreads) {
        const float x = ys[d] * norm;
        const bool neg = vec_has_signs && ((signs[d >> 3] >> (d & 7)) & 1) != 0;
        out[row * D + d] = neg ? -x : x;
    }
}

INSTANTIATE_KERNEL("flash_attn_vec_dk64", flash_attn_vec, float, 64)
INSTANTIATE_KERNEL("flash_attn_vec_dk80", flash_attn_vec, float, 80)
INSTANTIATE_KERNEL("flash_attn_vec_dk96", flash_attn_vec, float, 96)
INSTANTIATE_KERNEL("flash_attn_vec_dk128", flash_attn_vec, float, 128)
INSTANTIATE_KERNEL("flash_attn_vec_dk192", flash_attn_vec, float, 192)
INSTANTIATE_KERNEL("flash_attn_vec_dk256", flash_attn_vec, float, 256)
INSTANTIATE_KERNEL("flash_attn_vec_dk512", flash_attn_vec, float, 512)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk64", flash_attn_vec, half, 64)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk80", flash_attn_vec, half, 80)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk96", flash_attn_vec, half, 96)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk128", flash_attn_vec, half, 128)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk192", flash_attn_vec, half, 192)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk256", flash_attn_vec, half, 256)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk512", flash_attn_vec, half, 512)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk64", flash_attn_vec, bfloat, 64)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk80", flash_attn_vec, bfloat, 80)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk96", flash_attn_vec, bfloat, 96)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk128", flash_attn_vec, bfloat, 128)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk192", flash_attn_vec, bfloat, 192)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk256", flash_attn_vec, bfloat, 256)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk512", flash_attn_vec, bfloat, 512)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk64", flash_attn_vec_reduce, 64)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk80", flash_attn_vec_reduce, 80)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk96", flash_attn_vec_reduce, 96)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk128", flash_attn_vec_reduce, 128)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk192", flash_attn_vec_reduce, 192)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk256", flash_attn_vec_reduce, 256)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk512", flash_attn_vec_reduce, 512)
// The FWHT undo needs a power-of-two D: no 80, 96 or 192 (VecCapability.fwhtHeadDims).
INSTANTIATE_KERNEL("flash_attn_vec_reduce_tq_hb_undo_dk64", flash_attn_vec_reduce_tq_hb_undo, 64)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_tq_hb_undo_dk128", flash_attn_vec_reduce_tq_hb_undo, 128)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_tq_hb_undo_dk256", flash_attn_vec_reduce_tq_hb_undo, 256)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_tq_hb_undo_dk512", flash_attn_vec_reduce_tq_hb_undo, 512)
