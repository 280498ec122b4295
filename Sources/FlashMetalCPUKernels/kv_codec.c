/* The quantized-KV codec on the cpu. Encode and dequantize are bit for bit
 * the kv_codec.metal kernels:
 * the same Hadamard butterflies, the same pairwise tree for each block's sum
 * of squares (level 0 fmaf(a, a, b * b) over the two halves of the block,
 * then halving), the same divisions and the shared tables and code search of
 * kv_codec.h. Built with -ffp-contract=off, so no other product is fused.
 * The decode over codes follows the kernel's math, not its summation order
 * (it is held to a tolerance, not to bits). */
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

/* The centroids of a row of packed `bits`-bit codes (8 codes in `bits`
 * bytes, little-endian), with the width a constant after inlining. */
static inline __attribute__((always_inline)) void unpack_width(const uint8_t *row, int32_t d, const float *table,
                                                              int32_t bits, float *out) {
    const uint32_t mask = (1u << bits) - 1u;
    for (int32_t g = 0; g < d / 8; g++) {
        uint64_t w = 0;
        for (int32_t b = 0; b < bits; b++) w |= (uint64_t)row[g * bits + b] << (8 * b);
        for (int32_t j = 0; j < 8; j++) out[g * 8 + j] = table[(w >> (bits * j)) & mask];
    }
}

static void unpack_centroids(const uint8_t *row, int32_t d, int32_t bits, float *out) {
    switch (bits) {
    case 2: unpack_width(row, d, FM_KVQ_C2, 2, out); break;
    case 3: unpack_width(row, d, FM_KVQ_C3, 3, out); break;
    case 4: unpack_width(row, d, FM_KVQ_C4, 4, out); break;
    case 5: unpack_width(row, d, FM_KVQ_C5, 5, out); break;
    case 6: unpack_width(row, d, FM_KVQ_C6, 6, out); break;
    default: unpack_width(row, d, FM_KVQ_C8, 8, out); break;
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
    const float inv_n = 1.0f / (float)n;
    float z[FM_KVQ_MAX_HEAD_DIM];
    for (int64_t row = begin; row < end; row++) {
        unpack_centroids(codes + row * p->row_bytes, d, bits, z);
        hadamard(z, d, n);
        float *o = out + row * d;
        for (int32_t i = 0; i < d; i++) {
            const float v = z[i] * (norms[row * nb + i / n] * inv_n);
            o[i] = fm_kvq_sign_bit(p->seed, (uint32_t)i) ? -v : v;
        }
    }
}

void fm_cpu_kv_codes_decode_item(const KVCodesDecodeParams *p, const float *q, const uint8_t *k_codes,
                                 const float *k_norms, const uint8_t *v_codes, const float *v_norms, float *o,
                                 int64_t item) {
    const int32_t d = p->head_dim, n = p->block, nb = d / n, kbits = p->k_bits, vbits = p->v_bits;
    const int32_t group = p->n_heads / p->n_kv_heads;
    const int32_t chunks = (group + FM_CPU_KVQ_HEAD_CHUNK - 1) / FM_CPU_KVQ_HEAD_CHUNK;
    const int64_t bg = item / chunks, b = bg / p->n_kv_heads, g = bg % p->n_kv_heads;
    const int32_t h0 = (int32_t)(item % chunks) * FM_CPU_KVQ_HEAD_CHUNK;
    const int32_t heads = group - h0 < FM_CPU_KVQ_HEAD_CHUNK ? group - h0 : FM_CPU_KVQ_HEAD_CHUNK;
    const int64_t row0 = b * p->n_heads + g * group + h0;
    const float inv_n = 1.0f / (float)n;
    float qz[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_MAX_HEAD_DIM], acc[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_MAX_HEAD_DIM];
    float kc[FM_KVQ_MAX_HEAD_DIM], vcv[FM_KVQ_MAX_HEAD_DIM], mx[FM_CPU_KVQ_HEAD_CHUNK], sum[FM_CPU_KVQ_HEAD_CHUNK];
    float w[FM_CPU_KVQ_HEAD_CHUNK], corr[FM_CPU_KVQ_HEAD_CHUNK];
    for (int32_t j = 0; j < heads; j++) {
        for (int32_t i = 0; i < d; i++) {
            const float v = q[(row0 + j) * d + i];
            qz[j][i] = fm_kvq_sign_bit(p->k_seed, (uint32_t)i) ? -v : v;
            acc[j][i] = 0.0f;
        }
        hadamard(qz[j], d, n);
        mx[j] = FM_RUNNING_MAX_START;
        sum[j] = 0.0f;
    }
    const int64_t base = b * p->kv_strides[0] + g * p->kv_strides[1];
    const int32_t lo = p->window > 0 && p->kv_len > p->window ? p->kv_len - p->window : 0;
    for (int32_t t = lo; t < p->kv_len; t++) {
        const int64_t r = base + (int64_t)t * p->kv_strides[2];
        unpack_centroids(k_codes + r * p->k_row_bytes, d, kbits, kc);
        for (int32_t j = 0; j < heads; j++) {
            float dot = 0.0f;
            for (int32_t k = 0; k < nb; k++) {
                float lane[8] = {0};  /* eight independent sums: vectorisable without reassociation */
                for (int32_t i = k * n; i < (k + 1) * n; i += 8) {
                    for (int32_t l = 0; l < 8; l++) lane[l] += qz[j][i + l] * kc[i + l];
                }
                const float part = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
                dot += part * k_norms[r * nb + k];
            }
            float s = dot * inv_n * p->scale;
            if (p->softcap > 0.0f) s = p->softcap * tanhf(s / p->softcap);
            const float m_new = s > mx[j] ? s : mx[j];
            corr[j] = expf(mx[j] - m_new);
            w[j] = expf(s - m_new);
            sum[j] = sum[j] * corr[j] + w[j];
            mx[j] = m_new;
        }
        unpack_centroids(v_codes + r * p->v_row_bytes, d, vbits, vcv);
        for (int32_t j = 0; j < heads; j++) {
            for (int32_t k = 0; k < nb; k++) {
                const float wr = w[j] * v_norms[r * nb + k];
                for (int32_t i = k * n; i < (k + 1) * n; i++) acc[j][i] = acc[j][i] * corr[j] + wr * vcv[i];
            }
        }
    }
    for (int32_t j = 0; j < heads; j++) {
        hadamard(acc[j], d, n);
        const float norm = sum[j] > 0.0f ? inv_n / sum[j] : 0.0f;
        for (int32_t i = 0; i < d; i++) {
            const float v = acc[j][i] * norm;
            o[(row0 + j) * d + i] = fm_kvq_sign_bit(p->v_seed, (uint32_t)i) ? -v : v;
        }
    }
}
