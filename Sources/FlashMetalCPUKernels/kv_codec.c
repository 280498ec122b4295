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

/* Encodes the signed, loaded row z (transformed in place) into one row of
 * codes and norms. */
static void encode_row(const KVCodecParams *p, float *z, uint8_t *out, float *norms) {
    const int32_t d = p->head_dim, n = p->block, bits = p->bits, nb = d / n;
    for (int32_t i = 0; i < d; i++) {
        if (fm_kvq_sign_bit(p->seed, (uint32_t)i)) z[i] = -z[i];
    }
    hadamard(z, d, n);
    for (int32_t k = 0; k < nb; k++) {
        const float r = block_norm(z + k * n, n);
        norms[k] = r;
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

void fm_cpu_kv_encode_rows(const KVCodecParams *p, const void *x, int32_t dtype, uint8_t *codes, float *norms,
                           int64_t begin, int64_t end) {
    const int32_t d = p->head_dim, nb = d / p->block;
    float z[FM_KVQ_MAX_HEAD_DIM];
    for (int64_t row = begin; row < end; row++) {
        load_row(z, x, dtype, row, d);
        encode_row(p, z, codes + row * p->row_bytes, norms + row * nb);
    }
}

void fm_cpu_kv_codes_append_item(const KVCodesAppendParams *p, const FMCPUKVCodesAppendArgs *a, int32_t n_kv_heads,
                                 int64_t item) {
    const int64_t g = item % n_kv_heads, bi = item / n_kv_heads, i = bi % p->n_new, b = bi / p->n_new;
    const int64_t key = (int64_t)a->seqlens[b] + i;
    int64_t row;
    if (a->block_table != NULL) {
        const int64_t page = a->block_table[b * p->max_pages + key / p->page_size];
        row = page * p->cache_strides[0] + (key % p->page_size) * p->cache_strides[1];
    } else {
        row = b * p->cache_strides[0] + key * p->cache_strides[1];
    }
    row += g * p->cache_strides[2];
    const int64_t src = b * p->new_strides[0] + i * p->new_strides[1] + g * p->new_strides[2];
    const int32_t d = p->k.head_dim;
    const size_t esize = a->dtype == FM_DTYPE_F32 ? 4 : 2;
    float z[FM_KVQ_MAX_HEAD_DIM];
    /* src is a multiple of d, so it is a row index of the [*, D] view. */
    if (a->k_dense != NULL) {
        memcpy((char *)a->k_dense + (size_t)(row * d) * esize, (const char *)a->k_new + (size_t)src * esize,
               (size_t)d * esize);
    } else {
        load_row(z, a->k_new, a->dtype, src / d, d);
        encode_row(&p->k, z, a->k_codes + row * p->k.row_bytes, a->k_norms + row * (d / p->k.block));
    }
    if (a->v_dense != NULL) {
        memcpy((char *)a->v_dense + (size_t)(row * d) * esize, (const char *)a->v_new + (size_t)src * esize,
               (size_t)d * esize);
    } else {
        load_row(z, a->v_new, a->dtype, src / d, d);
        encode_row(&p->v, z, a->v_codes + row * p->v.row_bytes, a->v_norms + row * (d / p->v.block));
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

static int32_t floor_div(int32_t a, int32_t b) {
    const int32_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

void fm_cpu_kv_codes_decode_item(const KVCodesDecodeParams *p, const FMCPUKVCodesAttnArgs *a, int64_t item) {
    const int32_t d = p->head_dim, n = p->block, nb = d / n, kbits = p->k_bits, vbits = p->v_bits;
    const int32_t group = p->n_heads / p->n_kv_heads;
    const int32_t chunks = (group + FM_CPU_KVQ_HEAD_CHUNK - 1) / FM_CPU_KVQ_HEAD_CHUNK;
    const int64_t big = item / chunks, bi = big / p->n_kv_heads, g = big % p->n_kv_heads;
    int64_t b = bi / p->q_len, qi = bi % p->q_len, rows_b = p->q_len;
    if (a->cu_seqlens_q != NULL) {
        /* The sequence holding token bi: the last b with cu_q[b] <= bi. */
        if (bi >= a->cu_seqlens_q[p->batch]) return;  /* past the last sequence: no row to write */
        int64_t lo = 0, hi = p->batch;
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (a->cu_seqlens_q[mid] <= bi) lo = mid; else hi = mid;
        }
        b = lo;
        qi = bi - a->cu_seqlens_q[b];
        rows_b = a->cu_seqlens_q[b + 1] - a->cu_seqlens_q[b];
    }
    const int32_t h0 = (int32_t)(item % chunks) * FM_CPU_KVQ_HEAD_CHUNK;
    const int32_t heads = group - h0 < FM_CPU_KVQ_HEAD_CHUNK ? group - h0 : FM_CPU_KVQ_HEAD_CHUNK;
    const int64_t row0 = bi * p->n_heads + g * group + h0;
    const float inv_n = 1.0f / (float)n;
    /* A dense side reads as one block of norm 1 in the output basis. */
    const int32_t kn = a->k_dense != NULL ? d : n, vn = a->v_dense != NULL ? d : n;
    const float k_unit = a->k_dense != NULL ? 1.0f : inv_n;
    float qz[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_MAX_HEAD_DIM], acc[FM_CPU_KVQ_HEAD_CHUNK][FM_KVQ_MAX_HEAD_DIM];
    float kc[FM_KVQ_MAX_HEAD_DIM], vcv[FM_KVQ_MAX_HEAD_DIM], mx[FM_CPU_KVQ_HEAD_CHUNK], sum[FM_CPU_KVQ_HEAD_CHUNK];
    float w[FM_CPU_KVQ_HEAD_CHUNK], corr[FM_CPU_KVQ_HEAD_CHUNK];
    for (int32_t j = 0; j < heads; j++) {
        for (int32_t i = 0; i < d; i++) {
            const float v = a->q[(row0 + j) * d + i];
            qz[j][i] = (a->k_dense == NULL && fm_kvq_sign_bit(p->k_seed, (uint32_t)i)) ? -v : v;
            acc[j][i] = 0.0f;
        }
        if (a->k_dense == NULL) hadamard(qz[j], d, n);
        mx[j] = FM_RUNNING_MAX_START;
        sum[j] = 0.0f;
    }
    /* The keys this row sees: [lo, hi). */
    int32_t kl = a->seqlens != NULL ? a->seqlens[b] : p->kv_len;
    if (a->cu_seqlens_k != NULL) kl = a->cu_seqlens_k[b + 1] - a->cu_seqlens_k[b];
    const int32_t pos = kl - (int32_t)rows_b + (int32_t)qi;
    int32_t lo = 0, hi = kl;
    if (p->causal && pos + 1 < hi) hi = pos + 1;
    if (p->window_left >= 0 && pos - p->window_left > lo) lo = pos - p->window_left;
    if (p->window_right >= 0 && pos + p->window_right + 1 < hi) hi = pos + p->window_right + 1;
    if (p->attention_chunk > 0) {
        const int32_t c0 = floor_div(pos, p->attention_chunk) * p->attention_chunk;
        if (c0 > lo) lo = c0;
        if (c0 + p->attention_chunk < hi) hi = c0 + p->attention_chunk;
    }
    for (int32_t t = lo; t < hi; t++) {
        int64_t r = g * p->kv_strides[1];
        if (a->block_table != NULL) {
            r += (int64_t)a->block_table[b * p->max_pages + t / p->page_size] * p->kv_strides[0]
                 + (int64_t)(t % p->page_size) * p->kv_strides[2];
        } else {
            r += b * p->kv_strides[0] + (int64_t)t * p->kv_strides[2];
        }
        if (a->k_dense != NULL) {
            load_row(kc, a->k_dense, a->dense_dtype, r, d);
        } else {
            unpack_centroids(a->k_codes + r * p->k_row_bytes, d, kbits, kc);
        }
        for (int32_t j = 0; j < heads; j++) {
            float dot = 0.0f;
            for (int32_t k = 0; k < d / kn; k++) {
                float lane[8] = {0};  /* eight independent sums: vectorisable without reassociation */
                for (int32_t i = k * kn; i < (k + 1) * kn; i += 8) {
                    for (int32_t l = 0; l < 8; l++) lane[l] += qz[j][i + l] * kc[i + l];
                }
                const float part = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
                dot += a->k_dense != NULL ? part : part * a->k_norms[r * nb + k];
            }
            float s = dot * k_unit * p->scale;
            if (p->softcap > 0.0f) s = p->softcap * tanhf(s / p->softcap);
            const float m_new = s > mx[j] ? s : mx[j];
            corr[j] = expf(mx[j] - m_new);
            w[j] = expf(s - m_new);
            sum[j] = sum[j] * corr[j] + w[j];
            mx[j] = m_new;
        }
        if (a->v_dense != NULL) {
            load_row(vcv, a->v_dense, a->dense_dtype, r, d);
        } else {
            unpack_centroids(a->v_codes + r * p->v_row_bytes, d, vbits, vcv);
        }
        for (int32_t j = 0; j < heads; j++) {
            for (int32_t k = 0; k < d / vn; k++) {
                const float wr = a->v_dense != NULL ? w[j] : w[j] * a->v_norms[r * nb + k];
                for (int32_t i = k * vn; i < (k + 1) * vn; i++) acc[j][i] = acc[j][i] * corr[j] + wr * vcv[i];
            }
        }
    }
    for (int32_t j = 0; j < heads; j++) {
        const int32_t h = (int32_t)(g * group + h0 + j);
        if (a->sinks != NULL) {
            /* The sink joins the denominator without a value; +inf takes the row. */
            const float s = a->sinks[h];
            const float m_new = s > mx[j] ? s : mx[j];
            const float c = s == INFINITY ? 0.0f : expf(mx[j] - m_new);
            sum[j] = s == INFINITY ? INFINITY : sum[j] * c + expf(s - m_new);
            for (int32_t i = 0; i < d; i++) acc[j][i] *= c;
            mx[j] = m_new;
        }
        if (a->lse != NULL) {
            const int64_t at = a->cu_seqlens_q != NULL ? (int64_t)h * p->q_len + bi : (b * p->n_heads + h) * p->q_len + qi;
            a->lse[at] = sum[j] > 0.0f ? mx[j] + logf(sum[j]) : -INFINITY;
        }
        const int v_codes = a->v_dense == NULL;
        if (v_codes) hadamard(acc[j], d, n);
        const float norm = sum[j] > 0.0f ? (v_codes ? inv_n : 1.0f) / sum[j] : 0.0f;
        for (int32_t i = 0; i < d; i++) {
            const float v = acc[j][i] * norm;
            a->o[(row0 + j) * d + i] = (v_codes && fm_kvq_sign_bit(p->v_seed, (uint32_t)i)) ? -v : v;
        }
    }
}
