/* Cancellation of long calls by SIGINT (fm_runtime.h).
 *
 * Python's own SIGINT handler only sets a flag that the interpreter reads
 * once the C call returns, so a kernel that runs for minutes holds Ctrl-C
 * for minutes. This handler counts SIGINTs in `fm_int_gen` and then calls the
 * handler it replaced (Python's keeps working: the KeyboardInterrupt is
 * raised by Python when the call returns). Work loops compare the count with
 * the value their call started at: one relaxed load per unit of work.
 *
 * The handler is installed over a function handler only: under SIG_DFL a
 * SIGINT ends the process anyway, and under SIG_IGN it must stay ignored.
 * signal.signal() in Python replaces it; arming re-checks (a syscall) at most
 * every FM_INT_RECHECK_NS, so a replaced handler is chained again soon.
 *
 * Only the main thread is armed: Python raises KeyboardInterrupt there and
 * nowhere else, so a call another thread makes (a server's worker) runs to
 * completion whatever the application does with the SIGINT. Interruption
 * can be turned off: FLASHMETAL_INTERRUPT=0, or fm_interrupt_set_enabled. */
#if !defined(_POSIX_C_SOURCE) && !defined(__APPLE__)
#define _POSIX_C_SOURCE 200809L
#endif
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
long syscall(long number, ...); /* hidden by _POSIX_C_SOURCE */
#endif
#include "fm_runtime.h"
#include "../CFlashMetal/fm_env.h"

#define FM_INT_RECHECK_NS 100000000LL

static uint64_t fm_int_gen = 1; /* 0 is "not armed" */
static __thread uint64_t fm_int_armed;

/* The replaced handler, published through an index so that a handler
 * running on another thread never reads a half-written struct. */
static struct sigaction fm_int_prev[2];
static int fm_int_prev_slot = -1;
static pthread_mutex_t fm_int_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t fm_int_checked_ns = -FM_INT_RECHECK_NS;
static pthread_once_t fm_int_once = PTHREAD_ONCE_INIT;
static int fm_int_enabled = 1;
static __thread int fm_int_main = -1; /* this thread is the process's first: -1 unknown */

static void fm_int_read_env(void) {
    static int warned;
    long long on = 1;
    fm_env_int("FLASHMETAL_INTERRUPT", 0, 1, &on, &warned);
    __atomic_store_n(&fm_int_enabled, (int)on, __ATOMIC_RELAXED);
}

int fm_interrupt_set_enabled(int enabled) {
    pthread_once(&fm_int_once, fm_int_read_env);
    return __atomic_exchange_n(&fm_int_enabled, enabled ? 1 : 0, __ATOMIC_RELAXED);
}

static int fm_int_on_main_thread(void) {
    if (fm_int_main < 0) {
#if defined(__APPLE__)
        fm_int_main = pthread_main_np() != 0;
#elif defined(__linux__)
        fm_int_main = syscall(SYS_gettid) == getpid();
#else
        fm_int_main = 1;
#endif
    }
    return fm_int_main;
}

static void fm_int_handler(int sig, siginfo_t *info, void *uctx) {
    __atomic_add_fetch(&fm_int_gen, 1, __ATOMIC_SEQ_CST);
    const int slot = __atomic_load_n(&fm_int_prev_slot, __ATOMIC_ACQUIRE);
    if (slot < 0) return;
    const struct sigaction *prev = &fm_int_prev[slot];
    if (prev->sa_flags & SA_SIGINFO) {
        if (prev->sa_sigaction) prev->sa_sigaction(sig, info, uctx);
    } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
    }
}

static int fm_int_is_function(const struct sigaction *a) {
    if (a->sa_flags & SA_SIGINFO) return a->sa_sigaction != NULL;
    return a->sa_handler != SIG_DFL && a->sa_handler != SIG_IGN;
}

/* Installs the handler unless it is in place or the current one is not a function. */
static void fm_int_install(void) {
    struct sigaction cur;
    if (sigaction(SIGINT, NULL, &cur) != 0) return;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == fm_int_handler) return;
    if (!fm_int_is_function(&cur)) return;
    const int slot = __atomic_load_n(&fm_int_prev_slot, __ATOMIC_RELAXED) == 0 ? 1 : 0;
    fm_int_prev[slot] = cur;
    __atomic_store_n(&fm_int_prev_slot, slot, __ATOMIC_RELEASE);
    struct sigaction mine = cur; /* same mask and flags (SA_RESTART or not, SA_ONSTACK) */
    mine.sa_flags |= SA_SIGINFO;
    mine.sa_sigaction = fm_int_handler;
    sigaction(SIGINT, &mine, NULL);
}

static int64_t fm_int_coarse_ns(void) {
    struct timespec ts;
#if defined(CLOCK_MONOTONIC_COARSE)
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
#else
    clock_gettime(CLOCK_MONOTONIC, &ts);
#endif
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

uint64_t fm_interrupt_arm(void) {
    const uint64_t previous = fm_int_armed;
    if (previous) return previous; /* nested: the outer call's start counts */
    pthread_once(&fm_int_once, fm_int_read_env);
    if (!__atomic_load_n(&fm_int_enabled, __ATOMIC_RELAXED) || !fm_int_on_main_thread()) return previous;
    const int64_t now = fm_int_coarse_ns();
    if (now - __atomic_load_n(&fm_int_checked_ns, __ATOMIC_RELAXED) >= FM_INT_RECHECK_NS &&
        pthread_mutex_trylock(&fm_int_mu) == 0) {
        fm_int_install();
        __atomic_store_n(&fm_int_checked_ns, now, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&fm_int_mu);
    }
    fm_int_armed = __atomic_load_n(&fm_int_gen, __ATOMIC_SEQ_CST);
    return previous;
}

void fm_interrupt_disarm(uint64_t previous) { fm_int_armed = previous; }

uint64_t fm_interrupt_token(void) { return fm_int_armed; }

int fm_interrupt_since(uint64_t token) {
    return token != 0 && __atomic_load_n(&fm_int_gen, __ATOMIC_RELAXED) != token;
}

int fm_interrupt_pending(void) { return fm_interrupt_since(fm_int_armed); }
