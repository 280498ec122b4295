// kv_codec.h — the quantized-KV codec's shared integer and table functions,
// read by C (the cpu kernels), C++ (the simulator) and MSL (the shaders), so
// the signs, the tables and the code search have one definition.
//
// Codec, per row x of head_dim D cut into rotation blocks of n coordinates:
//   z = H_n (s ⊙ x)            unnormalised Sylvester Hadamard, per block
//   r = sqrt(Σ z² / n)          the block's norm, = ‖Ĥ(s ⊙ x)‖ (Ĥ = H_n / √n)
//   u_i = z_i / r               (0 when r == 0); unit variance per coordinate
//   code_i = #{ boundaries b_k < u_i }   nearest centroid, ties to the lower
//   x̂ = s ⊙ H_n(c[code]) · r / n         = s ⊙ Ĥᵀ(c[code] · r / √n)
// Sign s_j = -1 when fm_kvq_sign_bit(seed, j) is 1.
// Codes are packed little-endian: code j of a row occupies bits
// [j*bits, (j+1)*bits) of the row's bytes read as one little-endian integer,
// so 8 codes fill `bits` bytes (4 bits: the low nibble is the even coordinate).
#ifndef FM_KV_CODEC_H
#define FM_KV_CODEC_H

#ifndef __METAL_VERSION__
#include <stdint.h>
#endif

#include "kv_codec_tables.h"

#define FM_KVQ_FN static inline

// The sign bit of coordinate j (1 = -1): the top bit of the (j+1)-th output of
// splitmix64 started at state `seed` (Steele, Lea and Flood 2014: the state
// advances by 0x9E3779B97F4A7C15, each output is the state mixed).
FM_KVQ_FN uint32_t fm_kvq_sign_bit(uint64_t seed, uint32_t j) {
    uint64_t z = seed + (uint64_t)(j + 1u) * (uint64_t)0x9E3779B97F4A7C15UL;
    z = (z ^ (z >> 30)) * (uint64_t)0xBF58476D1CE4E5B9UL;
    z = (z ^ (z >> 27)) * (uint64_t)0x94D049BB133111EBUL;
    z = z ^ (z >> 31);
    return (uint32_t)(z >> 63);
}

// Centroid `code` of the table of `bits` (2, 3, 4, 5, 6 or 8).
FM_KVQ_FN float fm_kvq_centroid(int bits, uint32_t code) {
    switch (bits) {
    case 2: return FM_KVQ_C2[code];
    case 3: return FM_KVQ_C3[code];
    case 4: return FM_KVQ_C4[code];
    case 5: return FM_KVQ_C5[code];
    case 6: return FM_KVQ_C6[code];
    default: return FM_KVQ_C8[code];
    }
}

// Boundary i (between centroids i and i+1) of the table of `bits`.
FM_KVQ_FN float fm_kvq_boundary(int bits, uint32_t i) {
    switch (bits) {
    case 2: return FM_KVQ_B2[i];
    case 3: return FM_KVQ_B3[i];
    case 4: return FM_KVQ_B4[i];
    case 5: return FM_KVQ_B5[i];
    case 6: return FM_KVQ_B6[i];
    default: return FM_KVQ_B8[i];
    }
}

// The code of u: how many boundaries lie strictly below it (a tie goes to
// the lower centroid; NaN gives 0). Binary search over the 2^bits - 1 sorted
// boundaries.
FM_KVQ_FN uint32_t fm_kvq_code(int bits, float u) {
    uint32_t c = 0;
    for (uint32_t step = 1u << (bits - 1); step != 0; step >>= 1) {
        if (fm_kvq_boundary(bits, c + step - 1u) < u) c += step;
    }
    return c;
}

#endif // FM_KV_CODEC_H
