/* fm_env.h — the one parser of FLASHMETAL_* environment values (C and C++).
 *
 * A value is a whole decimal integer inside the variable's range, or it is
 * ignored: the caller keeps its default and stderr gets one line naming the
 * variable, the value and the range (once per variable and process, so a
 * per-call reader does not flood the log). Nothing here can overflow or
 * trap, whatever the environment holds. Header-only so that the simulator's
 * standalone build (mk/sim.mk) and the library share it; outside include/
 * so that Swift never imports it (C files include it by relative path). */
#ifndef FM_ENV_H
#define FM_ENV_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

/* Prints, once per `*warned` flag, why `name=value` is ignored. */
static inline void fm_env_warn(const char *name, const char *value, const char *expected, int *warned) {
    if (warned && __atomic_exchange_n(warned, 1, __ATOMIC_RELAXED)) return;
    fprintf(stderr, "flashmetal: ignoring %s=\"%.64s\": expected %s\n", name, value, expected);
}

/* *out = the value of `name` when it is an integer in [lo, hi]; returns 1
 * then, 0 when unset or empty, -1 (after a warning) when malformed or out of
 * range (*out untouched). */
static inline int fm_env_int(const char *name, long long lo, long long hi, long long *out, int *warned) {
    const char *s = getenv(name);
    if (!s || !*s) return 0;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    while (end && (*end == ' ' || *end == '\t' || *end == '\n')) end++;
    if (errno != 0 || end == s || (end && *end) || v < lo || v > hi) {
        char expected[96];
        snprintf(expected, sizeof expected, "an integer in %lld..%lld", lo, hi);
        fm_env_warn(name, s, expected, warned);
        return -1;
    }
    *out = v;
    return 1;
}

#endif /* FM_ENV_H */
