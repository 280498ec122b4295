/* Arithmetic shared by the cpu kernels. */
#ifndef FM_KERNEL_MATH_H
#define FM_KERNEL_MATH_H
#include <float.h>
#include <stdint.h>

/* The running row max starts at the finite -FLT_MAX/2 (DESIGN §2): a -inf
 * score then gives exp(-inf) = 0, never exp(-inf - -inf) = NaN. */
#define FM_M_INIT (-FLT_MAX / 2)

/* Independent partial sums keep the dot product deterministic and
 * vectorisable without reassociation flags. */
#define FM_LANES 16

static inline float fm_dot(const float *a, const float *b, int32_t n) {
    float acc[FM_LANES] = {0};
    int32_t i = 0;
    for (; i + FM_LANES <= n; i += FM_LANES)
        for (int j = 0; j < FM_LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[0] += a[i] * b[i];
    float s = 0;
    for (int j = 0; j < FM_LANES; j++) s += acc[j];
    return s;
}
#endif
