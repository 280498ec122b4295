/*
 * flashmetal.h — the library's public C ABI: tensors, options, errors and
 * entry points. The kernels' own interface (function constants, buffer
 * indices, parameter structs) is flashmetal_kernels.h, which callers never
 * need.
 *
 * Two readers besides C and C++ callers:
 *   - Swift (through the CFlashMetal module) for the @_cdecl entry points,
 *   - cffi (python/flashmetal/_loader.py), which reads the text between the
 *     FM_CDEF markers with preprocessor lines removed. Keep that part free of
 *     macros, attributes and expressions cffi cannot parse.
 *
 * Sizes and offsets of the structs are pinned by static asserts in
 * layout_checks.c.
 */
#ifndef FLASHMETAL_H
#define FLASHMETAL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The release of the library and of the Python package (one source). */
#define FM_VERSION "0.1.0"

/* FM_CDEF_BEGIN */

/* The version of this C ABI: bumped on every incompatible change to a struct
 * or an entry point. The Python package checks fm_abi_version() against the
 * value of the header it ships. */
enum { FM_ABI_VERSION = 14 };

/* The most query rows per sequence of a short query: fm_dispatch_vec_seq's
 * q [B, L, H, D] takes 1 <= L <= FM_SHORT_QUERY_ROWS. */
enum { FM_SHORT_QUERY_ROWS = 8 };

/* FMVecOptions.mask_type. */
typedef enum FMVecMaskType {
    FM_VEC_MASK_NONE = 0, FM_VEC_MASK_CAUSAL = 1, FM_VEC_MASK_WINDOW = 2
} FMVecMaskType;

/* Element types of borrowed tensors. */
typedef enum FMDType {
    FM_DTYPE_F32 = 0,
    FM_DTYPE_F16 = 1,
    FM_DTYPE_BF16 = 2,
    FM_DTYPE_BOOL = 3,   /* one byte per element; every kernel reads any nonzero byte as true */
    FM_DTYPE_U8 = 4,
    FM_DTYPE_I32 = 5
} FMDType;

/* Every entry point returns one of these; the details go to `err` (FMError). */
typedef enum FMStatus {
    FM_OK = 0,
    FM_ERROR_VALUE = 1,    /* a bad shape, size, length or option */
    FM_ERROR_TYPE = 2,     /* a bad dtype */
    FM_ERROR_BACKEND = 3,  /* a backend could not be created or failed */
    FM_ERROR_INTERNAL = 4, /* a bug: please report */
    FM_ERROR_INTERRUPTED = 5, /* a SIGINT cancelled the call; outputs are unspecified */
    FM_ERROR_UNSUPPORTED = 6  /* a feature no kernel implements for this call */
} FMStatus;

/* The error of a call, every entry point's last parameter (NULL = not
 * wanted). In: public_op, the public function the caller is running (NULL or
 * "" = the entry point's own op): every error of the call names it, and the
 * argument names follow that function's parameters. Out: the status, the op,
 * the argument at fault ("" when the error is not about one argument) and
 * what is wrong with it, naming the value (no op prefix); on success FM_OK
 * and empty strings. Strings are NUL-terminated and truncated to fit. */
typedef struct FMError {
    const char *public_op;
    int32_t status;
    int32_t _pad;
    char op[64];
    char argument[64];
    char message[1024];
} FMError;

/* Prefill layouts: head-major [B, H, L, D] or seq-major [B, L, H, D]. */
typedef enum FMLayout {
    FM_LAYOUT_BHLD = 0,
    FM_LAYOUT_BLHD = 1
} FMLayout;

/* A borrowed, C-contiguous host tensor. The library checks nbytes against
 * the shape before it touches `data`. `tag` is 0 for caller memory; a tensor
 * from fm_alloc_blk carries a tag the library never hands out twice, by which
 * it recognises stale copies and checks the blk's geometry. */
typedef struct FMTensor {
    void *data;
    uint64_t nbytes;
    int32_t dtype;
    int32_t ndim;
    int64_t shape[8];
    uint64_t tag;
} FMTensor;

typedef struct FMRegistry FMRegistry;

typedef struct FMPrefillOptions {
    float scale;      /* finite; 1/sqrt(D) is the usual choice */
    float softcap;    /* 0 = off, else > 0 */
    int32_t causal;   /* 0 or 1 */
    int32_t q_offset; /* absolute position of query row 0, >= 0 */
    int32_t kv_len;   /* valid K/V length; 0 = all of K's sequence axis */
    int32_t layout;   /* FMLayout */
    int32_t window;   /* 0 = none, else keys p with t - p < window */
    int32_t _pad;
} FMPrefillOptions;

/* fm_build_mask: cell (i, p) of out is 0 when key p is visible to query row
 * i, else -inf; row i sits at t = q_offset + i and sees p when
 * (!causal || p <= t) && (window == 0 || t - p < window). */
typedef struct FMMaskOptions {
    int32_t causal;   /* 0 or 1 */
    int32_t window;   /* 0 = none, else > 0 */
    int32_t q_offset; /* absolute position of query row 0, >= 0 */
    int32_t _pad;
} FMMaskOptions;

/* fm_dispatch_vec (decode, one query row per head; the query sits at
 * position kv_len - 1). */
typedef struct FMVecOptions {
    float scale;       /* finite */
    float softcap;     /* 0 = off, else > 0 */
    int32_t mask_type; /* FMVecMaskType */
    int32_t window;    /* mask_type 2: keys p with (kv_len - 1) - p < window */
    int32_t kv_len;    /* valid K/V length, 1..kv_capacity */
    int32_t fwht;      /* 1: reduce fused with the FWHT sign undo */
} FMVecOptions;

/* fm_dispatch_sdpa. Zeroed extension fields give the plain kernel:
 * bottom-right positions, no softcap, no window. */
typedef struct FMSdpaOptions {
    float scale;      /* finite; 1/sqrt(D) is the usual choice */
    int32_t causal;   /* 0 or 1 */
    int32_t kv_len;   /* valid K/V length; 0 = all of K's sequence axis */
    int32_t has_q_offset; /* 0: query i at kv_len - qL + i (bottom-right);
                             1: query i at q_offset + i (0 = top-left) */
    int32_t q_offset; /* with has_q_offset; may be negative */
    int32_t window;   /* 0 = none, else keys p with t - p < window */
    float softcap;    /* 0 = off, else > 0 */
    int32_t _pad;
} FMSdpaOptions;

/* ---- serving (flash-attn's API) -----------------------------------------
 * The per-sequence tensors of a serving call; each may be NULL. Every index
 * in them is checked against the buffers before any kernel reads through it. */
typedef struct FMSeqTensors {
    const FMTensor *cu_seqlens_q; /* int32 [B+1]: q/out packed [total_q, H, D] */
    const FMTensor *cu_seqlens_k; /* int32 [B+1]: k/v packed [total_k, Hkv, D] */
    const FMTensor *seqlens_k;    /* int32 [B]: valid keys of each cache row; or [2, B]: row 0
                                   * as [B], row 1 each sequence's first key (flash-attn's
                                   * cache_leftpad: keys [row1[b], row0[b]) are the sequence) */
    const FMTensor *block_table;  /* int32 [B, max_pages]: k/v [num_pages, page_size, Hkv, D] */
    const FMTensor *sinks;        /* float32 [H]: per-head sink logit */
    const FMTensor *lse;          /* float32 out: [B, H, qL], [H, total_q] varlen, [B, H] decode
                                   * ([B, L, H] over L short query rows) */
    const FMTensor *alibi_slopes; /* float32 [B, H]: score of key p at row position t gains
                                   * -slopes[b, h] * |t - p| after the softcap (flash-attn's ALiBi) */
    const FMTensor *seqused_q;    /* int32 [B], with cu_seqlens_q and cu_seqlens_k (flash-attn 3's):
                                   * sequence b's first seqused_q[b] <= cu_seqlens_q[b+1] - cu_seqlens_q[b]
                                   * rows attend; its other rows see no key (out 0, lse -inf or the
                                   * sink logit). seqlens_k beside cu_seqlens_k is flash-attn 3's seqused_k */
    const FMTensor *k_new;        /* [B, n_new, Hkv, D] with v_new and seqlens_k (flash_attn_with_kvcache's
                                   * k/v): appended into k/v, the caches, at each sequence's length
                                   * (fm_dispatch_kv_append), then attended with the lengths grown by
                                   * n_new; the append and the attention are validated before either
                                   * runs, so a call either refuses appends nothing (into quantized
                                   * caches under fm_dispatch_kv_codes_attn: fm_dispatch_kv_codes_append) */
    const FMTensor *v_new;        /* [B, n_new, Hkv, Dv] */
    const FMTensor *cu_seqlens_k_new; /* int32 [B+1], fm_dispatch_attn only: k_new/v_new are ragged,
                                       * [total_k_new, Hkv, D], sequence b appending its rows
                                       * cu_seqlens_k_new[b] ..< [b+1] (flash-attn 3's) */
    const FMTensor *cache_batch_idx; /* int32 [B], with seqlens_k (flash_attn_with_kvcache's): sequence b
                                      * reads and appends through cache row cache_batch_idx[b], of
                                      * block_table [batch_cache, max_pages] when paged, else of the
                                      * cache [batch_cache, cap, Hkv, D] (each row then one page of cap
                                      * keys); distinct rows when appending */
} FMSeqTensors;

/* fm_dispatch_attn / fm_dispatch_vec_seq. Causal and windows are
 * bottom-right per sequence (flash-attn): row i of sequence b at kL_b - qL_b + i. */
typedef struct FMAttnOptions {
    float scale;          /* finite */
    float softcap;        /* 0 = off, else > 0 */
    int32_t causal;       /* 0 or 1 */
    int32_t window_left;  /* -1 = unbounded, else >= 0 */
    int32_t window_right; /* -1 = unbounded, else >= 0 */
    int32_t max_seqlen_q; /* varlen q: >= every sequence's length; else ignored */
    int32_t max_seqlen_k; /* varlen k: >= every sequence's length; else ignored */
    int32_t attention_chunk; /* 0 = off, else > 0: row t sees keys p with p / c == t / c (floor) */
    int32_t head_major;   /* 0: flash-attn's layouts (q/out [B, L, H, D], caches [B, cap, Hkv, D]);
                           * 1 (fm_dispatch_vec_seq only): torch's head-major ones (q/out
                           * [B, H, L, D], lse [B, H, L], caches [B, Hkv, cap, D], pages
                           * [num_pages, Hkv, page_size, D]), without k_new or cache_batch_idx */
} FMAttnOptions;

/* The metal-sim runtime's counters (Linux builds), process-wide and only
 * growing (but LIVE_COMMAND_BUFFERS), in the order fm_metal_sim_counters
 * writes them. BYTES_COPIED_OUT: bytes of copied buffers the host read back
 * after their command buffer completed. WRAPS: buffers made over host memory
 * without a copy; COPY_BUFFERS: buffers made by copying host memory. */
typedef enum FMMetalSimCounter {
    FM_MSIM_COMMAND_BUFFERS = 0, FM_MSIM_COMMITS = 1, FM_MSIM_ENCODERS = 2, FM_MSIM_DISPATCHES = 3,
    FM_MSIM_BARRIERS = 4, FM_MSIM_BYTES_WRAPPED = 5, FM_MSIM_BYTES_COPIED_IN = 6,
    FM_MSIM_BYTES_COPIED_OUT = 7, FM_MSIM_VIOLATIONS = 8, FM_MSIM_LIVE_COMMAND_BUFFERS = 9,
    FM_MSIM_NO_COPY_REFUSED = 10, FM_MSIM_WRAPS = 11, FM_MSIM_COPY_BUFFERS = 12,
    FM_MSIM_COUNTER_COUNT = 13
} FMMetalSimCounter;

/* A quantized-KV codec (fm_kv_codec_layout, fm_dispatch_kv_encode/dequantize). */
typedef struct FMKVCodec {
    int32_t head_dim;
    int32_t bits;
    uint64_t seed;
} FMKVCodec;

/* The storage of one row (one token of one kv head) of a codec. */
typedef struct FMKVCodecLayout {
    int32_t block;      /* rotation block n */
    int32_t num_blocks; /* head_dim / block: float32 norms per row */
    int32_t row_bytes;  /* uint8 codes per row */
    int32_t _pad;
} FMKVCodecLayout;

/* fm_dispatch_kv_codes_decode. */
typedef struct FMKVCodesDecodeOptions {
    float scale;     /* finite */
    float softcap;   /* 0 = off, else > 0 */
    int32_t kv_len;  /* valid keys, 1..cap */
    int32_t window;  /* 0 = none, else keys p with (kv_len - 1) - p < window */
} FMKVCodesDecodeOptions;

/* One call of the front door (torch's scaled_dot_product_attention), as
 * fm_plan_attention checks it: the arguments beside q, k, v and sinks. Each
 * optional value is given when its has_ flag is 1. */
typedef struct FMAttentionCall {
    double scale;            /* has_scale: finite (default 1/sqrt(D)) */
    double softcap;          /* 0 = off, else finite > 0 */
    int64_t window;          /* has_window: 1..INT32_MAX */
    int64_t kv_len;          /* has_kv_len: 1..key's sequence length (default: all of it) */
    int64_t bias_query_rows; /* has_causal_bias: a causal attn_mask built for */
    int64_t bias_keys;       /* these query rows and keys (torch's CausalBias) */
    int32_t has_scale;
    int32_t has_window;
    int32_t has_kv_len;
    int32_t has_causal_bias;
    int32_t enable_gqa;      /* key heads may divide query heads */
    int32_t bottom_right;    /* align: 0 top_left (query i at i), 1 bottom_right (at kv_len - qL + i) */
} FMAttentionCall;
/* What a checked call is (FMAttentionPlan.kind). */
typedef enum FMAttentionPlanKind {
    FM_PLAN_RUN = 0,     /* route it (fm_route_attention) and run the kernel */
    FM_PLAN_EMPTY = 1,   /* B, H or qL is 0: the result is empty, no kernel runs */
    FM_PLAN_NO_KEYS = 2  /* key's sequence length 0: the result is zeros, no kernel runs */
} FMAttentionPlanKind;
/* A checked call's dims (rank-3 inputs read with batch 1), the keys it
 * attends and query row 0's position; why, as text, for kinds that run no
 * kernel. */
typedef struct FMAttentionPlan {
    int32_t kind;            /* FMAttentionPlanKind */
    int32_t _pad;
    int64_t batch;
    int64_t heads;
    int64_t kv_heads;
    int64_t query_rows;
    int64_t head_dim;
    int64_t head_dim_v;
    int64_t capacity;        /* key's sequence length */
    int64_t keys;            /* kv_len, or capacity */
    int64_t query_offset;    /* 0 top_left, keys - query_rows bottom_right */
    char reason[256];
} FMAttentionPlan;

/* The kernel families of the front door's routes (FMRoute.kernel). */
typedef enum FMRouteKernel {
    FM_ROUTE_DECODE = 1,  /* the split-KV decode kernel (fm_dispatch_vec / fm_dispatch_vec_seq) */
    FM_ROUTE_PREFILL = 2, /* the tiled prefill kernel (fm_dispatch_prefill) */
    FM_ROUTE_SDPA = 3     /* the general kernel, one thread per query row (fm_dispatch_sdpa) */
} FMRouteKernel;
/* One call of torch's scaled_dot_product_attention, as fm_route_attention
 * routes it. Flags are 0 or 1. */
typedef struct FMRouteCall {
    int32_t dtype;        /* FMDType of q (k and v alike) */
    int32_t window;       /* sliding window w > 0 (keys within w of the row), 0 = none */
    int64_t head_dim;     /* q's and k's, >= 1 */
    int64_t head_dim_v;   /* v's and the output's, >= 1 */
    int64_t query_rows;   /* qL >= 1 */
    int64_t keys;         /* keys attended, >= 1 */
    int64_t query_offset; /* position of query row 0 among the keys */
    int32_t mask;         /* an attn_mask array is applied */
    int32_t mask_is_key_ranges; /* that mask keeps one key range per batch row for the one query row */
    int32_t causal;
    int32_t sinks;
} FMRouteCall;
/* A route: the kernel and why, as text. */
typedef struct FMRoute {
    int32_t kernel; /* FMRouteKernel */
    char reason[512];
} FMRoute;

#if !defined(__swift__)
/* Entry points (implemented by @_cdecl functions in Sources/FlashMetal).
 * Hidden from Swift, which defines them. `err` may be NULL; otherwise it
 * receives the error (FMError).
 * Registry handles are never reused: a destroyed registry's handle (or any
 * other value) is an FM_ERROR_VALUE, never another registry. */
int fm_abi_version(void);
/* A static name for a status code ("FM_ERROR_VALUE"; "unknown status" else). */
const char *fm_status_string(int status);
int fm_create_registry(const char *backend, FMRegistry **out, FMError *err);
int fm_destroy_registry(FMRegistry *registry);
/* The backend's name ("cpu", "sim", "metal"); "" with an error status when
 * the registry is not live. */
int fm_registry_backend(const FMRegistry *registry, char *name, size_t namelen);
/* The backends this build can create, comma-separated ("cpu,metal-sim,sim"
 * on Linux; "auto" aside), into names (NUL-terminated, truncated to len).
 * One may still fail to open (a Mac whose session sees no GPU). */
void fm_backend_names(char *names, size_t len);
/* *out = 1 when the registry's backend defers the work of a batch scope to
 * its end (Metal: one command buffer), so the caller must keep the memory
 * of calls made inside the scope alive until fm_end_batch; else 0 (cpu and
 * sim finish every call before it returns). */
int fm_registry_defers_work(const FMRegistry *registry, int32_t *out, FMError *err);
/* A batch scope: until fm_end_batch a backend may defer work (Metal commits
 * one command buffer at the end); outputs are valid after fm_end_batch. */
int fm_begin_batch(FMRegistry *registry, FMError *err);
int fm_end_batch(FMRegistry *registry, FMError *err);
int fm_dispatch_prefill(FMRegistry *registry, const FMTensor *q, const FMTensor *k,
                        const FMTensor *v, const FMTensor *mask, const FMTensor *blk,
                        const FMTensor *out, const FMPrefillOptions *options,
                        FMError *err);
/* fm_dispatch_prefill with per-head sink logits: sinks float32 [H] (or
 * NULL) joins each head's softmax denominators without a value, beside the
 * mask, causal and window (gpt-oss). */
int fm_dispatch_prefill_sinks(FMRegistry *registry, const FMTensor *q, const FMTensor *k,
                              const FMTensor *v, const FMTensor *mask, const FMTensor *blk,
                              const FMTensor *sinks, const FMTensor *out,
                              const FMPrefillOptions *options, FMError *err);
const char *fm_version(void);
/* Threads the cpu backend's worker pool uses, the caller included: what the
 * pool decided (FLASHMETAL_NUM_THREADS as the pool reads it, else the
 * online CPUs). */
int32_t fm_num_threads(void);
/* Announces a cpu call soon: the worker pool's sleeping threads wake and spin
 * for it a short while (~0.4 ms), so a caller that prepares its arguments
 * first (the Python package) does not wait for their wake-up inside the call.
 * No effect before the pool exists or on other backends' calls. */
void fm_prepare_workers(void);
/* SIGINT cuts short a call only in the process's main thread (where Python
 * raises KeyboardInterrupt; the call returns FM_ERROR_INTERRUPTED), and only
 * while enabled: 1 enables, 0 disables; returns the previous setting.
 * FLASHMETAL_INTERRUPT=0 starts disabled. */
int32_t fm_set_interrupt(int32_t enabled);
/* blk tile-skip pre-pass. (BQ, BK) come from the head dim of the
 * prefill that will consume the blk. Byte length: ceil(qL/BQ)*ceil(kL/BK)
 * rounded up to a multiple of 32, at least 32. */
int fm_blk_byte_len(int64_t q_len, int64_t k_len, int32_t head_dim, size_t *out,
                    FMError *err);
/* Fills *out with a zeroed, library-owned uint8 [NQ, NK] tensor of
 * fm_blk_byte_len bytes; release it with fm_free_blk. */
int fm_alloc_blk(int64_t q_len, int64_t k_len, int32_t head_dim, FMTensor *out,
                 FMError *err);
/* Frees a tensor from fm_alloc_blk and clears its data pointer and tag; a
 * tensor the library did not allocate, or a stale copy of one already freed
 * (even when its address was reused since), is an error. */
int fm_free_blk(FMTensor *blk, FMError *err);
/* The natively tiled head dims of op "flash_attn_prefill",
 * "flash_attn_prefill_f32" (its float32 I/O) or "flash_attn_decode"
 * ("flash_attn_vec", the decode kernel's name, is an alias), ascending:
 * *count receives how many, out the first min(cap, count). Any other head dim
 * from 1 to 256 runs too, on the kernel of the next tiled dim up. "kv_codec"
 * gives the head dims a quantized-KV codec takes (those only). */
int fm_supported_head_dims(const char *op, int32_t *out, size_t cap, size_t *count,
                           FMError *err);
/* Whether op "flash_attn_prefill", "flash_attn_prefill_f32" (its float32 I/O)
 * or "flash_attn_decode" (alias "flash_attn_vec") runs q/k of head dim d with
 * v and the output of dv: *out 1 or 0 (the prefill: equal dims it runs, both
 * in 1...512, or 576 over 512 on bfloat16/float16; the decode: any pair whose
 * larger dim it runs). */
int fm_runs_head_dims(const char *op, int32_t d, int32_t dv, int32_t *out, FMError *err);
/* The largest head dim of op "flash_attn_prefill", "flash_attn_decode" or "sdpa"
 * (whose kernel takes any head dim up to it) into *out. */
int fm_max_head_dim(const char *op, int32_t *out, FMError *err);
/* The kernel that computes exactly `call`, the fastest that takes it: the
 * rule the Python package's scaled_dot_product_attention follows. A call only
 * the prefill could take with its sinks is FM_ERROR_UNSUPPORTED; a head dim
 * above every kernel's an FM_ERROR_VALUE. */
int fm_route_attention(const FMRouteCall *call, FMRoute *out, FMError *err);
/* Checks a call of the front door before any mask is read, as torch's
 * scaled_dot_product_attention takes it: q [B, H, qL, D], k [B, Hkv, kL, D],
 * v [B, Hkv, kL, Dv] (all rank 4, or all rank 3 without B) of one float
 * dtype, H a multiple of Hkv (Hkv < H only with enable_gqa), sinks float32
 * [H] or NULL, and the options of `call`. Reads only the descriptors' dtypes
 * and shapes. The plan says whether a kernel runs and over which keys. */
int fm_plan_attention(const FMTensor *q, const FMTensor *k, const FMTensor *v,
                      const FMTensor *sinks, const FMAttentionCall *call,
                      FMAttentionPlan *out, FMError *err);
/* The keys one query row at position q_pos sees under mask [B or 1, H or 1,
 * 1, kL] (bool, or additive float32/float16/bfloat16: 0 attends, -inf
 * hides), causal (keys after q_pos hidden) and window (0 = none, else keys p
 * with q_pos - p < window): *found 1 and out int32 [2, B] (row 0 each batch
 * row's end, row 1 its start; [0, 0) when it sees none) when they are one
 * contiguous range per batch row, the same for every head, biased by
 * nothing but 0 (the split-KV decode reads them as a [2, B] lengths table);
 * else *found 0 and out unchanged. */
int fm_mask_key_ranges(const FMTensor *mask, int32_t causal, int32_t q_pos, int32_t window, const FMTensor *out,
                       int32_t *found, FMError *err);
/* Every kernel the capability tables imply, one a line ("name function
 * arg ...": its name, its MSL template function, the function's template
 * arguments), as a static string: what the shaders must instantiate
 * (tools/gen_instantiations.py writes their INSTANTIATE_KERNEL lines from it). */
const char *fm_kernel_instantiations(void);
/* mask: [qL, kL] bfloat16 or float16 additive; blk_out: uint8 [NQ, NK] (its
 * shape for head_dim and the mask's shape), >= NQ*NK bytes. fm_dispatch_prefill
 * checks the blk's shape against its own geometry, and the head dim and mask
 * shape a tagged (fm_alloc_blk) blk was filled for. */
int fm_dispatch_blk(FMRegistry *registry, const FMTensor *mask, const FMTensor *blk_out,
                    int32_t head_dim, FMError *err);
/* Fills out ([qL, kL] bfloat16 or float16) with 0 / -inf. */
int fm_build_mask(FMRegistry *registry, const FMTensor *out, const FMMaskOptions *options,
                  FMError *err);
/* Decode: q [H, D] or [B, H, D]; k, v [(B,) Hkv, cap, D] float32,
 * float16 or bfloat16; out like q. q and out each float32 or k's dtype: q is
 * read exactly as float32, the float32 result rounded once (nearest even)
 * into a 16-bit out. fwht_signs: NULL (all +1) or
 * uint8 [D/8], used only with options->fwht. tmp: NULL (the library
 * allocates it and keeps it until the work ran: the call, or the open batch
 * scope) or float32 with >= B*H*32*(D+2)*4 bytes. */
int fm_dispatch_vec(FMRegistry *registry, const FMTensor *q, const FMTensor *k,
                    const FMTensor *v, const FMTensor *fwht_signs, const FMTensor *tmp,
                    const FMTensor *out, const FMVecOptions *options, FMError *err);
/* Simple SDPA: q/out [B, H, qL, D], k/v [B, Hkv, cap, D], all float32, all
 * float16 or all bfloat16; D <= fm_max_head_dim("sdpa"). mask: NULL, or additive (Q's dtype) or bool (true =
 * attend), [qL, kv_len], [H, qL, kv_len] or [B, H, qL, kv_len], where B, H and qL
 * may be 1 (read with stride 0; prefill's mask takes the same shapes). */
int fm_dispatch_sdpa(FMRegistry *registry, const FMTensor *q, const FMTensor *k,
                     const FMTensor *v, const FMTensor *mask, const FMTensor *out,
                     const FMSdpaOptions *options, FMError *err);
/* Serving prefill (flash_attn_func / varlen / with_kvcache with qL > 1):
 * q/out bfloat16 or float16 [B, qL, H, D] (or [total_q, H, D] with
 * cu_seqlens_q); k/v like q's dtype: [B, cap, Hkv, D], [total_k, Hkv, D]
 * with cu_seqlens_k, or [num_pages, page_size, Hkv, D] with block_table.
 * Packed rows after cu_seqlens_q[B] belong to no sequence: out 0, lse -inf.
 * seq may be NULL (every field NULL). */
int fm_dispatch_attn(FMRegistry *registry, const FMTensor *q, const FMTensor *k,
                     const FMTensor *v, const FMSeqTensors *seq, const FMTensor *out,
                     const FMAttnOptions *options, FMError *err);
/* Serving decode: q/out [B, H, D], or [B, L, H, D] with 1 <= L <=
 * FM_SHORT_QUERY_ROWS short query rows (row i at position seqlens_k[b] - L + i,
 * each with its own causal, window (both sides) and chunk keys); k/v [B, cap, Hkv, D] or paged
 * [num_pages, page_size, Hkv, D] (float32, float16 or bfloat16); q and out each
 * float32 or k's dtype (as fm_dispatch_vec); seq: seqlens_k,
 * block_table, sinks, lse ([B, H], or [B, L, H]); cu_seqlens_* and seqused_q must
 * be NULL. tmp as fm_dispatch_vec. options->head_major reads torch's layouts instead
 * (q/out [B, H, L, D], lse [B, H, L], k/v [B, Hkv, cap, D] or pages
 * [num_pages, Hkv, page_size, D]; same bits as the flash-attn layouts). */
int fm_dispatch_vec_seq(FMRegistry *registry, const FMTensor *q, const FMTensor *k,
                        const FMTensor *v, const FMSeqTensors *seq, const FMTensor *tmp,
                        const FMTensor *out, const FMAttnOptions *options,
                        FMError *err);
/* Writes k_new/v_new [B, n_new, Hkv, D] (the caches' dtype) into the caches
 * ([B, cap, Hkv, D], or [num_pages, page_size, Hkv, D] with block_table) at
 * rows cache_seqlens[b] .. + n_new. cache_seqlens is not changed. */
int fm_dispatch_kv_append(FMRegistry *registry, const FMTensor *k_new, const FMTensor *v_new,
                          const FMTensor *k_cache, const FMTensor *v_cache,
                          const FMTensor *cache_seqlens, const FMTensor *block_table,
                          FMError *err);
/* Host memory for long-lived tensors (a KV cache): *out receives `bytes`
 * (> 0) zeroed bytes, aligned to and rounded up to 16 KiB, which the metal
 * backend wraps once for the allocation's lifetime instead of on every
 * call. Free it with fm_free_host (anything else there is an error). */
int fm_alloc_host(size_t bytes, void **out, FMError *err);
int fm_free_host(void *p, FMError *err);
/* The GPU a metal or metal-sim registry runs on; "" for other backends. */
int fm_registry_device(const FMRegistry *registry, char *name, size_t namelen);
/* metal-sim (Linux): the FM_MSIM_COUNTER_COUNT counters into out (cap >=
 * that); an FM_ERROR_VALUE where metal-sim is not built in. */
int fm_metal_sim_counters(int64_t *out, size_t cap, FMError *err);
/* metal-sim: the last broken Metal rule, with its Apple documentation page
 * ("" for none). */
int fm_metal_sim_last_violation(char *buf, size_t len);
/* Quantized KV codec: validates a codec and returns its storage layout.
 * head_dim 64, 128, 256 or 512 (one rotation block) or 80, 96, 192 (blocks
 * of 16, 32, 64); bits 2, 3, 4, 5, 6 or 8; any seed. */
int fm_kv_codec_layout(const FMKVCodec *codec, FMKVCodecLayout *out, FMError *err);
/* x [..., D] float32/float16/bfloat16 -> codes uint8 [..., row_bytes] and
 * norms float32 [..., num_blocks] (same leading shape). */
/* Rotary embedding (flash-attn's apply_rotary_emb with seqlen_offsets) of x
 * [B, L, H, D] into out (same shape and dtype, not overlapping x): cos/sin
 * [seqlen_ro, rotary_dim / 2] of one float dtype, rotary_dim <= D; offsets
 * int32 [B]; row i of sequence b at offsets[b] + (per_row ? i : 0), which
 * must be < seqlen_ro. interleaved: pairs (2j, 2j+1), else (j, j +
 * rotary_dim/2). x_name names x in errors (NULL: "x"). */
int fm_dispatch_rotary(FMRegistry *registry, const FMTensor *x, const FMTensor *cos, const FMTensor *sin,
                       const FMTensor *offsets, const FMTensor *out, int32_t interleaved, int32_t per_row,
                       const char *x_name, FMError *err);
int fm_dispatch_kv_encode(FMRegistry *registry, const FMKVCodec *codec, const FMTensor *x,
                          const FMTensor *codes, const FMTensor *norms, FMError *err);
/* codes and norms as fm_dispatch_kv_encode writes them -> out float32 [..., D]. */
int fm_dispatch_kv_dequantize(FMRegistry *registry, const FMKVCodec *codec, const FMTensor *codes,
                              const FMTensor *norms, const FMTensor *out, FMError *err);
/* Decode over quantized caches (flash_attn_decode's layout): q/out [H, D] or
 * [B, H, D], both float32 or both float16 or bfloat16 (read exactly, the float32
 * result rounded once); each cache is the codes and norms of its codec with
 * leading shape [Hkv, cap] or [B, Hkv, cap]. The codecs share the head dim
 * D; widths and seeds may differ. */
int fm_dispatch_kv_codes_decode(FMRegistry *registry, const FMTensor *q, const FMKVCodec *k_codec,
                                const FMTensor *k_codes, const FMTensor *k_norms, const FMKVCodec *v_codec,
                                const FMTensor *v_codes, const FMTensor *v_norms, const FMTensor *out,
                                const FMKVCodesDecodeOptions *options, FMError *err);
/* flash_attn_with_kvcache over quantized caches: q/out [B, qL, H, D], both
 * float32 or both float16 or bfloat16 (then a dense side of that dtype too);
 * each cache the codes and norms of its codec with leading shape
 * [B, cap, Hkv], or [num_pages, page_size, Hkv] with seq->block_table; at
 * most one side dense: a NULL codec, its cache [..., Hkv, D] (float32,
 * float16 or bfloat16) as codes and NULL norms. seq:
 * seqlens_k ([B], or [2, B] with first keys), block_table, sinks, lse
 * ([B, H, qL]), alibi_slopes, k_new/v_new (encoded into the caches first).
 * Packed queries: cu_seqlens_q with q/out [total_q, H, D] and lse [H, total_q]
 * (rows past cu_seqlens_q[B] read 0, lse -inf), over the caches' lengths
 * (seqlens_k; with k_new/v_new [total_new, Hkv, D] split by cu_seqlens_k_new,
 * ragged), or over cu_seqlens_k's key counts (varlen: paged caches, or packed
 * keys of leading shape [1, total_k, Hkv], sequence b's keys rows
 * cu_seqlens_k[b] ..< [b+1]; seqlens_k is then flash-attn 3's seqused_k, and
 * seqused_q may be given, as in fm_dispatch_attn). Options as
 * fm_dispatch_attn's (max_seqlen_* bound the varlen lengths). */
int fm_dispatch_kv_codes_attn(FMRegistry *registry, const FMTensor *q, const FMKVCodec *k_codec,
                              const FMTensor *k_codes, const FMTensor *k_norms, const FMKVCodec *v_codec,
                              const FMTensor *v_codes, const FMTensor *v_norms, const FMSeqTensors *seq,
                              const FMTensor *out, const FMAttnOptions *options, FMError *err);
/* Encodes k_new/v_new [B, n_new, Hkv, D] (float32, float16 or bfloat16) into
 * the code caches (leading shape [B, cap, Hkv] or paged [num_pages,
 * page_size, Hkv] with block_table) at rows cache_seqlens[b] .. + n_new, in
 * one dispatch; a dense side (NULL codec, as fm_dispatch_kv_codes_attn's) of
 * k_new's dtype receives the rows' bits. cache_seqlens is not changed. */
int fm_dispatch_kv_codes_append(FMRegistry *registry, const FMTensor *k_new, const FMTensor *v_new,
                                const FMKVCodec *k_codec, const FMTensor *k_codes, const FMTensor *k_norms,
                                const FMKVCodec *v_codec, const FMTensor *v_codes, const FMTensor *v_norms,
                                const FMTensor *cache_seqlens, const FMTensor *block_table, FMError *err);
#endif /* !__swift__ */

/* FM_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* FLASHMETAL_H */
