/* Run-time ISA selection of the cpu kernels (the ISAs: fm_cpu_kernels.h).
 *
 * x86-64 levels portable < avx2 < avx512 < avx512bf16; arm64 portable < neon.
 * FLASHMETAL_CPU_ISA caps the detected level (it never raises it); its case
 * does not matter (AVX2 as oneDNN's ONEDNN_MAX_CPU_ISA spells it). A value
 * naming no ISA warns once on stderr and is ignored; another architecture's
 * ISA (neon on x86-64, avx2 on arm64) warns and means portable. Read once per
 * process. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "fm_cpu_kernels.h"

static int fm_detect_isa(void) {
#if defined(__x86_64__) && defined(FM_ISA_EMULATED)
    /* The emulated test build (mk/cpu-harness.mk): its AVX-512 instances are
     * portable code, so every x86 ISA is there. */
    return FM_ISA_AVX512BF16;
#elif defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
    __builtin_cpu_init();
    int isa = FM_ISA_PORTABLE;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        isa = FM_ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
            isa = FM_ISA_AVX512;
            if (__builtin_cpu_supports("avx512bf16")) isa = FM_ISA_AVX512BF16;
        }
    }
    return isa;
#elif defined(__aarch64__)
    return FM_ISA_NEON; /* Advanced SIMD (with FCVTL) is part of every arm64 CPU */
#else
    return FM_ISA_PORTABLE;
#endif
}

static const char *const fm_isa_names[] = {"portable", "avx2", "avx512", "avx512bf16", "neon"};

/* The ISA `env` caps `detected` to. */
static int fm_isa_cap(int detected, const char *env) {
    int want = -1;
    for (int i = 0; i < (int)(sizeof fm_isa_names / sizeof *fm_isa_names); i++)
        if (strcasecmp(env, fm_isa_names[i]) == 0) want = i;
    if (want < 0) {
        fprintf(stderr, "flashmetal: FLASHMETAL_CPU_ISA='%s' is not one of portable, avx2, avx512, "
                        "avx512bf16, neon; using %s\n", env, fm_isa_names[detected]);
        return detected;
    }
    if (want == FM_ISA_PORTABLE) return FM_ISA_PORTABLE;
    const int want_arm = want == FM_ISA_NEON, have_arm = detected == FM_ISA_NEON;
    if (detected != FM_ISA_PORTABLE && want_arm != have_arm) {
        fprintf(stderr, "flashmetal: FLASHMETAL_CPU_ISA='%s' is not an ISA of this architecture; "
                        "using portable\n", env);
        return FM_ISA_PORTABLE;
    }
    return want < detected ? want : detected;
}

static int fm_isa_cached = -1;

int fm_cpu_isa(void) {
    int isa = __atomic_load_n(&fm_isa_cached, __ATOMIC_ACQUIRE);
    if (isa >= 0) return isa;
    isa = fm_detect_isa();
    const char *env = getenv("FLASHMETAL_CPU_ISA");
    if (env && *env) isa = fm_isa_cap(isa, env);
    int expected = -1; /* the first caller's answer wins (one warning) */
    if (!__atomic_compare_exchange_n(&fm_isa_cached, &expected, isa, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        isa = expected;
    return isa;
}

const char *fm_cpu_isa_name(int isa) {
    if (isa < 0 || isa >= (int)(sizeof fm_isa_names / sizeof *fm_isa_names)) return "unknown";
    return fm_isa_names[isa];
}

int64_t fm_atomic_fetch_add_i64(int64_t *p, int64_t v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
