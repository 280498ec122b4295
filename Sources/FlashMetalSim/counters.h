// counters.h — what a counted dispatch did, for the GPU cost model.
//
// The counted copy of each kernel is compiled with the host compiler's
// load/store tracing (-fsanitize-coverage=trace-loads,trace-stores): every
// load and store of 1, 2, 4, 8 or 16 bytes left after optimisation calls a
// hook with its address. The hooks (counters.cpp) sort each address into a
// device binding, a constant binding, the threadgroup's memory or none of
// them (the fiber's own stack: registers on the GPU) and count it for the
// fiber's worker. Barriers and SIMD-group collectives are counted by the
// scheduler as they complete; MMAs and special functions by the counted
// shim. A dispatch with check_bounds runs the same hooks to flag every
// access that falls in none of those places, the simulator's own state or
// the library's static data (fmsim.h). Nothing here runs for a dispatch that
// asks for neither.
//
// Limits: an access the tracing does not see is not counted: a block copy
// (memcpy of a struct), or an access of another width (the kernels read no
// 32-byte vectors). Widths are the host compiler's after scalar
// optimisation, with vectorisation off and a source vector load kept one
// load (not split into its lanes): what the source asks for, not what
// Apple's compiler may merge or split.
#pragma once
#include "include/fmsim.h"
#include "simulator.h"

#include <atomic>
#include <memory>
#include <vector>
#include <mutex>
#include <stddef.h>
#include <stdint.h>

namespace fmsim {

// One bound buffer the hooks watch.
struct CountRange {
    uintptr_t lo = 0;
    size_t len = 0;
    int binding = 0;
    bool device = false; // false: constant (setBytes)
    // Device only: a bit per byte read, a bit per byte written.
    std::unique_ptr<std::atomic<uint64_t>[]> rbits, wbits;
};

// The part of a traced dispatch the workers share: its counts, its bounds
// check, or both.
struct DispatchCounter {
    CountRange ranges[FMSIM_MAX_BINDINGS];
    int n_ranges = 0;
    bool counting = true; // fill FMSimCounts
    bool checking = false; // flag accesses outside every range
    std::mutex mu;
    FMSimCounts sum{}; // additive counts merged from the workers
    // The lowest-addressed access outside every range (under mu once `oob` is
    // set): the lowest, not the first, so the report does not depend on which
    // worker ran first.
    std::atomic<bool> oob{false};
    uintptr_t oob_addr = 0;
    unsigned oob_bytes = 0;
    bool oob_write = false;
    uint64_t oob_count = 0; // accesses outside, all workers (under mu)
    // Watches [p, p + len) as binding `binding`; false when out of memory.
    bool add_range(const void *p, size_t len, int binding, bool device);
    // Fills *out: the merged sums plus the unique bytes and lines.
    void finish(FMSimCounts *out);
    void out_of_bounds(uintptr_t a, unsigned n, bool write);
    // The recorded access, described against the nearest range.
    void describe_oob(const char *kernel, char *buf, size_t len);
};

// Memory a traced kernel may touch that is no binding: the simulator's own
// (defined in simulator.cpp: the running worker and its per-group state)
// and the library's static data (function constants, tables, literals).
bool simulator_owns(uintptr_t a);

// The accesses of one SIMD group since its last barrier or collective,
// matched across lanes by their ordinal: the lanes' n-th accesses are one
// instruction when control flow is uniform (divergent code is approximate).
struct SimdRequests {
    struct Line {
        uint64_t key;     // binding, line, write
        uint64_t mask[2]; // bytes touched in the line
    };
    // Distinct lines kept per instruction (more count without merging): 16
    // covers a SIMD group's 16-byte loads (512 bytes, 4-8 lines when rows are
    // 128-256 bytes and every other one is read).
    static constexpr int kLines = 16;
    uint32_t ordinal[32]{};
    uint32_t top = 0; // slots in use
    // Lines in use per ordinal (a type of the simulator's own: instances of
    // std::vector over std types would be exported from the library).
    struct Used {
        uint8_t n;
    };
    std::vector<Line> slots; // kLines per ordinal
    std::vector<Used> used;
    void reset() {
        for (uint32_t k = 0; k < top; k++) used[k].n = 0;
        for (auto &o : ordinal) o = 0;
        top = 0;
    }
};

// One worker's counts (no sharing on the hot path but the bitmaps).
struct WorkerCounts {
    DispatchCounter *dc = nullptr;
    uintptr_t tg_lo = 0;
    size_t tg_len = 0;
    uintptr_t stack_lo = 0; // the worker's fiber stacks (thread-private memory)
    size_t stack_len = 0;
    FMSimCounts c{};
    uint64_t ops[OP_COUNT]{};
    std::vector<SimdRequests> simd;
    void merge();
    // A barrier or collective ended SIMD group `sg`'s phase (-1: every group's).
    void phase(int sg);
};

extern __thread WorkerCounts *tl_counts;

// A completed SIMD-group collective, by its name.
void count_collective(WorkerCounts *wc, const char *what);

} // namespace fmsim
