/* Entry points of the fast prefill: route each call to the ISA instance of
 * prefill_body.h (kernels_<isa>.c). An ISA without an instance, or a call
 * the fast path does not cover, reports 0 pack bytes and the caller uses the
 * portable kernel (prefill.c). */
#include "prefill_fast.h"

int fm_pf_blk_all_skip(const FMPrefillArgs *a, int64_t ra, int64_t rb, int64_t c0, int64_t kc) {
    const int64_t nk = a->p.NK;
    const int64_t ka = c0 / a->bk, kz = (c0 + kc - 1) / a->bk;
    for (int64_t qt = ra / a->bq; qt <= rb / a->bq; qt++)
        for (int64_t kt = ka; kt <= kz && kt < nk; kt++)
            if (a->blk[qt * nk + kt] != 0) return 0;
    return 1;
}

#if defined(__x86_64__)
#define FM_PF_ROUTE(isa, call, dflt)                                \
    switch (isa) {                                                  \
    case FM_ISA_AVX2: return fm_pf_##call##_avx2;                   \
    case FM_ISA_AVX512:                                             \
    case FM_ISA_AVX512VBMI: return fm_pf_##call##_avx512;           \
    case FM_ISA_AVX512BF16: return fm_pf_##call##_avx512bf16;       \
    default: return dflt;                                           \
    }
#elif defined(__aarch64__)
#define FM_PF_ROUTE(isa, call, dflt)                                \
    switch (isa) {                                                  \
    case FM_ISA_NEON: return fm_pf_##call##_neon;                   \
    default: return dflt;                                           \
    }
#else
#define FM_PF_ROUTE(isa, call, dflt) (void)(isa); return dflt;
#endif

typedef size_t (*fm_pf_size_fn)(const FMPrefillArgs *);
typedef int32_t (*fm_pf_rows_fn)(void);
typedef void (*fm_pf_pack_fn)(const FMPrefillArgs *, int64_t, int64_t, int64_t, void *);
typedef void (*fm_pf_item_fn)(const FMPrefillArgs *, int64_t, int64_t, int64_t, const void *, float *);

static fm_pf_size_fn fm_pf_pack_bytes_for(int isa) { FM_PF_ROUTE(isa, pack_bytes, NULL) }
static fm_pf_size_fn fm_pf_scratch_for(int isa) { FM_PF_ROUTE(isa, scratch_floats, NULL) }
static fm_pf_rows_fn fm_pf_rows_for(int isa) { FM_PF_ROUTE(isa, item_rows, NULL) }
static fm_pf_pack_fn fm_pf_pack_for(int isa) { FM_PF_ROUTE(isa, pack, NULL) }
static fm_pf_item_fn fm_pf_item_for(int isa) { FM_PF_ROUTE(isa, item, NULL) }

/* The shapes the instances cover: any D and Dv up to FM_PF_DMAX (the panels
 * pad them to fm_pf_dp, a multiple of the widest vector). */
static int fm_pf_covers(const FMPrefillArgs *a) {
    const int32_t D = a->p.D, Dv = a->p.Dv;
    const int io = a->io_dtype;
    return D > 0 && D <= FM_PF_DMAX && Dv > 0 && Dv <= FM_PF_DMAX &&
           (io == FM_DTYPE_F32 || io == FM_DTYPE_F16 || io == FM_DTYPE_BF16);
}

int fm_cpu_prefill_fast_covers(const FMPrefillArgs *a, int isa) {
    return fm_pf_pack_bytes_for(isa) != NULL && fm_pf_covers(a);
}

int64_t fm_cpu_prefill_panel_blocks(const FMPrefillArgs *a) {
    const int64_t nseq = fm_pf_per_sequence(a) ? a->p.B : 1; /* outside it every sequence is alike */
    int64_t most = 0;
    for (int64_t b = 0; b < nseq; b++) {
        const FMPfSeqDims sd = fm_pf_seq_dims(a, b);
        int64_t kb0, kb1;
        fm_pf_seq_blocks(a, &sd, &kb0, &kb1);
        if (kb1 - kb0 > most) most = kb1 - kb0;
    }
    return most;
}

size_t fm_cpu_prefill_pack_bytes(const FMPrefillArgs *a, int isa) {
    const fm_pf_size_fn f = fm_pf_pack_bytes_for(isa);
    return f && fm_pf_covers(a) ? f(a) : 0;
}

int32_t fm_cpu_prefill_item_rows(int isa) {
    const fm_pf_rows_fn f = fm_pf_rows_for(isa);
    return f ? f() : 0;
}

size_t fm_cpu_prefill_fast_scratch_floats(const FMPrefillArgs *a, int isa) {
    const fm_pf_size_fn f = fm_pf_scratch_for(isa);
    return f ? f(a) : 0;
}

void fm_cpu_prefill_pack(const FMPrefillArgs *a, int isa, int64_t b, int64_t kvh, int64_t j,
                         void *packed) {
    const fm_pf_pack_fn f = fm_pf_pack_for(isa);
    if (f) f(a, b, kvh, j, packed);
}

void fm_cpu_prefill_fast_item(const FMPrefillArgs *a, int isa, int64_t b, int64_t h, int64_t qi,
                              const void *packed, float *scratch) {
    const fm_pf_item_fn f = fm_pf_item_for(isa);
    if (f) f(a, b, h, qi, packed, scratch);
}
