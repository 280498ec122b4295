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
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include "fm_cpu_kernels.h"

#define FM_POOL_SPIN_NS 50000LL
/* A job whose items are projected (from the first one, timed on the caller)
 * to take less than this in total runs inline: waking a worker would cost more. */
#define FM_POOL_INLINE_NS 15000LL

struct FMPool {
    int nthreads; /* including the caller */
    pthread_t *tids;
    pthread_mutex_t job_mu; /* held by the caller that owns the job slot */
    pthread_mutex_t mu;     /* sleep/wake */
    pthread_cond_t cv;
    /* job (written by the caller before gen is bumped) */
    fm_pool_fn fn;
    void *ctx;
    int64_t count;
    int64_t job_workers;
    uint64_t job_gen;
    int64_t next;
    /* synchronisation */
    uint64_t gen;
    int open;
    int active;
    int sleepers;
    int stop;
    int ids; /* worker index dispenser */
#if defined(__linux__)
    cpu_set_t allowed; /* the process's CPUs when the pool was made */
    int caller_cpu;    /* the CPU the workers are currently kept off, or -1 */
#endif
};

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
    for (;;) {
        int64_t cur = __atomic_load_n(&p->next, __ATOMIC_SEQ_CST);
        if (cur >= count) break;
        int64_t c = (count - cur) / div;
        if (c < 1) c = 1;
        if (!__atomic_compare_exchange_n(&p->next, &cur, cur + c, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            continue;
        for (int64_t i = cur; i < cur + c; i++) p->fn(p->ctx, w, i);
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
                if (__atomic_load_n(&p->stop, __ATOMIC_SEQ_CST)) return NULL;
                fm_relax();
                if (++spins < 256) continue;
                spins = 0;
                if (fm_now_ns() - t0 < FM_POOL_SPIN_NS) continue;
                pthread_mutex_lock(&p->mu);
                __atomic_add_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
                while (__atomic_load_n(&p->gen, __ATOMIC_SEQ_CST) == seen &&
                       !__atomic_load_n(&p->stop, __ATOMIC_SEQ_CST))
                    pthread_cond_wait(&p->cv, &p->mu);
                __atomic_sub_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
                pthread_mutex_unlock(&p->mu);
                t0 = fm_now_ns();
            }
        }
        if (__atomic_load_n(&p->stop, __ATOMIC_SEQ_CST)) return NULL;
        seen = __atomic_load_n(&p->gen, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(&p->active, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&p->open, __ATOMIC_SEQ_CST) &&
            __atomic_load_n(&p->job_gen, __ATOMIC_SEQ_CST) == seen && w < p->job_workers)
            fm_pool_work(p, w);
        __atomic_sub_fetch(&p->active, 1, __ATOMIC_SEQ_CST);
    }
}

FMPool *fm_pool_create(int32_t nthreads) {
    if (nthreads < 2) return NULL;
    FMPool *p = (FMPool *)calloc(1, sizeof(FMPool));
    if (!p) return NULL;
    p->nthreads = nthreads;
#if defined(__linux__)
    p->caller_cpu = -1;
    if (sched_getaffinity(0, sizeof(p->allowed), &p->allowed) != 0) CPU_ZERO(&p->allowed);
#endif
    pthread_mutex_init(&p->job_mu, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->tids = (pthread_t *)calloc((size_t)nthreads, sizeof(pthread_t));
    int started = 0;
    for (int i = 1; i < nthreads; i++) {
        if (pthread_create(&p->tids[i], NULL, fm_pool_main, p) != 0) break;
        started++;
    }
    p->nthreads = 1 + started;
    return p;
}

int32_t fm_pool_threads(const FMPool *p) { return p ? p->nthreads : 1; }

void fm_pool_destroy(FMPool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->stop, 1, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->nthreads; i++) pthread_join(p->tids[i], NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->job_mu);
    free(p->tids);
    free(p);
}

/* Restricts the workers to the allowed CPUs other than the caller's; a
 * syscall per worker, only when the caller's CPU changed since the last job. */
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

void fm_pool_run(FMPool *p, int64_t count, int64_t max_workers, fm_pool_fn fn, void *ctx) {
    if (count <= 0) return;
    int64_t first = 0;
    if (p && max_workers > 1 && count >= 16) {
        /* Probe: time item 0 here; a tiny job (decode of a short cache)
         * finishes inline without touching the workers. */
        const int64_t t0 = fm_now_ns();
        fn(ctx, 0, 0);
        first = 1;
        if ((fm_now_ns() - t0) * (count - 1) < FM_POOL_INLINE_NS) {
            for (int64_t i = 1; i < count; i++) fn(ctx, 0, i);
            return;
        }
    }
    if (!p || max_workers <= 1 || count - first <= 1 || pthread_mutex_trylock(&p->job_mu) != 0) {
        for (int64_t i = first; i < count; i++) fn(ctx, 0, i);
        return;
    }
    fm_pool_keep_off_caller_cpu(p);
    p->fn = fn;
    p->ctx = ctx;
    p->count = count;
    p->job_workers = max_workers;
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
    pthread_mutex_unlock(&p->job_mu);
}
