// CPU kernels of the turbo2 / turbo3 / turbo4 types (clickpaca patch set).
//
// The dot product is taken in the rotated domain without dequantizing to a buffer:
//     q . k_hat = sum over blocks of d * sum_j level[idx_j] * q_j
// Indices are expanded 8 at a time (one byte load, widen, shift, mask) and looked up with a
// register permute (AVX2); no allocation, no temporary rows. Compiled into ggml-cpu with its
// -march flags; a portable scalar path is used elsewhere.
//
// Copied into ggml/src/ggml-cpu/ by native/turboquant/apply.py.

#include "ggml-turbo-cpu.h"
#include "ggml-turbo-tables.h"

#include <assert.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TURBO_AVX2 1
#endif

static inline float turbo_fp16_to_fp32(ggml_fp16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return ggml_fp16_to_fp32(h);
#endif
}

void quantize_row_turbo2(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_turbo2_ref(x, (block_turbo2 *) y, k);
}

void quantize_row_turbo3(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_turbo3_ref(x, (block_turbo3 *) y, k);
}

void quantize_row_turbo4(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    quantize_row_turbo4_ref(x, (block_turbo4 *) y, k);
}

static inline bool turbo_is_turbo(enum ggml_type t) {
    return t == GGML_TYPE_TURBO2 || t == GGML_TYPE_TURBO3 || t == GGML_TYPE_TURBO4;
}

bool ggml_turbo_fa_tiled(enum ggml_type k, enum ggml_type v) {
    const bool kt = turbo_is_turbo(k);
    const bool vt = turbo_is_turbo(v);
    return (kt || vt) &&
           (kt || k == GGML_TYPE_F16 || k == GGML_TYPE_F32) &&
           (vt || v == GGML_TYPE_F16 || v == GGML_TYPE_F32);
}

#ifdef TURBO_AVX2
static inline __m256i turbo_load8_u8(const uint8_t * p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) p));
}

static inline float turbo_hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
#endif

void ggml_vec_dot_turbo2_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    assert(nrc == 1);
    assert(n % QK_TURBO == 0);
    (void) bs; (void) bx; (void) by; (void) nrc;
    const block_turbo2 * GGML_RESTRICT x = (const block_turbo2 *) vx;
    const float        * GGML_RESTRICT y = (const float *) vy;
    const int nb = n / QK_TURBO;
#ifdef TURBO_AVX2
    const __m256  tab = _mm256_setr_ps(ggml_turbo2_levels[0], ggml_turbo2_levels[1], ggml_turbo2_levels[2], ggml_turbo2_levels[3], 0, 0, 0, 0);
    const __m256i m3  = _mm256_set1_epi32(3);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const float * yb = y + i*QK_TURBO;
        __m256 a0 = _mm256_setzero_ps();
        __m256 a1 = _mm256_setzero_ps();
        for (int b = 0; b < 32; b += 8) {
            const __m256i q = turbo_load8_u8(x[i].qs + b);
            a0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(tab, _mm256_and_si256(q, m3)),                        _mm256_loadu_ps(yb + b),      a0);
            a1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(tab, _mm256_and_si256(_mm256_srli_epi32(q, 2), m3)), _mm256_loadu_ps(yb + b + 32), a1);
            a0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(tab, _mm256_and_si256(_mm256_srli_epi32(q, 4), m3)), _mm256_loadu_ps(yb + b + 64), a0);
            a1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(tab, _mm256_srli_epi32(q, 6)),                       _mm256_loadu_ps(yb + b + 96), a1);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(turbo_fp16_to_fp32(x[i].d)), _mm256_add_ps(a0, a1), acc);
    }
    *s = turbo_hsum(acc);
#else
    float sumf = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const float * yb = y + i*QK_TURBO;
        float sb = 0.0f;
        for (int b = 0; b < 32; ++b) {
            const uint8_t q = x[i].qs[b];
            sb += ggml_turbo2_levels[q & 3] * yb[b] + ggml_turbo2_levels[(q >> 2) & 3] * yb[b + 32]
                + ggml_turbo2_levels[(q >> 4) & 3] * yb[b + 64] + ggml_turbo2_levels[q >> 6] * yb[b + 96];
        }
        sumf += turbo_fp16_to_fp32(x[i].d) * sb;
    }
    *s = sumf;
#endif
}

void ggml_vec_dot_turbo3_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    assert(nrc == 1);
    assert(n % QK_TURBO == 0);
    (void) bs; (void) bx; (void) by; (void) nrc;
    const block_turbo3 * GGML_RESTRICT x = (const block_turbo3 *) vx;
    const float        * GGML_RESTRICT y = (const float *) vy;
    const int nb = n / QK_TURBO;
#ifdef TURBO_AVX2
    const __m256  tab = _mm256_loadu_ps(ggml_turbo3_levels);
    const __m256i m3  = _mm256_set1_epi32(3);
    const __m256i m4  = _mm256_set1_epi32(4);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const float * yb = y + i*QK_TURBO;
        // qh bits, two groups of 8 bytes: value j has its bit 2 at bit j/16 of qh[j%16]
        const __m256i h0 = turbo_load8_u8(x[i].qh);
        const __m256i h1 = turbo_load8_u8(x[i].qh + 8);
        __m256 a0 = _mm256_setzero_ps();
        __m256 a1 = _mm256_setzero_ps();
        for (int b = 0; b < 32; b += 8) {
            // values b + 32*g for g = 0..3; their qh byte group is (b % 16) and bit 2*g + b/16
            const __m256i q  = turbo_load8_u8(x[i].qs + b);
            const __m256i hv = (b % 16) ? h1 : h0;
            const int     hb = b / 16; // 0 or 1
            // bit (2g + hb) of hv -> bit 2
            const __m256i hs = hb ? hv : _mm256_slli_epi32(hv, 1); // the bit of group g is now at 2g + 1
            const __m256i i0 = _mm256_or_si256(_mm256_and_si256(q, m3),                        _mm256_and_si256(_mm256_slli_epi32(hs, 1), m4));
            const __m256i i1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(q, 2), m3), _mm256_and_si256(_mm256_srli_epi32(hs, 1), m4));
            const __m256i i2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(q, 4), m3), _mm256_and_si256(_mm256_srli_epi32(hs, 3), m4));
            const __m256i i3 = _mm256_or_si256(_mm256_srli_epi32(q, 6),                        _mm256_and_si256(_mm256_srli_epi32(hs, 5), m4));
            a0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(tab, i0), _mm256_loadu_ps(yb + b),      a0);
            a1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(tab, i1), _mm256_loadu_ps(yb + b + 32), a1);
            a0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(tab, i2), _mm256_loadu_ps(yb + b + 64), a0);
            a1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(tab, i3), _mm256_loadu_ps(yb + b + 96), a1);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(turbo_fp16_to_fp32(x[i].d)), _mm256_add_ps(a0, a1), acc);
    }
    *s = turbo_hsum(acc);
#else
    float sumf = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const float * yb = y + i*QK_TURBO;
        float sb = 0.0f;
        for (int j = 0; j < QK_TURBO; ++j) {
            const int lo = (x[i].qs[j % 32] >> (2*(j / 32))) & 3;
            const int hi = (x[i].qh[j % 16] >> (j / 16)) & 1;
            sb += ggml_turbo3_levels[lo | (hi << 2)] * yb[j];
        }
        sumf += turbo_fp16_to_fp32(x[i].d) * sb;
    }
    *s = sumf;
#endif
}

void ggml_vec_dot_turbo4_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    assert(nrc == 1);
    assert(n % QK_TURBO == 0);
    (void) bs; (void) bx; (void) by; (void) nrc;
    const block_turbo4 * GGML_RESTRICT x = (const block_turbo4 *) vx;
    const float        * GGML_RESTRICT y = (const float *) vy;
    const int nb = n / QK_TURBO;
#ifdef TURBO_AVX2
    const __m256  tlo = _mm256_loadu_ps(ggml_turbo4_levels);
    const __m256  thi = _mm256_loadu_ps(ggml_turbo4_levels + 8);
    const __m256i m15 = _mm256_set1_epi32(15);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const float * yb = y + i*QK_TURBO;
        __m256 a0 = _mm256_setzero_ps();
        __m256 a1 = _mm256_setzero_ps();
        for (int b = 0; b < 64; b += 8) {
            const __m256i q  = turbo_load8_u8(x[i].qs + b);
            const __m256i i0 = _mm256_and_si256(q, m15);
            const __m256i i1 = _mm256_srli_epi32(q, 4);
            // bit 3 of the index picks the upper half of the table: it becomes the blend mask's sign
            const __m256 c0 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, i0), _mm256_permutevar8x32_ps(thi, i0),
                                               _mm256_castsi256_ps(_mm256_slli_epi32(i0, 28)));
            const __m256 c1 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, i1), _mm256_permutevar8x32_ps(thi, i1),
                                               _mm256_castsi256_ps(_mm256_slli_epi32(i1, 28)));
            a0 = _mm256_fmadd_ps(c0, _mm256_loadu_ps(yb + b),      a0);
            a1 = _mm256_fmadd_ps(c1, _mm256_loadu_ps(yb + b + 64), a1);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(turbo_fp16_to_fp32(x[i].d)), _mm256_add_ps(a0, a1), acc);
    }
    *s = turbo_hsum(acc);
#else
    float sumf = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const float * yb = y + i*QK_TURBO;
        float sb = 0.0f;
        for (int b = 0; b < 64; ++b) {
            const uint8_t q = x[i].qs[b];
            sb += ggml_turbo4_levels[q & 15] * yb[b] + ggml_turbo4_levels[q >> 4] * yb[b + 64];
        }
        sumf += turbo_fp16_to_fp32(x[i].d) * sb;
    }
    *s = sumf;
#endif
}
