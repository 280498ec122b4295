// flash_attn_vec.metal — split-KV decode (mlx-native's flash_attn_vec and its reduce): one query row per
// head, the KV range split over NWG = 32 workgroups, then a reduce.
//
// Main kernel, grid (1, rows / HG, NWG), HG SIMD groups (32 * HG threads)
// per threadgroup: HG query rows of one kv head (HG divides H / Hkv, times
// the query rows L of a short query, and is at most vec_group_rows<D>;
// VecDispatcher.headsPerGroup), one SIMD group each, over one workgroup's
// keys. Workgroup wg takes a contiguous run of 32-key chunks (FM_VEC_CHUNK:
// the split flashmetal_kernels.h defines for every backend). Per chunk:
//   lane l owns the elements VW * (l + 32 i) + t, t < VW (vec_width: VW = 4
//   or 2, so K and V come in 8-byte half4 / 16-byte float4 loads) and dots
//   them with each of the chunk's 32 keys, then a butterfly reduce-scatter
//   over the SIMD group (31 shuffles) leaves the full q.k of key c + j in
//   lane j; lane j scores key c + j: s = scale * q.k, softcap, then
//   s * log2(e); online softmax in the exp2 domain (the running max starts
//   at the finite -FLT_MAX / 2, so a masked key (-inf) gives exp2(-inf) = 0,
//   never NaN); the 32 probabilities go through threadgroup memory and each
//   lane accumulates its output elements over the chunk's V rows.
// With HG = 1 the lanes load K and V rows straight from device memory. With
// HG > 1 the threadgroup reads each K (then V) row once: all its threads copy
// RS rows (vec_stage_rows) into one of two threadgroup stages unchanged, a
// barrier, then every SIMD group reads them there (one barrier per stage:
// the stages alternate). Either way each lane sums the same floats in the
// same order, so HG changes no bit of a decode (one query row per sequence).
// Each lane reads its dims of q (float32, or with 508 vec_q_io the K/V
// dtype at buffer 9, exact in float) straight into registers: q is
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
// 4 tmp. Threadgroup buffer 0 (VecDispatcher.threadgroupMemoryBytes): 32
// probabilities (floats) per SIMD group, then with HG > 1 two stages of
// RS * D K/V elements. Function constant 506 (vec_unaligned): q, K, V or tmp is not
// aligned to a vector (16 bytes for tmp); every access to them is then
// scalar (same values).
//
// Serving extension (FlashAttnVecSeqParams in flashmetal_kernels.h). With
// function constant 501 (vec_seq) row r = b * H + h reads kv head
// g = h / (H / Hkv) of sequence b through the strides at buffer 5, and the
// grid's y times HG is the row count (n_heads is H then). 502 (vec_kv_lens): sequence
// b holds seqlens_k[b] keys (buffer 6) instead of kv_seq_len; 0 sees nothing.
// 503 (vec_paged): key p lives in page block_table[b * max_pages + p /
// page_size] (buffer 7). When page_size is a multiple of 16 a chunk of 32
// keys spans at most two pages: the table is read once per half chunk, and
// only for halves that start before kv_len_b (entries past it are never
// checked by the host and never read here); chunks start at multiples of 32,
// so each half lies in one page. Any other page size (1, 4, 24...): every
// visible key reads its own entry (vec_key_offset). The window and the attention chunk apply
// per sequence. 507 (vec_alibi, with 501): row r's ALiBi slope is buffer 8's
// float b * H + h; key p scores -slope * |t - p| more, after the softcap.
// Short queries (FlashAttnVecSeqParams.q_rows = L > 1): each sequence has L
// query rows, row i at t = kv_len_b - L + i, each with its own visible keys
// (window_right hides p > t + window_right: causal is 0). The grid's y runs
// over rows ordered (b, kv head, i, head within the group) so the HG SIMD
// groups of a threadgroup (HG divides L * H / Hkv) share one kv head's K/V
// reads across query rows as well as heads; the threadgroup walks the union
// of its rows' keys, each SIMD group scoring and accumulating only its own.
// The workgroups split that union, so when HG covers all L * H / Hkv rows
// of a kv head (L * H / Hkv <= vec_group_rows) K/V are read once per kv head
// and the split is the cpu kernel's (the union of the sequence's rows).
// q, tmp and out rows are (b * L + i) * H + h, or with head_major (b * H +
// h) * L + i (torch's [B, H, L, D]); the grid's order is the same either way.
//
// Head dims that are not a multiple of 32 * VW (80, 96): lane l owns
// vector i only if l + 32 i < D / VW.
//
// The kernels are instantiated for tile widths D; a head dim DR < D (any
// DR <= 512: FlashAttnVecParams.head_dim, FlashAttnVecReduceParams.head_dim)
// runs the next tile up. Elements at or past DR load as zeros and are never
// stored; q and the plain K rows are DR elements apart. V has a head dim DV
// of its own (FlashAttnVecParams.head_dim_v, <= D; the reduce's head_dim is
// DV): V loads stop at DV, and tmp's partials and the plain V rows are DV
// elements apart. A DR off the
// vector width makes the host set 506 (its rows are off vector boundaries);
// a lane's vector that straddles DR moves element by element.
//
// Reduce, grid (rows, 1, 1), 32 * NWG threads, each thread 4 dims of the
// row (float4 reads of tmp; scalar with 506): rescales partial w by
// exp(M_w - M) (0 for a workgroup with S_w = 0, whose O is never read),
// normalises by the combined S (S == 0: a row that sees no key outputs
// zeros). The fused variant then applies the inverse normalised
// Walsh-Hadamard transform y = H_D x / sqrt(D) (Sylvester, natural order) in
// threadgroup memory and flips the signs given by the bitmask at buffer 4
// when function constant 500 (has_signs) is true. Buffers: 0
// FlashAttnVecReduceParams, 1 tmp, 2 out (f32), 3 nwg (uint), 4 signs; with
// 509 (vec_out_f16) or 510 (vec_out_bf16) the output goes instead to buffer
// 8 (half) or 9 (bfloat), each value the float32 result rounded to nearest even.
// The fused variant's buffers 5-7 (constants 504, 505 false) only keep the
// buffer positions of 8 and 9.
// The plain reduce's serving extension: sinks (504, buffer 5, float32 [H])
// join the combined denominator once, as a logit without a value; lse (505,
// buffer 6) receives M + log(S [+ e^{sink - M}]) in natural units, -inf for
// a row that sees nothing and has no sink; FlashAttnVecReduceExtParams at
// buffer 7 give H (row r has head r % H). Its buffer 4 is never bound (the
// dispatcher sets 500 false): it only keeps the buffer positions.
#include "dialect.h"
#include "flashmetal_kernels.h"
using namespace metal;
#include "simd_scatter.h"

FUNCTION_CONSTANT(bool, vec_has_signs, 500)
FUNCTION_CONSTANT(bool, vec_seq, 501)
FUNCTION_CONSTANT(bool, vec_kv_lens, 502)
FUNCTION_CONSTANT(bool, vec_paged, 503)
FUNCTION_CONSTANT(bool, vec_sinks, 504)
FUNCTION_CONSTANT(bool, vec_lse, 505)
FUNCTION_CONSTANT(bool, vec_unaligned, 506)
FUNCTION_CONSTANT(bool, vec_alibi, 507)
FUNCTION_CONSTANT(bool, vec_q_io, 508)
FUNCTION_CONSTANT(bool, vec_out_f16, 509)
FUNCTION_CONSTANT(bool, vec_out_bf16, 510)
FUNCTION_CONSTANT_EXPR(bool, vec_reduce_ext, vec_sinks || vec_lse)
FUNCTION_CONSTANT_EXPR(bool, vec_q_f32, !vec_q_io)
FUNCTION_CONSTANT_EXPR(bool, vec_out_f32, !vec_out_f16 && !vec_out_bf16)

#define VEC_LN2 0.693147180559945309f

// Elements of one lane's K/V load (a half4 is 8 bytes): 4, or 2 where that
// keeps every lane busy (D = 64: 32 lanes x 2; D = 192: 3 x 2 per lane).
template <int D>
constexpr int vec_width() {
    return D % 128 == 0 ? 4 : (D % 64 == 0 ? 2 : 4);
}

// Query rows (SIMD groups) one threadgroup serves at most: 32 up to D = 128,
// 16 up to 256, 8 beyond (FM_VEC_GROUP_ROWS_*: a lane's registers grow with D).
template <int D>
constexpr int vec_group_rows() {
    return D <= 128 ? FM_VEC_GROUP_ROWS_D128 : (D <= 256 ? FM_VEC_GROUP_ROWS_D256 : FM_VEC_GROUP_ROWS_WIDE);
}

// Key rows staged in threadgroup memory at a time when a threadgroup serves
// several query heads: the largest power of two <= 32 such that two stages
// of rows (double buffering) fit in 16 KiB (VecDispatcher.stageRows).
template <typename KV, int D>
constexpr int vec_stage_rows() {
    return 8192 / (D * int(sizeof(KV))) >= 32   ? 32
           : 8192 / (D * int(sizeof(KV))) >= 16 ? 16
           : 8192 / (D * int(sizeof(KV))) >= 8  ? 8
                                                : 4;
}

// VW consecutive elements at p as floats: one vector load, or VW scalar
// loads when the host found a buffer off a vector boundary (506). Both give
// the same values.
template <int VW>
inline void vec_load(thread float *f, const device float *p) {
    if (vec_unaligned) {
        for (int t = 0; t < VW; t++) f[t] = p[t];
    } else if (VW == 4) {
        const float4 x = *reinterpret_cast<const device float4 *>(p);
        for (int t = 0; t < 4; t++) f[t] = x[t];
    } else {
        const float2 x = *reinterpret_cast<const device float2 *>(p);
        for (int t = 0; t < 2; t++) f[t] = x[t];
    }
}

template <int VW>
inline void vec_load(thread float *f, const device half *p) {
    if (vec_unaligned) {
        for (int t = 0; t < VW; t++) f[t] = float(p[t]);
    } else if (VW == 4) {
        const half4 x = *reinterpret_cast<const device half4 *>(p);
        for (int t = 0; t < 4; t++) f[t] = float(x[t]);
    } else {
        const half2 x = *reinterpret_cast<const device half2 *>(p);
        for (int t = 0; t < 2; t++) f[t] = float(x[t]);
    }
}

// bfloat widens to float exactly by placing its 16 bits on top. The vector
// is read as one 64-bit (32-bit) word and split by shifts: element t holds
// bits 16 t .. 16 t + 15 (little-endian, as on every Apple GPU and the
// simulator's hosts).
template <int VW>
inline void vec_load(thread float *f, const device bfloat *p) {
    if (vec_unaligned) {
        for (int t = 0; t < VW; t++) f[t] = float(p[t]);
    } else if (VW == 4) {
        const ulong x = *reinterpret_cast<const device ulong *>(p);
        for (int t = 0; t < 4; t++) f[t] = as_type<float>(uint(x >> (16 * t)) << 16);
    } else {
        const uint x = *reinterpret_cast<const device uint *>(p);
        f[0] = as_type<float>(x << 16);
        f[1] = as_type<float>(x & 0xffff0000u);
    }
}

// VW floats from f to p: one vector store, or VW scalar ones (506).
template <int VW>
inline void vec_store(device float *p, thread const float *f) {
    if (vec_unaligned) {
        for (int t = 0; t < VW; t++) p[t] = f[t];
    } else if (VW == 4) {
        float4 x = float4(0.0f);
        for (int t = 0; t < 4; t++) x[t] = f[t];
        *reinterpret_cast<device float4 *>(p) = x;
    } else {
        float2 x = float2(0.0f);
        for (int t = 0; t < 2; t++) x[t] = f[t];
        *reinterpret_cast<device float2 *>(p) = x;
    }
}

// VW elements from device to threadgroup memory unchanged: one vector move,
// or VW scalar ones (506).
template <int VW>
inline void vec_copy(threadgroup float *d, const device float *p) {
    if (vec_unaligned) {
        for (int t = 0; t < VW; t++) d[t] = p[t];
    } else if (VW == 4) {
        *reinterpret_cast<threadgroup float4 *>(d) = *reinterpret_cast<const device float4 *>(p);
    } else {
        *reinterpret_cast<threadgroup float2 *>(d) = *reinterpret_cast<const device float2 *>(p);
    }
}

template <int VW>
inline void vec_copy(threadgroup half *d, const device half *p) {
    if (vec_unaligned) {
        for (int t = 0; t < VW; t++) d[t] = p[t];
    } else if (VW == 4) {
        *reinterpret_cast<threadgroup half4 *>(d) = *reinterpret_cast<const device half4 *>(p);
    } else {
        *reinterpret_cast<threadgroup half2 *>(d) = *reinterpret_cast<const device half2 *>(p);
    }
}

// bfloat moves as raw 64-bit (32-bit) words.
template <int VW>
inline void vec_copy(threadgroup bfloat *d, const device bfloat *p) {
    if (vec_unaligned) {
        for (int t = 0; t < VW; t++) d[t] = p[t];
    } else if (VW == 4) {
        *reinterpret_cast<threadgroup ulong *>(d) = *reinterpret_cast<const device ulong *>(p);
    } else {
        *reinterpret_cast<threadgroup uint *>(d) = *reinterpret_cast<const device uint *>(p);
    }
}

// Lane `lane`'s i-th vector (elements VW * (lane + 32 i) ...) exists: always
// when D is a multiple of 32 * VW.
template <int D>
inline bool vec_lane_vec(uint lane, int i) {
    constexpr int VW = vec_width<D>();
    return D % (32 * VW) == 0 || int(lane) + 32 * i < D / VW;
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

// Element offset of row j of chunk c (key c + j): from its half chunk's
// row offset `off` when a half chunk lies in one page (or K/V are not
// paged), else through the key's own block-table entry.
inline long vec_key_offset(thread const long *off, long c, int j, long b, long g,
                           constant FlashAttnVecSeqParams *sp, const device int *block_table, thread const long *s) {
    if (vec_paged && sp->page_size % 16u != 0u) {
        const long ps = long(sp->page_size), p = c + long(j);
        return long(block_table[b * long(sp->max_pages) + p / ps]) * s[0] + g * s[1] + (p % ps) * s[2];
    }
    return off[j >> 4] + long(j & 15) * s[2];
}

// This lane's elements of one K or V row (row points at its element 0) of
// DR elements, from device memory: one vector load per lane vector, 0 past DR.
template <typename KV, int D>
inline void vec_row_device(thread float *x, const device KV *row, uint lane, int DR) {
    constexpr int VW = vec_width<D>();
    constexpr int NV = (D / VW + 31) / 32;
    for (int i = 0; i < NV; i++) {
        const int e0 = VW * (int(lane) + 32 * i);
        if (vec_lane_vec<D>(lane, i) && e0 + VW <= DR) {
            vec_load<VW>(x + VW * i, row + e0);
        } else {
            for (int t = 0; t < VW; t++) x[VW * i + t] = vec_lane_vec<D>(lane, i) && e0 + t < DR ? float(row[e0 + t]) : 0.0f;
        }
    }
}

// The same elements of a row staged in threadgroup memory (converted to
// float as they are read: the values vec_row_device gives).
template <typename KV, int D>
inline void vec_row_staged(thread float *x, const threadgroup KV *row, uint lane, int DR) {
    constexpr int VW = vec_width<D>();
    constexpr int NV = (D / VW + 31) / 32;
    for (int i = 0; i < NV; i++) {
        for (int t = 0; t < VW; t++) {
            const int e = VW * (int(lane) + 32 * i) + t;
            x[VW * i + t] = vec_lane_vec<D>(lane, i) && e < DR ? float(row[e]) : 0.0f;
        }
    }
}

// Stages rows j in [j0, j1) (chunk-relative, j0 >= s0) of chunk c's K or V
// into stage[(j - s0) * D ...] unchanged, all threads of the group copying
// vectors (base: the tensor; off, b, g, st: vec_key_offset's arguments);
// only the first DR elements of a row (the rest is never read).
template <typename KV, int D>
inline void vec_stage(threadgroup KV *stage, const device KV *base, thread const long *off, long c, long b, long g,
                      thread const long *st, constant FlashAttnVecSeqParams *sp, const device int *block_table, int s0,
                      int j0, int j1, int DR, uint tid, uint nthreads) {
    constexpr int VW = vec_width<D>();
    constexpr int NVR = D / VW;  // vectors per row of the tile width
    if (DR == D) {               // the row's width is the tile's: constant divisors
        const int n = (j1 - j0) * NVR;
        for (int idx = int(tid); idx < n; idx += int(nthreads)) {
            const int j = j0 + idx / NVR;
            const int e = (idx % NVR) * VW;
            vec_copy<VW>(stage + (j - s0) * D + e, base + vec_key_offset(off, c, j, b, g, sp, block_table, st) + e);
        }
        return;
    }
    const int nvr = (DR + VW - 1) / VW;  // vectors per row, the last maybe partial
    const int n = (j1 - j0) * nvr;
    for (int idx = int(tid); idx < n; idx += int(nthreads)) {
        const int j = j0 + idx / nvr;
        const int e = (idx % nvr) * VW;
        threadgroup KV *to = stage + (j - s0) * D + e;
        const device KV *from = base + vec_key_offset(off, c, j, b, g, sp, block_table, st) + e;
        if (e + VW <= DR) {
            vec_copy<VW>(to, from);
        } else {
            for (int t = 0; t < VW; t++) {  // a fixed count: element moves, never a block copy
                if (e + t < DR) to[t] = from[t];
            }
        }
    }
}

// The keys [*lo, *hi) (empty when *hi <= *lo) that the query at position t
// of a sequence of kv_len keys from its first key `first` sees: the sliding
// window w (mask_type 2) keeps p > t - w; the attention chunk keys in
// [s, s + c), s = first + (t - first) / c * c, none when t < first; window_right keys
// p <= t + window_right; never a key at or past kv_len.
inline void vec_visible(uint mask_type, uint window, constant FlashAttnVecSeqParams *sp, long first, long kv_len,
                        long t, thread long *lo, thread long *hi) {
    long l = first, h = kv_len;
    if (mask_type == 2u) l = max(t + 1 - long(window), l);
    if (vec_seq && sp->attention_chunk > 0u) {
        const long c = long(sp->attention_chunk);
        if (t >= first) {
            const long start = first + (t - first) / c * c;
            l = max(l, start);
            h = min(h, start + c);  // the chunk ends there too (keys right of t)
        } else {
            h = min(h, first);  // empty, below every later row's keys: the union stays exact
        }
    }
    if (vec_seq && sp->window_right >= 0) h = min(h, t + 1 + long(sp->window_right));
    *lo = l;
    *hi = h;
}

template <typename KV, int D>
[[max_total_threads_per_threadgroup(32 * vec_group_rows<D>())]]
kernel void flash_attn_vec(
    constant FlashAttnVecParams &p [[buffer(0)]],
    const device float *q [[buffer(1), function_constant(vec_q_f32)]],
    const device KV *k [[buffer(2)]],
    const device KV *v [[buffer(3)]],
    device float *tmp [[buffer(4)]],
    constant FlashAttnVecSeqParams *sp [[buffer(5), function_constant(vec_seq)]],
    const device int *seqlens_k [[buffer(6), function_constant(vec_kv_lens)]],
    const device int *block_table [[buffer(7), function_constant(vec_paged)]],
    const device float *alibi [[buffer(8), function_constant(vec_alibi)]],
    const device KV *q_io [[buffer(9), function_constant(vec_q_io)]],
    TG_BUFFER(float, tgm, 0),  // probabilities [HG][32], then two stages of rows (HG > 1)
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint3 ngroups BUILTIN(threadgroups_per_grid),
    uint3 tpg BUILTIN(threads_per_threadgroup),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint sg BUILTIN(simdgroup_index_in_threadgroup),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    constexpr int VW = vec_width<D>();
    constexpr int NV = (D / VW + 31) / 32;  // vectors per lane (the last maybe absent)
    constexpr int NE = NV * VW;             // elements per lane
    constexpr int RS = vec_stage_rows<KV, D>();
    static_assert(FM_VEC_CHUNK == 32, "one key of a chunk per lane");
    static_assert(D % VW == 0 && 32 % RS == 0, "whole vectors and whole stages");

    // HG query rows of one kv head share the threadgroup, one SIMD group each.
    const int hg = int(tpg.x) / 32;
    const long vrow = long(tgid.y) * hg + long(sg);  // (b, g, i, head in group) order
    const long wg = tgid.z;
    const long nrows = vec_seq ? long(ngroups.y) * hg : long(p.n_heads);
    const long nwg = p.nwg;
    const long gqa = long(p.n_heads) / long(p.n_kv_heads);
    // Query rows per sequence (short queries), and the row of q, tmp and out.
    const long qrows = vec_seq && sp->q_rows > 1u ? long(sp->q_rows) : 1L;
    long row = vrow;
    long qi = 0;  // this row's index within its sequence's query rows
    // (sequence, kv head) of the row and the (sequence or page, kv head, row)
    // strides of K and V. Without vec_seq the call is one sequence of B * Hkv kv heads.
    long b = 0;
    long g = row / gqa;
    long h = row % long(p.n_heads);  // this row's query head
    const int DR = int(p.head_dim);     // q's and k's head dim, <= D
    const int DV = int(p.head_dim_v);   // v's and the output's, <= D
    long ks[3] = {0, long(p.kv_capacity) * DR, DR};
    long vs[3] = {0, long(p.kv_capacity) * DV, DV};
    if (vec_seq) {
        const long bg = vrow / (gqa * qrows);  // b * Hkv + g
        qi = (vrow / gqa) % qrows;
        b = bg / long(p.n_kv_heads);
        g = bg % long(p.n_kv_heads);
        h = g * gqa + vrow % gqa;
        row = sp->head_major != 0u ? (b * long(p.n_heads) + h) * qrows + qi : (b * qrows + qi) * long(p.n_heads) + h;
        for (int i = 0; i < 3; i++) {
            ks[i] = sp->K_strides[i];
            vs[i] = sp->V_strides[i];
        }
    }
    const long kv_len = vec_kv_lens ? long(seqlens_k[b]) : long(p.kv_seq_len);
    // An argument whose constant is false is not there: never read, only null.
    constant FlashAttnVecSeqParams *seq = vec_seq ? sp : nullptr;
    const device int *table = vec_paged ? block_table : nullptr;
    threadgroup float *probs = tgm + 32 * int(sg);  // this head's chunk probabilities
    // Two stages of RS rows of K or V (HG > 1), used in turn: the barrier
    // after writing one also orders every read of the other before its next write.
    threadgroup KV *stages = reinterpret_cast<threadgroup KV *>(tgm + 32 * hg);
    int nstage = 0;

    float qv[NE];  // this lane's elements of q: VW * (lane + 32 i) + t
    if (vec_q_io) vec_row_device<KV, D>(qv, q_io + row * DR, lane, DR);  // the K/V dtype: exact in float32
    if (vec_q_f32) vec_row_device<float, D>(qv, q + row * DR, lane, DR);
    const float scale = p.scale, softcap = p.softcap;
    const float slope = vec_alibi ? alibi[b * long(p.n_heads) + h] : 0.0f;

    // Visible keys of this row: [lo, hi), from the sequence's first key f
    // (cache_leftpad, after the lengths in seqlens_k). The threadgroup walks
    // the union [ulo, uhi) of its rows' ranges (its first and last rows'
    // bounds: both grow with the query position), so its barriers are uniform.
    const long first = vec_seq && vec_kv_lens && sp->key_starts_at > 0
        ? long(seqlens_k[long(sp->key_starts_at) + b]) : 0L;
    const long t = kv_len - qrows + qi;  // the query's position
    long lo = 0, hi = 0;
    vec_visible(p.mask_type, p.sliding_window, seq, first, kv_len, t, &lo, &hi);
    long ulo = lo, uhi = hi;
    if (qrows > 1 && hg > 1) {
        const long v0 = long(tgid.y) * hg;
        const long t0 = kv_len - qrows + (v0 / gqa) % qrows;
        const long t1 = kv_len - qrows + ((v0 + hg - 1) / gqa) % qrows;
        long ignore = 0;
        vec_visible(p.mask_type, p.sliding_window, seq, first, kv_len, t0, &ulo, &ignore);
        vec_visible(p.mask_type, p.sliding_window, seq, first, kv_len, t1, &ignore, &uhi);
    }

    float o[NE];
    for (int e = 0; e < NE; e++) o[e] = 0.0f;
    float m = FM_RUNNING_MAX_START;  // log2 domain
    float s_sum = 0.0f;

    // This workgroup's contiguous run of chunks (FM_VEC_CHUNK in flashmetal_kernels.h).
    // Every SIMD group of the threadgroup walks the same keys, the union
    // [ulo, uhi) of its rows' visible keys (one sequence and kv head; the
    // rows' own ranges filter the scores), so the barriers below are uniform.
    const long c0 = ulo / FM_VEC_CHUNK;
    const long chunks = uhi > ulo ? (uhi + FM_VEC_CHUNK - 1) / FM_VEC_CHUNK - c0 : 0;
    const long busy = min(chunks, nwg);
    const long c_begin = wg < busy ? (c0 + chunks * wg / busy) * FM_VEC_CHUNK : 0;
    const long c_end = wg < busy ? (c0 + chunks * (wg + 1) / busy) * FM_VEC_CHUNK : 0;
    for (long c = c_begin; c < c_end; c += FM_VEC_CHUNK) {
        // Row offsets of the chunk's two half chunks (uniform over the threadgroup).
        long koff[2] = {0, 0};
        long voff[2] = {0, 0};
        for (int hf = 0; hf < 2; hf++) {
            if (c + 16 * hf >= uhi) continue;
            koff[hf] = vec_half_offset(c, hf, b, g, seq, table, ks);
            voff[hf] = vec_half_offset(c, hf, b, g, seq, table, vs);
        }
        // Keys of the chunk the threadgroup reads: [j0, j1); this row sees [r0, r1).
        const int j0 = int(max(ulo - c, 0L));
        const int j1 = int(min(long(FM_VEC_CHUNK), uhi - c));
        const int r0 = int(min(max(lo - c, 0L), long(FM_VEC_CHUNK)));
        const int r1 = int(min(max(hi - c, 0L), long(FM_VEC_CHUNK)));
        float part[FM_VEC_CHUNK];
        for (int j = 0; j < FM_VEC_CHUNK; j++) part[j] = 0.0f;
        float x[NE];
        if (hg == 1) {
            for (int j = 0; j < FM_VEC_CHUNK; j++) {  // constant bounds: part stays in registers
                if (j < j0 || j >= j1) continue;         // uniform over the SIMD group
                vec_row_device<KV, D>(x, k + vec_key_offset(koff, c, j, b, g, seq, table, ks), lane, DR);
                for (int e = 0; e < NE; e++) part[j] = fma(qv[e], x[e], part[j]);
            }
        } else {
            // K read once for the HG heads: staged RS rows at a time.
            for (int s0 = 0; s0 < FM_VEC_CHUNK; s0 += RS) {
                const int a = max(j0, s0), z = min(j1, s0 + RS);
                if (a >= z) continue;
                threadgroup KV *stage = stages + (nstage++ & 1) * (RS * D);
                vec_stage<KV, D>(stage, k, koff, c, b, g, ks, seq, table, s0, a, z, DR, tid, tpg.x);
                threadgroup_barrier(mem_flags::mem_threadgroup);
                for (int r = 0; r < RS; r++) {
                    const int j = s0 + r;
                    if (j < a || j >= z || j < r0 || j >= r1) continue;  // uniform per SIMD group
                    vec_row_staged<KV, D>(x, stage + r * D, lane, DR);
                    for (int e = 0; e < NE; e++) part[j] = fma(qv[e], x[e], part[j]);
                }
            }
        }
        const float dot = simd_reduce_scatter32(part, lane);  // lane j: q.k of key c + j
        const long pos = c + long(lane);
        float s = -INFINITY;
        if (pos < hi && pos >= lo) {
            s = scale * dot;
            if (softcap > 0.0f) s = softcap * precise::tanh(s / softcap);
            if (vec_alibi) s -= slope * float(t >= pos ? t - pos : pos - t);
            s *= FM_LOG2E;
        }
        const float m_new = max(m, simd_max(s));
        const float factor = exp2(m - m_new);
        const float pr = exp2(s - m_new);
        s_sum = s_sum * factor + simd_sum(pr);
        m = m_new;

        probs[lane] = pr;
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (int e = 0; e < NE; e++) o[e] *= factor;
        if (hg == 1) {
            for (int j = j0; j < j1; j++) {
                const float pj = probs[j];
                vec_row_device<KV, D>(x, v + vec_key_offset(voff, c, j, b, g, seq, table, vs), lane, DV);
                for (int e = 0; e < NE; e++) o[e] = fma(pj, x[e], o[e]);
            }
        } else {
            for (int s0 = 0; s0 < FM_VEC_CHUNK; s0 += RS) {
                const int a = max(j0, s0), z = min(j1, s0 + RS);
                if (a >= z) continue;
                threadgroup KV *stage = stages + (nstage++ & 1) * (RS * D);
                vec_stage<KV, D>(stage, v, voff, c, b, g, vs, seq, table, s0, a, z, DV, tid, tpg.x);
                threadgroup_barrier(mem_flags::mem_threadgroup);
                for (int j = max(a, r0); j < min(z, r1); j++) {
                    const float pj = probs[j];
                    vec_row_staged<KV, D>(x, stage + (j - s0) * D, lane, DV);
                    for (int e = 0; e < NE; e++) o[e] = fma(pj, x[e], o[e]);
                }
            }
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);  // probs is rewritten next chunk
    }

    device float *o_part = tmp + (row * nwg + wg) * DV;
    for (int i = 0; i < NV; i++) {
        const int e0 = VW * (int(lane) + 32 * i);
        if (!vec_lane_vec<D>(lane, i) || e0 >= DV) continue;
        if (e0 + VW <= DV) {
            vec_store<VW>(o_part + e0, o + VW * i);
        } else {
            for (int t = 0; t < VW; t++) {
                if (e0 + t < DV) o_part[e0 + t] = o[VW * i + t];
            }
        }
    }
    if (lane == 0) {
        const float sm[2] = {s_sum, m * VEC_LN2};  // M in natural-log units, like the cpu kernel
        vec_store<2>(tmp + nrows * nwg * DV + (row * nwg + wg) * 2, sm);
    }
}

// Simdgroup 0 combines the (S, M) pairs of a row: weights[w] = exp(M_w - M)
// and weights[32] = 1 / S (0 when S == 0: a row that sees no key outputs
// zeros). With a sink logit (natural units; NaN = none) it joins M and S once
// without a value; with `lse` lane 0 writes M + log(S) (-inf when S == 0).
// Called by every thread; ends with the barrier that publishes the weights.
inline void vec_reduce_weights(const device float *tmp, long nrows, long row, uint nwg, int DR, uint sg, uint lane,
                               threadgroup float *weights, bool has_sink, float sink, device float *lse) {
    if (sg == 0) {  // uniform per SIMD group: all 32 lanes reach the collectives
        const device float *sm = tmp + nrows * long(nwg) * DR + row * long(nwg) * 2;
        const bool has = lane < nwg;
        float sw[2] = {0.0f, FM_RUNNING_MAX_START};  // (S, M) of workgroup `lane`
        if (has) vec_load<2>(sw, sm + 2 * lane);
        const float s_w = sw[0], m_w = sw[1];
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

// Output dims d .. d + 3 of a row of DR dims: the weighted sum of the
// partials, normalised, read as float4s (each dim's own fma chain, as one
// dim at a time would give); dims at or past DR read as zeros, and a DR off
// a multiple of 4 reads element by element (its rows are off float4
// boundaries). Partials of weight 0 are skipped (a workgroup without keys
// leaves its O unspecified, flashmetal_kernels.h); for a finite partial
// fma(x, 0, y) == y, so skipping changes no bits.
inline void vec_reduce_dims(thread float *y, const device float *tmp, long row, uint nwg, int DR, uint d,
                            const threadgroup float *weights) {
    for (int t = 0; t < 4; t++) y[t] = 0.0f;
    for (uint w = 0; w < nwg; w++) {
        if (weights[w] == 0.0f) continue;
        float x[4];
        const device float *at = tmp + (row * long(nwg) + long(w)) * DR + d;
        if (DR % 4 == 0) {
            vec_load<4>(x, at);
        } else {
            for (int t = 0; t < 4; t++) x[t] = int(d) + t < DR ? at[t] : 0.0f;
        }
        for (int t = 0; t < 4; t++) y[t] = fma(x[t], weights[w], y[t]);
    }
    for (int t = 0; t < 4; t++) y[t] *= weights[32];
}

// The reduce's output: the one bound (its function constant true), the
// others null.
struct VecOut {
    device float *f32;
    device half *f16;
    device bfloat *bf16;
};

// Element `at` of the reduce's output, in its dtype: float32, or the float32
// result rounded to nearest even in float16 or bfloat16.
inline void vec_store_out(VecOut o, long at, float y) {
    if (vec_out_f16) {
        o.f16[at] = half(y);
    } else if (vec_out_bf16) {
        o.bf16[at] = bfloat(y);
    } else {
        o.f32[at] = y;
    }
}

template <int D>
kernel void flash_attn_vec_reduce(
    constant FlashAttnVecReduceParams &p [[buffer(0)]],
    const device float *tmp [[buffer(1)]],
    device float *out [[buffer(2), function_constant(vec_out_f32)]],
    constant uint &nwg [[buffer(3)]],
    const device uchar *unused_signs [[buffer(4), function_constant(vec_has_signs)]],
    const device float *sinks [[buffer(5), function_constant(vec_sinks)]],
    device float *lse [[buffer(6), function_constant(vec_lse)]],
    constant FlashAttnVecReduceExtParams *ext [[buffer(7), function_constant(vec_reduce_ext)]],
    device half *out_f16 [[buffer(8), function_constant(vec_out_f16)]],
    device bfloat *out_bf16 [[buffer(9), function_constant(vec_out_bf16)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup),
    uint sg BUILTIN(simdgroup_index_in_threadgroup),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    TG_ARRAY(float, weights, 33);
    const VecOut outs = {vec_out_f32 ? out : nullptr, vec_out_f16 ? out_f16 : nullptr,
                         vec_out_bf16 ? out_bf16 : nullptr};
    const long row = tgid.x;
    const float sink = vec_sinks ? sinks[(row / (ext->head_rows > 1u ? long(ext->head_rows) : 1L)) % long(ext->n_heads)] : 0.0f;
    device float *lse_out = nullptr;
    if (vec_lse) lse_out = lse;
    const int DR = int(p.head_dim);  // the true head dim, <= D
    vec_reduce_weights(tmp, long(p.nrows), row, nwg, DR, sg, lane, weights, vec_sinks, sink, lse_out);
    static_assert(D % 4 == 0, "whole float4s");
    for (uint d = 4 * tid; d < uint(DR); d += 4 * tpg.x) {
        float y[4];
        vec_reduce_dims(y, tmp, row, nwg, DR, d, weights);
        for (int t = 0; t < 4; t++) {
            if (int(d) + t < DR) vec_store_out(outs, row * DR + d + t, y[t]);
        }
    }
}

template <int D>
kernel void flash_attn_vec_reduce_tq_hb_undo(
    constant FlashAttnVecReduceParams &p [[buffer(0)]],
    const device float *tmp [[buffer(1)]],
    device float *out [[buffer(2), function_constant(vec_out_f32)]],
    constant uint &nwg [[buffer(3)]],
    const device uchar *signs [[buffer(4), function_constant(vec_has_signs)]],
    const device float *unused_sinks [[buffer(5), function_constant(vec_sinks)]],
    device float *unused_lse [[buffer(6), function_constant(vec_lse)]],
    constant FlashAttnVecReduceExtParams *unused_ext [[buffer(7), function_constant(vec_reduce_ext)]],
    device half *out_f16 [[buffer(8), function_constant(vec_out_f16)]],
    device bfloat *out_bf16 [[buffer(9), function_constant(vec_out_bf16)]],
    TG_BUFFER(float, yb, 0),
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup),
    uint3 tpg BUILTIN(threads_per_threadgroup),
    uint sg BUILTIN(simdgroup_index_in_threadgroup),
    uint lane BUILTIN(thread_index_in_simdgroup)) {
    static_assert((D & (D - 1)) == 0, "the Hadamard transform needs a power of two");
    static_assert(D * 4 + 33 * 4 <= 32768, "threadgroup memory over 32 KiB");
    TG_ARRAY(float, weights, 33);
    const VecOut outs = {vec_out_f32 ? out : nullptr, vec_out_f16 ? out_f16 : nullptr,
                         vec_out_bf16 ? out_bf16 : nullptr};
    const long row = tgid.x;
    const uint nthreads = tpg.x;
    threadgroup float *ys = yb;  // D floats (VecDispatcher binds D * 4 bytes)
    // The FWHT needs the whole power-of-two row: the host runs it only with head_dim == D.
    vec_reduce_weights(tmp, long(p.nrows), row, nwg, D, sg, lane, weights, false, 0.0f, nullptr);
    for (uint d = 4 * tid; d < uint(D); d += 4 * nthreads) {
        float y[4];
        vec_reduce_dims(y, tmp, row, nwg, D, d, weights);
        for (int t = 0; t < 4; t++) ys[d + t] = y[t];
    }

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
        vec_store_out(outs, row * D + d, neg ? -x : x);
    }
}

// The entry points: decode per (K/V dtype, head dim) and reduce per head dim of VecCapability in
// Sources/FlashMetalCore/Capabilities.swift; the FWHT undo only at its power-of-two head dims
// (fwhtHeadDims): the Hadamard transform needs one.
// BEGIN GENERATED INSTANTIATIONS: flash_attn_vec flash_attn_vec_reduce flash_attn_vec_reduce_tq_hb_undo
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("flash_attn_vec_dk64", flash_attn_vec, float, 64)
INSTANTIATE_KERNEL("flash_attn_vec_dk80", flash_attn_vec, float, 80)
INSTANTIATE_KERNEL("flash_attn_vec_dk96", flash_attn_vec, float, 96)
INSTANTIATE_KERNEL("flash_attn_vec_dk128", flash_attn_vec, float, 128)
INSTANTIATE_KERNEL("flash_attn_vec_dk192", flash_attn_vec, float, 192)
INSTANTIATE_KERNEL("flash_attn_vec_dk256", flash_attn_vec, float, 256)
INSTANTIATE_KERNEL("flash_attn_vec_dk512", flash_attn_vec, float, 512)
INSTANTIATE_KERNEL("flash_attn_vec_dk576", flash_attn_vec, float, 576)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk64", flash_attn_vec, half, 64)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk80", flash_attn_vec, half, 80)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk96", flash_attn_vec, half, 96)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk128", flash_attn_vec, half, 128)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk192", flash_attn_vec, half, 192)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk256", flash_attn_vec, half, 256)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk512", flash_attn_vec, half, 512)
INSTANTIATE_KERNEL("flash_attn_vec_f16kv_dk576", flash_attn_vec, half, 576)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk64", flash_attn_vec, bfloat, 64)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk80", flash_attn_vec, bfloat, 80)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk96", flash_attn_vec, bfloat, 96)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk128", flash_attn_vec, bfloat, 128)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk192", flash_attn_vec, bfloat, 192)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk256", flash_attn_vec, bfloat, 256)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk512", flash_attn_vec, bfloat, 512)
INSTANTIATE_KERNEL("flash_attn_vec_bf16kv_dk576", flash_attn_vec, bfloat, 576)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk64", flash_attn_vec_reduce, 64)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk80", flash_attn_vec_reduce, 80)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk96", flash_attn_vec_reduce, 96)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk128", flash_attn_vec_reduce, 128)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk192", flash_attn_vec_reduce, 192)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk256", flash_attn_vec_reduce, 256)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk512", flash_attn_vec_reduce, 512)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_dk576", flash_attn_vec_reduce, 576)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_tq_hb_undo_dk64", flash_attn_vec_reduce_tq_hb_undo, 64)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_tq_hb_undo_dk128", flash_attn_vec_reduce_tq_hb_undo, 128)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_tq_hb_undo_dk256", flash_attn_vec_reduce_tq_hb_undo, 256)
INSTANTIATE_KERNEL("flash_attn_vec_reduce_tq_hb_undo_dk512", flash_attn_vec_reduce_tq_hb_undo, 512)
// END GENERATED INSTANTIATIONS
