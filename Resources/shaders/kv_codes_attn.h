// kv_codes_attn.h — what the kernels over quantized caches share (MSL):
// the Hadamard butterflies in threadgroup memory, one packed code read, and
// the function constants of attention over codes (KVCodesDecodeParams of
// flashmetal_kernels.h), read by kv_codec.metal (encode, append),
// kv_codes_decode.metal (the split decode) and kv_codes_prefill.metal (the
// tiled prefill).
#ifndef FM_KV_CODES_ATTN_H
#define FM_KV_CODES_ATTN_H

// z[i], z[i + h] <- z[i] + z[i + h], z[i] - z[i + h] for every i with bit h
// clear: one stage of the unnormalised Hadamard transform of every block of
// `block` values among the d (a multiple of block; several rows side by side
// are transformed at once).
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

// Code i of a packed row of `bits`-bit codes (a code spans at most two bytes).
inline uint kvq_code_at(const device uchar *row, uint i, uint bits) {
    const uint bit = i * bits, byte = bit / 8, shift = bit % 8;
    uint w = uint(row[byte]);
    if (shift + bits > 8) w |= uint(row[byte + 1]) << 8;
    return (w >> shift) & ((1u << bits) - 1u);
}

// floor(a / b) for b > 0 (a row's position may be negative).
inline int kvq_floor_div(int a, int b) {
    const int q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

FUNCTION_CONSTANT(bool, kvq_lens, 800)
FUNCTION_CONSTANT(bool, kvq_paged, 801)
FUNCTION_CONSTANT(bool, kvq_sinks, 802)
FUNCTION_CONSTANT(bool, kvq_lse, 803)
FUNCTION_CONSTANT(bool, kvq_k_dense, 805)
FUNCTION_CONSTANT(bool, kvq_v_dense, 806)
FUNCTION_CONSTANT_EXPR(bool, kvq_k_codes, !kvq_k_dense)
FUNCTION_CONSTANT_EXPR(bool, kvq_v_codes, !kvq_v_dense)
FUNCTION_CONSTANT(bool, kvq_varlen_q, 809)
FUNCTION_CONSTANT(bool, kvq_varlen_k, 810)
FUNCTION_CONSTANT(bool, kvq_alibi, 812)

// The ALiBi term of a score: -slope * |pos - key| (pos the query row's
// position among the keys), after the softcap.
inline float kvq_alibi_bias(float slope, int pos, int key) {
    const long gap = long(pos) - long(key);
    return -slope * float(gap >= 0 ? gap : -gap);
}

// Keys [lo, hi) of one query row, hi >= lo.
struct KVQKeyRange {
    int lo, hi;
};

// The position of query row qi of rows_b among kl keys (bottom-right
// aligned).
inline int kvq_row_position(int kl, int rows_b, int qi) { return kl - rows_b + qi; }

// The keys query row qi of rows_b of sequence b sees among its kl keys (at
// kvq_row_position). In 64 bits: a window or chunk near INT_MAX must not
// wrap around the row's position.
inline KVQKeyRange kvq_key_range(constant KVCodesDecodeParams &p, int kl, int rows_b, int qi) {
    const int pos = kvq_row_position(kl, rows_b, qi);
    long lo = 0, hi = long(kl);
    if (p.causal != 0) hi = min(hi, long(pos) + 1);
    if (p.window_left >= 0) lo = max(lo, long(pos) - long(p.window_left));
    if (p.window_right >= 0) hi = min(hi, long(pos) + long(p.window_right) + 1);
    if (p.attention_chunk > 0) {
        const long c0 = long(kvq_floor_div(pos, p.attention_chunk)) * long(p.attention_chunk);
        lo = max(lo, c0);
        hi = min(hi, c0 + long(p.attention_chunk));
    }
    KVQKeyRange r;
    r.lo = int(lo);
    r.hi = int(max(lo, hi));
    return r;
}

// The storage row of key t of kv head g of sequence b: through the block
// table when paged; else row t of sequence b's cache, or, packed (varlen
// keys without pages: storage [1, total_k, Hkv], kv_strides[0] 0), row
// cu_k[b] + t.
inline long kvq_storage_row(constant KVCodesDecodeParams &p, const device int *block_table, const device int *cu_k,
                            uint b, uint g, int t) {
    long r = long(g) * p.kv_strides[1];
    if (kvq_paged) {
        const long page = long(block_table[long(b) * long(p.max_pages) + long(t / p.page_size)]);
        r += page * p.kv_strides[0] + long(t % p.page_size) * p.kv_strides[2];
    } else {
        const long first = kvq_varlen_k ? long(cu_k[b]) : 0;
        r += long(b) * p.kv_strides[0] + (first + long(t)) * p.kv_strides[2];
    }
    return r;
}

#endif // FM_KV_CODES_ATTN_H
