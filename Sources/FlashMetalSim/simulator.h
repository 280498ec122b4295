// simulator.h — the runtime interface between the metal shim (inline code in
// kernels) and the fiber simulator (simulator.cpp). Host-only: never seen by
// the Metal compiler.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <source_location>

namespace fmsim {

// A call site of a barrier or collective. Two arrivals match when they come
// from the same source location.
struct Site {
    const char *file;
    const char *func;
    uint32_t line, column;
    static Site from(const std::source_location &l) {
        return Site{l.file_name(), l.function_name(), l.line(), l.column()};
    }
    bool operator==(const Site &o) const {
        return line == o.line && column == o.column &&
               (file == o.file || __builtin_strcmp(file, o.file) == 0);
    }
};

// The ids of the running GPU thread, read by BUILTIN parameters.
struct ThreadIds {
    uint32_t tid[3];      // thread_position_in_threadgroup
    uint32_t tgid[3];     // threadgroup_position_in_grid
    uint32_t tpg[3];      // threads_per_threadgroup
    uint32_t ngroups[3];  // threadgroups_per_grid
    uint32_t linear;      // thread_index_in_threadgroup
    uint32_t lane;        // thread_index_in_simdgroup
    uint32_t simd;        // simdgroup_index_in_threadgroup
    uint32_t nsimd;       // simdgroups_per_threadgroup
};

// Set by the scheduler before it resumes a fiber.
extern __thread const ThreadIds *tl_ids;

// A collective's combine step: runs once, on the last lane to arrive, with
// every live lane's input and output pointer (null for lanes not live).
using CombineFn = void (*)(void *const *in, void *const *out, uint32_t live_mask);

[[noreturn]] void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

void threadgroup_barrier(const Site &site);
void simdgroup_barrier(const Site &site);
void collective(void *in, void *out, CombineFn fn, const char *what, const Site &site);
void *tg_array(const void *key, size_t bytes, size_t align, const char *name, const Site &site);
void *tg_buffer(int index);
// Value of function constant `index`; fails when unset or of the other kind.
int32_t constant_value(int index, bool is_bool, const char *name);
bool constant_defined(int index);

// Thread-level operations the counted copy of the kernels reports (per lane).
enum CountedOp : int { OP_SPECIAL = 0, OP_MMA_F16 = 1, OP_MMA_BF16 = 2, OP_MMA_F32 = 3, OP_COUNT = 4 };
// Adds one to `op` of the running fiber's counted dispatch (no-op otherwise).
void count_op(int op);

// A kernel as registered by INSTANTIATE_KERNEL.
struct BoundArgs;
struct KernelEntry {
    const char *name;
    int n_params;                 // required (non-BUILTIN) parameters
    // kind of each parameter: 0 pointer buffer, 1 reference buffer, 2 tg buffer
    uint8_t kinds[32];
    uint32_t ref_sizes[32];       // sizeof the referenced struct (kind 1)
    uint32_t aligns[32];          // alignof the pointee (kind 0) or struct (kind 1)
    int tg_index[32];             // kind 2: threadgroup index
    void (*invoke)(const BoundArgs &);
    // The copy compiled with load/store tracing (FMSIM_COUNTED_COPY): run
    // by dispatches that ask for counts, never by the others.
    bool counted;
};
struct BoundArgs {
    void *ptr[32];                // by parameter position
};
void register_kernel(const KernelEntry *e);
// The plain copy of a kernel, and the counted one (null when not compiled in).
const KernelEntry *find_kernel(const char *name);
const KernelEntry *find_counted_kernel(const char *name);

} // namespace fmsim
