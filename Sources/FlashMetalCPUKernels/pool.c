/* A small persistent thread pool for the cpu backend (WorkerPool.swift).
 *
 * The calling thread always works as worker 0 and never waits for a worker
 * that has not joined the job: items are claimed from an atomic counter, a
 * worker joins only while the job is open, and the caller closes the job
 * when the counter runs out and then waits only for workers inside an item.
 * So a sleeping worker costs the caller nothing, and a short job may run
 * entirely on the calling thread. After a job, workers spin ~FM_POOL_SPIN_NS
 * before sleeping on a condition variable, so back-to-back calls (decode
 * loops, the two passes of a prefill) do not pay a futex wake-up each.
 * A job of >= 16 items first times item 0 on the caller and runs inline when
 * the whole job is projected to take < FM_POOL_INLINE_NS.
 * One job at a time: a caller that finds the pool busy (another thread, or a
 * nested call) runs its items inline.
 * One pool per process (registries share it), made on the first job that
 * needs a second thread. A fork()ed child does not inherit the parent's
 * threads, so the child forgets the parent's pool (it leaks a few bytes: its
 * mutexes may be held by threads that no longer exist) and makes its own.
 * On Linux the workers are kept off the caller's current CPU: after an idle
 * spell the scheduler otherwise tends to wake a worker onto the waker's CPU
 * (wake-affine), and the two then share one CPU for about a millisecond
 * (measured on the 2-vCPU build machine: a 1 ms job ran on one CPU). */
#if defined(__linux__)
#define _GNU_SOURCE
#include <sched.h>
#elif !defined(_POSIX_C_SOURCE) && !defined(__APPLE__)
#define _POSIX_C_SOURCE 200809L
#endif
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include "../CFlashMetal/fm_env.h"
#include "fm_runtime.h"

#define FM_POOL_MAX_THREADS 1024

#define FM_POOL_SPIN_NS 50000LL
/* How long workers woken by fm_pool_prepare spin for the job announced: the
 * host-side work before a job is submitted (Python's argument handling,
 * 100-300 us per call) fits in it. */
#define FM_POOL_PREPARE_NS 400000LL
/* A job whose items are projected (from the first one, timed on the caller)
 * to take less than this in total runs inline: waking a worker would cost more. */
#define FM_POOL_INLINE_NS 15000LL

typedef struct FMPool {
    int nthreads; /* including the caller */
    pthread_t *tids;
    pthread_mutex_t job_mu; /* held by the caller that owns the job slot */
    pthread_mutex_t mu;     /* sleep/wake */
    pthread_cond_t cv;
    /* job (written by the caller before gen is bumped) */
    fm_pool_fn fn;
    void *ctx;
    uint64_t interrupt_token; /* the caller's (fm_interrupt_token) */
    int interrupted;
    int64_t count;
    int64_t job_workers;
    uint64_t job_gen;
    int64_t next;
    /* synchronisation */
    uint64_t gen;
    int open;
    int active;
    int sleepers;
    int64_t spin_until; /* fm_now_ns() before which idle workers spin (fm_pool_prepare) */
    int ids; /* worker index dispenser */
#if defined(__linux__)
    cpu_set_t allowed; /* the process's CPUs when the pool was made */
    int caller_cpu;    /* the CPU the workers are currently kept off, or -1 */
#endif
} FMPool;

static inline void fm_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t fm_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Guided self-scheduling: claim (remaining / 2 workers) items at a time, at
 * least one, so many tiny items do not bounce the counter's cache line. */
static void fm_pool_work(FMPool *p, int64_t w) {
    const int64_t count = p->count, div = 2 * p->job_workers;
    const uint64_t token = p->interrupt_token;
    for (;;) {
        int64_t cur = __atomic_load_n(&p->next, __ATOMIC_SEQ_CST);
        if (cur >= count) break;
        int64_t c = (count - cur) / div;
        if (c < 1) c = 1;
        if (!__atomic_compare_exchange_n(&p->next, &cur, cur + c, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            continue;
        for (int64_t i = cur; i < cur + c; i++) {
            if (fm_interrupt_since(token)) { /* skip the rest of the job */
                __atomic_store_n(&p->interrupted, 1, __ATOMIC_SEQ_CST);
                __atomic_store_n(&p->next, count, __ATOMIC_SEQ_CST);
                return;
            }
            p->fn(p->ctx, w, i);
        }
    }
}

static void *fm_pool_main(void *arg) {
    FMPool *p = (FMPool *)arg;
    const int64_t w = __atomic_add_fetch(&p->ids, 1, __ATOMIC_SEQ_CST);
    uint64_t seen = 0;
    for (;;) {
        if (__atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) == seen) {
            int64_t t0 = fm_now_ns();
            int spins = 0;
            while (__atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) == seen) {
                fm_relax();
                if (++spins < 256) continue;
                spins = 0;
                const int64_t now = fm_now_ns();
                if (now - t0 < FM_POOL_SPIN_NS || now < __atomic_load_n(&p->spin_until, __ATOMIC_RELAXED)) continue;
                pthread_mutex_lock(&p->mu);
                __atomic_add_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
                /* Woken by a job, or by fm_pool_prepare (spin_until ahead). */
                while (__atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) == seen &&
                       fm_now_ns() >= __atomic_load_n(&p->spin_until, __ATOMIC_RELAXED))
                    pthread_cond_wait(&p->cv, &p->mu);
                __atomic_sub_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
                pthread_mutex_unlock(&p->mu);
                t0 = fm_now_ns();
            }
        }
        seen = __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(&p->active, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&p->open, __ATOMIC_SEQ_CST) &&
            __atomic_load_n(&p->job_gen, __ATOMIC_SEQ_CST) == seen && w < p->job_workers)
            fm_pool_work(p, w);
        __atomic_sub_fetch(&p->active, 1, __ATOMIC_SEQ_CST);
    }
}

static FMPool *fm_pool_create(int32_t nthreads) {
    FMPool *p = (FMPool *)calloc(1, sizeof(FMPool));
    if (!p) return NULL;
    p->tids = (pthread_t *)calloc((size_t)nthreads, sizeof(pthread_t));
    if (!p->tids) {
        free(p);
        return NULL;
    }
#if defined(__linux__)
    p->caller_cpu = -1;
    if (sched_getaffinity(0, sizeof(p->allowed), &p->allowed) != 0) CPU_ZERO(&p->allowed);
#endif
    pthread_mutex_init(&p->job_mu, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    /* Workers block every signal (they inherit the mask): a SIGINT or
     * SIGCHLD is then delivered to a thread of the application. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int started = 0;
    for (int i = 1; i < nthreads; i++) {
        if (pthread_create(&p->tids[i], NULL, fm_pool_main, p) != 0) break;
        started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    p->nthreads = 1 + started;
    return p;
}

/* ---- the process's pool ---------------------------------------------------- */
static pthread_mutex_t fm_pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t fm_pool_once = PTHREAD_ONCE_INIT;
static FMPool *fm_pool_global;
static int32_t fm_pool_size = 1;

/* The child of a fork has only the forking thread: the parent's workers are
 * gone, so their pool (and any lock they held) must not be touched again. */
static void fm_pool_before_fork(void) { pthread_mutex_lock(&fm_pool_mu); }
static void fm_pool_after_fork_parent(void) { pthread_mutex_unlock(&fm_pool_mu); }
static void fm_pool_after_fork_child(void) {
    __atomic_store_n(&fm_pool_global, NULL, __ATOMIC_SEQ_CST);
    pthread_mutex_init(&fm_pool_mu, NULL);
}

static void fm_pool_init_once(void) {
    static int warned;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    long long n = online > 0 ? online : 1;
    if (n > FM_POOL_MAX_THREADS) n = FM_POOL_MAX_THREADS;
    fm_env_int("FLASHMETAL_NUM_THREADS", 1, FM_POOL_MAX_THREADS, &n, &warned);
    fm_pool_size = (int32_t)n;
    pthread_atfork(fm_pool_before_fork, fm_pool_after_fork_parent, fm_pool_after_fork_child);
}

int32_t fm_pool_threads(void) {
    pthread_once(&fm_pool_once, fm_pool_init_once);
    return fm_pool_size;
}

/* The pool, made on first call; NULL with one thread or when no thread starts. */
static FMPool *fm_pool_get(void) {
    FMPool *p = __atomic_load_n(&fm_pool_global, __ATOMIC_ACQUIRE);
    if (p || fm_pool_threads() < 2) return p;
    pthread_mutex_lock(&fm_pool_mu);
    p = fm_pool_global;
    if (!p) {
        p = fm_pool_create(fm_pool_size);
        __atomic_store_n(&fm_pool_global, p, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&fm_pool_mu);
    return p && p->nthreads > 1 ? p : NULL;
}

int32_t fm_pool_started_threads(void) {
    FMPool *p = __atomic_load_n(&fm_pool_global, __ATOMIC_ACQUIRE);
    return p ? p->nthreads - 1 : 0;
}

void fm_pool_prepare(void) {
    FMPool *p = __atomic_load_n(&fm_pool_global, __ATOMIC_ACQUIRE);
    if (!p || p->nthreads < 2) return;
    /* Set under the sleepers' mutex: a worker between its check and its wait
     * cannot miss it. */
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->spin_until, fm_now_ns() + FM_POOL_PREPARE_NS, __ATOMIC_RELAXED);
    if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST) > 0) pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Restricts the workers (never the caller) to the allowed CPUs other than
 * the caller's; a syscall per worker, only when the caller's CPU changed
 * since the last job. */
static void fm_pool_keep_off_caller_cpu(FMPool *p) {
#if defined(__linux__)
    const int me = sched_getcpu();
    if (me < 0 || me == p->caller_cpu || !CPU_ISSET(me, &p->allowed)) return;
    cpu_set_t set = p->allowed;
    CPU_CLR(me, &set);
    if (CPU_COUNT(&set) == 0) return;
    p->caller_cpu = me;
    for (int i = 1; i < p->nthreads; i++) pthread_setaffinity_np(p->tids[i], sizeof(set), &set);
#else
    (void)p;
#endif
}

/* Items [first, count) on the calling thread; stops at a SIGINT. */
static int fm_pool_inline(int64_t first, int64_t count, fm_pool_fn fn, void *ctx) {
    const uint64_t token = fm_interrupt_token();
    for (int64_t i = first; i < count; i++) {
        if (fm_interrupt_since(token)) return 1;
        fn(ctx, 0, i);
    }
    return 0;
}

/* The job fm_pool_prepare announced has come: workers it kept spinning go
 * back to the usual spin after a job (a job run inline leaves them nothing
 * to wait for). */
static void fm_pool_settle(void) {
    FMPool *p = __atomic_load_n(&fm_pool_global, __ATOMIC_ACQUIRE);
    if (p) __atomic_store_n(&p->spin_until, 0, __ATOMIC_RELAXED);
}

static int fm_pool_run_job(int64_t count, int64_t max_workers, fm_pool_fn fn, void *ctx);

int fm_pool_run(int64_t count, int64_t max_workers, fm_pool_fn fn, void *ctx) {
    const int interrupted = fm_pool_run_job(count, max_workers, fn, ctx);
    fm_pool_settle();
    return interrupted;
}

static int fm_pool_run_job(int64_t count, int64_t max_workers, fm_pool_fn fn, void *ctx) {
    if (count <= 0) return 0;
    if (fm_interrupt_pending()) return 1;
    if (max_workers > fm_pool_threads()) max_workers = fm_pool_threads();
    int64_t first = 0;
    if (max_workers > 1 && count >= 16) {
        /* Probe: time item 0 here; a tiny job (decode of a short cache)
         * finishes inline without touching the workers. */
        const int64_t t0 = fm_now_ns();
        fn(ctx, 0, 0);
        first = 1;
        if ((fm_now_ns() - t0) * (count - 1) < FM_POOL_INLINE_NS) return fm_pool_inline(1, count, fn, ctx);
    }
    FMPool *p = max_workers > 1 && count - first > 1 ? fm_pool_get() : NULL;
    if (!p || pthread_mutex_trylock(&p->job_mu) != 0) return fm_pool_inline(first, count, fn, ctx);
    fm_pool_keep_off_caller_cpu(p);
    p->fn = fn;
    p->ctx = ctx;
    p->interrupt_token = fm_interrupt_token();
    p->interrupted = 0;
    p->count = count;
    p->job_workers = max_workers < p->nthreads ? max_workers : p->nthreads;
    __atomic_store_n(&p->next, first, __ATOMIC_SEQ_CST);
    const uint64_t g = __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) + 1;
    __atomic_store_n(&p->job_gen, g, __ATOMIC_SEQ_CST);
    __atomic_store_n(&p->open, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&p->gen, g, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    fm_pool_work(p, 0);
    __atomic_store_n(&p->open, 0, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&p->active, __ATOMIC_SEQ_CST) > 0) fm_relax();
    const int interrupted = __atomic_load_n(&p->interrupted, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&p->job_mu);
    return interrupted;
}
