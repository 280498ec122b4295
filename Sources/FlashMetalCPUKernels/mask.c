/* Mask builder on the cpu: row i of an additive [qL, kL] mask, 0 where key p
 * is visible to the query at t = q_offset + i, -inf elsewhere. */
#include "fm_cpu_kernels.h"

void fm_cpu_mask_row(const MaskParams *p, uint16_t *out, int32_t is_bf16, int64_t i) {
    const int64_t kL = p->seq_len_k;
    const int64_t t = (int64_t)p->q_offset + i;
    const uint16_t ninf = is_bf16 ? 0xFF80u : 0xFC00u;
    uint16_t *row = out + i * kL;
    for (int64_t c = 0; c < kL; c++) {
        int vis = 1;
        if (p->causal && c > t) vis = 0;
        if (p->window > 0 && t - c >= (int64_t)p->window) vis = 0;
        row[c] = vis ? 0 : ninf;
    }
}
