/* How fast the memory streams under the decode's access orders, with and
 * without software prefetch: every core reads its half of K and V (64 MiB
 * each, transparent hugepages), one line at a time, by five patterns timed
 * in the same rounds (best of `rounds`), the whole measurement repeated
 * `repeats` times because a shared VM's bandwidth changes from second to
 * second. The by-hand supplement of bench/RESULTS.md for the question "is
 * the decode's gap to the read ceiling the decode's, or software
 * prefetch's?" (the 2026-11-23 session note has the numbers).
 *
 *   clang -O2 -pthread bench/prefetch_read.c -o prefetch_read
 *   ./prefetch_read [rounds] [repeats]
 *
 * Patterns (`tile`: 8 KiB, the K bytes of one 32-key decode tile of a
 * 16-bit D = 128 cache):
 *   seq       K, then V, in order; the hardware prefetchers alone
 *   seq+T1    the same, each line prefetching the line 32 KiB ahead to L2
 *   tiles     a tile of K, then the same tile of V, tile after tile
 *   tiles+T1  the same, each line prefetching its line of the next tile to L2
 *             (the decode's shadow prefetch)
 *   tiles+T0  the same into L1 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

enum { LINE = 64, TILE = 8192, AHEAD = 32768, MAXT = 64 };

/* A pattern: K and V whole or tile by tile; the prefetch distance (0: none)
 * and whether it goes to L1. */
typedef struct {
    const char *name;
    int tiled;
    size_t ahead;
    int l1;
} Pattern;
static const Pattern patterns[] = {
    {"seq", 0, 0, 0}, {"seq+T1", 0, AHEAD, 0}, {"tiles", 1, 0, 0}, {"tiles+T1", 1, TILE, 0}, {"tiles+T0", 1, TILE, 1},
};
enum { NPAT = sizeof patterns / sizeof *patterns };

static char *K, *V;
static size_t N; /* bytes of K (and of V), a multiple of TILE * threads */
static int nthreads;
static const Pattern *pattern;
static volatile uint64_t sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline uint64_t line(const char *p) {
    uint64_t x[8];
    memcpy(x, p, LINE);
    return x[0] | x[1] | x[2] | x[3] | x[4] | x[5] | x[6] | x[7];
}

/* Lines [a, b) of one array; ahead > 0 prefetches the line that far on. */
static uint64_t run_lines(const char *x, size_t a, size_t b, size_t ahead, int l1) {
    uint64_t acc = 0;
    for (size_t i = a; i < b; i += LINE) {
        if (ahead && l1) __builtin_prefetch(x + i + ahead, 0, 3);
        else if (ahead) __builtin_prefetch(x + i + ahead, 0, 2);
        acc |= line(x + i);
    }
    return acc;
}

static void *reader(void *arg) {
    const long t = (long)arg;
    const size_t a = N / nthreads * t, b = a + N / nthreads;
    const size_t step = pattern->tiled ? TILE : b - a;
    uint64_t acc = 0;
    for (size_t c = a; c < b; c += step)
        acc |= run_lines(K, c, c + step, pattern->ahead, pattern->l1) |
               run_lines(V, c, c + step, pattern->ahead, pattern->l1);
    sink = acc;
    return NULL;
}

static double timed(int p) {
    pthread_t th[MAXT];
    pattern = &patterns[p];
    const double t0 = now();
    for (long i = 1; i < nthreads; i++) pthread_create(&th[i], NULL, reader, (void *)i);
    reader((void *)0);
    for (int i = 1; i < nthreads; i++) pthread_join(th[i], NULL);
    return now() - t0;
}

static char *array(size_t bytes, int fill) {
    const size_t huge = (size_t)2 << 20;
    bytes = (bytes + huge - 1) / huge * huge; /* aligned_alloc wants a multiple of the alignment */
    char *p = aligned_alloc(huge, bytes);
    if (!p) {
        fprintf(stderr, "prefetch_read: out of memory\n");
        exit(1);
    }
    madvise(p, bytes, MADV_HUGEPAGE);
    memset(p, fill, bytes);
    return p;
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 5, repeats = argc > 2 ? atoi(argv[2]) : 3;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    nthreads = cpus < 1 ? 1 : cpus > MAXT ? MAXT : (int)cpus;
    N = (size_t)64 << 20;
    N -= N % ((size_t)TILE * nthreads);
    /* Room past the end for the prefetches (they never fault, but stay in our pages). */
    K = array(N + AHEAD, 1);
    V = array(N + AHEAD, 2);
    printf("%d threads, K and V %zu MiB each; GB/s (best of %d)\n", nthreads, N >> 20, rounds);
    for (int r = 0; r < repeats; r++) {
        double best[NPAT];
        for (int p = 0; p < NPAT; p++) best[p] = 1e30;
        for (int k = 0; k < rounds; k++)
            for (int p = 0; p < NPAT; p++) {
                const double s = timed(p);
                if (s < best[p]) best[p] = s;
            }
        for (int p = 0; p < NPAT; p++) printf("%s %.1f%s", patterns[p].name, 2.0 * N / best[p] / 1e9, p + 1 < NPAT ? "  " : "\n");
        fflush(stdout);
    }
    return 0;
}
