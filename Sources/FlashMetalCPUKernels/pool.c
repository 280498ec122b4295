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
 * nested call) runs its items inline. */
#if !defined(_POSIX_C_SOURCE) && !defined(__APPLE__)
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
