// flash_attn_prefill.metal — tiled flash attention with online softmax.
//
// One threadgroup computes BQ query rows of one (batch, head): WM simdgroups,
// each owning 8 rows, walk the key range in tiles of BK keys. Per tile:
//   S = Q K^T            (8x8 simdgroup MMAs over the head dim, f32)
//   s = log2(e) * (softcap(scale * S) - slope * |t - p| + mask) (the ALiBi
//       term only with has_alibi), floored at the running max's
//       start; masked (-inf / false), causal and past-kL cells -> -inf
//   online softmax in the exp2 domain (running max starts at -FLT_MAX/2, so
//   a -inf score gives exp2(-inf) = 0 and never NaN)
//   O = O * exp2(m_old - m_new) + P V
// and finally O / l, with l == 0 (a row that sees nothing) giving zeros.
//
// The floor: a cell that is not masked keeps weight however negative its
// bias (finfo(bfloat16).min, or one whose score overflows to -inf in the
// exp2 domain): its score is raised to -FLT_MAX/2, so a row whose every key
// carries such a bias returns their uniform average, as the float64
// reference and torch do. It is a compare-and-select, so NaN stays NaN.
//
// A key tile in which a row sees nothing leaves that row's m, l and O
// unchanged bit for bit (factor exp2(0) = 1, P = 0), which is why skipping
// such tiles (blk class 0: all -inf; tiles past the causal diagonal) is exact.
//
// One kernel, two bodies sharing the score cell (PrefillTiles picks by head
// dim). Tiles up to 256 keep the O accumulator in registers (TD 8x8 fragments
// per simdgroup, each simdgroup owning 8 query rows). At D = 512 one simdgroup
// per 8 rows would hold 128 accumulator floats per thread, and 32 rows of Q
// alone fill 32 KiB; its body ("wide", as llama.cpp's flash-attention kernel
// and mlx-native's D = 512 port split the work) has NSG simdgroups share a
// tile of BQ rows and BK = 8 * NSG keys: for S = Q K^T each simdgroup scores
// its own 8 keys against all BQ rows, K read straight from device memory
// against Q^T held once in threadgroup memory; the scores meet in a
// threadgroup S tile, where each simdgroup runs the online softmax of BQ /
// NSG rows; for O += P V each simdgroup owns BD / NSG head-dim columns of O
// in registers (BQ / 8 x BD / (8 NSG) fragments) and reads its V columns
// straight from device memory, each lane a run of 8 consecutive elements
// per row (wide_column). S and the row factors are double-buffered, so a
// key tile takes two barriers. K and V rows past the sequence's keys are
// never read: their lanes read its last key instead, whose score is masked
// (P = 0). bf16/f16, BQ 16, BK 64, NSG 8: Q^T 18 KiB + two S tiles and
// factors 8.6 KiB = 27,264 bytes; 32 accumulator floats per thread. MLA's
// q/k of 576 over v of 512 (BDV) runs the same body: S over 576 columns
// (Q^T 20.25 KiB, 29,568 bytes in all), O over 512.
// Float I/O (D <= 192) takes a 32-bit word per tile element, so its tiles
// are smaller at D 192 (PrefillCapability.f32Geometry); float D 256 and 512
// run flash_attn_prefill_split (below).
//
// Buffers (mlx-native's layout): 0 Q, 1 K, 2 V, 3 O, 4 AttnParams, 5 AttnMaskParams,
// 6 mask, 7 blk. Function constants 200 align_Q, 201 align_K, 300 has_mask,
// 301 do_causal, 303 has_blk, 312 tile_load_bytes (the tile loaders' device
// load width; see the comment on runs above read_run).
//
// The serving extension (flashmetal_kernels.h, AttnSeqParams; constants 302,
// 304-310; buffers 8-14): each threadgroup first reads its sequence's
// lengths (PrefillSeq: packed varlen rows, per-sequence key counts, paged
// K/V through the block table), then walks only the key tiles that hold a
// key some of its rows may see (prefill_key_range: causal and the window's
// right bound cap the last tile, the window's left bound lifts the first),
// so tiles wholly outside are never loaded; cells inside are checked one by
// one. Positions are bottom-right per sequence (t = kL_b - qL_b + i), or
// qL_off + i outside per-sequence mode. Sinks join the denominator once at
// the end, in the exp2 domain (prefill_finish_row), which also writes the
// natural-log LSE.
#include "dialect.h"
#include "flashmetal_kernels.h"
using namespace metal;

FUNCTION_CONSTANT(bool, align_Q, 200)
FUNCTION_CONSTANT(bool, align_K, 201)
FUNCTION_CONSTANT(bool, has_mask, 300)
FUNCTION_CONSTANT(bool, do_causal, 301)
FUNCTION_CONSTANT(bool, has_blk, 303)
FUNCTION_CONSTANT(int, tile_load_bytes, 312)
// The serving extension (flashmetal_kernels.h, AttnSeqParams).
FUNCTION_CONSTANT(bool, has_sinks, 302)
FUNCTION_CONSTANT(bool, prefill_seq, 304)
FUNCTION_CONSTANT(bool, has_window, 305)
FUNCTION_CONSTANT(bool, varlen_q, 306)
FUNCTION_CONSTANT(bool, varlen_k, 307)
FUNCTION_CONSTANT(bool, kv_lens, 308)
FUNCTION_CONSTANT(bool, paged_kv, 309)
FUNCTION_CONSTANT(bool, has_lse, 310)
FUNCTION_CONSTANT(bool, has_alibi, 311)
FUNCTION_CONSTANT_EXPR(bool, per_seq, varlen_q || varlen_k || kv_lens || paged_kv)

#define FA_UNROLL _Pragma("clang loop unroll(full)")

// An additive mask value in natural units. A bool mask (true = attend) is
// read as its bytes: any nonzero byte attends, as on the cpu; a `bool` load of
// a byte other than 0/1 (C ABI callers may pass one) is undefined.
inline float mask_bias(uchar attend) { return attend != 0 ? 0.0f : -INFINITY; }
inline float mask_bias(half m) { return float(m); }
inline float mask_bias(bfloat m) { return float(m); }
inline float mask_bias(float m) { return m; }

// The (row, column) of a lane's first element in an 8x8 simdgroup fragment;
// its second element is (row, column + 1).
inline void frag_coord(uint lane, thread short &row, thread short &col) {
    const short q = short(lane / 4);
    row = short((q & 4) + short((lane / 2) % 4));
    col = short((q & 2) * 2 + short(lane % 2) * 2);
}

// Threadgroup tiles hold their T elements two to a 32-bit word, the lower
// column in the low half; K is held transposed (row = head-dim column, a
// word = two consecutive keys): a fragment's two neighbouring elements are
// one threadgroup load, a copied pair one store. A float tile holds one
// element per word (the same layout with one element in place of a pair).
// The bits move unchanged, so the values are those of the T elements.
template <typename T> struct TileWords {
    static constexpr int per_word = 4 / int(sizeof(T));  // elements per 32-bit word
};
template <typename T> inline uint pack2(T a, T b) {
    return uint(as_type<ushort>(a)) | (uint(as_type<ushort>(b)) << 16);
}
template <typename T> inline float low_of(uint w) { return float(as_type<T>(ushort(w & 0xffffu))); }
template <typename T> inline float high_of(uint w) { return float(as_type<T>(ushort(w >> 16))); }

// Elements i and i + 1 (i even) of a tile row into a fragment's two elements.
template <typename T> inline void read_pair(thread simdgroup_float8x8 &f, const threadgroup uint *row, int i) {
    const uint w = row[i / 2];
    f.thread_elements()[0] = low_of<T>(w);
    f.thread_elements()[1] = high_of<T>(w);
}
template <> inline void read_pair<float>(thread simdgroup_float8x8 &f, const threadgroup uint *row, int i) {
    f.thread_elements()[0] = as_type<float>(row[i]);
    f.thread_elements()[1] = as_type<float>(row[i + 1]);
}

// Elements at[0], at[1] into elements c, c + 1 (c even) of a tile row: the
// first n of them (0, 1 or 2) read, the rest zeros (nothing past them is
// read: n < 2 at the end of a row of odd width or past a padded head dim).
template <typename T> inline void copy_pair(threadgroup uint *row, int c, const device T *at, int n) {
    row[c / 2] = n >= 2 ? pack2(at[0], at[1]) : n == 1 ? pack2(at[0], T(0.0f)) : 0u;
}
template <> inline void copy_pair<float>(threadgroup uint *row, int c, const device float *at, int n) {
    row[c] = n >= 1 ? as_type<uint>(at[0]) : 0u;
    row[c + 1] = n >= 2 ? as_type<uint>(at[1]) : 0u;
}

// How many of columns c, c + 1 lie in a row of D columns: 2, 1 or 0.
inline int pair_columns(int c, int D) { return D - c >= 2 ? 2 : D - c == 1 ? 1 : 0; }

// One word of each of keys 2kp (a) and 2kp + 1 (b), both holding the same
// column(s) from d, into a transposed tile (rows ldw words apart). Two-byte
// elements: a word holds columns d and d + 1 (the lower in its low half);
// rows d and d + 1 get word kp, the two keys' halves of one column each.
// Float: a word is column d; row d gets words 2kp and 2kp + 1.
template <typename T> inline void put_word_t(threadgroup uint *dst, int ldw, int d, int kp, uint a, uint b) {
    dst[d * ldw + kp] = (a & 0xffffu) | (b << 16);
    dst[(d + 1) * ldw + kp] = (a >> 16) | (b & 0xffff0000u);
}
template <> inline void put_word_t<float>(threadgroup uint *dst, int ldw, int d, int kp, uint a, uint b) {
    dst[d * ldw + 2 * kp] = a;
    dst[d * ldw + 2 * kp + 1] = b;
}

// Columns d, d + 1 of keys 2kp (ka: its column d) and 2kp + 1 (kb) into rows
// d and d + 1 of a transposed tile (rows ldw words apart), elements 2kp and
// 2kp + 1; of each key the first na (nb) columns of the two are read (0, 1
// or 2), the rest become zeros. Two-byte elements: each key's column pair is
// read as one word and the halves swapped.
template <typename T>
inline void copy_quad_t(threadgroup uint *dst, int ldw, int d, int kp, const device T *ka, const device T *kb, int na,
                        int nb) {
    const uint a = na >= 2 ? pack2(ka[0], ka[1]) : na == 1 ? pack2(ka[0], T(0.0f)) : 0u;
    const uint b = nb >= 2 ? pack2(kb[0], kb[1]) : nb == 1 ? pack2(kb[0], T(0.0f)) : 0u;
    put_word_t<T>(dst, ldw, d, kp, a, b);
}
template <>
inline void copy_quad_t<float>(threadgroup uint *dst, int ldw, int d, int kp, const device float *ka,
                               const device float *kb, int na, int nb) {
    put_word_t<float>(dst, ldw, d, kp, na >= 1 ? as_type<uint>(ka[0]) : 0u, nb >= 1 ? as_type<uint>(kb[0]) : 0u);
    put_word_t<float>(dst, ldw, d + 1, kp, na >= 2 ? as_type<uint>(ka[1]) : 0u, nb >= 2 ? as_type<uint>(kb[1]) : 0u);
}

// A[r][c] = tile[row0 + r][col0 + c], the tile's rows `ldw` words apart;
// col0 and this lane's fc are even, so its two elements share one word
// (two-byte T; a float tile's are neighbouring words).
template <typename T>
inline void load_frag(thread simdgroup_float8x8 &f, const threadgroup uint *src, int ldw, int row0, int col0,
                      short fr, short fc) {
    read_pair<T>(f, src + (row0 + fr) * ldw, col0 + fc);
}

// A[r][c] = K[key0 + c][col0 + r] from a transposed tile (row = head-dim
// column, `ldw` words apart, a word = keys 2i and 2i + 1): this lane's two
// keys key0 + fc and key0 + fc + 1 (fc even) share one word (two-byte T).
template <typename T>
inline void load_frag_t(thread simdgroup_float8x8 &f, const threadgroup uint *src, int ldw, int key0, int col0,
                        short fr, short fc) {
    read_pair<T>(f, src + (col0 + fr) * ldw, key0 + fc);
}

// Runs (tile_load_bytes 8 or 16): the host found the base of Q, K and V and
// every stride of theirs (page strides too) a multiple of that many bytes,
// and the true head dim a multiple of a run's elements, so every run a
// loader copies starts on a run boundary and lies wholly below D or wholly
// past it. Each thread then copies one run with one vector load (uint2 or
// uint4, V below) into as many tile words; with 4 the loaders copy column
// pairs (copy_pair, copy_quad_t). The bits move unchanged: a two-byte
// tile word holds two neighbouring columns, the lower in its low half, which
// is what a little-endian word load of them reads (pack2's word); a float
// tile word is one element. So both give the same tiles.

// The sizeof(V) bytes at `at` (a run boundary) as 32-bit words w[0...]:
// one device load; zeros when !valid (nothing is read).
template <typename V, typename T> inline void read_run(thread uint *w, const device T *at, bool valid) {
    constexpr int W = int(sizeof(V)) / 4;
    if (valid) {
        const V x = *reinterpret_cast<const device V *>(at);
        FA_UNROLL
        for (int j = 0; j < W; j++) w[j] = x[j];
    } else {
        FA_UNROLL
        for (int j = 0; j < W; j++) w[j] = 0u;
    }
}

// A run of V: its T elements and its 32-bit words (tile words too).
template <typename T, typename V> struct TileRun {
    static constexpr int elems = int(sizeof(V)) / int(sizeof(T));
    static constexpr int words = int(sizeof(V)) / 4;
};
// The host chose BYTES-byte runs and a row of BD columns is whole runs.
template <typename T, int BD, int BYTES> inline bool runs_fit() {
    return tile_load_bytes == BYTES && BD % (BYTES / int(sizeof(T))) == 0;
}

// A run's words w (columns c...) into tile row `row` (row-major, copy_pair's layout).
template <typename T, int W> inline void put_run(threadgroup uint *row, int c, thread const uint *w) {
    threadgroup uint *to = row + c / TileWords<T>::per_word;
    FA_UNROLL
    for (int j = 0; j < W; j++) to[j] = w[j];
}

// Runs a (key 2kp) and b (key 2kp + 1), columns d..., into a transposed tile.
template <typename T, int W>
inline void put_runs_t(threadgroup uint *dst, int ldw, int d, int kp, thread const uint *a, thread const uint *b) {
    FA_UNROLL
    for (int j = 0; j < W; j++) put_word_t<T>(dst, ldw, d + j * TileWords<T>::per_word, kp, a[j], b[j]);
}

// load_tile by runs of V: rows past `len` and runs past D read nothing and
// become zeros. Row and column indices are 32-bit.
template <typename T, typename V, int ROWS, int BD, int LDW, int THREADS>
inline void load_tile_runs(threadgroup uint *dst, const device T *src, long stride, long row0, long len,
                           bool aligned, int D, uint tid) {
    typedef TileRun<T, V> R;
    constexpr int RUNS = BD / R::elems;  // per row
    const device T *base = src + row0 * stride;
    const bool whole = aligned || row0 + ROWS <= len;
    const int rows = whole ? ROWS : len > row0 ? int(len - row0) : 0;
    const bool full = whole && D == BD;  // every run read: no checks
    for (int i = int(tid); i < ROWS * RUNS; i += THREADS) {
        const int r = i / RUNS;
        const int c = (i % RUNS) * R::elems;
        uint w[R::words];
        read_run<V>(w, base + long(r) * stride + c, full || (r < rows && c < D));
        put_run<T, R::words>(dst + r * LDW, c, w);
    }
}

// load_tile_t by runs of V: a thread takes two keys by one run of columns;
// consecutive threads take consecutive runs of the same keys.
template <typename T, typename V, int KEYS, int BD, int LDW, int THREADS>
inline void load_tile_t_runs(threadgroup uint *dst, const device T *src, long stride, long len, bool aligned, int D,
                             uint tid) {
    typedef TileRun<T, V> R;
    constexpr int RUNS = BD / R::elems;  // per key
    const int keys = aligned || len >= KEYS ? KEYS : len > 0 ? int(len) : 0;
    for (int i = int(tid); i < KEYS / 2 * RUNS; i += THREADS) {
        const int d = (i % RUNS) * R::elems;
        const int kp = i / RUNS;
        const device T *at = src + long(2 * kp) * stride + d;
        uint a[R::words], b[R::words];
        read_run<V>(a, at, 2 * kp < keys && d < D);
        read_run<V>(b, at + stride, 2 * kp + 1 < keys && d < D);
        put_runs_t<T, R::words>(dst, LDW, d, kp, a, b);
    }
}

// Copies rows [row0, row0 + ROWS) of a [len, D] slab (row stride `stride`)
// into threadgroup memory with row pitch LDW words (copy_pair's layout);
// rows past `len` and columns past D (D <= BD: a head dim padded to the
// kernel's tile width BD) become zeros. A thread copies a run
// (load_tile_runs) or a column pair. A tile wholly inside (`aligned`) and
// D == BD take the loop without checks. Column and row indices are 32-bit;
// only the row's offset in device memory is 64-bit.
template <typename T, int ROWS, int BD, int LDW, int THREADS>
inline void load_tile(threadgroup uint *dst, const device T *src, long stride, long row0, long len, bool aligned,
                      int D, uint tid) {
    static_assert(BD % 2 == 0, "rows are whole column pairs");
    if (runs_fit<T, BD, 16>()) {
        load_tile_runs<T, uint4, ROWS, BD, LDW, THREADS>(dst, src, stride, row0, len, aligned, D, tid);
        return;
    }
    if (runs_fit<T, BD, 8>()) {
        load_tile_runs<T, uint2, ROWS, BD, LDW, THREADS>(dst, src, stride, row0, len, aligned, D, tid);
        return;
    }
    constexpr int PAIRS = BD / 2;
    const device T *base = src + row0 * stride;
    if (D == BD && (aligned || row0 + ROWS <= len)) {
        for (int i = int(tid); i < ROWS * PAIRS; i += THREADS) {
            const int r = i / PAIRS;
            const int c = (i % PAIRS) * 2;
            copy_pair<T>(dst + r * LDW, c, base + long(r) * stride + c, 2);
        }
        return;
    }
    const int rows = aligned || row0 + ROWS <= len ? ROWS : len > row0 ? int(len - row0) : 0;
    for (int i = int(tid); i < ROWS * PAIRS; i += THREADS) {
        const int r = i / PAIRS;
        const int c = (i % PAIRS) * 2;
        copy_pair<T>(dst + r * LDW, c, base + long(r) * stride + c, r < rows ? pair_columns(c, D) : 0);
    }
}

// Copies keys [0, KEYS) of a [len, D] slab (row stride `stride`) into
// threadgroup memory transposed: row d (LDW words apart) holds column d
// (copy_quad_t's layout); keys past `len` and columns past D (D <= BD)
// become zeros. A thread takes two keys by one run (load_tile_t_runs) or
// by two columns; consecutive threads take consecutive column pairs of the
// same keys.
template <typename T, int KEYS, int BD, int LDW, int THREADS>
inline void load_tile_t(threadgroup uint *dst, const device T *src, long stride, long len, bool aligned, int D,
                        uint tid) {
    static_assert(KEYS % 2 == 0 && BD % 2 == 0, "keys and columns come in pairs");
    if (runs_fit<T, BD, 16>()) {
        load_tile_t_runs<T, uint4, KEYS, BD, LDW, THREADS>(dst, src, stride, len, aligned, D, tid);
        return;
    }
    if (runs_fit<T, BD, 8>()) {
        load_tile_t_runs<T, uint2, KEYS, BD, LDW, THREADS>(dst, src, stride, len, aligned, D, tid);
        return;
    }
    constexpr int CP = BD / 2;
    constexpr int ITEMS = KEYS / 2 * CP;
    const int keys = aligned || len >= KEYS ? KEYS : len > 0 ? int(len) : 0;
    for (int i = int(tid); i < ITEMS; i += THREADS) {
        const int d = (i % CP) * 2;
        const int kp = i / CP;
        const int n = D == BD ? 2 : pair_columns(d, D);
        const device T *at = src + long(2 * kp) * stride + d;
        copy_quad_t<T>(dst, LDW, d, kp, at, at + stride, 2 * kp < keys ? n : 0, 2 * kp + 1 < keys ? n : 0);
    }
}

// One threadgroup's sequence (flashmetal_kernels.h, serving extension). Outside
// per-sequence mode it is the whole AttnParams problem.
struct PrefillSeq {
    long q_start;  // first row of the sequence in Q, O and lse (varlen_q)
    long q_len;    // its rows
    long k_start;  // first key in K/V (varlen_k, not paged)
    long k_len;    // its keys
    long q_off;    // position of row 0
    int wl, wr;    // window bounds (keys t - wl <= p <= t + wr); -1 = unbounded
    int chunk;     // attention chunk c > 0: keys p with floor((p - f) / c) == floor((t - f) / c); 0 = off
    long first;    // its first visible key f (cache_leftpad), else 0
};

// The first position of the attention chunk of t: floor(t / c) * c (t < 0
// when a sequence has more rows than keys).
inline long chunk_start(long t, int c) {
    const long q = t >= 0 ? t / long(c) : -((-t + long(c) - 1) / long(c));
    return q * long(c);
}

// The tables the serving extension binds; each is read only under its constant.
struct PrefillSeqBuffers {
    constant AttnSeqParams *sp;
    const device int *cu_q;
    const device int *cu_k;
    const device int *seqlens_k;
    const device int *block_table;
    const device float *sinks;
    device float *lse;
    const device float *alibi;  // [B, H] slopes
};

inline PrefillSeq prefill_seq_of(constant AttnParams &p, thread const PrefillSeqBuffers &sb, long b) {
    PrefillSeq s;
    s.q_start = varlen_q ? long(sb.cu_q[b]) : 0;
    s.q_len = varlen_q ? long(sb.cu_q[b + 1]) - s.q_start : long(p.qL);
    s.k_start = varlen_k ? long(sb.cu_k[b]) : 0;
    s.k_len = kv_lens ? long(sb.seqlens_k[b]) : varlen_k ? long(sb.cu_k[b + 1]) - s.k_start : long(p.kL);
    s.q_off = per_seq ? s.k_len - s.q_len : long(p.qL_off);
    s.wl = has_window ? sb.sp->window_left : -1;
    s.wr = has_window ? sb.sp->window_right : -1;
    s.chunk = has_window ? sb.sp->attention_chunk : 0;
    s.first = kv_lens && sb.sp->key_starts_at > 0 ? long(sb.seqlens_k[long(sb.sp->key_starts_at) + b]) : 0;
    return s;
}

// Key tiles [lo, hi) a threadgroup of rows [r0, r1) visits: outside it no
// row sees a key (p < k_len; causal p <= t; window t - wl <= p <= t + wr;
// the chunk of t, whose bounds never decrease as t grows), so skipping those
// tiles is exact (see the header). lo == hi: none.
template <int BK>
inline void prefill_key_range(thread const PrefillSeq &s, long r0, long r1, thread int &lo, thread int &hi) {
    const long t0 = s.q_off + r0;
    const long t1 = s.q_off + r1 - 1;
    long first = s.first;
    long last = s.k_len - 1;
    if (do_causal) last = min(last, t1);
    if (s.wr >= 0) last = min(last, t1 + long(s.wr));
    if (s.wl >= 0) first = max(first, t0 - long(s.wl));
    if (s.chunk > 0) {
        first = max(first, s.first + chunk_start(t0 - s.first, s.chunk));
        last = min(last, s.first + chunk_start(t1 - s.first, s.chunk) + long(s.chunk) - 1);
    }
    lo = 0;
    hi = 0;
    if (first <= last) {
        lo = int(first / BK);
        hi = int(last / BK) + 1;
    }
}

// Key `key`'s row of kv head kvh of sequence b in a paged K or V (strides
// st, page stride ps), through its block-table entry.
template <typename T>
inline const device T *prefill_paged_row(const device T *X, constant int64_t *st, long ps,
                                         thread const PrefillSeqBuffers &sb, long b, long kvh, long key) {
    const long page = sb.block_table[b * sb.sp->max_pages + key / sb.sp->page_size];
    return X + page * ps + kvh * st[1] + (key % sb.sp->page_size) * st[2];
}

// The first key row of tile k0 of the sequence's kv head kvh in K or V
// (strides st, page stride ps). A paged tile lies within one page when the
// page size is a multiple of BK; otherwise (prefill_split_pages) the
// tile's keys are loaded one page lookup each by the *_paged loaders.
template <typename T>
inline const device T *prefill_kv_tile(const device T *X, constant int64_t *st, long ps,
                                       thread const PrefillSeqBuffers &sb, thread const PrefillSeq &s, long b,
                                       long kvh, long k0) {
    if (paged_kv) return prefill_paged_row(X, st, ps, sb, b, kvh, k0);
    return X + b * st[0] + kvh * st[1] + (s.k_start + k0) * st[2];
}

// Whether a key tile of BK keys may span pages: paged, with a page size
// that is not a multiple of BK (uniform over the dispatch).
template <int BK>
inline bool prefill_split_pages(thread const PrefillSeqBuffers &sb) {
    return paged_kv && sb.sp->page_size % BK != 0;
}

// load_tile_paged by runs of V (see load_tile_runs): a run of key k0 + r
// below len and below D is read through that key's page.
template <typename T, typename V, int ROWS, int BD, int LDW, int THREADS>
inline void load_tile_paged_runs(threadgroup uint *dst, const device T *X, constant int64_t *st, long ps,
                                 thread const PrefillSeqBuffers &sb, long b, long kvh, long k0, int c0, long len,
                                 int D, uint tid) {
    typedef TileRun<T, V> R;
    constexpr int RUNS = BD / R::elems;
    for (int i = int(tid); i < ROWS * RUNS; i += THREADS) {
        const int r = i / RUNS;
        const int c = (i % RUNS) * R::elems;
        const bool valid = r < len && c < D;
        uint w[R::words];
        read_run<V>(w, valid ? prefill_paged_row(X, st, ps, sb, b, kvh, k0 + r) + c0 + c : X, valid);
        put_run<T, R::words>(dst + r * LDW, c, w);
    }
}

// load_tile_t_paged by runs of V (see load_tile_t_runs), each key through its page.
template <typename T, typename V, int KEYS, int BD, int LDW, int THREADS>
inline void load_tile_t_paged_runs(threadgroup uint *dst, const device T *X, constant int64_t *st, long ps,
                                   thread const PrefillSeqBuffers &sb, long b, long kvh, long k0, int c0, long len,
                                   int D, uint tid) {
    typedef TileRun<T, V> R;
    constexpr int RUNS = BD / R::elems;
    for (int i = int(tid); i < KEYS / 2 * RUNS; i += THREADS) {
        const int d = (i % RUNS) * R::elems;
        const int kp = i / RUNS;
        const bool va = 2 * kp < len && d < D, vb = 2 * kp + 1 < len && d < D;
        uint wa[R::words], wb[R::words];
        read_run<V>(wa, va ? prefill_paged_row(X, st, ps, sb, b, kvh, k0 + 2 * kp) + c0 + d : X, va);
        read_run<V>(wb, vb ? prefill_paged_row(X, st, ps, sb, b, kvh, k0 + 2 * kp + 1) + c0 + d : X, vb);
        put_runs_t<T, R::words>(dst, LDW, d, kp, wa, wb);
    }
}

// load_tile over a paged K or V whose pages may split the tile: rows r <
// len of keys k0 + r (columns [c0, c0 + BD), those past D zeros), each
// through its own page; the rest zeros. Only keys below len read the block table.
template <typename T, int ROWS, int BD, int LDW, int THREADS>
inline void load_tile_paged(threadgroup uint *dst, const device T *X, constant int64_t *st, long ps,
                            thread const PrefillSeqBuffers &sb, long b, long kvh, long k0, int c0, long len,
                            int D, uint tid) {
    if (runs_fit<T, BD, 16>()) {
        load_tile_paged_runs<T, uint4, ROWS, BD, LDW, THREADS>(dst, X, st, ps, sb, b, kvh, k0, c0, len, D, tid);
        return;
    }
    if (runs_fit<T, BD, 8>()) {
        load_tile_paged_runs<T, uint2, ROWS, BD, LDW, THREADS>(dst, X, st, ps, sb, b, kvh, k0, c0, len, D, tid);
        return;
    }
    constexpr int PAIRS = BD / 2;
    for (int i = int(tid); i < ROWS * PAIRS; i += THREADS) {
        const int r = i / PAIRS;
        const int c = (i % PAIRS) * 2;
        const device T *at = r < len ? prefill_paged_row(X, st, ps, sb, b, kvh, k0 + r) + c0 + c : X;
        copy_pair<T>(dst + r * LDW, c, at, r < len ? pair_columns(c, D) : 0);
    }
}

// load_tile_t over a paged K or V whose pages may split the tile (as
// load_tile_paged): the same transposed layout, each key through its page.
template <typename T, int KEYS, int BD, int LDW, int THREADS>
inline void load_tile_t_paged(threadgroup uint *dst, const device T *X, constant int64_t *st, long ps,
                              thread const PrefillSeqBuffers &sb, long b, long kvh, long k0, int c0, long len,
                              int D, uint tid) {
    if (runs_fit<T, BD, 16>()) {
        load_tile_t_paged_runs<T, uint4, KEYS, BD, LDW, THREADS>(dst, X, st, ps, sb, b, kvh, k0, c0, len, D, tid);
        return;
    }
    if (runs_fit<T, BD, 8>()) {
        load_tile_t_paged_runs<T, uint2, KEYS, BD, LDW, THREADS>(dst, X, st, ps, sb, b, kvh, k0, c0, len, D, tid);
        return;
    }
    constexpr int CP = BD / 2;
    constexpr int ITEMS = KEYS / 2 * CP;
    for (int i = int(tid); i < ITEMS; i += THREADS) {
        const int d = (i % CP) * 2;
        const int kp = i / CP;
        const int n = pair_columns(d, D);
        const bool va = 2 * kp < len, vb = 2 * kp + 1 < len;
        const device T *ka = va ? prefill_paged_row(X, st, ps, sb, b, kvh, k0 + 2 * kp) + c0 + d : X;
        const device T *kb = vb ? prefill_paged_row(X, st, ps, sb, b, kvh, k0 + 2 * kp + 1) + c0 + d : X;
        copy_quad_t<T>(dst, LDW, d, kp, ka, kb, va ? n : 0, vb ? n : 0);
    }
}

// A row's final scale 1/l (0 for a row that sees nothing), the sink joining
// the denominator once in the exp2 domain; writes the natural-log LSE when
// lse_at is set. Every lane holding the row calls it (same row_max/row_sum).
inline float prefill_finish_row(float row_max, float row_sum, float sink, device float *lse_at) {
    float factor = 1.0f;
    if (has_sinks) {
        const float sk = sink * FM_LOG2E;
        const float m = max(row_max, sk);
        factor = exp2(row_max - m);
        // A +inf sink takes all the mass: the sum is +inf (not exp2(inf - inf),
        // NaN), so the factor is 0 and the LSE +inf, the limit. NaN stays NaN.
        row_sum = row_sum * factor + (sk == INFINITY ? INFINITY : exp2(sk - m));
        row_max = m;
    }
    if (has_lse && lse_at != nullptr) *lse_at = row_sum == 0.0f ? -INFINITY : (row_max + log2(row_sum)) / FM_LOG2E;
    return row_sum == 0.0f ? 0.0f : factor / row_sum;
}

// One score cell: the raw score q.k of the row at position q_pos and key
// column col, in the exp2 domain with scale, softcap, ALiBi and the mask
// applied and the floor taken, or -inf where the row must not see the key.
template <typename MaskT>
inline float prefill_cell(float x, constant AttnParams &p, thread const PrefillSeq &sq, const device MaskT *mask_row,
                          long col, bool row_exists, long q_pos, uchar tile_class, float slope) {
    const bool col_exists = align_K || col < sq.k_len;
    x *= p.scale;
    if (p.softcapping > 0.0f) x = p.softcapping * precise::tanh(x / p.softcapping);
    if (has_alibi) x -= slope * float(q_pos >= col ? q_pos - col : col - q_pos);
    bool masked = !col_exists || col < sq.first || (do_causal && col > q_pos);
    if (has_window) {
        masked = masked || (sq.wl >= 0 && col < q_pos - sq.wl) || (sq.wr >= 0 && col > q_pos + sq.wr);
        if (sq.chunk > 0) {
            const long start = sq.first + chunk_start(q_pos - sq.first, sq.chunk);
            masked = masked || col < start || col >= start + long(sq.chunk);
        }
    }
    if (has_mask && tile_class != 2 && col_exists && row_exists) {
        const float bias = mask_bias(mask_row[col]);
        masked = masked || bias == -INFINITY;
        x += bias;
    }
    x *= FM_LOG2E;
    x = x < FM_RUNNING_MAX_START ? FM_RUNNING_MAX_START : x;  // the floor (NaN compares false: kept)
    return masked ? -INFINITY : x;
}

// Scores -> probabilities for one key tile, in place in s[TK] (this lane's
// row, columns k0 + j * 8 + fc + e), and the online-softmax update of the
// row's max and sum. Returns the factor exp2(m_old - m_new) by which the
// caller rescales O. Called by all 32 lanes (the shuffles are collectives).
template <int TK, typename MaskT>
inline float prefill_softmax_step(thread simdgroup_float8x8 *s, constant AttnParams &p, thread const PrefillSeq &sq,
                                  const device MaskT *mask_row, long k0, short fc, bool row_exists, long q_pos,
                                  uchar tile_class, float slope, thread float &row_max, thread float &row_sum) {
    float tile_max = row_max;
    FA_UNROLL
    for (int j = 0; j < TK; j++) {
        FA_UNROLL
        for (int e = 0; e < 2; e++) {
            const float x = prefill_cell(s[j].thread_elements()[e], p, sq, mask_row, k0 + j * 8 + fc + e, row_exists,
                                         q_pos, tile_class, slope);
            s[j].thread_elements()[e] = x;
            tile_max = max(tile_max, x);
        }
    }
    // The 4 lanes holding one row: lane ^ 1 and lane ^ 8.
    tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(1)));
    tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(8)));

    const float factor = exp2(row_max - tile_max);
    float tile_sum = 0.0f;
    FA_UNROLL
    for (int j = 0; j < TK; j++) {
        FA_UNROLL
        for (int e = 0; e < 2; e++) {
            const float pe = exp2(s[j].thread_elements()[e] - tile_max);
            s[j].thread_elements()[e] = pe;
            tile_sum += pe;
        }
    }
    tile_sum += simd_shuffle_xor(tile_sum, ushort(1));
    tile_sum += simd_shuffle_xor(tile_sum, ushort(8));
    row_sum = row_sum * factor + tile_sum;
    row_max = tile_max;
    return factor;
}

// S[j] += Q[rows, c0 .. c0 + 8 * TD) . K[keys j * 8 .., same columns]^T, with
// Q at column offset c0 of its tile and the transposed K tile (load_tile_t,
// rows ldk words apart) holding just those columns.
template <typename T, int TK, int TD>
inline void prefill_qk(thread simdgroup_float8x8 *s, const threadgroup uint *Qs, int ldq, int c0,
                       const threadgroup uint *Ks, int ldk, int row0, short fr, short fc) {
    FA_UNROLL
    for (int j = 0; j < TK; j++) {
        FA_UNROLL
        for (int d = 0; d < TD; d++) {
            simdgroup_float8x8 qf;
            simdgroup_float8x8 kf;
            load_frag<T>(qf, Qs, ldq, row0, c0 + d * 8, fr, fc);
            load_frag_t<T>(kf, Ks, ldk, j * 8, d * 8, fr, fc);
            simdgroup_multiply_accumulate(s[j], qf, kf, s[j]);
        }
    }
}

// Call only when has_mask: otherwise Metal leaves mask and mp unbound.
template <typename MaskT>
inline const device MaskT *prefill_mask_row(const device MaskT *mask, constant AttnMaskParams *mp, long b, long h,
                                            long q_row) {
    return mask + b * mp->M_strides[0] + h * mp->M_strides[1] + q_row * mp->M_strides[2];
}

// Threadgroup memory of the wide body (D > 256, two-byte T): Q^T (a row of
// BQ / 2 words per head-dim column, load_tile_t's layout) and, in floats, two
// S tiles of BQ rows (BK + 4 floats apart) and two arrays of BQ row factors.
template <typename T, int BQ, int BK, int BD> struct PrefillWideTiles {
    // Words per Q^T row, one more against bank conflicts.
    static constexpr int LDQT = BQ / TileWords<T>::per_word + 1;
    static constexpr int qt_words = BD * LDQT;
    static constexpr int LDS = BK + 4;  // floats per S row
    static constexpr int s_floats = BQ * LDS;
    static constexpr int floats = 2 * (s_floats + BQ);
};

// Threadgroup memory of one prefill threadgroup, by head dim, in 32-bit
// words of EPW elements (two, or one for float). D <= 256: the Q tile and a K/V tile, each row
// padded by 8 elements (Os is a 1-float stub); K^T reuses the K/V words. D > 256
// ("wide"): PrefillWideTiles (KVs is a 1-word stub).
template <typename T, int BQ, int BK, int BD> struct PrefillTiles {
    static constexpr bool wide = BD > 256;
    static constexpr int DC = BD;  // K/V columns held at a time
    static constexpr int LDQ = BD + 8;
    static constexpr int LDC = DC + 8;
    static constexpr int EPW = TileWords<T>::per_word;
    static constexpr int LDQW = LDQ / EPW;  // the same pitches in 32-bit words
    static constexpr int LDCW = LDC / EPW;
    static constexpr int q_words = wide ? PrefillWideTiles<T, BQ, BK, BD>::qt_words : BQ * LDQW;
    // K^T: a row per column, BK / EPW words, one more against bank conflicts
    // where that still fits in the V tile's words.
    static constexpr int LDKW = DC * (BK / EPW + 1) <= BK * LDCW ? BK / EPW + 1 : BK / EPW;
    static constexpr int kv_words = wide ? 1 : BK * LDCW;
    static constexpr int o_floats = wide ? PrefillWideTiles<T, BQ, BK, BD>::floats : 1;
    static constexpr int bytes = (q_words + kv_words) * 4 + o_floats * 4;
};
template <bool Wide> struct PrefillBody {};  // picks prefill_body's overload (C++14: no if constexpr)

// One threadgroup's work: its sequence, the base pointers of its (batch,
// head), its first query row and the key tiles it visits.
template <typename T> struct PrefillWork {
    PrefillSeq s;
    const device T *Qb;  // row 0 of the sequence, head h
    device T *Ob;
    long b, h, kvh, q_row0;
    int lo, hi;          // key tiles [lo, hi)
};

template <typename T, int BQ, int BK>
inline PrefillWork<T> prefill_work(const device T *Q, device T *O, constant AttnParams &p,
                                   thread const PrefillSeqBuffers &sb, uint3 tgid) {
    PrefillWork<T> w;
    w.b = tgid.z;
    w.h = tgid.y;
    w.kvh = w.h / p.gqa_factor;
    w.q_row0 = long(tgid.x) * BQ;
    w.s = prefill_seq_of(p, sb, w.b);
    w.Qb = Q + w.b * p.Q_strides[0] + w.h * p.Q_strides[1] + w.s.q_start * p.Q_strides[2];
    w.Ob = O + w.b * p.O_strides[0] + w.h * p.O_strides[1] + w.s.q_start * p.O_strides[2];
    prefill_key_range<BK>(w.s, w.q_row0, min(w.q_row0 + long(BQ), w.s.q_len), w.lo, w.hi);
    return w;
}

// Where this lane writes its row's LSE: one lane of the four holding a row.
template <typename T>
inline device float *prefill_lse_at(thread const PrefillWork<T> &w, thread const PrefillSeqBuffers &sb, long q_row,
                                    bool row_exists, short fc) {
    if (!has_lse || !row_exists || fc != 0) return nullptr;
    return sb.lse + w.b * sb.sp->lse_strides[0] + w.h * sb.sp->lse_strides[1]
           + (w.s.q_start + q_row) * sb.sp->lse_strides[2];
}

// D <= 256: the O accumulator in registers (Os unused). Q and K columns past
// p.D and V columns past p.Dv (v's head dim) load as zeros; BD >= max(D, Dv).
template <typename T, typename MaskT, int BQ, int BK, int BD, int WM, int WN, int BQB, int BKB, int BDV>
inline void prefill_body(PrefillBody<false>, const device T *Q, const device T *K, const device T *V, device T *O,
                         constant AttnParams &p, constant AttnMaskParams *mp, const device MaskT *mask,
                         const device uchar *blk, thread const PrefillSeqBuffers &sb, threadgroup uint *Qs,
                         threadgroup uint *KVs, threadgroup float *Os, uint3 tgid, uint sg, uint lane, uint tid) {
    constexpr int TK = BK / 8;  // score fragments per 8-row block
    constexpr int TD = BD / 8;  // output fragments per 8-row block
    typedef PrefillTiles<T, BQ, BK, BD> G;
    constexpr int LDW = G::LDQW;  // padded row pitch of the Q and V tiles, in words
    constexpr int LDKW = G::LDKW; // of the K^T tile
    constexpr int THREADS = 32 * WM * WN;
    static_assert(WN == 1 && BQ == WM * 8, "each simdgroup owns 8 query rows");
    static_assert(BDV == BD, "V and O share the tile width (p.Dv bounds them)");
    static_assert(BK % 8 == 0 && BD % 8 == 0, "tiles are whole 8x8 fragments");

    const PrefillWork<T> w = prefill_work<T, BQ, BK>(Q, O, p, sb, tgid);
    if (w.q_row0 >= w.s.q_len) return;  // past a short sequence: the whole group
    load_tile<T, BQ, BD, LDW, THREADS>(Qs, w.Qb, p.Q_strides[2], w.q_row0, w.s.q_len, align_Q, p.D, tid);

    short fr, fc;
    frag_coord(lane, fr, fc);
    const int row0 = int(sg) * 8;
    const long q_row = w.q_row0 + row0 + fr;
    const bool row_exists = align_Q || q_row < w.s.q_len;
    const long q_pos = w.s.q_off + q_row;
    const device MaskT *mask_row = nullptr;  // only touched when has_mask
    if (has_mask) mask_row = prefill_mask_row(mask, mp, w.b, w.h, q_row);
    const float slope = has_alibi ? sb.alibi[w.b * long(p.H) + w.h] : 0.0f;
    const bool split_pages = prefill_split_pages<BK>(sb);

    simdgroup_float8x8 acc[TD];
    FA_UNROLL
    for (int d = 0; d < TD; d++) acc[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    float row_max = FM_RUNNING_MAX_START;
    float row_sum = 0.0f;

    for (int kt = w.lo; kt < w.hi; kt++) {
        uchar tile_class = 1;
        if (has_blk) {
            tile_class = blk[long(tgid.x) * BQ / BQB * p.NK + kt * BK / BKB];
            if (tile_class == 0) continue;  // uniform over the threadgroup
        }
        const long k0 = long(kt) * BK;
        const device T *Kt = prefill_kv_tile(K, p.K_strides, paged_kv ? sb.sp->K_page_stride : 0, sb, w.s, w.b,
                                             w.kvh, k0);
        const device T *Vt = prefill_kv_tile(V, p.V_strides, paged_kv ? sb.sp->V_page_stride : 0, sb, w.s, w.b,
                                             w.kvh, k0);

        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (split_pages) {
            load_tile_t_paged<T, BK, BD, LDKW, THREADS>(KVs, K, p.K_strides, sb.sp->K_page_stride, sb, w.b, w.kvh, k0,
                                                        0, w.s.k_len - k0, p.D, tid);
        } else {
            load_tile_t<T, BK, BD, LDKW, THREADS>(KVs, Kt, p.K_strides[2], w.s.k_len - k0, align_K, p.D, tid);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        simdgroup_float8x8 s[TK];
        FA_UNROLL
        for (int j = 0; j < TK; j++) s[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        prefill_qk<T, TK, TD>(s, Qs, LDW, 0, KVs, LDKW, row0, fr, fc);
        const float factor = prefill_softmax_step<TK>(s, p, w.s, mask_row, k0, fc, row_exists, q_pos, tile_class,
                                                      slope, row_max, row_sum);
        FA_UNROLL
        for (int d = 0; d < TD; d++) {
            acc[d].thread_elements()[0] *= factor;
            acc[d].thread_elements()[1] *= factor;
        }

        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (split_pages) {
            load_tile_paged<T, BK, BD, LDW, THREADS>(KVs, V, p.V_strides, sb.sp->V_page_stride, sb, w.b, w.kvh, k0, 0,
                                                     w.s.k_len - k0, p.Dv, tid);
        } else {
            load_tile<T, BK, BD, LDW, THREADS>(KVs, Vt, p.V_strides[2], 0, w.s.k_len - k0, align_K, p.Dv, tid);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        FA_UNROLL
        for (int j = 0; j < TK; j++) {
            FA_UNROLL
            for (int d = 0; d < TD; d++) {
                simdgroup_float8x8 vf;
                load_frag<T>(vf, KVs, LDW, j * 8, d * 8, fr, fc);
                simdgroup_multiply_accumulate(acc[d], s[j], vf, acc[d]);
            }
        }
    }

    const float inv = prefill_finish_row(row_max, row_sum, has_sinks ? sb.sinks[w.h] : 0.0f,
                                         prefill_lse_at(w, sb, q_row, row_exists, fc));
    if (row_exists) {
        device T *out_row = w.Ob + q_row * p.O_strides[2];
        FA_UNROLL
        for (int d = 0; d < TD; d++) {
            const int c = d * 8 + fc;  // columns at or past v's head dim Dv are padding: not stored
            if (c < p.Dv) out_row[c] = T(acc[d].thread_elements()[0] * inv);
            if (c + 1 < p.Dv) out_row[c + 1] = T(acc[d].thread_elements()[1] * inv);
        }
    }
}

// The tile-skip class of the kernel tile (qt, kt) of BQ x BK from the blk
// grid of BQB x BKB tiles (p.NQ x p.NK): a kernel tile inside one blk tile
// takes its class; one covering several takes 0 when all its blk tiles are
// 0 (nothing seen), 2 when all are 2 (mask all zeros), else 1.
template <int BQ, int BK, int BQB, int BKB>
inline uchar prefill_tile_class(const device uchar *blk, constant AttnParams &p, long qt, int kt) {
    if (BQB % BQ == 0 && BKB % BK == 0) return blk[qt * BQ / BQB * p.NK + long(kt) * BK / BKB];
    constexpr int RQ = BQ / BQB, RK = BK / BKB;
    const long r0 = qt * RQ, c0 = long(kt) * RK;
    const int rows = int(min(long(RQ), long(p.NQ) - r0)), cols = int(min(long(RK), long(p.NK) - c0));
    bool none = true, zeros = true;
    for (int i = 0; i < rows; i++) {
        for (int j = 0; j < cols; j++) {
            const uchar c = blk[(r0 + i) * p.NK + c0 + j];
            none = none && c == 0;
            zeros = zeros && c == 2;
        }
    }
    return none ? uchar(0) : zeros ? uchar(2) : uchar(1);
}

// The wide body reads K and V rows straight into MMA fragments a run of
// RUN consecutive elements per lane: fragment i of the run takes elements
// 2i and 2i + 1 as its two. The lane holding fragment column c (c even, with
// c + 1) reads the run at column c / 2 * RUN of a block of 4 * RUN columns,
// so fragment i's column c is head-dim column c / 2 * RUN + 2i + c % 2 of
// the block (wide_column); Q^T rows and O columns follow the same map.
inline int wide_column(int c, int i, int run) { return (c / 2) * run + 2 * i + c % 2; }

// RUN elements at `at` into fragments f[0 .. RUN / 2).
template <typename T, int RUN> inline void read_run_frags(thread simdgroup_float8x8 *f, const device T *at) {
    if (int(sizeof(T)) * RUN == 16 && tile_load_bytes >= 8) {
        // The run is 16 bytes from a run boundary (every row start the host
        // found aligned to tile_load_bytes, every offset a multiple of RUN):
        // one 16-byte device load, or two of 8.
        uint w[4];
        if (tile_load_bytes == 16) {
            read_run<uint4>(w, at, true);
        } else {
            read_run<uint2>(w, at, true);
            read_run<uint2>(w + 2, at + RUN / 2, true);
        }
        FA_UNROLL
        for (int i = 0; i < 4; i++) {
            f[i].thread_elements()[0] = low_of<T>(w[i]);
            f[i].thread_elements()[1] = high_of<T>(w[i]);
        }
        return;
    }
    FA_UNROLL
    for (int i = 0; i < RUN / 2; i++) {
        f[i].thread_elements()[0] = float(at[2 * i]);
        f[i].thread_elements()[1] = float(at[2 * i + 1]);
    }
}

// The first n elements of a run at `at` into fragments f[0 .. RUN / 2), the
// rest zeros: a run that reaches past the row's head dim (n < RUN, a head
// dim below the tile width) reads nothing at or past it.
template <typename T, int RUN> inline void read_run_frags_upto(thread simdgroup_float8x8 *f, const device T *at,
                                                               int n) {
    if (n >= RUN) {
        read_run_frags<T, RUN>(f, at);
        return;
    }
    FA_UNROLL
    for (int i = 0; i < RUN / 2; i++) {
        f[i].thread_elements()[0] = 2 * i < n ? float(at[2 * i]) : 0.0f;
        f[i].thread_elements()[1] = 2 * i + 1 < n ? float(at[2 * i + 1]) : 0.0f;
    }
}

// Key k0 + r's row of kv head kvh in K or V (strides st, page stride ps),
// r < BK; a key at or past `len` (keys of the tile that exist) reads the
// tile's last existing key instead (len >= 1 in every visited tile). `tile`
// is the tile's first row (prefill_kv_tile), used unless pages split it.
template <typename T>
inline const device T *prefill_wide_row(const device T *X, const device T *tile, constant int64_t *st, long ps,
                                        thread const PrefillSeqBuffers &sb, long b, long kvh, long k0, int r,
                                        long len, bool split_pages) {
    const int rr = len > long(r) ? r : int(len) - 1;
    if (split_pages) return prefill_paged_row(X, st, ps, sb, b, kvh, k0 + rr);
    return tile + long(rr) * st[2];
}

// The wide body's softmax of one key tile for one row: this lane's CPL
// scores (columns k0 + c0 .. of S row `srow`) become probabilities in place,
// the LPR lanes holding the row (lane ^ 1, ^ 2, ... ^ LPR / 2) combine the
// max and the sum. Returns the factor exp2(m_old - m_new). Called by all 32
// lanes (the shuffles are collectives).
template <int CPL, int LPR, typename MaskT>
inline float prefill_wide_softmax(threadgroup float *srow, constant AttnParams &p, thread const PrefillSeq &sq,
                                  const device MaskT *mask_row, long col0, bool row_exists, long q_pos,
                                  uchar tile_class, float slope, thread float &row_max, thread float &row_sum) {
    float x[CPL];
    float tile_max = row_max;
    FA_UNROLL
    for (int e = 0; e < CPL; e++) {
        x[e] = prefill_cell(srow[e], p, sq, mask_row, col0 + e, row_exists, q_pos, tile_class, slope);
        tile_max = max(tile_max, x[e]);
    }
    FA_UNROLL
    for (int m = 1; m < LPR; m *= 2) tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(m)));
    const float factor = exp2(row_max - tile_max);
    float tile_sum = 0.0f;
    FA_UNROLL
    for (int e = 0; e < CPL; e++) {
        const float pe = exp2(x[e] - tile_max);
        srow[e] = pe;
        tile_sum += pe;
    }
    FA_UNROLL
    for (int m = 1; m < LPR; m *= 2) tile_sum += simd_shuffle_xor(tile_sum, ushort(m));
    row_sum = row_sum * factor + tile_sum;
    row_max = tile_max;
    return factor;
}

// D > 256 (the header's "wide" body): NSG = WM * WN simdgroups share BQ
// rows and BK = 8 * NSG keys per tile. Qs holds Q^T, Os the S tiles and
// row factors (PrefillWideTiles); KVs is unused. Q and K have BD columns,
// V and O BDV (576 over 512: MLA's q/k over its latent v). A head dim p.D
// below BD (p.Dv below BDV) runs on the same tile: Q^T's columns past p.D
// load as zeros, K and V reads stop at p.D and p.Dv, the score loop stops
// at the last block of runs holding a column below p.D, and O columns at or
// past p.Dv are not stored.
template <typename T, typename MaskT, int BQ, int BK, int BD, int WM, int WN, int BQB, int BKB, int BDV>
inline void prefill_body(PrefillBody<true>, const device T *Q, const device T *K, const device T *V, device T *O,
                         constant AttnParams &p, constant AttnMaskParams *mp, const device MaskT *mask,
                         const device uchar *blk, thread const PrefillSeqBuffers &sb, threadgroup uint *Qs,
                         threadgroup uint *KVs, threadgroup float *Os, uint3 tgid, uint sg, uint lane, uint tid) {
    typedef PrefillWideTiles<T, BQ, BK, BD> G;
    constexpr int NSG = WM * WN;
    constexpr int THREADS = 32 * NSG;
    constexpr int TQ = BQ / 8;        // row fragments of the tile
    constexpr int DS = BDV / NSG;     // O columns a simdgroup accumulates
    constexpr int TO = DS / 8;        // its output fragments per row fragment
    constexpr int RPS = BQ / NSG;     // S rows a simdgroup's softmax takes
    constexpr int LPR = 32 / RPS;     // lanes per S row
    constexpr int CPL = BK / LPR;     // S columns per lane
    constexpr int LDQT = G::LDQT;
    constexpr int LDS = G::LDS;
    constexpr int RUN = 8;        // K/V elements a lane reads at a time (wide_column)
    constexpr int RF = RUN / 2;   // fragments per run
    constexpr int RB = 4 * RUN;   // head-dim columns per block of runs
    static_assert(TileWords<T>::per_word == 2, "the wide body takes two-byte elements");
    static_assert(BK == 8 * NSG, "each simdgroup scores one 8-key fragment of the tile");
    static_assert(BQ % 8 == 0 && BQ % NSG == 0 && BDV % (8 * NSG) == 0, "whole fragments per simdgroup");
    static_assert(BDV <= BD, "v's head dim is at most the tile width");
    static_assert(32 % RPS == 0 && BK % LPR == 0, "whole S rows per simdgroup, whole columns per lane");
    static_assert(BD % RB == 0 && DS % RB == 0, "whole blocks of runs");

    const PrefillWork<T> w = prefill_work<T, BQ, BK>(Q, O, p, sb, tgid);
    if (w.q_row0 >= w.s.q_len) return;  // past a short sequence: the whole group
    load_tile_t<T, BQ, BD, LDQT, THREADS>(Qs, w.Qb + w.q_row0 * p.Q_strides[2], p.Q_strides[2],
                                          w.s.q_len - w.q_row0, align_Q, p.D, tid);

    short fr, fc;
    frag_coord(lane, fr, fc);
    // The softmax's row and columns of this lane.
    const int srow = int(sg) * RPS + int(lane) / LPR;
    const int scol = (int(lane) % LPR) * CPL;
    const long q_row = w.q_row0 + srow;
    const bool row_exists = align_Q || q_row < w.s.q_len;
    const long q_pos = w.s.q_off + q_row;
    const device MaskT *mask_row = nullptr;  // only touched when has_mask
    if (has_mask) mask_row = prefill_mask_row(mask, mp, w.b, w.h, q_row);
    const float slope = has_alibi ? sb.alibi[w.b * long(p.H) + w.h] : 0.0f;
    const bool split_pages = prefill_split_pages<BK>(sb);
    const long kps = paged_kv ? sb.sp->K_page_stride : 0;
    const long vps = paged_kv ? sb.sp->V_page_stride : 0;
    const int dk = int(p.D);
    const int dv = int(p.Dv);
    const int k_col = (fc / 2) * RUN;                 // this lane's first column of a block of K
    const int v_col = int(sg) * DS + (fc / 2) * RUN;  // ... of its first block of V and O
    float row_max = FM_RUNNING_MAX_START;
    float row_sum = 0.0f;

    // acc[q * TO + m]: O rows q * 8 .., fragment m % RF of block m / RF of
    // this simdgroup's DS columns (wide_column's order).
    simdgroup_float8x8 acc[TQ * TO];
    FA_UNROLL
    for (int i = 0; i < TQ * TO; i++) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // Q^T is in

    int buf = 0;
    for (int kt = w.lo; kt < w.hi; kt++) {
        uchar tile_class = 1;
        if (has_blk) {
            tile_class = prefill_tile_class<BQ, BK, BQB, BKB>(blk, p, long(tgid.x), kt);
            if (tile_class == 0) continue;  // uniform over the threadgroup
        }
        const long k0 = long(kt) * BK;
        const long len = align_K ? long(BK) : min(long(BK), w.s.k_len - k0);
        const device T *Kt = prefill_kv_tile(K, p.K_strides, kps, sb, w.s, w.b, w.kvh, k0);
        const device T *Vt = prefill_kv_tile(V, p.V_strides, vps, sb, w.s, w.b, w.kvh, k0);
        threadgroup float *S = Os + buf * G::s_floats;
        threadgroup float *F = Os + 2 * G::s_floats + buf * BQ;

        // S^T[keys sg * 8 .., all rows] = K Q^T over the head dim, a block
        // of RB columns at a time (wide_column's order).
        {
            const device T *krow = prefill_wide_row(K, Kt, p.K_strides, kps, sb, w.b, w.kvh, k0, int(sg) * 8 + fr,
                                                    len, split_pages) + k_col;
            simdgroup_float8x8 st[TQ];
            FA_UNROLL
            for (int q = 0; q < TQ; q++) st[q] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            for (int cb = 0; cb < dk; cb += RB) {
                simdgroup_float8x8 kf[RF];
                read_run_frags_upto<T, RUN>(kf, krow + cb, dk - cb - k_col);
                FA_UNROLL
                for (int i = 0; i < RF; i++) {
                    const threadgroup uint *qt = Qs + (cb + wide_column(fr, i, RUN)) * LDQT;
                    FA_UNROLL
                    for (int q = 0; q < TQ; q++) {
                        simdgroup_float8x8 qf;  // B[r][c] = Q[row q * 8 + c][column r of block cb, run i]
                        read_pair<T>(qf, qt, q * 8 + fc);
                        simdgroup_multiply_accumulate(st[q], kf[i], qf, st[q]);
                    }
                }
            }
            FA_UNROLL
            for (int q = 0; q < TQ; q++) {
                S[(q * 8 + fc) * LDS + int(sg) * 8 + fr] = st[q].thread_elements()[0];
                S[(q * 8 + fc + 1) * LDS + int(sg) * 8 + fr] = st[q].thread_elements()[1];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        const float factor = prefill_wide_softmax<CPL, LPR>(S + srow * LDS + scol, p, w.s, mask_row, k0 + scol,
                                                            row_exists, q_pos, tile_class, slope, row_max, row_sum);
        if (int(lane) % LPR == 0) F[srow] = factor;
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // O[rows, sg's columns] = O * factor + P V.
        FA_UNROLL
        for (int q = 0; q < TQ; q++) {
            const float f = F[q * 8 + fr];
            FA_UNROLL
            for (int m = 0; m < TO; m++) {
                acc[q * TO + m].thread_elements()[0] *= f;
                acc[q * TO + m].thread_elements()[1] *= f;
            }
        }
        FA_UNROLL
        for (int j = 0; j < BK / 8; j++) {
            simdgroup_float8x8 pf[TQ];
            FA_UNROLL
            for (int q = 0; q < TQ; q++) {
                const threadgroup float *pr = S + (q * 8 + fr) * LDS + j * 8 + fc;
                pf[q].thread_elements()[0] = pr[0];
                pf[q].thread_elements()[1] = pr[1];
            }
            const device T *vrow = prefill_wide_row(V, Vt, p.V_strides, vps, sb, w.b, w.kvh, k0, j * 8 + fr, len,
                                                    split_pages) + v_col;
            FA_UNROLL
            for (int m = 0; m < TO; m += RF) {
                simdgroup_float8x8 vf[RF];
                read_run_frags_upto<T, RUN>(vf, vrow + m / RF * RB, dv - v_col - m / RF * RB);
                FA_UNROLL
                for (int i = 0; i < RF; i++) {
                    FA_UNROLL
                    for (int q = 0; q < TQ; q++) {
                        simdgroup_multiply_accumulate(acc[q * TO + m + i], pf[q], vf[i], acc[q * TO + m + i]);
                    }
                }
            }
        }
        buf ^= 1;
    }

    // 1/l per row through the factor array no simdgroup still reads.
    threadgroup float *F = Os + 2 * G::s_floats + buf * BQ;
    const float inv = prefill_finish_row(row_max, row_sum, has_sinks ? sb.sinks[w.h] : 0.0f,
                                         prefill_lse_at(w, sb, q_row, row_exists, short(int(lane) % LPR)));
    if (int(lane) % LPR == 0) F[srow] = inv;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    FA_UNROLL
    for (int q = 0; q < TQ; q++) {
        const long r = w.q_row0 + q * 8 + fr;
        if (!(align_Q || r < w.s.q_len)) continue;
        const float f = F[q * 8 + fr];
        device T *out = w.Ob + r * p.O_strides[2] + v_col;  // this lane's runs
        FA_UNROLL
        for (int m = 0; m < TO; m++) {
            const int c = m / RF * RB + (m % RF) * 2;
            if (v_col + c < dv) out[c] = T(acc[q * TO + m].thread_elements()[0] * f);
            if (v_col + c + 1 < dv) out[c + 1] = T(acc[q * TO + m].thread_elements()[1] * f);
        }
    }
}

// The thread cap tells Apple's compiler the threadgroup is exactly WM * WN
// simdgroups, so it may give each thread the registers the O accumulator
// needs (64 floats per thread at D = 256) instead of planning for 1024.
//
// The blk tiles are BQB x BKB (the head dim's tile-skip geometry; by
// default the kernel's own): a kernel tile lies inside one blk tile
// (BQB, BKB multiples of BQ, BK), whose class then holds for it too; or
// (wide) covers whole blk tiles, whose classes combine
// (prefill_tile_class). BDV is v's head dim (the O columns) where the wide
// body's differs from the tile width BD (q's and k's).
template <typename T, typename MaskT, int BQ, int BK, int BD, int WM, int WN, int BQB = BQ, int BKB = BK,
          int BDV = BD>
[[max_total_threads_per_threadgroup(32 * WM * WN)]]
kernel void flash_attn_prefill(
    const device T *Q [[buffer(0)]],
    const device T *K [[buffer(1)]],
    const device T *V [[buffer(2)]],
    device T *O [[buffer(3)]],
    constant AttnParams &p [[buffer(4)]],
    // Declared only when their constant is set, so Metal never asks for them unbound.
    constant AttnMaskParams *mp [[buffer(5), function_constant(has_mask)]],
    const device MaskT *mask [[buffer(6), function_constant(has_mask)]],
    const device uchar *blk [[buffer(7), function_constant(has_blk)]],
    constant AttnSeqParams *sp [[buffer(8), function_constant(prefill_seq)]],
    const device int *cu_q [[buffer(9), function_constant(varlen_q)]],
    const device int *cu_k [[buffer(10), function_constant(varlen_k)]],
    const device int *seqlens_k [[buffer(11), function_constant(kv_lens)]],
    const device int *block_table [[buffer(12), function_constant(paged_kv)]],
    const device float *sinks [[buffer(13), function_constant(has_sinks)]],
    device float *lse [[buffer(14), function_constant(has_lse)]],
    const device float *alibi [[buffer(15), function_constant(has_alibi)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint sg BUILTIN(simdgroup_index_in_threadgroup),
    uint lane BUILTIN(thread_index_in_simdgroup),
    uint tid BUILTIN(thread_index_in_threadgroup)) {
    typedef PrefillTiles<T, BQ, BK, BD> G;
    static_assert(G::bytes < 32768, "threadgroup memory must stay under 32 KiB");
    static_assert(G::wide || G::DC * G::LDKW <= G::kv_words, "the K^T tile fits in the K/V words");
    static_assert((BQB % BQ == 0 && BKB % BK == 0) || (G::wide && BQ % BQB == 0 && BK % BKB == 0),
                  "a kernel tile lies inside one blk tile, or (wide) is tiled by whole blk tiles");
    TG_ARRAY(uint, Qs, G::q_words);    // the Q tile (wide: Q^T)
    TG_ARRAY(uint, KVs, G::kv_words);  // the K tile, then the V tile
    TG_ARRAY(float, Os, G::o_floats);  // wide: the S tiles and row factors
    // An argument whose constant is false is not there: never read, only null.
    PrefillSeqBuffers sb;
    sb.sp = prefill_seq ? sp : nullptr;
    sb.cu_q = varlen_q ? cu_q : nullptr;
    sb.cu_k = varlen_k ? cu_k : nullptr;
    sb.seqlens_k = kv_lens ? seqlens_k : nullptr;
    sb.block_table = paged_kv ? block_table : nullptr;
    sb.sinks = has_sinks ? sinks : nullptr;
    sb.lse = has_lse ? lse : nullptr;
    sb.alibi = has_alibi ? alibi : nullptr;
    prefill_body<T, MaskT, BQ, BK, BD, WM, WN, BQB, BKB, BDV>(PrefillBody<G::wide>(), Q, K, V, O, p,
                                                              has_mask ? mp : nullptr, has_mask ? mask : nullptr,
                                                              has_blk ? blk : nullptr, sb, Qs, KVs, Os, tgid, sg,
                                                              lane, tid);
}

// Float32 at D 256 and 512 ("split" body). A float32 tile of 32 query rows
// alone fills 32 KiB at D = 256, so Q does not live in threadgroup memory:
// NSG = WM * WN simdgroups split the head dim, each owning DS = BD / NSG
// columns of Q (read once into registers) and of O (registers), for all BQ
// rows. Per key tile of BK keys:
//   each simdgroup computes its partial S^T = K Q^T over its DS columns
//       (K read straight from device memory, a run of 4 floats per lane:
//       wide_column's map with RUN = 4) into its own threadgroup tile;
//   barrier; simdgroups 0 .. BQ / 8 - 1 each sum the NSG partials of 8 rows
//       (in simdgroup order) into P and run the online softmax on it
//       (prefill_wide_softmax; 4 lanes a row), writing the row factors;
//   barrier; each simdgroup rescales its O columns and adds P V, V read
//       from device memory a run per lane at its columns.
// P and the factors are read after the second barrier and next written after
// the next tile's first, the partials read between the two: one copy of
// each, two barriers per tile. K and V are read once per threadgroup and key
// tile (the K/V re-read is ceil(qL / BQ)). Keys past the tile's last read
// that key instead (prefill_wide_row; their score is masked). Columns at or
// past D (Q, K) or Dv (V) read as zeros and are not stored.
// D 256: BQ 32, BK 16, 8 simdgroups (32 columns each): partials 20 KiB +
// P and factors = 23,296 bytes; 32 + 32 floats of Q and O per thread. D 512:
// BQ 32, BK 8, 16 simdgroups: 26,368 bytes, the same registers.
template <int BQ, int BK, int NSG> struct PrefillSplitTiles {
    static constexpr int LDS = BK + 4;  // floats per S row (against bank conflicts)
    static constexpr int s_floats = BQ * LDS;
    static constexpr int floats = (NSG + 1) * s_floats + 2 * BQ;  // partials, P, factors, final 1/l
    static constexpr int bytes = floats * 4;
};

// Four floats of a row from `at` as words w[0..3]: n of them below the
// row's head dim are read, the rest are zeros (nothing past them is read).
// Where the host found rows aligned (tile_load_bytes) a whole run is one
// 16-byte load, or each whole pair one 8-byte load.
inline void split_read_run(thread uint *w, const device float *at, int n) {
    if (n >= 4 && tile_load_bytes == 16) {
        read_run<uint4>(w, at, true);
    } else if (tile_load_bytes == 8) {
        FA_UNROLL
        for (int h = 0; h < 4; h += 2) {
            if (n - h >= 2) {
                read_run<uint2>(w + h, at + h, true);
            } else {
                w[h] = n - h == 1 ? as_type<uint>(at[h]) : 0u;
                w[h + 1] = 0u;
            }
        }
    } else {
        FA_UNROLL
        for (int e = 0; e < 4; e++) w[e] = e < n ? as_type<uint>(at[e]) : 0u;
    }
}

// The same four floats into fragments f[0] (elements 0, 1) and f[1] (2, 3).
inline void split_read_frags(thread simdgroup_float8x8 *f, const device float *at, int n) {
    uint w[4];
    split_read_run(w, at, n);
    FA_UNROLL
    for (int i = 0; i < 2; i++) {
        f[i].thread_elements()[0] = as_type<float>(w[2 * i]);
        f[i].thread_elements()[1] = as_type<float>(w[2 * i + 1]);
    }
}

// x[0 .. N) += the N floats at `at` (16-byte aligned for 4, 8 for 2): one
// threadgroup load; split_put stores them back the same way.
template <int N> inline void split_add(thread float *x, const threadgroup float *at);
template <> inline void split_add<4>(thread float *x, const threadgroup float *at) {
    const float4 v = *reinterpret_cast<const threadgroup float4 *>(at);
    x[0] += v.x;
    x[1] += v.y;
    x[2] += v.z;
    x[3] += v.w;
}
template <> inline void split_add<2>(thread float *x, const threadgroup float *at) {
    const float2 v = *reinterpret_cast<const threadgroup float2 *>(at);
    x[0] += v.x;
    x[1] += v.y;
}
template <int N> inline void split_put(threadgroup float *at, thread const float *x);
template <> inline void split_put<4>(threadgroup float *at, thread const float *x) {
    float4 v;
    v.x = x[0];
    v.y = x[1];
    v.z = x[2];
    v.w = x[3];
    *reinterpret_cast<threadgroup float4 *>(at) = v;
}
template <> inline void split_put<2>(threadgroup float *at, thread const float *x) {
    float2 v;
    v.x = x[0];
    v.y = x[1];
    *reinterpret_cast<threadgroup float2 *>(at) = v;
}

template <typename T, typename MaskT, int BQ, int BK, int BD, int WM, int WN, int BQB = BQ, int BKB = BK>
[[max_total_threads_per_threadgroup(32 * WM * WN)]]
kernel void flash_attn_prefill_split(
    const device T *Q [[buffer(0)]],
    const device T *K [[buffer(1)]],
    const device T *V [[buffer(2)]],
    device T *O [[buffer(3)]],
    constant AttnParams &p [[buffer(4)]],
    // Declared only when their constant is set, so Metal never asks for them unbound.
    constant AttnMaskParams *mp [[buffer(5), function_constant(has_mask)]],
    const device MaskT *mask [[buffer(6), function_constant(has_mask)]],
    const device uchar *blk [[buffer(7), function_constant(has_blk)]],
    constant AttnSeqParams *sp [[buffer(8), function_constant(prefill_seq)]],
    const device int *cu_q [[buffer(9), function_constant(varlen_q)]],
    const device int *cu_k [[buffer(10), function_constant(varlen_k)]],
    const device int *seqlens_k [[buffer(11), function_constant(kv_lens)]],
    const device int *block_table [[buffer(12), function_constant(paged_kv)]],
    const device float *sinks [[buffer(13), function_constant(has_sinks)]],
    device float *lse [[buffer(14), function_constant(has_lse)]],
    const device float *alibi [[buffer(15), function_constant(has_alibi)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint sg BUILTIN(simdgroup_index_in_threadgroup),
    uint lane BUILTIN(thread_index_in_simdgroup),
    uint tid BUILTIN(thread_index_in_threadgroup)) {
    constexpr int NSG = WM * WN;
    typedef PrefillSplitTiles<BQ, BK, NSG> G;
    constexpr int TQ = BQ / 8;      // row fragments
    constexpr int TK = BK / 8;      // key fragments
    constexpr int DS = BD / NSG;    // Q and O columns of a simdgroup
    constexpr int RUN = 4;          // floats a lane reads at a time (wide_column)
    constexpr int RF = RUN / 2;     // fragments per run
    constexpr int RB = 4 * RUN;     // head-dim columns per block of runs
    constexpr int TB = DS / RB;     // blocks per simdgroup
    constexpr int TO = TB * RF;     // O fragments per row fragment
    constexpr int LPR = 4;          // softmax lanes per row
    constexpr int RPS = 32 / LPR;   // rows per softmax simdgroup
    constexpr int CPL = BK / LPR;   // S columns per lane
    constexpr int SMX = BQ / RPS;   // simdgroups running the softmax
    constexpr int LDS = G::LDS;
    static_assert(sizeof(T) == 4, "the split body takes float32 elements");
    static_assert(G::bytes < 32768, "threadgroup memory must stay under 32 KiB");
    static_assert(BQ % 8 == 0 && BK % LPR == 0 && DS % RB == 0 && SMX <= NSG, "whole fragments and runs");
    static_assert(RF == 2, "a run holds the columns of two fragments");
    static_assert(LDS % 4 == 0 && G::floats % 4 == 0 && (CPL == 2 || CPL == 4), "aligned vector S loads");
    static_assert((BQB % BQ == 0 && BKB % BK == 0) || (BQ % BQB == 0 && BK % BKB == 0),
                  "a kernel tile lies inside one blk tile or is tiled by whole blk tiles");
    typedef float4 SplitWord;  // the S tiles' element: aligned for their vector loads
    TG_ARRAY(SplitWord, Ss4, G::floats / 4);
    threadgroup float *Ss = reinterpret_cast<threadgroup float *>(Ss4);
    threadgroup float *P = Ss + NSG * G::s_floats;
    threadgroup float *F = P + G::s_floats;
    threadgroup float *Fi = F + BQ;

    PrefillSeqBuffers sb;
    sb.sp = prefill_seq ? sp : nullptr;
    sb.cu_q = varlen_q ? cu_q : nullptr;
    sb.cu_k = varlen_k ? cu_k : nullptr;
    sb.seqlens_k = kv_lens ? seqlens_k : nullptr;
    sb.block_table = paged_kv ? block_table : nullptr;
    sb.sinks = has_sinks ? sinks : nullptr;
    sb.lse = has_lse ? lse : nullptr;
    sb.alibi = has_alibi ? alibi : nullptr;
    const PrefillWork<T> w = prefill_work<T, BQ, BK>(Q, O, p, sb, tgid);
    if (w.q_row0 >= w.s.q_len) return;  // past a short sequence: the whole group
    (void)tid;

    short fr, fc;
    frag_coord(lane, fr, fc);
    const int c0 = int(sg) * DS;           // this simdgroup's first column
    const int lc = c0 + (fc / 2) * RUN;    // this lane's first run column (block 0)

    // qf[(q * TB + b) * RF + i]: B[r][c] = Q[row q * 8 + c][column r of
    // fragment i of block b] (wide_column's map), zeros past the rows and D.
    // Column r of fragments 0 and 1 is element r % 2 and 2 + r % 2 of the
    // run at r / 2: this lane reads the runs of its two rows whole.
    simdgroup_float8x8 qf[TQ * TB * RF];
    FA_UNROLL
    for (int q = 0; q < TQ; q++) {
        FA_UNROLL
        for (int e = 0; e < 2; e++) {
            const long r = w.q_row0 + q * 8 + fc + e;
            const bool ok = align_Q || r < w.s.q_len;
            const device T *qrow = w.Qb + (ok ? r : 0) * p.Q_strides[2] + c0 + (fr / 2) * RUN;
            FA_UNROLL
            for (int b = 0; b < TB; b++) {
                uint qw[RUN];
                split_read_run(qw, qrow + b * RB, ok ? p.D - (c0 + (fr / 2) * RUN + b * RB) : 0);
                qf[(q * TB + b) * RF].thread_elements()[e] = as_type<float>(fr % 2 != 0 ? qw[1] : qw[0]);
                qf[(q * TB + b) * RF + 1].thread_elements()[e] = as_type<float>(fr % 2 != 0 ? qw[3] : qw[2]);
            }
        }
    }
    // The softmax's row and columns of this lane (simdgroups below SMX).
    const bool smx = int(sg) < SMX;
    const int srow = smx ? int(sg) * RPS + int(lane) / LPR : 0;
    const int scol = (int(lane) % LPR) * CPL;
    const long q_row = w.q_row0 + srow;
    const bool row_exists = smx && (align_Q || q_row < w.s.q_len);
    const long q_pos = w.s.q_off + q_row;
    const device MaskT *mask_row = nullptr;  // only touched when has_mask
    if (has_mask) mask_row = prefill_mask_row(mask, mp, w.b, w.h, q_row);
    const float slope = has_alibi ? sb.alibi[w.b * long(p.H) + w.h] : 0.0f;
    const bool split_pages = prefill_split_pages<BK>(sb);
    const long kps = paged_kv ? sb.sp->K_page_stride : 0;
    const long vps = paged_kv ? sb.sp->V_page_stride : 0;
    float row_max = FM_RUNNING_MAX_START;
    float row_sum = 0.0f;

    // acc[q * TO + b * RF + i]: O rows q * 8 .., fragment i of block b of
    // this simdgroup's columns.
    simdgroup_float8x8 acc[TQ * TO];
    FA_UNROLL
    for (int i = 0; i < TQ * TO; i++) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

    for (int kt = w.lo; kt < w.hi; kt++) {
        uchar tile_class = 1;
        if (has_blk) {
            tile_class = prefill_tile_class<BQ, BK, BQB, BKB>(blk, p, long(tgid.x), kt);
            if (tile_class == 0) continue;  // uniform over the threadgroup
        }
        const long k0 = long(kt) * BK;
        const long len = align_K ? long(BK) : min(long(BK), w.s.k_len - k0);
        const device T *Kt = prefill_kv_tile(K, p.K_strides, kps, sb, w.s, w.b, w.kvh, k0);
        const device T *Vt = prefill_kv_tile(V, p.V_strides, vps, sb, w.s, w.b, w.kvh, k0);

        // This simdgroup's partial S^T[keys j * 8 .., rows] over its columns.
        {
            threadgroup float *S = Ss + int(sg) * G::s_floats;
            FA_UNROLL
            for (int j = 0; j < TK; j++) {
                const device T *krow = prefill_wide_row(K, Kt, p.K_strides, kps, sb, w.b, w.kvh, k0, j * 8 + fr,
                                                        len, split_pages) + lc;
                simdgroup_float8x8 st[TQ];
                FA_UNROLL
                for (int q = 0; q < TQ; q++) st[q] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
                FA_UNROLL
                for (int b = 0; b < TB; b++) {
                    simdgroup_float8x8 kf[RF];
                    split_read_frags(kf, krow + b * RB, p.D - (lc + b * RB));
                    FA_UNROLL
                    for (int i = 0; i < RF; i++) {
                        FA_UNROLL
                        for (int q = 0; q < TQ; q++) {
                            simdgroup_multiply_accumulate(st[q], kf[i], qf[(q * TB + b) * RF + i], st[q]);
                        }
                    }
                }
                FA_UNROLL
                for (int q = 0; q < TQ; q++) {
                    S[(q * 8 + fc) * LDS + j * 8 + fr] = st[q].thread_elements()[0];
                    S[(q * 8 + fc + 1) * LDS + j * 8 + fr] = st[q].thread_elements()[1];
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        if (smx) {
            threadgroup float *prow = P + srow * LDS + scol;
            float x[CPL];
            FA_UNROLL
            for (int e = 0; e < CPL; e++) x[e] = 0.0f;
            FA_UNROLL
            for (int g = 0; g < NSG; g++) split_add<CPL>(x, Ss + g * G::s_floats + srow * LDS + scol);
            split_put<CPL>(prow, x);
            const float factor = prefill_wide_softmax<CPL, LPR>(prow, p, w.s, mask_row, k0 + scol, row_exists, q_pos,
                                                                tile_class, slope, row_max, row_sum);
            if (int(lane) % LPR == 0) F[srow] = factor;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // O[rows, this simdgroup's columns] = O * factor + P V.
        FA_UNROLL
        for (int q = 0; q < TQ; q++) {
            const float f = F[q * 8 + fr];
            FA_UNROLL
            for (int m = 0; m < TO; m++) {
                acc[q * TO + m].thread_elements()[0] *= f;
                acc[q * TO + m].thread_elements()[1] *= f;
            }
        }
        FA_UNROLL
        for (int j = 0; j < TK; j++) {
            simdgroup_float8x8 pf[TQ];
            FA_UNROLL
            for (int q = 0; q < TQ; q++) {
                const float2 pr = *reinterpret_cast<const threadgroup float2 *>(P + (q * 8 + fr) * LDS + j * 8 + fc);
                pf[q].thread_elements()[0] = pr.x;
                pf[q].thread_elements()[1] = pr.y;
            }
            const device T *vrow = prefill_wide_row(V, Vt, p.V_strides, vps, sb, w.b, w.kvh, k0, j * 8 + fr, len,
                                                    split_pages) + lc;
            FA_UNROLL
            for (int b = 0; b < TB; b++) {
                simdgroup_float8x8 vf[RF];
                split_read_frags(vf, vrow + b * RB, p.Dv - (lc + b * RB));
                FA_UNROLL
                for (int i = 0; i < RF; i++) {
                    FA_UNROLL
                    for (int q = 0; q < TQ; q++) {
                        simdgroup_multiply_accumulate(acc[q * TO + b * RF + i], pf[q], vf[i],
                                                      acc[q * TO + b * RF + i]);
                    }
                }
            }
        }
    }

    // 1/l per row through its own array (the factors may still be read).
    if (smx) {
        const float inv = prefill_finish_row(row_max, row_sum, has_sinks ? sb.sinks[w.h] : 0.0f,
                                             prefill_lse_at(w, sb, q_row, row_exists, short(int(lane) % LPR)));
        if (int(lane) % LPR == 0) Fi[srow] = inv;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    FA_UNROLL
    for (int q = 0; q < TQ; q++) {
        const long r = w.q_row0 + q * 8 + fr;
        if (!(align_Q || r < w.s.q_len)) continue;
        const float f = Fi[q * 8 + fr];
        device T *out = w.Ob + r * p.O_strides[2];
        FA_UNROLL
        for (int m = 0; m < TO; m++) {
            const int c = lc + (m / RF) * RB + (m % RF) * 2;  // columns at or past Dv are padding
            if (c < p.Dv) out[c] = T(acc[q * TO + m].thread_elements()[0] * f);
            if (c + 1 < p.Dv) out[c + 1] = T(acc[q * TO + m].thread_elements()[1] * f);
        }
    }
}

// The entry points: one per (I/O dtype, head dim, mask type) of PrefillCapability in
// Sources/FlashMetalCore/Capabilities.swift, with template arguments (T, MaskT, BQ, BK, BD, WM, WN
// [, BQB, BKB[, BDV]]): the kernel's tile (float32: f32Geometry, or f32SplitGeometry for
// flash_attn_prefill_split; two-byte: wideGeometry where it has a row, else geometry), then the blk
// tile where it is not the kernel's own, then v's head dim where it is not the tile width
// (valueHeadDim).
// BEGIN GENERATED INSTANTIATIONS: flash_attn_prefill flash_attn_prefill_split
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d64", flash_attn_prefill, bfloat, bfloat, 32, 16, 64, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d64_boolmask", flash_attn_prefill, bfloat, uchar, 32, 16, 64, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d80", flash_attn_prefill, bfloat, bfloat, 32, 16, 80, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d80_boolmask", flash_attn_prefill, bfloat, uchar, 32, 16, 80, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d96", flash_attn_prefill, bfloat, bfloat, 32, 16, 96, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d96_boolmask", flash_attn_prefill, bfloat, uchar, 32, 16, 96, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d128", flash_attn_prefill, bfloat, bfloat, 32, 16, 128, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d128_boolmask", flash_attn_prefill, bfloat, uchar, 32, 16, 128, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d192", flash_attn_prefill, bfloat, bfloat, 32, 16, 192, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d192_boolmask", flash_attn_prefill, bfloat, uchar, 32, 16, 192, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d256", flash_attn_prefill, bfloat, bfloat, 32, 16, 256, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d256_boolmask", flash_attn_prefill, bfloat, uchar, 32, 16, 256, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d512", flash_attn_prefill, bfloat, bfloat, 16, 64, 512, 1, 8, 8, 8)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d512_boolmask", flash_attn_prefill, bfloat, uchar, 16, 64, 512, 1, 8, 8, 8)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d576", flash_attn_prefill, bfloat, bfloat, 16, 64, 576, 1, 8, 8, 8, 512)
INSTANTIATE_KERNEL("flash_attn_prefill_bf16_d576_boolmask", flash_attn_prefill, bfloat, uchar, 16, 64, 576, 1, 8, 8, 8, 512)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d64", flash_attn_prefill, half, half, 32, 16, 64, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d64_boolmask", flash_attn_prefill, half, uchar, 32, 16, 64, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d80", flash_attn_prefill, half, half, 32, 16, 80, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d80_boolmask", flash_attn_prefill, half, uchar, 32, 16, 80, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d96", flash_attn_prefill, half, half, 32, 16, 96, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d96_boolmask", flash_attn_prefill, half, uchar, 32, 16, 96, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d128", flash_attn_prefill, half, half, 32, 16, 128, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d128_boolmask", flash_attn_prefill, half, uchar, 32, 16, 128, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d192", flash_attn_prefill, half, half, 32, 16, 192, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d192_boolmask", flash_attn_prefill, half, uchar, 32, 16, 192, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d256", flash_attn_prefill, half, half, 32, 16, 256, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d256_boolmask", flash_attn_prefill, half, uchar, 32, 16, 256, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d512", flash_attn_prefill, half, half, 16, 64, 512, 1, 8, 8, 8)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d512_boolmask", flash_attn_prefill, half, uchar, 16, 64, 512, 1, 8, 8, 8)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d576", flash_attn_prefill, half, half, 16, 64, 576, 1, 8, 8, 8, 512)
INSTANTIATE_KERNEL("flash_attn_prefill_f16_d576_boolmask", flash_attn_prefill, half, uchar, 16, 64, 576, 1, 8, 8, 8, 512)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d64", flash_attn_prefill, float, float, 32, 16, 64, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d64_boolmask", flash_attn_prefill, float, uchar, 32, 16, 64, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d80", flash_attn_prefill, float, float, 32, 16, 80, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d80_boolmask", flash_attn_prefill, float, uchar, 32, 16, 80, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d96", flash_attn_prefill, float, float, 32, 16, 96, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d96_boolmask", flash_attn_prefill, float, uchar, 32, 16, 96, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d128", flash_attn_prefill, float, float, 32, 16, 128, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d128_boolmask", flash_attn_prefill, float, uchar, 32, 16, 128, 4, 1)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d192", flash_attn_prefill, float, float, 32, 8, 192, 4, 1, 32, 16)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d192_boolmask", flash_attn_prefill, float, uchar, 32, 8, 192, 4, 1, 32, 16)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d256", flash_attn_prefill_split, float, float, 32, 16, 256, 1, 8)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d256_boolmask", flash_attn_prefill_split, float, uchar, 32, 16, 256, 1, 8)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d512", flash_attn_prefill_split, float, float, 32, 8, 512, 1, 16, 8, 8)
INSTANTIATE_KERNEL("flash_attn_prefill_f32_d512_boolmask", flash_attn_prefill_split, float, uchar, 32, 8, 512, 1, 16, 8, 8)
// END GENERATED INSTANTIATIONS
