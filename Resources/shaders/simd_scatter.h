// simd_scatter.h — the SIMD-group reduce-scatter of 32 partial sums (MSL),
// read by the split decodes (flash_attn_vec.metal, kv_codes_decode.metal).
#ifndef FM_SIMD_SCATTER_H
#define FM_SIMD_SCATTER_H

// part[j] holds this lane's share of sum j (j < 32); afterwards lane j
// holds the whole sum j over the 32 lanes: at the stage of distance h a
// lane keeps the half of its indices whose bit h equals its own lane bit h
// and adds its partner's (lane ^ h) copy of them. 31 shuffles. Every lane
// of the SIMD group calls this (the shuffles are collectives).
inline float simd_reduce_scatter32(thread float *part, uint lane) {
    for (ushort h = 16; h >= 1; h >>= 1) {
        const bool upper = (lane & h) != 0;
        for (ushort i = 0; i < h; i++) {
            const float send = upper ? part[i] : part[i + h];
            const float keep = upper ? part[i + h] : part[i];
            part[i] = keep + simd_shuffle_xor(send, h);
        }
    }
    return part[0];
}

#endif // FM_SIMD_SCATTER_H
