// counters.cpp — the load/store hooks of the counted kernels and the
// merging of per-worker counts (see counters.h).
#include "counters.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#if defined(__linux__)
#include <link.h>
#endif
#include <new>

namespace fmsim {

__thread WorkerCounts *tl_counts = nullptr;

bool DispatchCounter::add_range(const void *p, size_t len, int binding, bool device) {
    if (!p || !len || n_ranges == FMSIM_MAX_BINDINGS) return true;
    CountRange &r = ranges[n_ranges];
    r.lo = reinterpret_cast<uintptr_t>(p);
    r.len = len;
    r.binding = binding;
    r.device = device;
    if (device && counting) {
        size_t words = (len + 63) / 64;
        r.rbits.reset(new (std::nothrow) std::atomic<uint64_t>[words]());
        r.wbits.reset(new (std::nothrow) std::atomic<uint64_t>[words]());
        if (!r.rbits || !r.wbits) return false;
    }
    n_ranges++;
    return true;
}

// Set bits among the first n of a bitmap (bits past n are never set).
static uint64_t popcount_bits(const std::atomic<uint64_t> *bits, size_t n) {
    uint64_t c = 0;
    for (size_t w = 0; w < (n + 63) / 64; w++)
        c += uint64_t(__builtin_popcountll(bits[w].load(std::memory_order_relaxed)));
    return c;
}

static void add_binding(FMSimBindingCounts &to, const FMSimBindingCounts &from) {
    to.bytes_read += from.bytes_read;
    to.bytes_written += from.bytes_written;
    to.load_events += from.load_events;
    to.store_events += from.store_events;
    to.unique_bytes_read += from.unique_bytes_read;
    to.unique_bytes_written += from.unique_bytes_written;
    to.unique_lines += from.unique_lines;
    to.load_requests += from.load_requests;
    to.load_request_bytes += from.load_request_bytes;
    to.store_requests += from.store_requests;
}

void DispatchCounter::finish(FMSimCounts *out) {
    *out = sum;
    out->device = FMSimBindingCounts{};
    for (int i = 0; i < n_ranges; i++) {
        const CountRange &r = ranges[i];
        if (!r.device) continue;
        FMSimBindingCounts &b = out->binding[r.binding];
        b.unique_bytes_read = popcount_bits(r.rbits.get(), r.len);
        b.unique_bytes_written = popcount_bits(r.wbits.get(), r.len);
        // Lines count from the buffer's start, as in a page-aligned Metal
        // buffer (host arrays are not aligned, and must not change the
        // counts): a line is two bitmap words.
        for (size_t w = 0; w < (r.len + 63) / 64; w += 2) {
            uint64_t any = r.rbits[w].load(std::memory_order_relaxed) | r.wbits[w].load(std::memory_order_relaxed);
            if (w + 1 < (r.len + 63) / 64)
                any |= r.rbits[w + 1].load(std::memory_order_relaxed) | r.wbits[w + 1].load(std::memory_order_relaxed);
            if (any) b.unique_lines++;
        }
    }
    for (int i = 0; i < FMSIM_MAX_BINDINGS; i++) add_binding(out->device, out->binding[i]);
}

void WorkerCounts::merge() {
    std::lock_guard<std::mutex> g(dc->mu);
    FMSimCounts &s = dc->sum;
    s.threadgroups += c.threadgroups;
    if (c.threadgroup_memory > s.threadgroup_memory) s.threadgroup_memory = c.threadgroup_memory;
    for (int i = 0; i < FMSIM_MAX_BINDINGS; i++) add_binding(s.binding[i], c.binding[i]);
    s.constant_bytes_read += c.constant_bytes_read;
    s.constant_load_events += c.constant_load_events;
    s.tg_bytes_read += c.tg_bytes_read;
    s.tg_bytes_written += c.tg_bytes_written;
    s.tg_load_events += c.tg_load_events;
    s.tg_store_events += c.tg_store_events;
    s.threadgroup_barriers += c.threadgroup_barriers;
    s.simd_barriers += c.simd_barriers;
    s.simd_shuffles += c.simd_shuffles;
    s.simd_reductions += c.simd_reductions;
    s.simd_votes += c.simd_votes;
    s.special += ops[OP_SPECIAL];
    // An MMA takes all 32 lanes (the shim enforces it): 32 lane counts are one.
    s.mma_f16 += ops[OP_MMA_F16] / 32;
    s.mma_bf16 += ops[OP_MMA_BF16] / 32;
    s.mma_f32 += ops[OP_MMA_F32] / 32;
}

void WorkerCounts::phase(int sg) {
    if (sg < 0) {
        for (auto &r : simd) r.reset();
    } else if (size_t(sg) < simd.size()) {
        simd[size_t(sg)].reset();
    }
}

// One lane's access of n bytes at offset `off` of range `ri`: joins the
// request of its instruction for that line, or opens one.
static void coalesce(WorkerCounts *wc, FMSimBindingCounts &b, int ri, size_t off, unsigned n, bool write) {
    const ThreadIds *ids = tl_ids;
    if (!ids) return;
    if (wc->simd.size() <= ids->simd) wc->simd.resize(ids->simd + 1);
    SimdRequests &r = wc->simd[ids->simd];
    const uint32_t k = r.ordinal[ids->lane]++;
    if (k >= r.used.size()) {
        r.used.resize(std::max(2 * r.used.size(), size_t(k) + 1024), SimdRequests::Used{0});
        r.slots.resize(r.used.size() * SimdRequests::kLines);
    }
    if (k >= r.top) r.top = k + 1;
    for (size_t lo = off; lo < off + n;) { // an access may straddle two lines
        const size_t line = lo / 128, hi = (line + 1) * 128 < off + n ? (line + 1) * 128 : off + n;
        const uint64_t key = (uint64_t(ri) << 56) | (uint64_t(line) << 1) | (write ? 1 : 0);
        uint64_t add[2] = {0, 0};
        for (size_t i = lo; i < hi; i++) add[(i % 128) / 64] |= uint64_t(1) << (i % 64);
        SimdRequests::Line *slot = &r.slots[size_t(k) * SimdRequests::kLines];
        SimdRequests::Line *hit = nullptr;
        for (int i = 0; i < r.used[k].n; i++)
            if (slot[i].key == key) hit = &slot[i];
        if (!hit) {
            if (write) b.store_requests++;
            else b.load_requests++;
            if (r.used[k].n < SimdRequests::kLines) {
                hit = &slot[r.used[k].n++];
                *hit = SimdRequests::Line{key, {0, 0}};
            }
        }
        if (!write) {
            const uint64_t n0 = add[0] & ~(hit ? hit->mask[0] : 0), n1 = add[1] & ~(hit ? hit->mask[1] : 0);
            b.load_request_bytes += uint64_t(__builtin_popcountll(n0) + __builtin_popcountll(n1));
        }
        if (hit) {
            hit->mask[0] |= add[0];
            hit->mask[1] |= add[1];
        }
        lo = hi;
    }
}

void count_collective(WorkerCounts *wc, const char *what) {
    FMSimCounts &c = wc->c;
    if (!strncmp(what, "simdgroup_multiply", 18)) return; // counted per element type by the shim
    if (!strcmp(what, "simdgroup_barrier")) c.simd_barriers++;
    else if (!strncmp(what, "simd_shuffle", 12) || !strncmp(what, "simd_broadcast", 14)) c.simd_shuffles++;
    else if (!strcmp(what, "simd_ballot") || !strcmp(what, "simd_any") || !strcmp(what, "simd_all")) c.simd_votes++;
    else c.simd_reductions++;
}

void count_op(int op) {
    if (WorkerCounts *wc = tl_counts; wc && op >= 0 && op < OP_COUNT) wc->ops[op]++;
}

void DispatchCounter::out_of_bounds(uintptr_t a, unsigned n, bool write) {
    std::lock_guard<std::mutex> g(mu);
    oob_count++;
    if (oob.load(std::memory_order_relaxed) && a >= oob_addr) return;
    oob_addr = a;
    oob_bytes = n;
    oob_write = write;
    oob.store(true);
}

void DispatchCounter::describe_oob(const char *kernel, char *buf, size_t len) {
    std::lock_guard<std::mutex> g(mu);
    const CountRange *near = nullptr;
    uintptr_t best = UINTPTR_MAX;
    for (int i = 0; i < n_ranges; i++) {
        const CountRange &r = ranges[i];
        const uintptr_t d = oob_addr < r.lo ? r.lo - oob_addr : oob_addr - r.lo < r.len ? 0 : oob_addr - (r.lo + r.len);
        if (d < best) { best = d; near = &r; }
    }
    const char *what = oob_write ? "wrote" : "read";
    if (!near) {
        snprintf(buf, len, "%s %s %u bytes at %#lx with no buffer bound (%llu access(es) out of bounds)", kernel,
                 what, oob_bytes, (unsigned long)oob_addr, (unsigned long long)oob_count);
        return;
    }
    snprintf(buf, len, "%s %s %u bytes at offset %lld of the %zu-byte %s bound at index %d (%llu access(es) out of "
             "bounds)", kernel, what, oob_bytes, (long long)(intptr_t)(oob_addr - near->lo), near->len,
             near->device ? "buffer" : "setBytes data", near->binding, (unsigned long long)oob_count);
}

// The loaded segments of the object the simulator is linked into (ELF
// only: elsewhere fmsim_dispatch refuses check_bounds).
#if defined(__linux__)
namespace {
struct ImageRanges {
    uintptr_t lo[16], hi[16];
    int n = 0;
};
const ImageRanges &image_ranges() {
    static const ImageRanges r = [] {
        ImageRanges out;
        dl_iterate_phdr(
            [](struct dl_phdr_info *info, size_t, void *data) -> int {
                auto *o = static_cast<ImageRanges *>(data);
                const uintptr_t self = reinterpret_cast<uintptr_t>(&image_ranges);
                ImageRanges mine;
                bool has_self = false;
                for (int i = 0; i < info->dlpi_phnum; i++) {
                    const ElfW(Phdr) &ph = info->dlpi_phdr[i];
                    if (ph.p_type != PT_LOAD || mine.n == 16) continue;
                    const uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
                    mine.lo[mine.n] = lo;
                    mine.hi[mine.n++] = hi;
                    if (self - lo < hi - lo) has_self = true;
                }
                if (!has_self) return 0;
                *o = mine;
                return 1;
            },
            &out);
        return out;
    }();
    return r;
}
} // namespace

static bool in_image(uintptr_t a) {
    const ImageRanges &r = image_ranges();
    for (int i = 0; i < r.n; i++)
        if (a - r.lo[i] < r.hi[i] - r.lo[i]) return true;
    return false;
}
#else
static bool in_image(uintptr_t) { return false; }
#endif

// Counts an access at offset `off` of range i (clipped to its end).
static inline void count_in_range(WorkerCounts *wc, DispatchCounter *dc, int i, uintptr_t off, unsigned n,
                                  bool write) {
    if (!dc->counting) return;
    FMSimCounts &c = wc->c;
    CountRange &r = dc->ranges[i];
    if (!r.device) {
        if (!write) { c.constant_bytes_read += n; c.constant_load_events++; }
        return;
    }
    FMSimBindingCounts &b = c.binding[r.binding];
    std::atomic<uint64_t> *bits;
    if (write) { b.bytes_written += n; b.store_events++; bits = r.wbits.get(); }
    else { b.bytes_read += n; b.load_events++; bits = r.rbits.get(); }
    const size_t end = off + n < r.len ? off + n : r.len;
    for (size_t k = off; k < end; k++)
        bits[k / 64].fetch_or(uint64_t(1) << (k % 64), std::memory_order_relaxed);
    coalesce(wc, b, i, off, unsigned(end - off), write);
}

// The hook of every traced access: threadgroup memory, the fiber stacks, a
// device or constant binding, or else (checked dispatches) out of bounds
// unless the simulator's own memory. Bindings may overlap (no-copy wraps
// reach to their page's end, over the next tensor): an access is in bounds
// when one binding holds all of it, and counts against that one.
static inline void on_access(const void *p, unsigned n, bool write) {
    WorkerCounts *wc = tl_counts;
    if (!wc) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    FMSimCounts &c = wc->c;
    DispatchCounter *dc = wc->dc;
    if (a - wc->tg_lo < wc->tg_len) {
        if (!dc->counting) return;
        if (write) { c.tg_bytes_written += n; c.tg_store_events++; }
        else { c.tg_bytes_read += n; c.tg_load_events++; }
        return;
    }
    if (a - wc->stack_lo < wc->stack_len) return;
    int partial = -1; // the first binding the access starts in but runs past
    for (int i = 0; i < dc->n_ranges; i++) {
        const uintptr_t off = a - dc->ranges[i].lo;
        if (off >= dc->ranges[i].len) continue;
        if (dc->ranges[i].len - off < n) {
            if (partial < 0) partial = i;
            continue;
        }
        count_in_range(wc, dc, i, off, n, write);
        return;
    }
    if (partial >= 0) {
        // The simulator's own memory (a thread's ids, SIMD slots) may lie in
        // a wrap's page next to a tensor: a shim load of it that runs past
        // the wrap's end is neither the kernel's access nor out of bounds.
        if (simulator_owns(a)) return;
        if (dc->checking) dc->out_of_bounds(a, n, write); // runs past the end
        count_in_range(wc, dc, partial, a - dc->ranges[partial].lo, n, write);
        return;
    }
    if (dc->checking && !in_image(a) && !simulator_owns(a)) dc->out_of_bounds(a, n, write);
}

} // namespace fmsim

// The tracing's callbacks (clang's SanitizerCoverage ABI). Called only by
// the counted kernels; hidden with the rest of the simulator.
extern "C" {
void __sanitizer_cov_load1(void *p) { fmsim::on_access(p, 1, false); }
void __sanitizer_cov_load2(void *p) { fmsim::on_access(p, 2, false); }
void __sanitizer_cov_load4(void *p) { fmsim::on_access(p, 4, false); }
void __sanitizer_cov_load8(void *p) { fmsim::on_access(p, 8, false); }
void __sanitizer_cov_load16(void *p) { fmsim::on_access(p, 16, false); }
void __sanitizer_cov_store1(void *p) { fmsim::on_access(p, 1, true); }
void __sanitizer_cov_store2(void *p) { fmsim::on_access(p, 2, true); }
void __sanitizer_cov_store4(void *p) { fmsim::on_access(p, 4, true); }
void __sanitizer_cov_store8(void *p) { fmsim::on_access(p, 8, true); }
void __sanitizer_cov_store16(void *p) { fmsim::on_access(p, 16, true); }
}
