// counts_json.cpp — one JSON line per counted dispatch, for the GPU cost
// model (bench/gpu_model.py reads them).
#include "include/fmsim.h"

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <unistd.h>

namespace {
// A line under construction (no std::string: its template instances would
// be exported from the library).
struct Line {
    char buf[32768];
    size_t n = 0;
    bool overflow = false;
};
void put(Line &s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void put(Line &s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(s.buf + s.n, sizeof s.buf - s.n, fmt, ap);
    va_end(ap);
    if (n < 0 || size_t(n) >= sizeof s.buf - s.n) s.overflow = true;
    else s.n += size_t(n);
}
void put_binding(Line &s, const FMSimBindingCounts &b) {
    put(s, "{\"bytes_read\":%llu,\"bytes_written\":%llu,\"load_events\":%llu,\"store_events\":%llu,"
           "\"unique_bytes_read\":%llu,\"unique_bytes_written\":%llu,\"unique_lines\":%llu,"
           "\"load_requests\":%llu,\"load_request_bytes\":%llu,\"store_requests\":%llu}",
        (unsigned long long)b.bytes_read, (unsigned long long)b.bytes_written, (unsigned long long)b.load_events,
        (unsigned long long)b.store_events, (unsigned long long)b.unique_bytes_read,
        (unsigned long long)b.unique_bytes_written, (unsigned long long)b.unique_lines,
        (unsigned long long)b.load_requests, (unsigned long long)b.load_request_bytes,
        (unsigned long long)b.store_requests);
}
} // namespace

extern "C" const char *fmsim_counts_log_path(void) {
    const char *p = getenv("FLASHMETAL_SIM_COUNTS");
    return p && *p ? p : nullptr;
}

extern "C" int fmsim_counts_append(const char *path, const FMSimDispatch *d, const FMSimCounts *c) {
    if (!path || !d || !c || !d->name) return -1;
    {
        static thread_local Line s;
        s.n = 0;
        s.overflow = false;
        put(s, "{\"kernel\":\"%s\",\"grid\":[%u,%u,%u],\"threads\":[%u,%u,%u],\"constants\":[", d->name, d->grid[0],
            d->grid[1], d->grid[2], d->threads[0], d->threads[1], d->threads[2]);
        for (int i = 0; i < d->n_constants; i++)
            put(s, "%s[%d,%d]", i ? "," : "", d->constants[i].index, d->constants[i].value);
        put(s, "],\"bindings\":[");
        for (int i = 0; i < d->n_bindings; i++)
            put(s, "%s[%d,%llu,%d]", i ? "," : "", d->bindings[i].index, (unsigned long long)d->bindings[i].length,
                d->bindings[i].is_bytes);
        put(s, "],\"threadgroups\":%llu,\"threads_per_threadgroup\":%u,\"threadgroup_memory\":%u,\"device\":",
            (unsigned long long)c->threadgroups, c->threads_per_threadgroup, c->threadgroup_memory);
        put_binding(s, c->device);
        put(s, ",\"binding\":{");
        bool first = true;
        for (int i = 0; i < d->n_bindings; i++) {
            const FMSimBinding &b = d->bindings[i];
            if (b.is_bytes || b.index < 0 || b.index >= FMSIM_MAX_BINDINGS) continue;
            put(s, "%s\"%d\":", first ? "" : ",", b.index);
            put_binding(s, c->binding[b.index]);
            first = false;
        }
        put(s, "},\"constant_bytes_read\":%llu,\"constant_load_events\":%llu,\"tg_bytes_read\":%llu,"
               "\"tg_bytes_written\":%llu,\"tg_load_events\":%llu,\"tg_store_events\":%llu,"
               "\"threadgroup_barriers\":%llu,\"simd_barriers\":%llu,\"simd_shuffles\":%llu,"
               "\"simd_reductions\":%llu,\"simd_votes\":%llu,\"mma_f16\":%llu,\"mma_bf16\":%llu,\"mma_f32\":%llu,"
               "\"special\":%llu}\n",
            (unsigned long long)c->constant_bytes_read, (unsigned long long)c->constant_load_events,
            (unsigned long long)c->tg_bytes_read, (unsigned long long)c->tg_bytes_written,
            (unsigned long long)c->tg_load_events, (unsigned long long)c->tg_store_events,
            (unsigned long long)c->threadgroup_barriers, (unsigned long long)c->simd_barriers,
            (unsigned long long)c->simd_shuffles, (unsigned long long)c->simd_reductions,
            (unsigned long long)c->simd_votes, (unsigned long long)c->mma_f16, (unsigned long long)c->mma_bf16,
            (unsigned long long)c->mma_f32, (unsigned long long)c->special);
        // One write of the whole line: lines of concurrent dispatches never interleave.
        if (s.overflow) return -1;
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd < 0) return -1;
        ssize_t w = write(fd, s.buf, s.n);
        close(fd);
        return w == ssize_t(s.n) ? 0 : -1;
    }
}
