/*
 * fmsim.h — the plain C interface of the flashmetal GPU simulator.
 *
 * The simulator runs kernels written in the portable dialect
 * (Resources/shaders/dialect.h) on the CPU: every GPU thread of a threadgroup
 * is a fiber, threadgroups are spread over OS worker threads. Kernels are
 * registered by their Metal host name (INSTANTIATE_KERNEL).
 *
 * Nothing here traps: every failure (unknown kernel, unset function constant,
 * divergent barrier, deadlock, threadgroup memory over 32 KiB, bad binding)
 * returns a non-zero status and a NUL-terminated message in `err`.
 */
#ifndef FMSIM_H
#define FMSIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { FMSIM_MAX_BINDINGS = 31, FMSIM_MAX_CONSTANTS = 64, FMSIM_MAX_THREADS = 1024 };

typedef enum FMSimStatus {
    FMSIM_OK = 0,
    FMSIM_ERROR_UNKNOWN_KERNEL = 1,
    FMSIM_ERROR_INVALID = 2, /* bad dispatch: geometry, binding index, sizes */
    FMSIM_ERROR_KERNEL = 3,  /* the kernel failed at run time (see message) */
    FMSIM_ERROR_RESOURCES = 4, /* no memory, mappings or threads for the dispatch */
    FMSIM_INTERRUPTED = 5,   /* `interrupted` returned non-zero: the dispatch stopped */
    FMSIM_ERROR_BOUNDS = 6   /* check_bounds: the kernel accessed memory outside every binding */
} FMSimStatus;

typedef struct FMSimConstant {
    int32_t index;    /* [[function_constant(index)]] */
    int32_t is_bool;  /* 1: bool constant, 0: int constant */
    int32_t value;
} FMSimConstant;

typedef struct FMSimBinding {
    int32_t index;    /* [[buffer(index)]] */
    int32_t is_bytes; /* 1: setBytes (copied, aligned); 0: caller memory */
    void *data;
    uint64_t length;  /* bytes */
} FMSimBinding;

typedef struct FMSimTGMemory {
    int32_t index;    /* [[threadgroup(index)]] (TG_BUFFER in the dialect) */
    uint32_t length;  /* bytes */
} FMSimTGMemory;

/* What one counted dispatch did (see FMSimDispatch.counts). Device memory is
 * every binding with is_bytes == 0, constant memory every is_bytes one.
 * Loads and stores are those of the counted copy of the kernel: the source's
 * accesses after the host compiler's scalar optimisation (no vectorisation),
 * one event per thread per access of 1, 2, 4, 8 or 16 bytes. 128-byte lines
 * count from the binding's start (as in a page-aligned Metal buffer). Threadgroup-wide and SIMD-group
 * operations count once per group; `special` and the MMAs' element types count
 * per thread. */
typedef struct FMSimBindingCounts {
    uint64_t bytes_read, bytes_written;
    uint64_t load_events, store_events;
    uint64_t unique_bytes_read, unique_bytes_written; /* distinct addresses */
    uint64_t unique_lines;                            /* 128-byte lines read or written */
    /* Coalesced: the lanes of a SIMD group running the same access (their
     * n-th since the group's last barrier or collective) make one request
     * per distinct line, bringing the distinct bytes they touch in it. */
    uint64_t load_requests, load_request_bytes, store_requests;
} FMSimBindingCounts;

typedef struct FMSimCounts {
    uint64_t threadgroups;                  /* run */
    uint32_t threads_per_threadgroup;
    uint32_t threadgroup_memory;            /* bytes one group holds (largest over groups) */
    FMSimBindingCounts device;              /* all device bindings together */
    FMSimBindingCounts binding[FMSIM_MAX_BINDINGS]; /* by buffer index (device bindings only) */
    uint64_t constant_bytes_read, constant_load_events;
    uint64_t tg_bytes_read, tg_bytes_written, tg_load_events, tg_store_events;
    uint64_t threadgroup_barriers;          /* completed, per group */
    uint64_t simd_barriers, simd_shuffles, simd_reductions, simd_votes; /* per SIMD group */
    uint64_t mma_f16, mma_bf16, mma_f32;    /* 8x8x8 simdgroup MMAs, per SIMD group */
    uint64_t special;                       /* exp, exp2, log, sqrt, rsqrt, ... per thread */
} FMSimCounts;

typedef struct FMSimDispatch {
    const char *name;                /* kernel host name */
    const FMSimConstant *constants;  int32_t n_constants;
    const FMSimBinding *bindings;    int32_t n_bindings;
    const FMSimTGMemory *tg_memory;  int32_t n_tg_memory;
    uint32_t grid[3];                /* threadgroups per grid */
    uint32_t threads[3];             /* threads per threadgroup */
    int32_t workers;                 /* OS threads; <= 0: one per core */
    int32_t scramble;                /* 1: scrambled schedule */
    uint64_t seed;                   /* scramble seed (0: fixed default) */
    /* Polled between threadgroups and scheduler passes (NULL: never). */
    int (*interrupted)(uint64_t token);
    uint64_t interrupt_token;
    /* Non-NULL: run the counted copy of the kernel (same numerics, traced
     * loads and stores; FMSIM_ERROR_UNKNOWN_KERNEL when none is compiled in)
     * and fill *counts. NULL: the plain copy, nothing counted. */
    FMSimCounts *counts;
    /* 1: run the counted copy of the kernel and check every load and store
     * it makes outside its threadgroup memory and its own stack against the
     * bindings: an access outside all of them (past a buffer's end, before
     * its start, or into memory no binding covers) completes the dispatch
     * and then fails it with FMSIM_ERROR_BOUNDS, the message naming the
     * kernel, the access and the nearest binding (index and offset). Works
     * with or without `counts`. Linux only (FMSIM_ERROR_INVALID elsewhere). */
    int32_t check_bounds;
} FMSimDispatch;

/* 1 when a kernel of that host name is compiled in. */
int fmsim_has_kernel(const char *name);
/* Number of registered kernels, and the i-th host name (NULL when out of range). */
int fmsim_kernel_count(void);
const char *fmsim_kernel_name(int i);
/* Parameter `index` ([[buffer(index)]] or [[threadgroup(index)]]) of kernel
 * `name`: 1 with *kind (0 device pointer, 1 constant struct reference, 2
 * threadgroup buffer) and *align (alignof what it points or refers to), or 0
 * when the kernel has no such parameter. */
int fmsim_kernel_param(const char *name, int index, int *kind, uint32_t *align);
/* Runs one dispatch to completion. Returns FMSIM_OK or an FMSimStatus.
 * FLASHMETAL_SIM_SCRAMBLE=1 (or =<seed>) in the environment scrambles
 * every dispatch; FLASHMETAL_SIM_WORKERS=<n> (1..1024) overrides `workers`;
 * FLASHMETAL_SIM_STACK_KB (64..16384, default 512) sizes each fiber stack.
 *
 * Resources are process-wide and bounded: OS workers (each with one fiber
 * stack per GPU thread of its group, plus a guard page) come from one pool
 * capped in count and in memory mappings; a dispatch takes what is free (at
 * least one worker; it waits while other dispatches hold them all) and
 * gives them back. Safe to call from many threads at once. */
int fmsim_dispatch(const FMSimDispatch *d, char *err, size_t errlen);
/* 1 when a counted copy of that kernel is compiled in. */
int fmsim_has_counted_kernel(const char *name);
/* The file named by FLASHMETAL_SIM_COUNTS (read at each call), or NULL. When
 * set, the sim backend runs every dispatch counted and appends its counts
 * there (fmsim_counts_append): the input of the GPU cost model. */
const char *fmsim_counts_log_path(void);
/* Appends one JSON line describing dispatch `d` (kernel, grid, threads,
 * constants, bindings) and its counts `c` to the file at `path`. Returns 0,
 * or -1 when the file cannot be written. */
int fmsim_counts_append(const char *path, const FMSimDispatch *d, const FMSimCounts *c);
/* Frees the idle workers' stacks (the pool refills on demand). */
void fmsim_release_idle(void);
/* Workers (busy or idle) and the memory mappings their stacks hold. */
void fmsim_resource_usage(int *workers, size_t *mappings);

#ifdef __cplusplus
}
#endif

#endif /* FMSIM_H */
