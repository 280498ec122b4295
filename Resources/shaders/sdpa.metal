// sdpa.metal — simple fused attention (mlx-native's sdpa): one thread per query row,
// TILE_Q = 32 rows per threadgroup, grid (B, H, ceil(qL / 32)).
//
// Each thread runs an online softmax over its row's visible keys in the exp2
// domain (scores scale * q.k, times log2(e); the running max starts at the
// finite -FLT_MAX / 2). Query i sits at t = kv_len - qL + i
// (bottom-right) or, with SdpaExtParams (buffer 8, constant 602), at
// t = q_offset + i; causal keeps keys <= t, a window w keeps keys with
// t - p < w, and (constant 603) the softcap c*tanh(s/c) applies to the
// scaled score before the mask. A row that sees no key outputs zeros (the
// S == 0 guard). GQA: head h reads kv head
// h / (H / Hkv). K/V rows are kv_capacity apart; keys at or past kv_len are
// never read. Accumulation in f32, the output rounded once.
//
// head_dim is a run-time value (<= 512) and there is no threadgroup memory
// in the contract, so a thread keeps only SDPA_DB output dims in registers:
// it walks the keys once per block of SDPA_DB dims, recomputing the same
// scores (bit for bit), so every block sees the same running max and sum.
//
// Buffers: 0 Q, 1 K, 2 V, 3 O ([B, H, qL, D] / [B, Hkv, cap, D]; V and O
// with SdpaExtParams.head_dim_v in place of D; f32, f16 or bf16), 4 SdpaParams; with a mask: 5 AttnMaskParams
// (batch, head, row strides), 6 an additive mask in T (constant 601) or
// 7 a bool mask, true = attend (constant 600). The mask is added to the
// scaled score before the exp2-domain scaling, as in prefill. 8
// SdpaExtParams (constant 602).
#include "dialect.h"
#include "flashmetal_kernels.h"
using namespace metal;

FUNCTION_CONSTANT(bool, sdpa_bool_mask, 600)
FUNCTION_CONSTANT(bool, sdpa_additive_mask, 601)
FUNCTION_CONSTANT(bool, sdpa_ext, 602)
FUNCTION_CONSTANT(bool, sdpa_softcap, 603)
FUNCTION_CONSTANT_EXPR(bool, sdpa_has_mask, sdpa_bool_mask || sdpa_additive_mask)

#define SDPA_DB 64

// max(x, lo) that keeps a NaN x (fmax would drop it).
inline float max_or_nan(float x, float lo) { return x < lo ? lo : x; }

template <typename T>
inline float sdpa_dot(const device T *a, const device T *b, int n) {
    float acc0 = 0.0f;
    float acc1 = 0.0f;
    int d = 0;
    for (; d + 2 <= n; d += 2) {
        acc0 = fma(float(a[d]), float(b[d]), acc0);
        acc1 = fma(float(a[d + 1]), float(b[d + 1]), acc1);
    }
    if (d < n) acc0 = fma(float(a[d]), float(b[d]), acc0);
    return acc0 + acc1;
}

template <typename T>
kernel void sdpa(
    const device T *Q [[buffer(0)]],
    const device T *K [[buffer(1)]],
    const device T *V [[buffer(2)]],
    device T *O [[buffer(3)]],
    constant SdpaParams &p [[buffer(4)]],
    constant AttnMaskParams *mp [[buffer(5), function_constant(sdpa_has_mask)]],
    const device T *amask [[buffer(6), function_constant(sdpa_additive_mask)]],
    const device uchar *bmask [[buffer(7), function_constant(sdpa_bool_mask)]],  // bool bytes: nonzero attends
    constant SdpaExtParams *ext [[buffer(8), function_constant(sdpa_ext)]],
    uint3 tgid BUILTIN(threadgroup_position_in_grid),
    uint tid BUILTIN(thread_index_in_threadgroup)) {
    const long D = p.head_dim;                                  // q's and k's
    const long DV = sdpa_ext ? long(ext->head_dim_v) : D;       // v's and the output's
    const long q_len = p.seq_len;
    const long kv_len = p.kv_seq_len;
    const long cap = p.kv_capacity != 0 ? long(p.kv_capacity) : kv_len;
    const long b = tgid.x;
    const long h = tgid.y;
    const long r = long(tgid.z) * FM_SDPA_TILE_Q + long(tid);
    if (r >= q_len) return;  // no barrier or collective below

    const long heads = p.n_heads;
    const long kvh = h / (heads / long(p.n_kv_heads));
    const long row = (b * heads + h) * q_len + r;
    const device T *qr = Q + row * D;
    const device T *kb = K + (b * long(p.n_kv_heads) + kvh) * cap * D;
    const device T *vb = V + (b * long(p.n_kv_heads) + kvh) * cap * DV;
    device T *orow = O + row * DV;

    long mask_row = 0;  // element offset of this row in the mask
    if (sdpa_has_mask) mask_row = b * mp->M_strides[0] + h * mp->M_strides[1] + r * mp->M_strides[2];

    // Visible keys: [begin, end), from the row's absolute position t.
    const long t = (sdpa_ext ? long(ext->q_offset) : kv_len - q_len) + r;
    long begin = 0;
    long end = kv_len;
    if (p.do_causal != 0) end = min(end, t + 1);
    if (sdpa_ext && ext->window > 0) begin = max(begin, t - long(ext->window) + 1);
    const float cap_c = sdpa_ext && sdpa_softcap ? ext->softcap : 0.0f;

    for (long d0 = 0; d0 < DV; d0 += SDPA_DB) {
        const int nb = int(min(long(SDPA_DB), DV - d0));
        float acc[SDPA_DB];
        for (int i = 0; i < SDPA_DB; i++) acc[i] = 0.0f;
        float m = FM_RUNNING_MAX_START;
        float l = 0.0f;
        for (long j = begin; j < end; j++) {
            float x = p.scale * sdpa_dot(qr, kb + j * D, int(D));
            if (sdpa_softcap) x = cap_c * precise::tanh(x / cap_c);
            if (sdpa_additive_mask) x += float(amask[mask_row + j]);
            if (sdpa_bool_mask && bmask[mask_row + j] == 0) x = -INFINITY;
            // Not masked: floored at the running max's start, so a huge
            // negative finite bias keeps its (uniform) weight; NaN compares
            // false and stays NaN. Masked (-inf / false): -inf.
            const bool masked = (sdpa_additive_mask && float(amask[mask_row + j]) == -INFINITY) ||
                                (sdpa_bool_mask && bmask[mask_row + j] == 0);
            const float s = masked ? -INFINITY : max_or_nan(x * FM_LOG2E, FM_RUNNING_MAX_START);
            const float m_new = max(m, s);
            const float factor = exp2(m - m_new);
            const float pj = exp2(s - m_new);
            l = l * factor + pj;
            m = m_new;
            const device T *vr = vb + j * DV + d0;
            for (int i = 0; i < SDPA_DB; i++) {
                if (i < nb) acc[i] = fma(pj, float(vr[i]), acc[i] * factor);
            }
        }
        const float inv = l == 0.0f ? 0.0f : 1.0f / l;
        for (int i = 0; i < SDPA_DB; i++) {
            if (i < nb) orow[d0 + i] = T(acc[i] * inv);
        }
    }
}

// BEGIN GENERATED INSTANTIATIONS: sdpa
// (written by tools/gen_instantiations.py from the capability tables; do not edit)
INSTANTIATE_KERNEL("sdpa", sdpa, float)
INSTANTIATE_KERNEL("sdpa_f16", sdpa, half)
INSTANTIATE_KERNEL("sdpa_bf16", sdpa, bfloat)
// END GENERATED INSTANTIATIONS
