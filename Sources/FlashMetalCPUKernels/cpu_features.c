/* Run-time ISA selection of the cpu kernels (the ISAs: fm_cpu_kernels.h).
 *
 * x86-64 levels portable < avx2 < avx512 < avx512vbmi < avx512bf16; arm64
 * portable < neon. AVX512-BF16 does not imply VBMI, so whether the CPU has
 * VBMI is kept beside the level. FLASHMETAL_CPU_ISA caps the detected level
 * (it never raises it; avx512vbmi on a CPU without VBMI means avx512); its
 * case does not matter (AVX2 as oneDNN's ONEDNN_MAX_CPU_ISA spells it). A
 * value naming no ISA warns once on stderr and is ignored; another
 * architecture's ISA (neon on x86-64, avx2 on arm64) warns and means
 * portable. Read once per process. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "fm_cpu_kernels.h"

/* The detected level; *vbmi whether the CPU has AVX512-VBMI. */
static int fm_detect_isa(int *vbmi) {
    *vbmi = 0;
#if defined(__x86_64__) && defined(FM_ISA_EMULATED)
    /* The emulated test build (mk/cpu-harness.mk): its AVX-512 instances are
     * portable code, so every x86 ISA is there. */
    *vbmi = 1;
    return FM_ISA_AVX512BF16;
#elif defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
    __builtin_cpu_init();
    int isa = FM_ISA_PORTABLE;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        isa = FM_ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
            isa = FM_ISA_AVX512;
            *vbmi = __builtin_cpu_supports("avx512vbmi") != 0;
            if (*vbmi) isa = FM_ISA_AVX512VBMI;
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

static const char *const fm_isa_names[] = {"portable", "avx2", "avx512", "avx512vbmi", "avx512bf16", "neon"};

/* The ISA `env` caps `detected` to (vbmi: whether the CPU has VBMI). */
static int fm_isa_cap(int detected, int vbmi, const char *env) {
    int want = -1;
    for (int i = 0; i < (int)(sizeof fm_isa_names / sizeof *fm_isa_names); i++)
        if (strcasecmp(env, fm_isa_names[i]) == 0) want = i;
    if (want < 0) {
        fprintf(stderr, "flashmetal: FLASHMETAL_CPU_ISA='%s' is not one of portable, avx2, avx512, "
                        "avx512vbmi, avx512bf16, neon; using %s\n", env, fm_isa_names[detected]);
        return detected;
    }
    if (want == FM_ISA_PORTABLE) return FM_ISA_PORTABLE;
    const int want_arm = want == FM_ISA_NEON, have_arm = detected == FM_ISA_NEON;
    if (detected != FM_ISA_PORTABLE && want_arm != have_arm) {
        fprintf(stderr, "flashmetal: FLASHMETAL_CPU_ISA='%s' is not an ISA of this architecture; "
                        "using portable\n", env);
        return FM_ISA_PORTABLE;
    }
    if (want == FM_ISA_AVX512VBMI && !vbmi) want = FM_ISA_AVX512;
    return want < detected ? want : detected;
}

/* The selected ISA, and 1 + whether it may use VBMI (0: not yet known). */
static int fm_isa_cached = -1, fm_vbmi_cached = 0;

int fm_cpu_isa(void) {
    int isa = __atomic_load_n(&fm_isa_cached, __ATOMIC_ACQUIRE);
    if (isa >= 0) return isa;
    int vbmi;
    isa = fm_detect_isa(&vbmi);
    const char *env = getenv("FLASHMETAL_CPU_ISA");
    if (env && *env) isa = fm_isa_cap(isa, vbmi, env);
    const int uses_vbmi = vbmi && isa >= FM_ISA_AVX512VBMI && isa != FM_ISA_NEON;
    /* Every caller computes the same pair; the first store of each wins. */
    int none = 0;
    __atomic_compare_exchange_n(&fm_vbmi_cached, &none, 1 + uses_vbmi, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    int expected = -1; /* the first caller's answer wins (one warning) */
    if (!__atomic_compare_exchange_n(&fm_isa_cached, &expected, isa, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        isa = expected;
    return isa;
}

int fm_cpu_vbmi(void) {
    (void)fm_cpu_isa();
    return __atomic_load_n(&fm_vbmi_cached, __ATOMIC_ACQUIRE) == 2;
}

const char *fm_cpu_isa_name(int isa) {
    if (isa < 0 || isa >= (int)(sizeof fm_isa_names / sizeof *fm_isa_names)) return "unknown";
    return fm_isa_names[isa];
}

int64_t fm_atomic_fetch_add_i64(int64_t *p, int64_t v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
