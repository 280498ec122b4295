/* fm_runtime.h — process-wide runtime of the native backends: the cpu
 * backend's worker pool (pool.c) and cancellation by SIGINT (interrupt.c).
 * Internal to libflashmetal: none of these symbols is exported. */
#ifndef FM_RUNTIME_H
#define FM_RUNTIME_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FM_RUNTIME_API __attribute__((visibility("hidden")))

/* ---- the worker pool: one per process, started on first use ------------- */
typedef void (*fm_pool_fn)(void *ctx, int64_t worker, int64_t item);
/* Threads a job may use, the caller included: FLASHMETAL_NUM_THREADS
 * (1..1024) or the online CPUs. Starts no thread. */
FM_RUNTIME_API int32_t fm_pool_threads(void);
/* fn(ctx, worker, item) for item in [0, count), worker < min(max_workers,
 * fm_pool_threads()); the caller works as worker 0. When the calling thread
 * is armed (fm_interrupt_arm) and a SIGINT arrives, the items not yet started
 * are skipped; returns 1 then, else 0. The pool's threads start on the first
 * job that needs them; a fork()ed child starts its own on its first job. */
FM_RUNTIME_API int fm_pool_run(int64_t count, int64_t max_workers, fm_pool_fn fn, void *ctx);
/* Announces a job soon (the caller is preparing one): sleeping workers wake
 * and spin for it a while, so their wake-up overlaps the preparation
 * instead of the job. Nothing happens before the pool exists. */
FM_RUNTIME_API void fm_pool_prepare(void);
/* Worker threads started so far (0 before the first parallel job). */
FM_RUNTIME_API int32_t fm_pool_started_threads(void);

/* ---- cancellation ---------------------------------------------------------
 * A SIGINT handler, installed on first use and chained to the handler it
 * replaces (Python's), counts SIGINTs. A call arms its thread, polls
 * fm_interrupt_pending() between units of work, and disarms on return. It
 * is installed only over a handler that is a function (never over SIG_DFL
 * or SIG_IGN), and put back when someone (signal.signal) replaced it. */
/* Only the process's main thread (where Python raises KeyboardInterrupt) is
 * ever armed, and only while interruption is enabled: FLASHMETAL_INTERRUPT=0
 * turns it off at start, fm_interrupt_set_enabled at any time. */
/* Arms the calling thread; returns the previous arming for fm_interrupt_disarm. */
FM_RUNTIME_API uint64_t fm_interrupt_arm(void);
/* Enables (1) or disables (0) interruption; returns the previous setting. */
FM_RUNTIME_API int fm_interrupt_set_enabled(int enabled);
FM_RUNTIME_API void fm_interrupt_disarm(uint64_t previous);
/* 1 when a SIGINT arrived since the calling thread was armed. */
FM_RUNTIME_API int fm_interrupt_pending(void);
/* 1 when a SIGINT arrived since `token` (a value of fm_interrupt_token()):
 * for threads that work for an armed caller. */
FM_RUNTIME_API uint64_t fm_interrupt_token(void);
FM_RUNTIME_API int fm_interrupt_since(uint64_t token);

#ifdef __cplusplus
}
#endif

#endif /* FM_RUNTIME_H */
