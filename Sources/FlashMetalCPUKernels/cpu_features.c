/* Run-time ISA selection of the cpu kernels.
 *
 * FM_ISA_PORTABLE   plain C (any machine: arm64, x86 without AVX-512)
 * FM_ISA_AVX512     AVX-512F/BW/DQ/VL + F16C + FMA: f32 FMA panels for bf16 and f16
 * FM_ISA_AVX512BF16 the above + AVX512-BF16: bf16 prefill on vdpbf16ps
 *
 * FLASHMETAL_CPU_ISA=portable|avx512|avx512bf16 caps the choice (it never
 * raises it above what the CPU supports). Read once per process. */
#include <stdlib.h>
#include <string.h>
#include "fm_cpu_kernels.h"

static int fm_detect_isa(void) {
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
    __builtin_cpu_init();
    int isa = FM_ISA_PORTABLE;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        isa = FM_ISA_AVX512;
        if (__builtin_cpu_supports("avx512bf16")) isa = FM_ISA_AVX512BF16;
    }
    return isa;
#else
    return FM_ISA_PORTABLE;
#endif
}

static int fm_isa_cached = -1;

int fm_cpu_isa(void) {
    int isa = __atomic_load_n(&fm_isa_cached, __ATOMIC_RELAXED);
    if (isa >= 0) return isa;
    isa = fm_detect_isa();
    const char *env = getenv("FLASHMETAL_CPU_ISA");
    if (env && *env) {
        int cap = isa;
        if (strcmp(env, "portable") == 0) cap = FM_ISA_PORTABLE;
        else if (strcmp(env, "avx512") == 0) cap = FM_ISA_AVX512;
        else if (strcmp(env, "avx512bf16") == 0) cap = FM_ISA_AVX512BF16;
        if (cap < isa) isa = cap;
    }
    __atomic_store_n(&fm_isa_cached, isa, __ATOMIC_RELAXED);
    return isa;
}

const char *fm_cpu_isa_name(int isa) {
    switch (isa) {
    case FM_ISA_AVX512: return "avx512";
    case FM_ISA_AVX512BF16: return "avx512bf16";
    default: return "portable";
    }
}

int64_t fm_atomic_fetch_add_i64(int64_t *p, int64_t v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
