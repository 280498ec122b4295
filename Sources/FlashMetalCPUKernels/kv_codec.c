/* The quantized-KV codec on the cpu, bit for bit the kv_codec.metal kernels:
 * the same Hadamard butterflies, the same pairwise tree for each block's sum
 * of squares (level 0 fmaf(a, a, b * b) over the two halves of the block,
 * then halving), the same divisions and the shared tables and code search of
 * kv_codec.h. Built with -ffp-contract=off, so no other product is fused. */
#include <math.h>
#include <string.h>

#include "fm_kv_codec.h"
#include "half_convert.h"
#include "../../Resources/shaders/kv_codec.h"

/* The unnormalised Hadamard transform of every block of z. */
static void hadamard(float *z, int32_t d, int32_t block) {
    for (int32_t h = 1; h < block; h <<= 1) {
        for (int32_t base = 0; base < d; base += 2 * h) {
            for (int32_t i = base; i < base + h; i++) {
                const float a = z[i], b = z[i + h];
                z[i] = a + b;
                z[i + h] = a - b;
            }
        }
    }
}

/* sqrt(sum z^2 / n) of one block, summed in the kernels' tree order. */
static float block_norm(const float *z, int32_t n) {
    float t[FM_KVQ_MAX_HEAD_DIM / 2];
    const int32_t half_n = n / 2;
    for (int32_t i = 0; i < half_n; i++) t[i] = fmaf(z[i], z[i], z[i + half_n] * z[i + half_n]);
    for (int32_t s = half_n / 2; s >= 1; s >>= 1) {
        for (int32_t i = 0; i < s; i++) t[i] = t[i] + t[i + s];
    }
    return sqrtf(t[0] * (1.0f / (float)n));
}

static void load_row(float *z, const void *x, int32_t dtype, int64_t row, int32_t d) {
    if (dtype == FM_DTYPE_F32) {
        memcpy(z, (const float *)x + row * d, (size_t)d * sizeof(float));
    } else {
        fm_load_row(z, (const uint16_t *)x + row * d, d, dtype == FM_DTYPE_BF16);
    }
}

void fm_cpu_kv_encode_rows(const KVCodecParams *p, const void *x, int32_t dtype, uint8_t *codes, float *norms,
                           int64_t begin, int64_t end) {
    const int32_t d = p->head_dim, n = p->block, bits = p->bits, nb = d / n;
    float z[FM_KVQ_MAX_HEAD_DIM];
    for (int64_t row = begin; row < end; row++) {
        load_row(z, x, dtype, row, d);
        for (int32_t i = 0; i < d; i++) {
            if (fm_kvq_sign_bit(p->seed, (uint32_t)i)) z[i] = -z[i];
        }
        hadamard(z, d, n);
        uint8_t *out = codes + row * p->row_bytes;
        for (int32_t k = 0; k < nb; k++) {
            const float r = block_norm(z + k * n, n);
            norms[row * nb + k] = r;
            for (int32_t g = k * n / 8; g < (k + 1) * n / 8; g++) {
                uint64_t w = 0;
                for (int32_t j = 0; j < 8; j++) {
                    const float u = r > 0.0f ? z[g * 8 + j] / r : 0.0f;
                    w |= (uint64_t)fm_kvq_code(bits, u) << (bits * j);
                }
                for (int32_t b = 0; b < bits; b++) out[g * bits + b] = (uint8_t)(w >> (8 * b));
            }
        }
        const int32_t used = d * bits / 8;
        memset(out + used, 0, (size_t)(p->row_bytes - used));
    }
}

void fm_cpu_kv_dequantize_rows(const KVCodecParams *p, const uint8_t *codes, const float *norms, float *out,
                               int64_t begin, int64_t end) {
    const int32_t d = p->head_dim, n = p->block, bits = p->bits, nb = d / n;
    const uint32_t mask = (1u << bits) - 1u;
    const float inv_n = 1.0f / (float)n;
    float z[FM_KVQ_MAX_HEAD_DIM];
    for (int64_t row = begin; row < end; row++) {
        const uint8_t *in = codes + row * p->row_bytes;
        for (int32_t g = 0; g < d / 8; g++) {
            uint64_t w = 0;
            for (int32_t b = 0; b < bits; b++) w |= (uint64_t)in[g * bits + b] << (8 * b);
            for (int32_t j = 0; j < 8; j++) z[g * 8 + j] = fm_kvq_centroid(bits, (uint32_t)(w >> (bits * j)) & mask);
        }
        hadamard(z, d, n);
        float *o = out + row * d;
        for (int32_t i = 0; i < d; i++) {
            const float v = z[i] * (norms[row * nb + i / n] * inv_n);
            o[i] = fm_kvq_sign_bit(p->seed, (uint32_t)i) ? -v : v;
        }
    }
}
