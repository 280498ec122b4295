/* The machine's FMA ceiling for the bench: every thread runs 12 independent
 * chains of vector FMAs (enough to cover latency x throughput) on the ISA's
 * widest vectors; prints GFLOP/s over all threads.
 *   fma_peak <avx2|avx512|neon|portable> <threads> */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHAINS 12
#define ITERS 40000000L

#define FMA_LOOP(T, STEP)                                                          \
    T a[CHAINS];                                                             \
    for (int i = 0; i < CHAINS; i++) a[i] = (T)(0.0f);                       \
    const T x = (T)(1.0000001f), y = (T)(0.9999999f);                        \
    for (long it = 0; it < ITERS; it++)                                      \
        for (int i = 0; i < CHAINS; i++) a[i] = STEP(a[i], x, y);  \
    T s = a[0];                                                              \
    for (int i = 1; i < CHAINS; i++) s += a[i];                              \
    return s[0];

typedef float v4 __attribute__((ext_vector_type(4)));
#define FMA(a, x, y) __builtin_elementwise_fma(a, x, y)
#if defined(__aarch64__)
static float run4(void) { FMA_LOOP(v4, FMA) }
#else /* baseline x86-64 has no FMA: multiply + add (2 flops) */
#define MULADD(a, x, y) ((a) * (x) + (y))
static float run4(void) { FMA_LOOP(v4, MULADD) }
#endif
#if defined(__x86_64__)
typedef float v8 __attribute__((ext_vector_type(8)));
typedef float v16 __attribute__((ext_vector_type(16)));
__attribute__((target("avx2,fma"))) static float run8(void) { FMA_LOOP(v8, FMA) }
__attribute__((target("avx512f"))) static float run16(void) { FMA_LOOP(v16, FMA) }
#endif

static int lanes = 4;
static volatile float sink;

static void *worker(void *arg) {
    (void)arg;
#if defined(__x86_64__)
    if (lanes == 16) { sink = run16(); return NULL; }
    if (lanes == 8) { sink = run8(); return NULL; }
#endif
    sink = run4();
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: fma_peak ISA THREADS\n"); return 2; }
    if (strncmp(argv[1], "avx512", 6) == 0) lanes = 16;
    else if (strcmp(argv[1], "avx2") == 0) lanes = 8;
    const int n = atoi(argv[2]) > 0 ? atoi(argv[2]) : 1;
    pthread_t th[256];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < n && i < 256; i++) pthread_create(&th[i], NULL, worker, NULL);
    for (int i = 0; i < n && i < 256; i++) pthread_join(th[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("%.1f\n", 2.0 * lanes * CHAINS * (double)ITERS * n / secs / 1e9);
    return 0;
}
