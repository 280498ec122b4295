/*
 * flashmetal.h — the one definition of the kernel parameter structs and of
 * the library's C ABI.
 *
 * Three compilers read this file:
 *   - Swift (through the CFlashMetal module) for the dispatchers and @_cdecl
 *     entry points,
 *   - C/C++ (cpu kernels, simulator) and the Metal compiler for the structs,
 *   - cffi (python/flashmetal/_loader.py), which reads the text between the
 *     FM_CDEF markers with preprocessor lines removed. Keep that part free of
 *     macros, attributes and expressions cffi cannot parse.
 *
 * Struct layouts follow the mlx-native seeds field for field; sizes and
 * offsets are pinned by static asserts in layout_checks.c and by swift tests.
 */
#ifndef FLASHMETAL_H
#define FLASHMETAL_H

#ifndef __METAL_VERSION__
#include <stddef.h>
#include <stdint.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- numeric constants of the kernels (DESIGN §2) ------------------------
 * Outside the cffi part: cffi cannot parse float macros. */
/* The running row max starts at the finite -FLT_MAX/2, so a -inf score gives
 * exp2(-inf - m) = 0 and m - m stays 0: never NaN. */
#define FM_RUNNING_MAX_START (-1.70141173e38f)
/* log2(e): the GPU kernels fold it into Q and use exp2. */
#define FM_LOG2E 1.44269504088896341f
/* The release of the library and of the Python package (one source). */
#define FM_VERSION "0.1.0"

/* FM_CDEF_BEGIN */

/* ---- cross-language integers ---------------------------------------------
 * One definition for the dispatchers (Swift), the cpu kernels (C), the
 * simulator (C++), the shaders (MSL) and cffi. Swift tests pin the Swift
 * enums that mirror them. */

/* The version of this C ABI: bumped on every incompatible change to a struct
 * or an entry point. The Python package checks fm_abi_version() against the
 * value of the header it ships. */
enum { FM_ABI_VERSION = 2 };

/* Metal function-constant indices ([[function_constant(i)]]). */
typedef enum FMFunctionConstant {
    FM_FC_ALIGN_Q = 200,            /* prefill: qL % BQ == 0 */
    FM_FC_ALIGN_K = 201,            /* prefill: kL % BK == 0 */
    FM_FC_HAS_MASK = 300,           /* prefill: a mask is bound */
    FM_FC_DO_CAUSAL = 301,          /* prefill: causal */
    FM_FC_HAS_BLK = 303,            /* prefill: a blk is bound */
    FM_FC_BLK_BQ = 400,             /* blk: BQ of the consuming prefill (int) */
    FM_FC_BLK_BK = 401,             /* blk: BK of the consuming prefill (int) */
    FM_FC_VEC_HAS_SIGNS = 500,      /* decode FWHT reduce: signs are bound */
    FM_FC_SDPA_BOOL_MASK = 600,     /* sdpa: a bool mask is bound */
    FM_FC_SDPA_ADDITIVE_MASK = 601, /* sdpa: an additive mask is bound */
    FM_FC_SDPA_EXT = 602,           /* sdpa: SdpaExtParams are bound (q_offset, window) */
    FM_FC_SDPA_SOFTCAP = 603        /* sdpa: apply SdpaExtParams.softcap */
} FMFunctionConstant;

/* Buffer indices ([[buffer(i)]]) of each kernel family. */
typedef enum FMPrefillBinding {
    FM_PREFILL_BUF_Q = 0, FM_PREFILL_BUF_K = 1, FM_PREFILL_BUF_V = 2, FM_PREFILL_BUF_O = 3,
    FM_PREFILL_BUF_PARAMS = 4,      /* AttnParams */
    FM_PREFILL_BUF_MASK_PARAMS = 5, /* AttnMaskParams, with a mask */
    FM_PREFILL_BUF_MASK = 6,
    FM_PREFILL_BUF_BLK = 7
} FMPrefillBinding;

typedef enum FMBlkBinding {
    FM_BLK_BUF_MASK = 0, FM_BLK_BUF_OUT = 1, FM_BLK_BUF_PARAMS = 2 /* BlkParams */
} FMBlkBinding;

typedef enum FMMaskBuilderBinding {
    FM_MASKB_BUF_OUT = 0, FM_MASKB_BUF_PARAMS = 1 /* MaskParams */
} FMMaskBuilderBinding;

typedef enum FMVecBinding {
    FM_VEC_BUF_PARAMS = 0, /* FlashAttnVecParams */
    FM_VEC_BUF_Q = 1, FM_VEC_BUF_K = 2, FM_VEC_BUF_V = 3, FM_VEC_BUF_TMP = 4
} FMVecBinding;

typedef enum FMVecReduceBinding {
    FM_VEC_REDUCE_BUF_PARAMS = 0, /* FlashAttnVecReduceParams */
    FM_VEC_REDUCE_BUF_TMP = 1, FM_VEC_REDUCE_BUF_OUT = 2,
    FM_VEC_REDUCE_BUF_NWG = 3,    /* uint32 */
    FM_VEC_REDUCE_BUF_SIGNS = 4   /* with FM_FC_VEC_HAS_SIGNS */
} FMVecReduceBinding;

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

/* FlashAttnVecParams.mask_type / FMVecOptions.mask_type. */
typedef enum FMVecMaskType {
    FM_VEC_MASK_NONE = 0, FM_VEC_MASK_CAUSAL = 1, FM_VEC_MASK_WINDOW = 2
} FMVecMaskType;

/* Split-KV decode: the number of workgroups each row's keys are split over. */
enum { FM_VEC_NWG = 32 };

/* sdpa: query rows per threadgroup, one thread each (the kernel indexes rows
 * by tgid.z * FM_SDPA_TILE_Q + tid). */
enum { FM_SDPA_TILE_Q = 32 };

/* ---- kernel parameter structs (seeds 000-004) -------------------------- */

/* Prefill: buffer(4). 160 bytes. Strides are (batch, head, seq) in elements. */
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
    int32_t _pad;
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

/* Decode: buffer(0). 40 bytes. mask_type 0 none, 1 causal, 2 sliding window. */
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
} FlashAttnVecParams;

/* Decode reduce (plain and FWHT-undo): buffer(0). 4 bytes. */
typedef struct FlashAttnVecReduceParams {
    uint32_t nrows;
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

/* Simple SDPA extension (ours): buffer(8) (FM_SDPA_BUF_EXT), bound only when
 * function constant 602 (FM_FC_SDPA_EXT) is true; SdpaParams stays the seed's. 16 bytes. With it,
 * query row i sits at absolute position t = q_offset + i (instead of the
 * seed's bottom-right kv_len - qL + i), so q_offset = 0 is torch's top-left
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
    int32_t _pad;
} SdpaExtParams;

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

/* ---- C ABI (hidden from the Metal compiler) ----------------------------- */
#ifndef __METAL_VERSION__

/* Element types of borrowed tensors. */
typedef enum FMDType {
    FM_DTYPE_F32 = 0,
    FM_DTYPE_F16 = 1,
    FM_DTYPE_BF16 = 2,
    FM_DTYPE_BOOL = 3,
    FM_DTYPE_U8 = 4
} FMDType;

/* Every entry point returns one of these; the message goes to `err`. */
typedef enum FMStatus {
    FM_OK = 0,
    FM_ERROR_VALUE = 1,    /* a bad shape, size, length or option */
    FM_ERROR_TYPE = 2,     /* a bad dtype */
    FM_ERROR_BACKEND = 3,  /* a backend could not be created or failed */
    FM_ERROR_INTERNAL = 4, /* a bug: please report */
    FM_ERROR_INTERRUPTED = 5 /* a SIGINT cancelled the call; outputs are unspecified */
} FMStatus;

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
    int32_t q_offset; /* absolute position of query row 0 (seeds: qL_off), >= 0 */
    int32_t kv_len;   /* valid K/V length; 0 = all of K's sequence axis */
    int32_t layout;   /* FMLayout */
} FMPrefillOptions;

/* fm_build_mask: see MaskParams. */
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

/* fm_dispatch_sdpa. Zeroed extension fields give the seed's kernel:
 * bottom-right positions, no softcap, no window. */
typedef struct FMSdpaOptions {
    float scale;      /* finite; NaN = the default 1/sqrt(D) */
    int32_t causal;   /* 0 or 1 */
    int32_t kv_len;   /* valid K/V length; 0 = all of K's sequence axis */
    int32_t has_q_offset; /* 0: query i at kv_len - qL + i (bottom-right);
                             1: query i at q_offset + i (0 = top-left) */
    int32_t q_offset; /* with has_q_offset; may be negative */
    int32_t window;   /* 0 = none, else keys p with t - p < window */
    float softcap;    /* 0 = off, else > 0 */
    int32_t _pad;
} FMSdpaOptions;

#if !defined(__swift__)
/* Entry points (implemented by @_cdecl functions in Sources/FlashMetal).
 * Hidden from Swift, which defines them. `err` may be NULL; otherwise it
 * receives a NUL-terminated message of at most errlen bytes.
 * Registry handles are never reused: a destroyed registry's handle (or any
 * other value) is an FM_ERROR_VALUE, never another registry. */
int fm_abi_version(void);
/* A static name for a status code ("FM_ERROR_VALUE"; "unknown status" else). */
const char *fm_status_string(int status);
int fm_create_registry(const char *backend, FMRegistry **out, char *err, size_t errlen);
int fm_destroy_registry(FMRegistry *registry);
/* The backend's name ("cpu", "sim", "metal"); "" with an error status when
 * the registry is not live. */
int fm_registry_backend(const FMRegistry *registry, char *name, size_t namelen);
/* A batch scope: until fm_end_batch a backend may defer work (Metal commits
 * one command buffer at the end); outputs are valid after fm_end_batch. */
int fm_begin_batch(FMRegistry *registry, char *err, size_t errlen);
int fm_end_batch(FMRegistry *registry, char *err, size_t errlen);
int fm_dispatch_prefill(FMRegistry *registry, const FMTensor *q, const FMTensor *k,
                        const FMTensor *v, const FMTensor *mask, const FMTensor *blk,
                        const FMTensor *out, const FMPrefillOptions *options,
                        char *err, size_t errlen);
const char *fm_version(void);
/* blk tile-skip pre-pass (seed 001). (BQ, BK) come from the head dim of the
 * prefill that will consume the blk. Byte length: ceil(qL/BQ)*ceil(kL/BK)
 * rounded up to a multiple of 32, at least 32. */
int fm_blk_byte_len(int64_t q_len, int64_t k_len, int32_t head_dim, size_t *out,
                    char *err, size_t errlen);
/* Fills *out with a zeroed, library-owned uint8 [NQ, NK] tensor of
 * fm_blk_byte_len bytes; release it with fm_free_blk. */
int fm_alloc_blk(int64_t q_len, int64_t k_len, int32_t head_dim, FMTensor *out,
                 char *err, size_t errlen);
/* Frees a tensor from fm_alloc_blk and clears its data pointer and tag; a
 * tensor the library did not allocate, or a stale copy of one already freed
 * (even when its address was reused since), is an error. */
int fm_free_blk(FMTensor *blk, char *err, size_t errlen);
/* The head dims with a kernel for op "flash_attn_prefill" or "flash_attn_vec",
 * ascending: *count receives how many, out the first min(cap, count). */
int fm_supported_head_dims(const char *op, int32_t *out, size_t cap, size_t *count,
                           char *err, size_t errlen);
/* mask: [qL, kL] bfloat16 or float16 additive; blk_out: uint8 [NQ, NK] (its
 * shape for head_dim and the mask's shape), >= NQ*NK bytes. fm_dispatch_prefill
 * checks the blk's shape against its own geometry, and the head dim and mask
 * shape a tagged (fm_alloc_blk) blk was filled for. */
int fm_dispatch_blk(FMRegistry *registry, const FMTensor *mask, const FMTensor *blk_out,
                    int32_t head_dim, char *err, size_t errlen);
/* Fills out ([qL, kL] bfloat16 or float16) with 0 / -inf. */
int fm_build_mask(FMRegistry *registry, const FMTensor *out, const FMMaskOptions *options,
                  char *err, size_t errlen);
/* Decode: q float32 [H, D] or [B, H, D]; k, v [(B,) Hkv, cap, D] float32,
 * float16 or bfloat16; out float32 like q. fwht_signs: NULL (all +1) or
 * uint8 [D/8], used only with options->fwht. tmp: NULL (the library
 * allocates it and keeps it until the work ran: the call, or the open batch
 * scope) or float32 with >= B*H*32*(D+2)*4 bytes. */
int fm_dispatch_vec(FMRegistry *registry, const FMTensor *q, const FMTensor *k,
                    const FMTensor *v, const FMTensor *fwht_signs, const FMTensor *tmp,
                    const FMTensor *out, const FMVecOptions *options, char *err, size_t errlen);
/* Simple SDPA: q/out [B, H, qL, D], k/v [B, Hkv, cap, D], all float32, all
 * float16 or all bfloat16; D <= 512. mask: NULL, or additive (Q's dtype) or bool (true =
 * attend), [qL, kv_len], [H, qL, kv_len] or [B, H, qL, kv_len], where B, H and qL
 * may be 1 (read with stride 0; prefill's mask takes the same shapes). */
int fm_dispatch_sdpa(FMRegistry *registry, const FMTensor *q, const FMTensor *k,
                     const FMTensor *v, const FMTensor *mask, const FMTensor *out,
                     const FMSdpaOptions *options, char *err, size_t errlen);
#endif /* !__swift__ */
#endif /* !__METAL_VERSION__ */

/* FM_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* FLASHMETAL_H */
