/*
 * flashmetal_kernels.h — the interface between the host and the kernels:
 * function-constant indices, buffer indices, the kernel parameter structs
 * and the kernels' numeric constants. Callers of the C ABI never see these
 * (the public API is flashmetal.h); the dispatchers (Swift), the cpu
 * kernels (C), the simulator (C++) and the Metal compiler read them.
 *
 * The shader embedder inlines this file into every shader that includes it;
 * it must therefore stay valid MSL as well as C and C++ (no C library
 * headers under __METAL_VERSION__).
 *
 * Struct layouts follow mlx-native's kernels field for field; sizes and
 * offsets are pinned by static asserts in layout_checks.c and by swift tests.
 */
#ifndef FLASHMETAL_KERNELS_H
#define FLASHMETAL_KERNELS_H

#ifndef __METAL_VERSION__
#include <stdint.h>
#endif

/* ---- numeric constants of the kernels (docs/ARCHITECTURE.md) ------------- */
/* The running row max starts at the finite -FLT_MAX/2, so a -inf score gives
 * exp2(-inf - m) = 0 and m - m stays 0: never NaN. */
#define FM_RUNNING_MAX_START (-1.70141173e38f)
/* log2(e): the GPU kernels fold it into Q and use exp2. */
#define FM_LOG2E 1.44269504088896341f

/* ---- cross-language integers ---------------------------------------------
 * One definition for the dispatchers (Swift), the cpu kernels (C), the
 * simulator (C++) and the shaders (MSL). Swift tests pin the Swift enums
 * that mirror them. */

/* Metal function-constant indices ([[function_constant(i)]]). */
typedef enum FMFunctionConstant {
    FM_FC_ALIGN_Q = 200,            /* prefill: qL % BQ == 0 */
    FM_FC_ALIGN_K = 201,            /* prefill: kL % BK == 0 */
    FM_FC_HAS_MASK = 300,           /* prefill: a mask is bound */
    FM_FC_DO_CAUSAL = 301,          /* prefill: causal */
    FM_FC_HAS_SINKS = 302,          /* prefill: sinks bound (MLX's index for has_sinks) */
    FM_FC_HAS_BLK = 303,            /* prefill: a blk is bound */
    FM_FC_PREFILL_SEQ = 304,        /* prefill: AttnSeqParams bound (any of 302, 305-310) */
    FM_FC_WINDOW = 305,             /* prefill: AttnSeqParams.window_left/right apply */
    FM_FC_VARLEN_Q = 306,           /* prefill: q/o/lse packed, cu_seqlens_q bound */
    FM_FC_VARLEN_K = 307,           /* prefill: k/v packed, cu_seqlens_k bound */
    FM_FC_KV_LENS = 308,            /* prefill: seqlens_k bound */
    FM_FC_PAGED = 309,              /* prefill: k/v paged, block_table bound */
    FM_FC_HAS_LSE = 310,            /* prefill: lse output bound */
    FM_FC_HAS_ALIBI = 311,          /* prefill: alibi slopes bound */
    FM_FC_TILE_LOAD_BYTES = 312,    /* prefill (int): bytes per tile-loader device load: 4 (column pairs),
                                     * 8 or 16 (runs: Q/K/V bases, strides and D aligned to them) */
    FM_FC_BLK_BQ = 400,             /* blk: BQ of the consuming prefill (int) */
    FM_FC_BLK_BK = 401,             /* blk: BK of the consuming prefill (int) */
    FM_FC_VEC_HAS_SIGNS = 500,      /* decode FWHT reduce: signs are bound */
    FM_FC_VEC_SEQ = 501,            /* decode: FlashAttnVecSeqParams bound (strides, paging) */
    FM_FC_VEC_KV_LENS = 502,        /* decode: seqlens_k bound */
    FM_FC_VEC_PAGED = 503,          /* decode: block_table bound */
    FM_FC_VEC_SINKS = 504,          /* decode plain reduce: sinks + FlashAttnVecReduceExtParams bound */
    FM_FC_VEC_LSE = 505,            /* decode plain reduce: lse + FlashAttnVecReduceExtParams bound */
    FM_FC_VEC_UNALIGNED = 506,   /* decode: q, K or V not aligned to a vector load (scalar loads) */
    FM_FC_VEC_ALIBI = 507,          /* decode: alibi slopes bound (with FM_FC_VEC_SEQ) */
    FM_FC_VEC_Q_IO = 508,           /* decode: q in the K/V dtype at FM_VEC_BUF_Q_IO, not float32 at FM_VEC_BUF_Q */
    FM_FC_VEC_OUT_F16 = 509,        /* decode reduce: out float16 at FM_VEC_REDUCE_BUF_OUT_F16 */
    FM_FC_VEC_OUT_BF16 = 510,       /* decode reduce: out bfloat16 at FM_VEC_REDUCE_BUF_OUT_BF16 */
    FM_FC_SDPA_BOOL_MASK = 600,     /* sdpa: a bool mask is bound */
    FM_FC_SDPA_ADDITIVE_MASK = 601, /* sdpa: an additive mask is bound */
    FM_FC_SDPA_EXT = 602,           /* sdpa: SdpaExtParams are bound (q_offset, window) */
    FM_FC_SDPA_SOFTCAP = 603,       /* sdpa: apply SdpaExtParams.softcap */
    FM_FC_APPEND_PAGED = 700,       /* kv_append: cache paged, block_table bound */
    FM_FC_KVQ_LENS = 800,           /* kv_codes_decode: seqlens_k bound */
    FM_FC_KVQ_PAGED = 801,          /* kv_codes_decode: caches paged, block_table bound */
    FM_FC_KVQ_SINKS = 802,          /* kv_codes_decode: sinks bound */
    FM_FC_KVQ_LSE = 803,            /* kv_codes_decode: lse output bound */
    FM_FC_KVQ_APPEND_PAGED = 804,   /* kv_codes_append: caches paged, block_table bound */
    FM_FC_KVQ_K_DENSE = 805,        /* kv_codes_decode: K is a dense cache (buffer 11), not codes */
    FM_FC_KVQ_V_DENSE = 806,        /* kv_codes_decode: V is a dense cache (buffer 12), not codes */
    FM_FC_KVQ_APPEND_K_DENSE = 807, /* kv_codes_append: K is a dense cache (buffer 9), not codes */
    FM_FC_KVQ_APPEND_V_DENSE = 808, /* kv_codes_append: V is a dense cache (buffer 10), not codes */
    FM_FC_KVQ_VARLEN_Q = 809,       /* kv_codes_decode: q/out/lse packed, cu_seqlens_q bound */
    FM_FC_KVQ_VARLEN_K = 810,       /* kv_codes_decode: key counts from cu_seqlens_k (paged caches) */
    FM_FC_KVQ_SPLIT = 811,          /* kv_codes_decode: partials to tmp (buffer 16) for kv_codes_reduce, not out */
    FM_FC_KVQ_ALIBI = 812           /* kv_codes_decode/_prefill: ALiBi slopes bound (buffer 15) */
} FMFunctionConstant;

/* Buffer indices ([[buffer(i)]]) of each kernel family. */
typedef enum FMPrefillBinding {
    FM_PREFILL_BUF_Q = 0, FM_PREFILL_BUF_K = 1, FM_PREFILL_BUF_V = 2, FM_PREFILL_BUF_O = 3,
    FM_PREFILL_BUF_PARAMS = 4,      /* AttnParams */
    FM_PREFILL_BUF_MASK_PARAMS = 5, /* AttnMaskParams, with a mask */
    FM_PREFILL_BUF_MASK = 6,
    FM_PREFILL_BUF_BLK = 7,
    /* Serving extension (see AttnSeqParams). */
    FM_PREFILL_BUF_SEQ_PARAMS = 8,   /* AttnSeqParams, with FM_FC_PREFILL_SEQ */
    FM_PREFILL_BUF_CU_SEQLENS_Q = 9, /* int32 [B+1], with FM_FC_VARLEN_Q */
    FM_PREFILL_BUF_CU_SEQLENS_K = 10,/* int32 [B+1], with FM_FC_VARLEN_K */
    FM_PREFILL_BUF_SEQLENS_K = 11,   /* int32 [B], with FM_FC_KV_LENS */
    FM_PREFILL_BUF_BLOCK_TABLE = 12, /* int32 [B, max_pages], with FM_FC_PAGED */
    FM_PREFILL_BUF_SINKS = 13,       /* float32 [H], with FM_FC_HAS_SINKS */
    FM_PREFILL_BUF_LSE = 14,         /* float32 out, with FM_FC_HAS_LSE */
    FM_PREFILL_BUF_ALIBI = 15        /* float32 [B, H] slopes, with FM_FC_HAS_ALIBI */
} FMPrefillBinding;

typedef enum FMBlkBinding {
    FM_BLK_BUF_MASK = 0, FM_BLK_BUF_OUT = 1, FM_BLK_BUF_PARAMS = 2 /* BlkParams */
} FMBlkBinding;

typedef enum FMMaskBuilderBinding {
    FM_MASKB_BUF_OUT = 0, FM_MASKB_BUF_PARAMS = 1 /* MaskParams */
} FMMaskBuilderBinding;

typedef enum FMVecBinding {
    FM_VEC_BUF_PARAMS = 0, /* FlashAttnVecParams */
    FM_VEC_BUF_Q = 1, FM_VEC_BUF_K = 2, FM_VEC_BUF_V = 3, FM_VEC_BUF_TMP = 4,
    /* Serving extension (see FlashAttnVecSeqParams). */
    FM_VEC_BUF_SEQ_PARAMS = 5,  /* FlashAttnVecSeqParams, with FM_FC_VEC_SEQ */
    FM_VEC_BUF_SEQLENS_K = 6,   /* int32 [B], with FM_FC_VEC_KV_LENS */
    FM_VEC_BUF_BLOCK_TABLE = 7, /* int32 [B, max_pages], with FM_FC_VEC_PAGED */
    FM_VEC_BUF_ALIBI = 8,       /* float32 [B * H] slopes of rows b * H + h, with FM_FC_VEC_ALIBI:
                                 * key p scores -slope * (kv_len_b - 1 - p) more, after the softcap */
    FM_VEC_BUF_Q_IO = 9         /* q in the K/V dtype, with FM_FC_VEC_Q_IO (then nothing at FM_VEC_BUF_Q) */
} FMVecBinding;

typedef enum FMVecReduceBinding {
    FM_VEC_REDUCE_BUF_PARAMS = 0, /* FlashAttnVecReduceParams */
    FM_VEC_REDUCE_BUF_TMP = 1, FM_VEC_REDUCE_BUF_OUT = 2,
    FM_VEC_REDUCE_BUF_NWG = 3,    /* uint32 */
    FM_VEC_REDUCE_BUF_SIGNS = 4,  /* with FM_FC_VEC_HAS_SIGNS */
    /* Serving extension of the plain reduce. */
    FM_VEC_REDUCE_BUF_SINKS = 5,  /* float32 [H], with FM_FC_VEC_SINKS */
    FM_VEC_REDUCE_BUF_LSE = 6,    /* float32 [rows] out, with FM_FC_VEC_LSE */
    FM_VEC_REDUCE_BUF_EXT = 7,    /* FlashAttnVecReduceExtParams, with 504 or 505 */
    /* The output in another dtype (then nothing at FM_VEC_REDUCE_BUF_OUT): the float32 result rounded to
     * nearest even. */
    FM_VEC_REDUCE_BUF_OUT_F16 = 8,  /* with FM_FC_VEC_OUT_F16 */
    FM_VEC_REDUCE_BUF_OUT_BF16 = 9  /* with FM_FC_VEC_OUT_BF16 */
} FMVecReduceBinding;

typedef enum FMKVAppendBinding {
    FM_APPEND_BUF_PARAMS = 0,     /* KVAppendParams */
    FM_APPEND_BUF_K_NEW = 1, FM_APPEND_BUF_V_NEW = 2,
    FM_APPEND_BUF_K_CACHE = 3, FM_APPEND_BUF_V_CACHE = 4,
    FM_APPEND_BUF_SEQLENS = 5,    /* int32 [B]: where row 0 of each sequence goes */
    FM_APPEND_BUF_BLOCK_TABLE = 6 /* with FM_FC_APPEND_PAGED */
} FMKVAppendBinding;

typedef enum FMSdpaBinding {
    FM_SDPA_BUF_Q = 0, FM_SDPA_BUF_K = 1, FM_SDPA_BUF_V = 2, FM_SDPA_BUF_O = 3,
    FM_SDPA_BUF_PARAMS = 4,        /* SdpaParams */
    FM_SDPA_BUF_MASK_PARAMS = 5,   /* AttnMaskParams, with a mask */
    FM_SDPA_BUF_ADDITIVE_MASK = 6, /* with FM_FC_SDPA_ADDITIVE_MASK */
    FM_SDPA_BUF_BOOL_MASK = 7,     /* with FM_FC_SDPA_BOOL_MASK */
    FM_SDPA_BUF_EXT = 8            /* SdpaExtParams, with FM_FC_SDPA_EXT */
} FMSdpaBinding;

/* The mask a prefill or sdpa call carries. */
typedef enum FMMaskKind {
    FM_MASK_NONE = 0, FM_MASK_ADDITIVE = 1, FM_MASK_BOOL = 2
} FMMaskKind;

/* Split-KV decode: the number of workgroups each row's keys are split over. */
enum { FM_VEC_NWG = 32 };

/* Split-KV decode: the most query rows (one SIMD group each) one main
 * threadgroup serves, sharing each K/V row it reads, by tile width D: 32
 * (1024 threads, as MLX's sdpa_vector) up to D = 128, 16 up to D = 256, 8
 * beyond (a lane holds ~32 + 3 * D / 32 floats: partial dots, q, output and
 * one K/V row). The kernel declares 32 times this as its
 * max_total_threads_per_threadgroup. */
enum { FM_VEC_GROUP_ROWS_D128 = 32, FM_VEC_GROUP_ROWS_D256 = 16, FM_VEC_GROUP_ROWS_WIDE = 8 };

/* Split-KV decode: which keys workgroup w reads, on every backend (so tmp
 * means the same on cpu, sim and Metal). The visible keys [lo, hi) of a row
 * are cut into chunks at absolute multiples of FM_VEC_CHUNK; the
 * chunks = ceil(hi / C) - floor(lo / C) of them are dealt as contiguous
 * runs over the first busy = min(chunks, FM_VEC_NWG) workgroups: w < busy
 * takes chunks [c0 + chunks*w/busy, c0 + chunks*(w+1)/busy), c0 = floor(lo/C);
 * the others read no key and write S = 0 (their O partial is then
 * unspecified: the reduce ignores it). Contiguous runs
 * let cpu prefetchers stream, and a key's partial depends only on its
 * position (paged and contiguous caches give the same bits). */
enum { FM_VEC_CHUNK = 32 };

/* sdpa: query rows per threadgroup, one thread each (the kernel indexes rows
 * by tgid.z * FM_SDPA_TILE_Q + tid). */
enum { FM_SDPA_TILE_Q = 32 };

/* ---- kernel parameter structs (mlx-native's layouts; AttnParams.Dv fills its
 * pad, FlashAttnVecParams appends head_dim_v) --------------------------------- */

/* Prefill: buffer(4). 160 bytes. Strides are (batch, head, seq) in elements.
 * D is q's and k's head dim (the QK dot), Dv v's and the output's (flash-attn's
 * head_dim_v; Dv == D but for MLA-style shapes): V loads stop at Dv, the
 * output rows hold Dv elements. The kernel's tile is at least max(D, Dv). */
typedef struct AttnParams {
    int32_t B;
    int32_t H;
    int32_t D;
    int32_t qL;
    int32_t kL;
    int32_t gqa_factor;
    float scale;
    float softcapping; /* logit softcap c; 0 disables it */
    int32_t NQ;
    int32_t NK;
    int32_t NQ_aligned;
    int32_t NK_aligned;
    int32_t qL_rem;
    int32_t kL_rem;
    int32_t qL_off;
    int32_t Dv;
    int64_t Q_strides[3];
    int64_t K_strides[3];
    int64_t V_strides[3];
    int64_t O_strides[3];
} AttnParams;

/* Prefill: buffer(5), only with a mask. 24 bytes. (batch, head, qL) strides. */
typedef struct AttnMaskParams {
    int64_t M_strides[3];
} AttnMaskParams;

/* Tile-skip pre-pass: buffer(2). 16 bytes. */
typedef struct BlkParams {
    int32_t seq_len_q;
    int32_t seq_len_k;
    int32_t mask_row_stride; /* elements between mask rows */
    int32_t _pad;
} BlkParams;

/* Decode: buffer(0). 48 bytes. mask_type 0 none, 1 causal, 2 sliding window.
 * head_dim is q's and k's (the QK dot), head_dim_v v's and the output's (the
 * partials in tmp and the reduce's rows hold head_dim_v elements). */
typedef struct FlashAttnVecParams {
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t kv_seq_len;
    uint32_t kv_capacity;
    float scale;
    uint32_t mask_type;
    uint32_t sliding_window;
    float softcap;
    uint32_t nwg;
    uint32_t head_dim_v;
    uint32_t _pad;
} FlashAttnVecParams;

/* Decode reduce (plain and FWHT-undo): buffer(0). 8 bytes. head_dim is the
 * true D (the kernel may be instantiated for a wider tile): the row stride of
 * tmp's partials and of out. */
typedef struct FlashAttnVecReduceParams {
    uint32_t nrows;
    uint32_t head_dim;
} FlashAttnVecReduceParams;

/* Simple SDPA: buffer(4). 32 bytes. */
typedef struct SdpaParams {
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t seq_len;
    uint32_t kv_seq_len;
    float scale;
    uint32_t kv_capacity;
    uint32_t do_causal;
} SdpaParams;

/* Simple SDPA extension: buffer(8) (FM_SDPA_BUF_EXT), bound only when
 * function constant 602 (FM_FC_SDPA_EXT) is true; SdpaParams stays mlx-native's. 16 bytes. With it,
 * query row i sits at absolute position t = q_offset + i (instead of the
 * plain kernel's bottom-right kv_len - qL + i), so q_offset = 0 is torch's top-left
 * causal alignment and kv_len - qL the KV-cache bottom-right one; it may be
 * negative (rows with t < 0 see no key under causal and output zeros).
 * Causal (SdpaParams.do_causal) keeps keys p <= t; window w > 0 keeps keys
 * with t - p < w (also without causal). softcap c > 0 applies c*tanh(s/c)
 * to the scaled score before the mask; it is read only when function
 * constant 603 (FM_FC_SDPA_SOFTCAP) is true. Constants 600/601 stay the mask's. */
typedef struct SdpaExtParams {
    float softcap;     /* c > 0; used only with constant 603 */
    int32_t q_offset;  /* absolute position of query row 0 */
    int32_t window;    /* 0 = no window */
    int32_t head_dim_v; /* v's and the output's head dim Dv (SdpaParams.head_dim is q's and k's) */
} SdpaExtParams;

/* ---- serving extension ---------------------------------------------------
 * The structs above stay mlx-native's byte for byte; serving adds these structs at
 * new buffer indices, switched on by new function constants.
 *
 * Prefill, per-sequence mode (any of FM_FC_VARLEN_Q, FM_FC_VARLEN_K,
 * FM_FC_KV_LENS, FM_FC_PAGED set). For sequence b:
 *   qL_b = VARLEN_Q ? cu_seqlens_q[b+1] - cu_seqlens_q[b] : AttnParams.qL
 *   kL_b = KV_LENS ? seqlens_k[b]
 *        : VARLEN_K ? cu_seqlens_k[b+1] - cu_seqlens_k[b] : AttnParams.kL
 *   f_b  = KV_LENS && key_starts_at > 0 ? seqlens_k[key_starts_at + b] : 0
 *          (the sequence's first key: flash-attn's cache_leftpad; the
 *          seqlens_k table then holds B lengths followed by B first keys)
 *   row i of q (and o, lse) is at  base + b*S[0] + h*S[1] + (qs + i)*S[2],
 *     qs = VARLEN_Q ? cu_seqlens_q[b] : 0 (the dispatcher sets S[0] = 0 then);
 *   key p of k (and v), kv head g:
 *     PAGED:    base + block_table[b*max_pages + p/page_size]*K_page_stride
 *                    + g*K_strides[1] + (p % page_size)*K_strides[2]
 *     VARLEN_K: base + g*K_strides[1] + (cu_seqlens_k[b] + p)*K_strides[2]
 *     else:     base + b*K_strides[0] + g*K_strides[1] + p*K_strides[2]
 *   row i sits at position t = kL_b - qL_b + i (bottom-right, flash-attn's
 *   convention); outside per-sequence mode t = AttnParams.qL_off + i.
 *   AttnParams.qL/kL then hold the largest lengths (grid bound: NQ tiles);
 *   align_Q = align_K = false; no mask, no blk.
 * Key p is visible to row i iff f_b <= p < kL_b
 *   && (!do_causal || p <= t)
 *   && (!FM_FC_WINDOW || ((window_left < 0 || p >= t - window_left)
 *                      && (window_right < 0 || p <= t + window_right)
 *                      && (attention_chunk == 0
 *                          || floor((p - f_b) / attention_chunk) == floor((t - f_b) / attention_chunk)))).
 * Key tiles wholly invisible to a threadgroup's rows are never loaded.
 * s_p = softcap(scale * q.k_p) (natural units), then with ALiBi (FM_FC_HAS_ALIBI,
 *   float32 slopes [B, H] at buffer 15): s_p -= slopes[b*H + h] * |t - p|. Sinks (FM_FC_HAS_SINKS):
 *   o_i = sum_p e^{s_p} v_p / (sum_p e^{s_p} + e^{sinks[h]}); the sink has no value.
 * LSE (FM_FC_HAS_LSE): lse_i = log(sum_p e^{s_p} [+ e^{sinks[h]}]), natural log,
 *   -inf for a row that sees no key and has no sink (its o_i is 0). A +inf sink
 *   takes all the mass (the limit): o_i = 0, lse_i = +inf.
 * Paged: page_size is any positive size (a key tile of a page size that is
 * not a multiple of BK reads each key's page entry); every table entry a
 * kernel reads was checked to be in
 * [0, num_pages) before the dispatch. Prefill buffer(8). 64 bytes. */
typedef struct AttnSeqParams {
    int32_t window_left;   /* -1 = unbounded, else >= 0 (with FM_FC_WINDOW) */
    int32_t window_right;  /* -1 = unbounded, else >= 0 (with FM_FC_WINDOW) */
    int32_t page_size;     /* keys per page (FM_FC_PAGED) */
    int32_t max_pages;     /* block_table row length (FM_FC_PAGED) */
    int64_t K_page_stride; /* elements between pages of K (FM_FC_PAGED) */
    int64_t V_page_stride; /* elements between pages of V (FM_FC_PAGED) */
    int64_t lse_strides[3];/* (batch, head, row) of lse in elements (FM_FC_HAS_LSE) */
    int32_t attention_chunk; /* 0 = off, else > 0: keys in t's chunk (with FM_FC_WINDOW) */
    int32_t key_starts_at;   /* 0 = every f_b is 0, else B: seqlens_k[B + b] is f_b (with FM_FC_KV_LENS) */
} AttnSeqParams;

/* Decode with per-sequence caches: vec buffer(5), with FM_FC_VEC_SEQ. 80
 * bytes. Row r = b * n_heads + h of q [B, H, D] reads kv head
 * g = h / (n_heads / n_kv_heads) of sequence b: key p at
 *   PAGED (FM_FC_VEC_PAGED): k + block_table[b*max_pages + p/page_size]*K_strides[0]
 *                            + g*K_strides[1] + (p % page_size)*K_strides[2]
 *   else:                    k + b*K_strides[0] + g*K_strides[1] + p*K_strides[2]
 * (V likewise). kv_len_b = FM_FC_VEC_KV_LENS ? seqlens_k[b] : kv_seq_len; the
 * query sits at kv_len_b - 1; FlashAttnVecParams.mask_type/sliding_window
 * apply per sequence (flash-attn's window_size left w is sliding_window
 * w + 1). f_b = key_starts_at > 0 (with FM_FC_VEC_KV_LENS) ? seqlens_k[key_starts_at + b]
 * : 0 is the sequence's first key (flash-attn's cache_leftpad): keys p < f_b are
 * hidden, and attention_chunk c > 0 further hides keys
 * p < f_b + floor((kv_len_b - 1 - f_b) / c) * c (outside the query's chunk).
 * f_b >= kv_len_b or kv_len_b == 0: the row sees no key.
 * Short queries (q_rows = L > 1): sequence b has L query rows, row i at
 * position t = kv_len_b - L + i (bottom-right); every rule above then applies
 * to t in place of kv_len_b - 1 (window: t - p < sliding_window; chunk: keys
 * in [s, s + c) with s = f_b + floor((t - f_b) / c) * c, none when t < f_b), keys p > t +
 * window_right are hidden (causal: window_right 0), and ALiBi scores
 * -slope * |t - p|. q, out and tmp rows are r = (b * L + i) * H + h
 * (head_major: r = (b * H + h) * L + i, q/out [B, H, L, D]); the
 * grid's y runs over rows ordered (b, kv head, i, head within the group), so
 * one threadgroup's SIMD groups share a kv head's K/V reads across i too.
 * page_size: any positive size (not a multiple of 16: a page entry per key).
 * With FM_FC_VEC_SEQ, FlashAttnVecParams.n_heads/n_kv_heads are per sequence
 * (H, Hkv); rows = B * L * H (the grid's y times the query heads per threadgroup)
 * and tmp holds B * L * H rows laid out as
 * without it; kv_capacity is the keys a sequence can hold (cap, or
 * max_pages * page_size when paged) and bounds every seqlens_k[b]. */
typedef struct FlashAttnVecSeqParams {
    int64_t K_strides[3];  /* (batch, or page when paged; kv head; row), elements */
    int64_t V_strides[3];
    uint32_t page_size;    /* FM_FC_VEC_PAGED */
    uint32_t max_pages;    /* FM_FC_VEC_PAGED: block_table row length */
    uint32_t attention_chunk; /* 0 = off, else > 0 */
    uint32_t key_starts_at;   /* 0 = every f_b is 0, else B: seqlens_k[B + b] is f_b */
    uint32_t q_rows;          /* query rows per sequence L (0 or 1: one, the decode) */
    int32_t window_right;     /* keys p <= t + window_right are visible; -1 = unbounded */
    uint32_t head_major;      /* 0: rows r = (b * L + i) * H + h; 1: r = (b * H + h) * L + i */
    uint32_t _pad;
} FlashAttnVecSeqParams;

/* Plain decode reduce with sinks/LSE: reduce buffer(7). 16 bytes. Row r has
 * head (r / head_rows) % n_heads. Sinks join the combined denominator once (as prefill);
 * lse[r] = M + log(S [+ e^{sink - M}]) in natural units, -inf for a row that
 * sees nothing and has no sink. */
typedef struct FlashAttnVecReduceExtParams {
    uint32_t n_heads;
    uint32_t head_rows; /* rows between one head's and the next's: 1, or L when head-major (0 reads as 1) */
    uint32_t _pad[2];
} FlashAttnVecReduceExtParams;

/* kv_append_{f32,f16,bf16}: kv_append buffer(0). 72 bytes. Writes row i of
 * sequence b of k_new/v_new [B, n_new, Hkv, D] to cache position
 * t = seqlens[b] + i:  PAGED: cache + block_table[b*max_pages + t/page_size]*
 * cache_strides[0] + (t % page_size)*cache_strides[1] + g*cache_strides[2];
 * else cache + b*cache_strides[0] + t*cache_strides[1] + g*cache_strides[2].
 * Grid (n_new, Hkv, B), D threads along x (any count; a loop covers D).
 * The strides are k's (multiples of head_dim, C-contiguous rows); v's rows
 * sit at the same index scaled by head_dim_v / head_dim. */
typedef struct KVAppendParams {
    int32_t n_new;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t page_size;       /* FM_FC_APPEND_PAGED */
    int32_t max_pages;       /* FM_FC_APPEND_PAGED */
    int32_t head_dim_v;      /* v's head dim Dv (v_new/v_cache rows; k's are head_dim) */
    int64_t new_strides[3];  /* (batch, row, kv head) of k_new/v_new */
    int64_t cache_strides[3];/* (batch or page, row, kv head) of the caches */
} KVAppendParams;

/* Mask builder (flash_attn_prefill_mask_{bf16,f16}): buffer(1). 24 bytes.
 * Cell (i, p) is 0 when visible, else -inf; t = q_offset + i; visible iff
 * (!causal || p <= t) && (window == 0 || t - p < window). */
typedef struct MaskParams {
    int32_t seq_len_q;
    int32_t seq_len_k;
    int32_t q_offset;
    int32_t window;   /* 0 = no window */
    int32_t causal;   /* 0 or 1 */
    int32_t _pad;
} MaskParams;

/* ---- rotary embedding (flash_attn_with_kvcache's rotary_cos/rotary_sin) ----
 * rotary_{x}_{cs}: x [B, L, H, D] (x = f32, f16 or bf16) -> out, same shape
 * and dtype; cos/sin [seqlen_ro, rotary_half] (cs = f32, f16 or bf16).
 * Row i of sequence b sits at position t = offsets[b] + (per_row ? i : 0);
 * with c = cos[t, j], s = sin[t, j] for j < rotary_half, the pair (x1, x2)
 * = (x[j], x[j + rotary_half]) (interleaved: (x[2j], x[2j + 1])) becomes
 * (x1*c - x2*s, x1*s + x2*c), computed in float32 and rounded once to x's
 * dtype; dims from 2*rotary_half on are copied. The host checked every t
 * against seqlen_ro. Grid (L, H, B), any threads along x. 24 bytes. */
typedef struct RotaryParams {
    int32_t n_rows;      /* L */
    int32_t n_heads;     /* H */
    int32_t head_dim;    /* D */
    int32_t rotary_half; /* rotary_dim / 2, >= 1, 2*rotary_half <= D */
    int32_t interleaved; /* 0: halves (GPT-NeoX); 1: even/odd pairs (GPT-J) */
    int32_t per_row;     /* 1: row i at offsets[b] + i; 0: every row at offsets[b] */
} RotaryParams;

typedef enum FMRotaryBinding {
    FM_ROT_BUF_PARAMS = 0, /* RotaryParams */
    FM_ROT_BUF_X = 1, FM_ROT_BUF_COS = 2, FM_ROT_BUF_SIN = 3, FM_ROT_BUF_OFFSETS = 4, FM_ROT_BUF_OUT = 5
} FMRotaryBinding;

/* ---- quantized KV codec (kv_encode / kv_dequantize) ----------------------
 * Codec math and packing: Resources/shaders/kv_codec.h. Row r of x [R, D]
 * (float32, float16 or bfloat16) becomes codes [R, row_bytes] (uint8, packed
 * little-endian, zero padding to row_bytes) and norms [R, D / block]
 * (float32, one per rotation block); kv_dequantize maps them back to float32
 * [R, D]. Grid (R, 1, 1) of any number of threads along x; one row per
 * threadgroup. 32 bytes. */
typedef struct KVCodecParams {
    uint64_t seed;      /* rotation signs: fm_kvq_sign_bit(seed, coordinate) */
    int32_t head_dim;   /* D, a multiple of block, <= FM_KVQ_MAX_HEAD_DIM */
    int32_t bits;       /* 2, 3, 4, 5, 6 or 8 */
    int32_t block;      /* rotation block n: 16, 32, 64, 128, 256 or 512 */
    int32_t row_bytes;  /* bytes per row of codes: D*bits/8 rounded up to 16 */
    int32_t _pad[2];
} KVCodecParams;

enum { FM_KVQ_MAX_HEAD_DIM = 512 };

typedef enum FMKVEncodeBinding {
    FM_KVENC_BUF_PARAMS = 0, /* KVCodecParams */
    FM_KVENC_BUF_X = 1, FM_KVENC_BUF_CODES = 2, FM_KVENC_BUF_NORMS = 3
} FMKVEncodeBinding;

typedef enum FMKVDequantizeBinding {
    FM_KVDEQ_BUF_PARAMS = 0, /* KVCodecParams */
    FM_KVDEQ_BUF_CODES = 1, FM_KVDEQ_BUF_NORMS = 2, FM_KVDEQ_BUF_OUT = 3
} FMKVDequantizeBinding;

/* kv_codes_decode: attention of query rows over quantized K and V caches
 * (kv_encode's codes and norms), buffer(0). Row r = (b*q_len +
 * i)*n_heads + h of q [B, q_len, H, D] reads kv head g = h / (n_heads /
 * n_kv_heads). Sequence b has kL = seqlens_k[b] keys (kv_len when
 * FM_FC_KVQ_LENS is off); row i sits at t = kL - q_len + i and sees key p
 * when (!causal || p <= t), window_left < 0 || p >= t - window_left,
 * window_right < 0 || p <= t + window_right and (attention_chunk == 0 ||
 * floor(p / c) == floor(t / c)). Key p is storage row
 * b*kv_strides[0] + p*kv_strides[2] + g*kv_strides[1] of both caches, or
 * when paged block_table[b*max_pages + p / page_size]*kv_strides[0] +
 * (p % page_size)*kv_strides[2] + g*kv_strides[1]; codes at row*row_bytes,
 * norms at row*(D/block).
 * With qz = H(s_k ⊙ q) per block: s_p = scale * Σ_blocks (r_k/block)
 * Σ_i qz_i c_k[code_i], softcap c > 0 gives c*tanh(s/c); a sink logit joins
 * the denominator without a value; o = s_v ⊙ H(Σ_p e^{s_p} c_v[code]
 * r_v/block) / denominator; lse [B, H, q_len] = log(denominator) (-inf when
 * empty). Varlen (FM_FC_KVQ_VARLEN_Q): q/out [q_len = total_q, H, D] packed,
 * row r = token*H + h, sequence b the one with cu_seqlens_q[b] <= token <
 * cu_seqlens_q[b+1] (a token past cu_seqlens_q[B] is not written), its rows
 * cu_seqlens_q[b+1] - cu_seqlens_q[b]; lse [H, total_q]. FM_FC_KVQ_VARLEN_K:
 * kL = cu_seqlens_k[b+1] - cu_seqlens_k[b]. 128 bytes.
 * Grid (tokens * H / heads_per_group, nwg, 1) of FM_KVQ_DECODE_THREADS
 * threads (tokens = B*q_len, varlen total_q): threadgroup (u, w) is one
 * SIMD group serving query heads h0 .. h0 + heads_per_group - 1 of token
 * u / (H / heads_per_group) (h0 = u % (H / heads_per_group) *
 * heads_per_group, all of one kv head) over split w of the token's keys:
 * the keys are cut into chunks of 32 / heads_per_group at absolute
 * multiples of it, and split w < busy = min(chunks, nwg) takes chunks
 * [c0 + chunks*w/busy, c0 + chunks*(w+1)/busy). With nwg == 1 the
 * threadgroup writes the output; with FM_FC_KVQ_SPLIT it writes, per row r
 * = token*H + h and split w, the unnormalised accumulator in V's rotated
 * basis to tmp[(r*nwg + w)*D ...] and (S, M) (natural log units; S = 0 for
 * a split without keys) to tmp[rows*nwg*D + (r*nwg + w)*2], and
 * kv_codes_reduce finishes (sinks, LSE, the rotation undone). */
typedef struct KVCodesDecodeParams {
    uint64_t k_seed;
    uint64_t v_seed;
    int64_t kv_strides[3]; /* storage rows between (sequence or page, kv head, key) */
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t block;
    int32_t k_bits;
    int32_t v_bits;
    int32_t k_row_bytes;
    int32_t v_row_bytes;
    int32_t kv_len;        /* keys of every sequence when seqlens_k is not bound */
    int32_t q_len;         /* query rows per sequence */
    float scale;
    float softcap;         /* 0 = off */
    int32_t causal;        /* 0 or 1 */
    int32_t window_left;   /* -1 = unbounded */
    int32_t window_right;  /* -1 = unbounded */
    int32_t attention_chunk; /* 0 = off */
    int32_t page_size;     /* keys per page (paged) */
    int32_t max_pages;     /* block_table's dim 1 (paged) */
    int32_t batch;         /* sequences (B) */
    int32_t nwg;           /* key splits of kv_codes_decode's grid (1: no reduce) */
    int32_t heads_per_group; /* query heads one kv_codes_decode SIMD group serves (a power of two) */
    int32_t _pad;
} KVCodesDecodeParams;

/* FM_KVQ_DECODE_LANE_FLOATS: heads_per_group * ceil(D / 32) is at most this
 * (a lane's query and accumulator coordinates over its heads).
 * FM_KVQ_MAX_SPLITS: the most key splits (nwg) of kv_codes_decode. */
enum { FM_KVQ_DECODE_THREADS = 32, FM_KVQ_DECODE_LANE_FLOATS = 16, FM_KVQ_MAX_SPLITS = 128 };

/* kv_codes_reduce: the split decode's partials merged, grid (rows, 1, 1)
 * (rows = tokens*H) of FM_KVQ_DECODE_THREADS threads, buffers
 * FMKVCodesReduceBinding; function constants 802, 803, 806 and 809 as the
 * decode's. */
typedef enum FMKVCodesReduceBinding {
    FM_KVQR_BUF_PARAMS = 0, /* KVCodesDecodeParams */
    FM_KVQR_BUF_TMP = 1,    /* float32 partials of kv_codes_decode */
    FM_KVQR_BUF_OUT = 2,    /* float32 [tokens, H, D] */
    FM_KVQR_BUF_SINKS = 3,  /* float32 [H], with FM_FC_KVQ_SINKS */
    FM_KVQR_BUF_LSE = 4,    /* float32 out, with FM_FC_KVQ_LSE */
    FM_KVQR_BUF_CU_SEQLENS_Q = 5 /* int32 [B+1], with FM_FC_KVQ_VARLEN_Q */
} FMKVCodesReduceBinding;

/* kv_codes_prefill: the same params, buffers and function constants as
 * kv_codes_decode (nwg 1, never split; heads_per_group unused). Grid (ceil(rows *
 * (H / Hkv) / FM_KVQ_PREFILL_ROWS), Hkv, B) of FM_KVQ_PREFILL_ROWS *
 * FM_KVQ_DECODE_THREADS threads, rows = q_len (varlen: the most rows of any
 * sequence): threadgroup (x, g, b) takes items x*FM_KVQ_PREFILL_ROWS + s
 * (s < FM_KVQ_PREFILL_ROWS) of kv head g of sequence b, item = query row *
 * (H / Hkv) + head within the group; each tile of keys is decoded into
 * FM_KVQ_PREFILL_TILE_FLOATS floats of threadgroup memory (K then V rows,
 * FM_KVQ_PREFILL_TILE_FLOATS / 2 / D keys). */
enum { FM_KVQ_PREFILL_ROWS = 8, FM_KVQ_PREFILL_TILE_FLOATS = 4096 };

typedef enum FMKVCodesDecodeBinding {
    FM_KVQD_BUF_PARAMS = 0, /* KVCodesDecodeParams */
    FM_KVQD_BUF_Q = 1,      /* float32 [B, q_len, H, D] */
    FM_KVQD_BUF_K_CODES = 2, FM_KVQD_BUF_K_NORMS = 3,
    FM_KVQD_BUF_V_CODES = 4, FM_KVQD_BUF_V_NORMS = 5,
    FM_KVQD_BUF_OUT = 6,    /* float32 [B, q_len, H, D] */
    FM_KVQD_BUF_SEQLENS = 7,     /* int32 [B], with FM_FC_KVQ_LENS */
    FM_KVQD_BUF_BLOCK_TABLE = 8, /* int32 [B, max_pages], with FM_FC_KVQ_PAGED */
    FM_KVQD_BUF_SINKS = 9,       /* float32 [H], with FM_FC_KVQ_SINKS */
    FM_KVQD_BUF_LSE = 10,        /* float32 [B, H, q_len] out, with FM_FC_KVQ_LSE */
    FM_KVQD_BUF_K_DENSE = 11,    /* dense K [rows, D] (f32/f16/bf16), with FM_FC_KVQ_K_DENSE; codes unbound */
    FM_KVQD_BUF_V_DENSE = 12,    /* dense V [rows, D], with FM_FC_KVQ_V_DENSE; codes unbound */
    FM_KVQD_BUF_CU_SEQLENS_Q = 13, /* int32 [B+1], with FM_FC_KVQ_VARLEN_Q */
    FM_KVQD_BUF_CU_SEQLENS_K = 14, /* int32 [B+1], with FM_FC_KVQ_VARLEN_K */
    FM_KVQD_BUF_ALIBI = 15,        /* float32 [B, H] ALiBi slopes, with FM_FC_KVQ_ALIBI: key t's score at
                                    * row position r gains -alibi[b, h] * |r - t| after the softcap */
    FM_KVQD_BUF_TMP = 16           /* float32 partials, with FM_FC_KVQ_SPLIT (and kv_codes_reduce) */
} FMKVCodesDecodeBinding;

/* kv_codes_append: row i of sequence b of k_new/v_new [B, n_new, Hkv, D]
 * (float32, float16 or bfloat16) encoded into both code caches at key
 * t = seqlens[b] + i, storage row b*cache_strides[0] + t*cache_strides[1] +
 * g*cache_strides[2], or through block_table when paged (page_size > 0):
 * block_table[b*max_pages + t / page_size]*cache_strides[0] + (t %
 * page_size)*cache_strides[1] + g*cache_strides[2]. Bits as kv_encode's.
 * Grid (n_new, Hkv, B) of any number of threads. 128 bytes. */
typedef struct KVCodesAppendParams {
    KVCodecParams k;
    KVCodecParams v;
    int64_t new_strides[3];   /* elements between (sequence, new row, kv head) of k_new/v_new */
    int64_t cache_strides[3]; /* storage rows between (sequence or page, key, kv head) */
    int32_t n_new;
    int32_t page_size;        /* 0 = not paged */
    int32_t max_pages;
    int32_t _pad;
} KVCodesAppendParams;

typedef enum FMKVCodesAppendBinding {
    FM_KVQA_BUF_PARAMS = 0, /* KVCodesAppendParams */
    FM_KVQA_BUF_K_NEW = 1, FM_KVQA_BUF_V_NEW = 2,
    FM_KVQA_BUF_K_CODES = 3, FM_KVQA_BUF_K_NORMS = 4,
    FM_KVQA_BUF_V_CODES = 5, FM_KVQA_BUF_V_NORMS = 6,
    FM_KVQA_BUF_SEQLENS = 7,     /* int32 [B] */
    FM_KVQA_BUF_BLOCK_TABLE = 8, /* int32 [B, max_pages], with FM_FC_KVQ_APPEND_PAGED */
    FM_KVQA_BUF_K_DENSE = 9,     /* dense K cache of k_new's dtype, with FM_FC_KVQ_APPEND_K_DENSE */
    FM_KVQA_BUF_V_DENSE = 10     /* dense V cache, with FM_FC_KVQ_APPEND_V_DENSE */
} FMKVCodesAppendBinding;

#endif /* FLASHMETAL_KERNELS_H */
