/* One core's decode over quantized caches (fm_cpu_kv_codes_decode_row, the
 * cpu backend's work items for a [B, kv, Hkv] cache, then the merge): thread
 * CPU time of the best of N calls, per key row of one kv head, and the
 * worst error against float64 attention over the dequantized rows (in units
 * of 1e-5 + 1e-4 |want|; the exit status is 1 above 1). The by-hand
 * supplement of bench/CODES_RESULTS.md for tuning the key loop. The cache
 * and parameters are tests/cpu_arm64/codes_case.h's (the C harness's), with
 * one query row and no sinks or LSE.
 *
 *   clang -O3 -ffp-contract=off -D_GNU_SOURCE -ISources/FlashMetalCPUKernels/include \
 *     -ISources/FlashMetalCPUKernels -ISources/CFlashMetal/include -Itests/cpu_arm64 \
 *     bench/codes_decode_per_core.c \
 *     every Sources/FlashMetalCPUKernels/X.c but pool.c and sdpa.c -lm -pthread -o codes_decode_per_core
 *   [FLASHMETAL_CPU_ISA=avx2] [SAMEROW=1] [THREADS=n] ./codes_decode_per_core kbits vbits kv_len rounds \
 *     [D=128 H=16 Hkv=8 nsplit=8]
 * SAMEROW=1 reads one row per kv head for every key (the key loop without
 * memory traffic; its error is then not meaningful). THREADS=n runs the
 * splits on n threads (the CPU time is then their sum; the wall time of the
 * best call is printed too). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "fm_cpu_kernels.h"
#include "fm_kv_codec.h"
#include "codes_case.h"
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static double wall(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
/* One thread's share of the splits (THREADS=n: split s runs on thread s % n,
 * as the cpu backend's pool deals them), its CPU time in cpu. */
typedef struct Share {
    const KVCodesDecodeParams *p;
    const FMCPUKVCodesAttnArgs *a;
    float *parts;
    int tid, nthreads, nsplit;
    double cpu;
} Share;
static void *run_share(void *arg) {
    Share *s = arg;
    const double t0 = now();
    for (int i = s->tid; i < s->nsplit; i += s->nthreads) fm_cpu_kv_codes_decode_row(s->p, s->a, 0, i, s->nsplit, s->parts);
    s->cpu = now() - t0;
    return NULL;
}
static unsigned long long st = 88172645463325252ULL;
static double urand(void) {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return (st >> 11) * (1.0 / 9007199254740992.0);
}
static float nrand(void) {
    double u = urand() + 1e-12, v = urand();
    return (float)(sqrt(-2 * log(u)) * cos(6.283185307179586 * v));
}
int main(int argc, char **argv) {
    int kb = atoi(argv[1]), vb = atoi(argv[2]), kL = atoi(argv[3]), reps = atoi(argv[4]);
    int D = argc > 5 ? atoi(argv[5]) : 128;
    int H = argc > 6 ? atoi(argv[6]) : 16, Hkv = argc > 7 ? atoi(argv[7]) : 8, nsplit = argc > 8 ? atoi(argv[8]) : 8;
    CodesCase c = codes_case_new(D, H, Hkv, 1, kL, 0, kb, vb, nrand);
    for (int i = 0; i < H * D; i++) c.q[i] *= 2;
    KVCodesDecodeParams p = codes_params(&c);
    if (getenv("SAMEROW")) p.kv_strides[2] = 0;
    FMCPUKVCodesAttnArgs a = codes_args(&c);
    a.sinks = NULL;
    a.lse = NULL;
    const float *q = c.q, *o = c.o, *kd = c.kd, *vd = c.vd;
    long rows = (long)kL * Hkv;
    int group = H / Hkv;
    long items = Hkv * ((group + FM_CPU_KVQ_HEAD_CHUNK - 1) / FM_CPU_KVQ_HEAD_CHUNK);
    /* 64-byte aligned, as the library allocates them (each part's rows then
     * sit on cache lines: a row 16 bytes off splits every vector load). */
    const size_t part_bytes = 4 * fm_cpu_kv_codes_part_floats(&p) * items * nsplit;
    float *parts = aligned_alloc(64, (part_bytes + 63) / 64 * 64);
    const int nthreads = getenv("THREADS") ? atoi(getenv("THREADS")) : 1;
    double best = 1e9, best_wall = 1e9;
    for (int r = 0; r < reps; r++) {
        double t0 = now(), w0 = wall(), cpu = 0;
        if (nthreads > 1) {
            pthread_t tid[64];
            Share sh[64];
            for (int i = 0; i < nthreads && i < 64; i++) {
                sh[i] = (Share){&p, &a, parts, i, nthreads, nsplit, 0};
                pthread_create(&tid[i], NULL, run_share, &sh[i]);
            }
            for (int i = 0; i < nthreads && i < 64; i++) {
                pthread_join(tid[i], NULL);
                cpu += sh[i].cpu;
            }
        } else {
            for (int s = 0; s < nsplit; s++) fm_cpu_kv_codes_decode_row(&p, &a, 0, s, nsplit, parts);
        }
        for (long it = 0; it < items; it++) fm_cpu_kv_codes_decode_merge(&p, &a, it, nsplit, parts);
        double t = now() - t0 + cpu, tw = wall() - w0;
        if (t < best) best = t;
        if (tw < best_wall) best_wall = tw;
    }
    double worst = 0;
    double *sc = malloc(8 * kL);
    for (int h = 0; h < H; h++) {
        int g = h / group;
        double m = -1e300;
        for (int j = 0; j < kL; j++) {
            double d = 0;
            for (int i = 0; i < D; i++) d += (double)q[h * D + i] * kd[((long)j * Hkv + g) * D + i];
            sc[j] = d * p.scale;
            if (sc[j] > m) m = sc[j];
        }
        double tot = 0;
        for (int j = 0; j < kL; j++) {
            sc[j] = exp(sc[j] - m);
            tot += sc[j];
        }
        for (int i = 0; i < D; i++) {
            double w = 0;
            for (int j = 0; j < kL; j++) w += sc[j] * vd[((long)j * Hkv + g) * D + i];
            w /= tot;
            double e = fabs(o[h * D + i] - w) / (1e-5 + 1e-4 * fabs(w));
            if (e > worst) worst = e;
        }
    }
    printf("%s K%d/V%d kL=%d D=%d: %.3f ms/call CPU time (%d threads), %.1f ns per key row, wall %.3f ms, err %.3gx tol\n",
           fm_cpu_isa_name(fm_cpu_isa()), kb, vb, kL, D, best * 1e3, nthreads, best * 1e9 / rows, best_wall * 1e3, worst);
    return worst <= 1.0 ? 0 : 1;
}
