/* Arithmetic shared by the cpu kernels. */
#ifndef FM_KERNEL_MATH_H
#define FM_KERNEL_MATH_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The running row max starts at the finite -FLT_MAX/2 (docs/ARCHITECTURE.md): a -inf
 * score then gives exp(-inf) = 0, never exp(-inf - -inf) = NaN. */
#define FM_M_INIT (-FLT_MAX / 2)

/* A sink's term e^{sink - m} in a denominator whose max m includes the sink.
 * A +inf sink takes all the mass: its term is +inf (not e^{inf - inf} =
 * NaN), so every other weight e^{x - inf} = 0 divided by it gives output 0,
 * and the LSE m + log(inf) is +inf, the limit as the sink grows. A NaN sink
 * stays NaN (deliberately: a NaN row). */
static inline float fm_sink_term(float sink, float m) {
    return sink == (float)INFINITY ? (float)INFINITY : expf(sink - m);
}

/* Independent partial sums keep the dot product deterministic and
 * vectorisable without reassociation flags. */
#define FM_LANES 16

/* Lane j sums the products of elements i = j (mod 16), then the lanes are
 * added in order. Written with a clang vector type because the vectoriser
 * left the array form scalar (measured: decode was compute-bound on it). */
typedef float fm_f32x16 __attribute__((ext_vector_type(FM_LANES)));

static inline float fm_dot(const float *a, const float *b, int32_t n) {
    fm_f32x16 acc = 0.0f;
    int32_t i = 0;
    for (; i + FM_LANES <= n; i += FM_LANES) {
        fm_f32x16 va, vb;
        memcpy(&va, a + i, sizeof va);
        memcpy(&vb, b + i, sizeof vb);
        acc += va * vb;
    }
    for (; i < n; i++) acc[0] += a[i] * b[i];
    float s = 0;
    for (int j = 0; j < FM_LANES; j++) s += acc[j];
    return s;
}
#endif
