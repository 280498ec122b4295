// simulator.cpp — the fiber simulator of the Apple GPU execution model.
//
// One threadgroup runs on one OS worker thread at a time: each GPU thread is
// a fiber with its own stack. A fiber runs until it reaches a barrier or a
// SIMD collective that is not yet complete, then yields to the scheduler
// loop of its worker. The last thread to arrive completes the barrier or
// collective and carries on. A scheduler pass that finds no runnable fiber
// while some are not finished reports a deadlock census.
//
// Nothing escapes fmsim_dispatch: kernel failures, exhausted memory,
// mappings or threads all come back as a status and a message.
#include "simulator.h"
#include "simulator_internal.h"
#include "counters.h"
#include "include/fmsim.h"
#include "../CFlashMetal/fm_env.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>
#include <cerrno>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

namespace fmsim {

__thread const ThreadIds *tl_ids = nullptr;

namespace {

constexpr size_t kTGLimit = 32768;

struct SimError {
    char msg[768];
};

enum class Wait : uint8_t { Run, Barrier, Simd, Done };

struct Fiber {
    void *sp = nullptr;
    ThreadIds ids{};
    Wait wait = Wait::Run;
    Site site{};
    const char *what = nullptr;
};

struct SimdSlot {
    uint32_t live_mask = 0;
    uint32_t arrived = 0;
    uint32_t gen = 0;
    CombineFn fn = nullptr;
    const char *what = nullptr;
    Site site{};
    void *in[32];
    void *out[32];
};

struct TGEntry {
    const void *key;
    void *ptr;
};

struct DispatchState;

// Per OS worker: the fibers of the group it runs, their stacks (kept for the
// worker's life: they come back to the pool with it), the scheduler context
// and threadgroup memory.
struct Worker {
    DispatchState *ds = nullptr;
    std::vector<Fiber> fibers;
    std::vector<SimdSlot> simd;
    char *stacks = nullptr;
    size_t stack_size = 0, stacks_n = 0, stacks_bytes = 0, stacks_maps = 0;
    void *sched_sp = nullptr;
    Fiber *cur = nullptr;
    uint32_t live = 0;
    uint32_t bar_count = 0;
    Site bar_site{};
    uint32_t tgid[3]{};
    alignas(64) unsigned char tg_mem[kTGLimit];
    size_t tg_used = 0;
    TGEntry tg_tab[64];
    int tg_n = 0;
    void *tg_param[FMSIM_MAX_BINDINGS]{};
    bool failed = false;
    char err[768];
    uint64_t rng = 0;
    ~Worker() {
        if (stacks) munmap(stacks, stacks_bytes);
    }
};

__thread Worker *tl_worker = nullptr;

struct DispatchState {
    const KernelEntry *entry = nullptr;
    BoundArgs args{};
    int32_t const_value[FMSIM_MAX_CONSTANTS];
    int32_t const_index[FMSIM_MAX_CONSTANTS];
    uint8_t const_bool[FMSIM_MAX_CONSTANTS];
    int n_const = 0;
    uint32_t grid[3], threads[3];
    uint32_t tg_len[FMSIM_MAX_BINDINGS]{};
    bool scramble = false;
    uint64_t seed = 0;
    int (*interrupted)(uint64_t) = nullptr;
    uint64_t interrupt_token = 0;
    DispatchCounter *counter = nullptr; // a counted dispatch
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    std::atomic<bool> stopped{false}; // by `interrupted`
    std::mutex err_mu;
    char err[1024] = "";
};

size_t page_size() {
    static const size_t s = [] {
        long p = sysconf(_SC_PAGESIZE); // 16 KiB on Apple silicon
        return p > 0 ? size_t(p) : size_t(4096);
    }();
    return s;
}

// FLASHMETAL_SIM_STACK_KB, read once, whole pages.
size_t stack_size_default() {
    static const size_t s = [] {
        static int warned;
        long long kb = 512;
        fm_env_int("FLASHMETAL_SIM_STACK_KB", 64, 16384, &kb, &warned);
        size_t bytes = size_t(kb) * 1024, page = page_size();
        return (bytes + page - 1) / page * page;
    }();
    return s;
}

void fmt_site(char *buf, size_t n, const Site &s) {
    const char *f = s.file ? strrchr(s.file, '/') : nullptr;
    snprintf(buf, n, "%s:%u", f ? f + 1 : (s.file ? s.file : "?"), s.line);
}

void yield_fiber() {
    Worker *w = tl_worker;
    ctx_switch(&w->cur->sp, w->sched_sp);
}

void complete_simd(Worker *w, SimdSlot &s, Fiber *self) {
    void *in[32], *out[32];
    for (int l = 0; l < 32; l++) {
        bool on = (s.live_mask >> l) & 1;
        in[l] = on ? s.in[l] : nullptr;
        out[l] = on ? s.out[l] : nullptr;
    }
    CombineFn fn = s.fn;
    uint32_t mask = s.live_mask;
    uint32_t base = uint32_t(&s - w->simd.data()) * 32;
    s.arrived = 0;
    s.fn = nullptr;
    s.gen++;
    if (tl_counts) {
        count_collective(tl_counts, s.what);
        tl_counts->phase(int(&s - w->simd.data()));
    }
    fn(in, out, mask);
    for (int l = 0; l < 32; l++) {
        if (!((mask >> l) & 1)) continue;
        Fiber &f = w->fibers[base + l];
        if (&f != self && f.wait == Wait::Simd) f.wait = Wait::Run;
    }
}

void release_barrier(Worker *w) {
    if (tl_counts) {
        tl_counts->c.threadgroup_barriers++;
        tl_counts->phase(-1);
    }
    for (auto &f : w->fibers)
        if (f.wait == Wait::Barrier) f.wait = Wait::Run;
    w->bar_count = 0;
}

void fiber_finish(Worker *w, Fiber *f) {
    f->wait = Wait::Done;
    w->live--;
    SimdSlot &s = w->simd[f->ids.simd];
    s.live_mask &= ~(1u << f->ids.lane);
    if (s.arrived && s.arrived == s.live_mask) complete_simd(w, s, f);
    if (w->bar_count && w->bar_count == w->live) release_barrier(w);
}

void fiber_entry() {
    Worker *w = tl_worker;
    Fiber *f = w->cur;
    try {
        w->ds->entry->invoke(w->ds->args);
    } catch (const SimError &e) {
        if (!w->failed) {
            w->failed = true;
            snprintf(w->err, sizeof w->err, "thread (%u,%u,%u): %s", f->ids.tid[0], f->ids.tid[1],
                     f->ids.tid[2], e.msg);
        }
    } catch (...) {
        if (!w->failed) {
            w->failed = true;
            snprintf(w->err, sizeof w->err, "thread (%u,%u,%u): C++ exception in kernel",
                     f->ids.tid[0], f->ids.tid[1], f->ids.tid[2]);
        }
    }
    // tl_worker may not be re-read after a switch on another worker, but a
    // fiber never migrates: its worker is fixed.
    fiber_finish(w, f);
    ctx_switch(&f->sp, w->sched_sp);
    __builtin_trap(); // a finished fiber is never resumed
}

// Mappings a worker with n fiber stacks holds: each guard page splits the
// area, so a stack and its guard are two.
size_t stack_maps(size_t n) { return 2 * n; }

// Maps n fiber stacks, each above a PROT_NONE guard page (an overflow faults
// instead of running into the next fiber's stack).
bool map_stacks(Worker *w, size_t n, char *err, size_t errlen) {
    const size_t ss = stack_size_default(), page = page_size();
    const size_t bytes = n * ss; // n <= 1024, ss <= 16 MiB: no overflow
    void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "sim: cannot map %zu fiber stacks of %zu KiB: %s", n, ss / 1024, strerror(errno));
        return false;
    }
    char *base = static_cast<char *>(p);
    for (size_t i = 0; i < n; i++) {
        if (mprotect(base + i * ss, page, PROT_NONE) != 0) {
            snprintf(err, errlen, "sim: cannot protect the guard page of fiber stack %zu of %zu: %s", i, n,
                     strerror(errno));
            munmap(base, bytes);
            return false;
        }
    }
    w->stacks = base;
    w->stacks_n = n;
    w->stack_size = ss;
    w->stacks_bytes = bytes;
    w->stacks_maps = stack_maps(n);
    return true;
}

uint64_t next_rand(uint64_t &s) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
}

void census(Worker *w, char *buf, size_t n) {
    struct Row { Wait k; Site s; const char *what; uint32_t count, first; };
    Row rows[16];
    int nr = 0;
    uint32_t done = 0;
    for (auto &f : w->fibers) {
        if (f.wait == Wait::Done) { done++; continue; }
        int i = 0;
        for (; i < nr; i++)
            if (rows[i].k == f.wait && rows[i].s == f.site) break;
        if (i == nr) {
            if (nr == 16) continue;
            rows[nr++] = Row{f.wait, f.site, f.what, 0, f.ids.linear};
        }
        rows[i].count++;
    }
    size_t o = snprintf(buf, n, "deadlock: no thread can make progress;");
    for (int i = 0; i < nr && o < n; i++) {
        char sb[256];
        fmt_site(sb, sizeof sb, rows[i].s);
        o += snprintf(buf + o, n - o, " %u thread(s) (first %u) wait at %s %s;", rows[i].count, rows[i].first,
                      rows[i].k == Wait::Barrier ? "threadgroup_barrier" : (rows[i].what ? rows[i].what : "?"), sb);
    }
    if (o < n) snprintf(buf + o, n - o, " %u finished", done);
}

// Runs one threadgroup to completion on the calling OS thread.
bool run_group(Worker *w, DispatchState *ds, uint64_t gi) {
    uint32_t gx = ds->grid[0], gy = ds->grid[1];
    w->tgid[0] = uint32_t(gi % gx);
    w->tgid[1] = uint32_t((gi / gx) % gy);
    w->tgid[2] = uint32_t(gi / (uint64_t(gx) * gy));
    uint32_t tx = ds->threads[0], ty = ds->threads[1], tz = ds->threads[2];
    uint32_t n = tx * ty * tz;
    uint32_t nsimd = (n + 31) / 32;
    w->fibers.resize(n);
    w->simd.assign(nsimd, SimdSlot{});
    for (uint32_t s = 0; s < nsimd; s++) {
        uint32_t lanes = (s + 1) * 32 <= n ? 32 : n - s * 32;
        w->simd[s].live_mask = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
    }
    // Threadgroup memory: dynamic buffers first, then TG_ARRAYs on demand;
    // all of it poisoned with NaN bytes.
    w->tg_used = 0;
    w->tg_n = 0;
    for (int i = 0; i < FMSIM_MAX_BINDINGS; i++) {
        w->tg_param[i] = nullptr;
        if (!ds->tg_len[i]) continue;
        size_t len = (ds->tg_len[i] + 15) & ~size_t(15);
        w->tg_param[i] = w->tg_mem + w->tg_used;
        memset(w->tg_param[i], 0xff, len);
        w->tg_used += len;
    }
    w->live = n;
    w->bar_count = 0;
    w->failed = false;
    w->ds = ds;
    for (uint32_t i = 0; i < n; i++) {
        Fiber &f = w->fibers[i];
        f.wait = Wait::Run;
        f.what = nullptr;
        ThreadIds &id = f.ids;
        id.tid[0] = i % tx;
        id.tid[1] = (i / tx) % ty;
        id.tid[2] = i / (tx * ty);
        for (int k = 0; k < 3; k++) {
            id.tgid[k] = w->tgid[k];
            id.tpg[k] = ds->threads[k];
            id.ngroups[k] = ds->grid[k];
        }
        id.linear = i;
        id.lane = i % 32;
        id.simd = i / 32;
        id.nsimd = nsimd;
        f.sp = ctx_init(w->stacks + size_t(i) * w->stack_size, w->stack_size, fiber_entry);
    }
    std::vector<uint32_t> order(n);
    for (uint32_t i = 0; i < n; i++) order[i] = i;
    while (true) {
        if (ds->interrupted && ds->interrupted(ds->interrupt_token)) {
            ds->stopped.store(true);
            snprintf(w->err, sizeof w->err, "interrupted");
            w->failed = true;
            return false;
        }
        if (ds->scramble) {
            for (uint32_t i = n; i > 1; i--) {
                uint32_t j = uint32_t(next_rand(w->rng) % i);
                std::swap(order[i - 1], order[j]);
            }
        }
        bool progress = false;
        for (uint32_t k = 0; k < n; k++) {
            Fiber &f = w->fibers[order[k]];
            if (f.wait != Wait::Run) continue;
            progress = true;
            w->cur = &f;
            tl_ids = &f.ids;
            ctx_switch(&w->sched_sp, f.sp);
            if (w->failed) break;
        }
        tl_ids = nullptr;
        if (w->failed) return false;
        if (w->live == 0) {
            if (WorkerCounts *wc = tl_counts) {
                wc->c.threadgroups++;
                wc->phase(-1);
                if (w->tg_used > wc->c.threadgroup_memory) wc->c.threadgroup_memory = uint32_t(w->tg_used);
            }
            return true;
        }
        if (!progress) {
            census(w, w->err, sizeof w->err);
            w->failed = true;
            return false;
        }
    }
}

} // namespace

// ---- runtime entry points used by the shim --------------------------------

void fail(const char *fmt, ...) {
    SimError e;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.msg, sizeof e.msg, fmt, ap);
    va_end(ap);
    throw e;
}

void threadgroup_barrier(const Site &site) {
    Worker *w = tl_worker;
    Fiber *f = w->cur;
    SimdSlot &s = w->simd[f->ids.simd];
    if (s.arrived) {
        char a[256], b[256];
        fmt_site(a, sizeof a, site);
        fmt_site(b, sizeof b, s.site);
        fail("divergence: lane %u reached threadgroup_barrier at %s while other lanes of SIMD group %u wait at %s %s",
             f->ids.lane, a, f->ids.simd, s.what, b);
    }
    if (w->bar_count == 0) {
        w->bar_site = site;
    } else if (!(w->bar_site == site)) {
        char a[256], b[256];
        fmt_site(a, sizeof a, site);
        fmt_site(b, sizeof b, w->bar_site);
        fail("divergent threadgroup_barrier: this thread is at %s, %u other thread(s) wait at %s", a, w->bar_count, b);
    }
    if (++w->bar_count == w->live) {
        release_barrier(w);
        return;
    }
    f->wait = Wait::Barrier;
    f->site = site;
    yield_fiber();
}

void collective(void *in, void *out, CombineFn fn, const char *what, const Site &site) {
    Worker *w = tl_worker;
    Fiber *f = w->cur;
    SimdSlot &s = w->simd[f->ids.simd];
    if (s.arrived == 0) {
        s.fn = fn;
        s.site = site;
        s.what = what;
    } else if (!(s.site == site) || s.fn != fn) {
        char a[256], b[256];
        fmt_site(a, sizeof a, site);
        fmt_site(b, sizeof b, s.site);
        fail("divergent SIMD collective: lane %u of SIMD group %u calls %s at %s while other lanes wait at %s %s",
             f->ids.lane, f->ids.simd, what, a, s.what, b);
    }
    s.in[f->ids.lane] = in;
    s.out[f->ids.lane] = out;
    s.arrived |= 1u << f->ids.lane;
    if (s.arrived == s.live_mask) {
        complete_simd(w, s, f);
        return;
    }
    f->wait = Wait::Simd;
    f->site = site;
    f->what = what;
    yield_fiber();
}

static void noop_combine(void *const *, void *const *, uint32_t) {}

void simdgroup_barrier(const Site &site) { collective(nullptr, nullptr, noop_combine, "simdgroup_barrier", site); }

void *tg_array(const void *key, size_t bytes, size_t align, const char *name, const Site &site) {
    Worker *w = tl_worker;
    for (int i = 0; i < w->tg_n; i++)
        if (w->tg_tab[i].key == key) return w->tg_tab[i].ptr;
    if (align < 16) align = 16;
    size_t off = (w->tg_used + align - 1) & ~(align - 1);
    if (off + bytes > kTGLimit || w->tg_n == 64) {
        char a[256];
        fmt_site(a, sizeof a, site);
        fail("threadgroup memory limit: TG_ARRAY %s (%zu bytes) at %s brings the total to %zu bytes, over 32 KiB "
             "(32768)", name, bytes, a, off + bytes);
    }
    void *p = w->tg_mem + off;
    memset(p, 0xff, bytes);
    w->tg_used = off + bytes;
    w->tg_tab[w->tg_n++] = TGEntry{key, p};
    return p;
}

void *tg_buffer(int index) {
    Worker *w = tl_worker;
    if (index < 0 || index >= FMSIM_MAX_BINDINGS || !w->tg_param[index])
        fail("threadgroup buffer %d has no length set in the dispatch", index);
    return w->tg_param[index];
}

int32_t constant_value(int index, bool is_bool, const char *name) {
    const DispatchState *ds = tl_worker->ds;
    for (int i = 0; i < ds->n_const; i++) {
        if (ds->const_index[i] != index) continue;
        if (bool(ds->const_bool[i]) != is_bool)
            fail("function constant %s (index %d) is declared %s but the dispatch sets an %s", name, index,
                 is_bool ? "bool" : "int", ds->const_bool[i] ? "bool" : "int");
        return ds->const_value[i];
    }
    fail("function constant %s (index %d) is not set by the dispatch", name, index);
}

bool constant_defined(int index) {
    const DispatchState *ds = tl_worker->ds;
    for (int i = 0; i < ds->n_const; i++)
        if (ds->const_index[i] == index) return true;
    return false;
}

// The simulator's own memory a traced kernel reads: the running fiber's ids
// (through the thread-local tl_ids), the dispatch's state (the bound
// arguments its invocation loads), the running worker's, and the per-group
// fibers and SIMD-group slots a traced collective reads (other lanes'
// values live on their stacks).
bool simulator_owns(uintptr_t a) {
    const Worker *w = tl_worker;
    if (!w) return false;
    auto in = [a](const void *p, size_t n) { return a - reinterpret_cast<uintptr_t>(p) < n; };
    return in(&tl_ids, sizeof tl_ids) || in(w->ds, sizeof *w->ds) || in(w, sizeof *w) ||
           in(w->simd.data(), w->simd.size() * sizeof(SimdSlot)) ||
           in(w->fibers.data(), w->fibers.size() * sizeof(Fiber));
}
} // namespace fmsim

using namespace fmsim;

namespace {
// ---- the process's workers: bounded in count and in memory mappings --------
//
// Every fiber stack with its guard page costs two memory mappings, and Linux
// allows 65530 per process by default (vm.max_map_count): a 1024-thread group
// needs 2048. Workers (and their stacks) are shared by every dispatch of the
// process and capped, so concurrent dispatches from many threads queue for
// workers instead of exhausting mappings.
constexpr size_t kMapBudget = 16384; // a quarter of Linux's default limit
constexpr int kMaxWorkers = 256;

struct WorkerPool {
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    Worker *all[kMaxWorkers];
    int n_all = 0;
    Worker *idle[kMaxWorkers];
    int n_idle = 0;
    size_t maps = 0; // held by all workers
};
WorkerPool g_pool;

void pool_lock_for_fork() { pthread_mutex_lock(&g_pool.mu); }
void pool_unlock_after_fork() { pthread_mutex_unlock(&g_pool.mu); }
// The child has only the forking thread: no dispatch runs there, so every
// worker is idle, and the lock and condition variable start afresh (waiters
// of the parent do not exist here).
void pool_reset_in_child() {
    pthread_mutex_init(&g_pool.mu, nullptr);
    pthread_cond_init(&g_pool.cv, nullptr);
    for (int i = 0; i < g_pool.n_all; i++) g_pool.idle[i] = g_pool.all[i];
    g_pool.n_idle = g_pool.n_all;
}
const int g_pool_atfork = pthread_atfork(pool_lock_for_fork, pool_unlock_after_fork, pool_reset_in_child);

// Frees an idle worker (locked).
void destroy_worker(Worker *w) {
    for (int i = 0; i < g_pool.n_all; i++) {
        if (g_pool.all[i] != w) continue;
        g_pool.all[i] = g_pool.all[--g_pool.n_all];
        break;
    }
    g_pool.maps -= w->stacks_maps;
    delete w;
}

// A new worker with n stacks, if the budget allows (locked). Returns null
// and leaves `err` empty when over budget, sets `err` when the system refused.
Worker *create_worker(size_t n, char *err, size_t errlen) {
    if (g_pool.n_all >= kMaxWorkers || g_pool.maps + stack_maps(n) > kMapBudget) return nullptr;
    Worker *w = new (std::nothrow) Worker();
    if (!w) {
        snprintf(err, errlen, "sim: out of memory for a worker");
        return nullptr;
    }
    if (!map_stacks(w, n, err, errlen)) {
        delete w;
        return nullptr;
    }
    g_pool.all[g_pool.n_all++] = w;
    g_pool.maps += w->stacks_maps;
    return w;
}

// Takes up to `want` (>= 1) workers with stacks for n threads into `out`:
// idle ones first, then new ones within the budget (freeing idle workers
// whose stacks are too small), waiting while other dispatches hold them all.
// Returns the count taken; 0 with `err` set when the system refused.
int acquire_workers(size_t n, int want, Worker **out, char *err, size_t errlen) {
    err[0] = 0;
    pthread_mutex_lock(&g_pool.mu);
    int got = 0;
    for (;;) {
        for (int i = g_pool.n_idle - 1; i >= 0 && got < want; i--) {
            Worker *w = g_pool.idle[i];
            if (w->stacks_n < n) continue;
            g_pool.idle[i] = g_pool.idle[--g_pool.n_idle];
            out[got++] = w;
        }
        while (got < want) {
            Worker *w = create_worker(n, err, errlen);
            if (!w && !err[0] && g_pool.n_idle > 0) { // make room: an idle worker too small for n
                destroy_worker(g_pool.idle[--g_pool.n_idle]);
                continue;
            }
            if (!w) break;
            out[got++] = w;
        }
        const bool others_busy = g_pool.n_all > g_pool.n_idle + got;
        if (got > 0 || !others_busy) break;
        err[0] = 0; // a dispatch in flight gives workers back: wait for them
        pthread_cond_wait(&g_pool.cv, &g_pool.mu);
    }
    pthread_mutex_unlock(&g_pool.mu);
    if (got == 0 && !err[0])
        snprintf(err, errlen, "sim: a %zu-thread threadgroup needs %zu memory mappings, over the simulator's budget "
                 "of %zu", n, stack_maps(n), kMapBudget);
    return got;
}

void release_workers(Worker *const *ws, int n) {
    pthread_mutex_lock(&g_pool.mu);
    // Kept for reuse (within the budget); a dispatch that needs room frees
    // idle workers too small for it, fmsim_release_idle frees them all.
    for (int i = 0; i < n; i++) g_pool.idle[g_pool.n_idle++] = ws[i];
    pthread_cond_broadcast(&g_pool.cv);
    pthread_mutex_unlock(&g_pool.mu);
}

// Returns the workers of one dispatch to the pool however it ends.
struct HeldWorkers {
    Worker *w[kMaxWorkers];
    int n = 0;
    ~HeldWorkers() { release_workers(w, n); }
};

// FLASHMETAL_SIM_* values read by every dispatch (a test may change them
// between calls); a bad value is reported once and ignored.
bool env_scramble(uint64_t *seed) {
    static int warned;
    long long v = 0;
    if (fm_env_int("FLASHMETAL_SIM_SCRAMBLE", 0, INT64_MAX, &v, &warned) != 1 || v == 0) return false;
    if (v != 1) *seed = uint64_t(v);
    return true;
}

long env_workers(long dflt) {
    static int warned;
    long long v = dflt;
    fm_env_int("FLASHMETAL_SIM_WORKERS", 1, 1024, &v, &warned);
    return long(v);
}

void set_error(DispatchState *ds, const char *msg) {
    std::lock_guard<std::mutex> g(ds->err_mu);
    if (!ds->failed.exchange(true)) snprintf(ds->err, sizeof ds->err, "%s", msg);
}

void worker_loop(DispatchState *ds, Worker *w, uint64_t total, uint64_t wid) noexcept {
    tl_worker = w;
    WorkerCounts wc;
    if (ds->counter) {
        wc.dc = ds->counter;
        wc.tg_lo = reinterpret_cast<uintptr_t>(w->tg_mem);
        wc.tg_len = sizeof w->tg_mem;
        wc.stack_lo = reinterpret_cast<uintptr_t>(w->stacks);
        wc.stack_len = w->stacks_bytes;
        tl_counts = &wc;
    }
    w->rng = (ds->seed ? ds->seed : 0x9e3779b97f4a7c15ull) + wid * 0x2545F4914F6CDD1Dull;
    if (!w->rng) w->rng = 1;
    char buf[1024];
    while (!ds->failed.load(std::memory_order_relaxed)) {
        if (ds->interrupted && ds->interrupted(ds->interrupt_token)) {
            ds->stopped.store(true);
            set_error(ds, "interrupted");
            break;
        }
        uint64_t gi = ds->next.fetch_add(1);
        if (gi >= total) break;
        bool ok;
        try {
            ok = run_group(w, ds, gi);
        } catch (...) { // allocation failure in the scheduler
            ok = false;
            w->failed = true;
            snprintf(w->err, sizeof w->err, "out of memory");
        }
        if (!ok) {
            snprintf(buf, sizeof buf, "%s: threadgroup (%u,%u,%u) %s", ds->entry->name, w->tgid[0], w->tgid[1],
                     w->tgid[2], w->err);
            set_error(ds, buf);
        }
    }
    if (ds->counter) {
        wc.merge();
        tl_counts = nullptr;
    }
    tl_worker = nullptr;
}

int dispatch(const FMSimDispatch *d, char *err, size_t errlen) {
    if (!d || !d->name) {
        snprintf(err, errlen, "sim: null dispatch or kernel name");
        return FMSIM_ERROR_INVALID;
    }
    const KernelEntry *e = find_kernel(d->name);
    if (!e) {
        snprintf(err, errlen, "sim: no kernel named '%s' is compiled into the simulator", d->name);
        return FMSIM_ERROR_UNKNOWN_KERNEL;
    }
#if !defined(__linux__)
    if (d->check_bounds) {
        snprintf(err, errlen, "%s: check_bounds needs the ELF image map (Linux only)", d->name);
        return FMSIM_ERROR_INVALID;
    }
#endif
    if (d->counts || d->check_bounds) {
        e = find_counted_kernel(d->name);
        if (!e) {
            snprintf(err, errlen, "sim: no counted copy of kernel '%s' is compiled into the simulator", d->name);
            return FMSIM_ERROR_UNKNOWN_KERNEL;
        }
    }
    auto ds = std::make_unique<DispatchState>();
    ds->entry = e;
    uint64_t ngroups = 1, nthreads = 1;
    for (int k = 0; k < 3; k++) {
        ds->grid[k] = d->grid[k];
        ds->threads[k] = d->threads[k];
        ngroups *= d->grid[k];
        nthreads *= d->threads[k];
    }
    if (nthreads == 0 || nthreads > FMSIM_MAX_THREADS) {
        snprintf(err, errlen, "%s: threads per threadgroup (%u,%u,%u) must number 1..%d", e->name, d->threads[0],
                 d->threads[1], d->threads[2], FMSIM_MAX_THREADS);
        return FMSIM_ERROR_INVALID;
    }
    if (d->n_constants < 0 || d->n_constants > FMSIM_MAX_CONSTANTS) {
        snprintf(err, errlen, "%s: %d function constants (at most %d)", e->name, d->n_constants, FMSIM_MAX_CONSTANTS);
        return FMSIM_ERROR_INVALID;
    }
    for (int i = 0; i < d->n_constants; i++) {
        ds->const_index[i] = d->constants[i].index;
        ds->const_bool[i] = d->constants[i].is_bool != 0;
        ds->const_value[i] = d->constants[i].value;
    }
    ds->n_const = d->n_constants;
    // Bindings: parameter position == buffer index.
    std::vector<std::unique_ptr<unsigned char[]>> copies;
    for (int i = 0; i < d->n_bindings; i++) {
        const FMSimBinding &b = d->bindings[i];
        if (b.index < 0 || b.index >= FMSIM_MAX_BINDINGS) {
            snprintf(err, errlen, "%s: binding index %d is out of range 0..%d", e->name, b.index, FMSIM_MAX_BINDINGS - 1);
            return FMSIM_ERROR_INVALID;
        }
        if (b.index >= e->n_params || e->kinds[b.index] == 2) {
            snprintf(err, errlen, "%s: binding index %d has no buffer parameter (the kernel has %d parameter(s))",
                     e->name, b.index, e->n_params);
            return FMSIM_ERROR_INVALID;
        }
        if (e->kinds[b.index] == 1 && b.length < e->ref_sizes[b.index]) {
            snprintf(err, errlen, "%s: buffer %d holds %llu bytes, the kernel reads a %u-byte struct", e->name,
                     b.index, (unsigned long long)b.length, e->ref_sizes[b.index]);
            return FMSIM_ERROR_INVALID;
        }
        void *p = b.data;
        if (b.is_bytes) {
            copies.emplace_back(new unsigned char[(b.length + 64)]);
            unsigned char *c = copies.back().get();
            c = reinterpret_cast<unsigned char *>((reinterpret_cast<uintptr_t>(c) + 15) & ~uintptr_t(15));
            if (b.length) memcpy(c, b.data, b.length);
            p = c;
        }
        ds->args.ptr[b.index] = p;
    }
    std::unique_ptr<DispatchCounter> counter;
    if (d->counts || d->check_bounds) {
        counter = std::make_unique<DispatchCounter>();
        counter->counting = d->counts != nullptr;
        counter->checking = d->check_bounds != 0;
        for (int i = 0; i < d->n_bindings; i++) {
            const FMSimBinding &b = d->bindings[i];
            if (!counter->add_range(ds->args.ptr[b.index], size_t(b.length), b.index, !b.is_bytes)) {
                snprintf(err, errlen, "sim: out of memory for the counters of buffer %d", b.index);
                return FMSIM_ERROR_RESOURCES;
            }
        }
        ds->counter = counter.get();
    }
    // Unbound struct references see zeros (the kernel must not read them).
    alignas(64) static const unsigned char zeros[4096] = {};
    for (int i = 0; i < e->n_params; i++) {
        if (e->kinds[i] == 1 && !ds->args.ptr[i]) {
            if (e->ref_sizes[i] > sizeof zeros) {
                snprintf(err, errlen, "%s: struct buffer %d is not bound", e->name, i);
                return FMSIM_ERROR_INVALID;
            }
            ds->args.ptr[i] = const_cast<unsigned char *>(zeros);
        }
    }
    uint64_t tg_total = 0;
    for (int i = 0; i < d->n_tg_memory; i++) {
        const FMSimTGMemory &t = d->tg_memory[i];
        if (t.index < 0 || t.index >= FMSIM_MAX_BINDINGS) {
            snprintf(err, errlen, "%s: threadgroup memory index %d is out of range 0..%d", e->name, t.index,
                     FMSIM_MAX_BINDINGS - 1);
            return FMSIM_ERROR_INVALID;
        }
        ds->tg_len[t.index] = t.length;
        tg_total += (uint64_t(t.length) + 15) & ~uint64_t(15);
    }
    if (tg_total > 32768) {
        snprintf(err, errlen, "%s: threadgroup memory lengths total %llu bytes, over 32 KiB (32768)", e->name,
                 (unsigned long long)tg_total);
        return FMSIM_ERROR_INVALID;
    }
    ds->scramble = d->scramble != 0;
    ds->seed = d->seed;
    if (env_scramble(&ds->seed)) ds->scramble = true;
    ds->interrupted = d->interrupted;
    ds->interrupt_token = d->interrupt_token;
    long workers = env_workers(d->workers);
    if (workers <= 0) workers = long(std::thread::hardware_concurrency());
    if (workers <= 0) workers = 1;
    if (workers > kMaxWorkers) workers = kMaxWorkers;
    if (uint64_t(workers) > ngroups) workers = long(ngroups);
    if (d->counts) *d->counts = FMSimCounts{};
    if (ngroups == 0) return FMSIM_OK;

    HeldWorkers held;
    held.n = acquire_workers(nthreads, int(workers), held.w, err, errlen);
    if (held.n == 0) return FMSIM_ERROR_RESOURCES;
    if (held.n == 1) {
        Worker *prev = tl_worker;
        worker_loop(ds.get(), held.w[0], ngroups, 0);
        tl_worker = prev;
    } else {
        // A thread the system refuses leaves its share to the others.
        // Helper threads block every signal (they inherit the mask), so a
        // SIGINT reaches an application thread.
        std::vector<std::thread> th;
        th.reserve(size_t(held.n));
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        for (int i = 1; i < held.n; i++) {
            try {
                th.emplace_back(worker_loop, ds.get(), held.w[i], ngroups, uint64_t(i));
            } catch (...) {
                break;
            }
        }
        pthread_sigmask(SIG_SETMASK, &old, nullptr);
        worker_loop(ds.get(), held.w[0], ngroups, 0);
        for (auto &t : th) t.join();
    }
    if (ds->stopped.load()) {
        snprintf(err, errlen, "%s: interrupted", e->name);
        return FMSIM_INTERRUPTED;
    }
    if (ds->failed.load()) {
        snprintf(err, errlen, "%s", ds->err);
        return FMSIM_ERROR_KERNEL;
    }
    if (counter && counter->counting) {
        counter->finish(d->counts);
        d->counts->threads_per_threadgroup = uint32_t(nthreads);
    }
    if (counter && counter->oob.load()) {
        counter->describe_oob(e->name, err, errlen);
        return FMSIM_ERROR_BOUNDS;
    }
    return FMSIM_OK;
}
} // namespace

extern "C" int fmsim_dispatch(const FMSimDispatch *d, char *err, size_t errlen) {
    char dummy[8];
    if (!err || errlen == 0) { err = dummy; errlen = sizeof dummy; }
    err[0] = 0;
    try {
        return dispatch(d, err, errlen);
    } catch (const std::bad_alloc &) {
        snprintf(err, errlen, "sim: out of memory");
    } catch (const std::exception &x) {
        snprintf(err, errlen, "sim: %s", x.what());
    } catch (...) {
        snprintf(err, errlen, "sim: unexpected C++ exception");
    }
    return FMSIM_ERROR_RESOURCES;
}

extern "C" void fmsim_release_idle(void) {
    pthread_mutex_lock(&g_pool.mu);
    while (g_pool.n_idle > 0) destroy_worker(g_pool.idle[--g_pool.n_idle]);
    pthread_mutex_unlock(&g_pool.mu);
}

extern "C" void fmsim_resource_usage(int *workers, size_t *mappings) {
    pthread_mutex_lock(&g_pool.mu);
    if (workers) *workers = g_pool.n_all;
    if (mappings) *mappings = g_pool.maps;
    pthread_mutex_unlock(&g_pool.mu);
}

extern "C" const char *fmsim_context_switch_kind(void) { return ctx_kind(); }
