// TurboQuant-mse block types for ggml (clickpaca patch set): reference quantization and
// dequantization. Bit-exact with clickpaca/turboquant.py; change both together.
//
// Copied into ggml/src/ by native/turboquant/apply.py and compiled into ggml-base.

#include "ggml-turbo.h"
#include "ggml-turbo-tables.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define TURBO_X86_DISPATCH 1
#endif

#define TURBO_FP16_NAN 0x7E00
#define TURBO_FP16_MAX 65504.0f

const float * ggml_turbo_levels(int bits) {
    switch (bits) {
        case 2: return ggml_turbo2_levels;
        case 3: return ggml_turbo3_levels;
        case 4: return ggml_turbo4_levels;
        default: return NULL;
    }
}

const float * ggml_turbo_bounds(int bits) {
    switch (bits) {
        case 2: return ggml_turbo2_bounds;
        case 3: return ggml_turbo3_bounds;
        case 4: return ggml_turbo4_bounds;
        default: return NULL;
    }
}

int ggml_turbo_norm_mode(void) {
    static volatile int mode = -1; // benign race: every thread computes the same value
    int m = mode;
    if (m < 0) {
        const char * env = getenv("GGML_TURBO_NORM");
        m = 2;
        if (env && strcmp(env, "plain") == 0) {
            m = 0;
        } else if (env && strcmp(env, "preserve") == 0) {
            m = 1;
        }
        mode = m;
    }
    return m;
}

// One block: the gain d and the 128 indices (unpacked). See clickpaca/turboquant.py for the
// rules; every floating-point step here has its twin there.
static void turbo_quantize_block(const float * GGML_RESTRICT x, int bits, ggml_fp16_t * d_out, uint8_t * GGML_RESTRICT idx) {
    const int     nb = (1 << bits) - 1; // number of boundaries
    const float * lv = ggml_turbo_levels(bits);
    const float * bd = ggml_turbo_bounds(bits);

    double s = 0.0;
    for (int j = 0; j < QK_TURBO; ++j) {
        s += (double) x[j] * (double) x[j];
    }
    if (!isfinite(s)) {
        // NaN or inf in the input: keep the block visibly bad.
        *d_out = (ggml_fp16_t) TURBO_FP16_NAN;
        memset(idx, 0, QK_TURBO);
        return;
    }
    const double n   = sqrt(s);
    const double inv = n > 0.0 ? 1.0 / n : 0.0; // double: denormal-sized blocks must not overflow it

    float u[QK_TURBO];
    for (int j = 0; j < QK_TURBO; ++j) {
        u[j] = (float) ((double) x[j] * inv);
        int q = 0;
        for (int i = 0; i < nb; ++i) {
            q += u[j] > bd[i]; // ties go to the lower level
        }
        idx[j] = (uint8_t) q;
    }

    float dv;
    const int mode = ggml_turbo_norm_mode();
    if (mode == 0) {
        dv = (float) n;
    } else {
        double cc = 0.0;
        double xc = 0.0;
        for (int j = 0; j < QK_TURBO; ++j) {
            const double c = (double) lv[idx[j]];
            cc += c * c;
            xc += (double) u[j] * c;
        }
        if (mode == 1) {
            dv = cc > 0.0 ? (float) (n / sqrt(cc)) : 0.0f;
        } else {
            dv = cc > 0.0 ? (float) (n * xc / cc) : 0.0f;
        }
    }
    if (dv > TURBO_FP16_MAX) {
        dv = TURBO_FP16_MAX; // saturate instead of storing inf
    }
    *d_out = ggml_fp32_to_fp16(dv);
}

void quantize_row_turbo2_ref(const float * GGML_RESTRICT x, block_turbo2 * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_TURBO == 0);
    const int64_t nb = k / QK_TURBO;
    uint8_t idx[QK_TURBO];
    for (int64_t i = 0; i < nb; ++i) {
        turbo_quantize_block(x + i*QK_TURBO, 2, &y[i].d, idx);
        for (int b = 0; b < 32; ++b) {
            y[i].qs[b] = (uint8_t) (idx[b] | (idx[b + 32] << 2) | (idx[b + 64] << 4) | (idx[b + 96] << 6));
        }
    }
}

void quantize_row_turbo3_ref(const float * GGML_RESTRICT x, block_turbo3 * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_TURBO == 0);
    const int64_t nb = k / QK_TURBO;
    uint8_t idx[QK_TURBO];
    for (int64_t i = 0; i < nb; ++i) {
        turbo_quantize_block(x + i*QK_TURBO, 3, &y[i].d, idx);
        for (int b = 0; b < 32; ++b) {
            y[i].qs[b] = (uint8_t) ((idx[b] & 3) | ((idx[b + 32] & 3) << 2) | ((idx[b + 64] & 3) << 4) | ((idx[b + 96] & 3) << 6));
        }
        for (int b = 0; b < 16; ++b) {
            uint8_t h = 0;
            for (int g = 0; g < 8; ++g) {
                h |= (uint8_t) (((idx[b + 16*g] >> 2) & 1) << g);
            }
            y[i].qh[b] = h;
        }
    }
}

void quantize_row_turbo4_ref(const float * GGML_RESTRICT x, block_turbo4 * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_TURBO == 0);
    const int64_t nb = k / QK_TURBO;
    uint8_t idx[QK_TURBO];
    for (int64_t i = 0; i < nb; ++i) {
        turbo_quantize_block(x + i*QK_TURBO, 4, &y[i].d, idx);
        for (int b = 0; b < 64; ++b) {
            y[i].qs[b] = (uint8_t) (idx[b] | (idx[b + 64] << 4));
        }
    }
}

// ---- dequantization: y = fp32(d) * level[idx] (one multiply per value, so any SIMD variant
// gives the same bits). Scalar versions first, AVX2 versions chosen at run time below.

static void dequantize_row_turbo2_scalar(const block_turbo2 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    const int64_t nb = k / QK_TURBO;
    for (int64_t i = 0; i < nb; ++i) {
        const float d = ggml_fp16_to_fp32(x[i].d);
        float dl[4];
        for (int l = 0; l < 4; ++l) {
            dl[l] = d * ggml_turbo2_levels[l];
        }
        float * yb = y + i*QK_TURBO;
        for (int b = 0; b < 32; ++b) {
            const uint8_t q = x[i].qs[b];
            yb[b]      = dl[q & 3];
            yb[b + 32] = dl[(q >> 2) & 3];
            yb[b + 64] = dl[(q >> 4) & 3];
            yb[b + 96] = dl[q >> 6];
        }
    }
}

static void dequantize_row_turbo3_scalar(const block_turbo3 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    const int64_t nb = k / QK_TURBO;
    for (int64_t i = 0; i < nb; ++i) {
        const float d = ggml_fp16_to_fp32(x[i].d);
        float dl[8];
        for (int l = 0; l < 8; ++l) {
            dl[l] = d * ggml_turbo3_levels[l];
        }
        float * yb = y + i*QK_TURBO;
        for (int j = 0; j < QK_TURBO; ++j) {
            const int lo = (x[i].qs[j % 32] >> (2*(j / 32))) & 3;
            const int hi = (x[i].qh[j % 16] >> (j / 16)) & 1;
            yb[j] = dl[lo | (hi << 2)];
        }
    }
}

static void dequantize_row_turbo4_scalar(const block_turbo4 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    const int64_t nb = k / QK_TURBO;
    for (int64_t i = 0; i < nb; ++i) {
        const float d = ggml_fp16_to_fp32(x[i].d);
        float dl[16];
        for (int l = 0; l < 16; ++l) {
            dl[l] = d * ggml_turbo4_levels[l];
        }
        float * yb = y + i*QK_TURBO;
        for (int b = 0; b < 64; ++b) {
            const uint8_t q = x[i].qs[b];
            yb[b]      = dl[q & 15];
            yb[b + 64] = dl[q >> 4];
        }
    }
}

#ifdef TURBO_X86_DISPATCH
// ggml-base is built without -march flags; these are compiled for AVX2 and used only when the
// CPU has it (checked once). 8 values per step: widen 8 index bytes, shift/mask, permute.

__attribute__((target("avx2")))
static inline __m256i turbo_load8_u8(const uint8_t * p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) p));
}

__attribute__((target("avx2")))
static void dequantize_row_turbo2_avx2(const block_turbo2 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    const int64_t nb = k / QK_TURBO;
    const __m256  tab  = _mm256_setr_ps(ggml_turbo2_levels[0], ggml_turbo2_levels[1], ggml_turbo2_levels[2], ggml_turbo2_levels[3], 0, 0, 0, 0);
    const __m256i mask = _mm256_set1_epi32(3);
    for (int64_t i = 0; i < nb; ++i) {
        const __m256 vd = _mm256_set1_ps(ggml_fp16_to_fp32(x[i].d));
        const __m256 dl = _mm256_mul_ps(vd, tab);
        float * yb = y + i*QK_TURBO;
        for (int b = 0; b < 32; b += 8) {
            const __m256i q = turbo_load8_u8(x[i].qs + b);
            for (int g = 0; g < 4; ++g) {
                const __m256i id = _mm256_and_si256(_mm256_srl_epi32(q, _mm_cvtsi32_si128(2*g)), mask);
                _mm256_storeu_ps(yb + 32*g + b, _mm256_permutevar8x32_ps(dl, id));
            }
        }
    }
}

__attribute__((target("avx2")))
static void dequantize_row_turbo3_avx2(const block_turbo3 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    const int64_t nb = k / QK_TURBO;
    const __m256  tab   = _mm256_loadu_ps(ggml_turbo3_levels);
    const __m256i mask3 = _mm256_set1_epi32(3);
    const __m256i mask4 = _mm256_set1_epi32(4);
    for (int64_t i = 0; i < nb; ++i) {
        const __m256 vd = _mm256_set1_ps(ggml_fp16_to_fp32(x[i].d));
        const __m256 dl = _mm256_mul_ps(vd, tab);
        float * yb = y + i*QK_TURBO;
        const __m256i h0 = turbo_load8_u8(x[i].qh);
        const __m256i h1 = turbo_load8_u8(x[i].qh + 8);
        for (int j = 0; j < QK_TURBO; j += 8) {
            const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(turbo_load8_u8(x[i].qs + (j % 32)), _mm_cvtsi32_si128(2*(j / 32))), mask3);
            const __m256i hv = (j % 16) ? h1 : h0;
            // bit (j/16) of qh -> bit 2
            const int sh = j / 16;
            const __m256i hi = _mm256_and_si256(sh >= 2 ? _mm256_srl_epi32(hv, _mm_cvtsi32_si128(sh - 2))
                                                        : _mm256_sll_epi32(hv, _mm_cvtsi32_si128(2 - sh)), mask4);
            _mm256_storeu_ps(yb + j, _mm256_permutevar8x32_ps(dl, _mm256_or_si256(lo, hi)));
        }
    }
}

__attribute__((target("avx2")))
static void dequantize_row_turbo4_avx2(const block_turbo4 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    const int64_t nb = k / QK_TURBO;
    const __m256  tlo  = _mm256_loadu_ps(ggml_turbo4_levels);
    const __m256  thi  = _mm256_loadu_ps(ggml_turbo4_levels + 8);
    const __m256i m15  = _mm256_set1_epi32(15);
    for (int64_t i = 0; i < nb; ++i) {
        const __m256 vd  = _mm256_set1_ps(ggml_fp16_to_fp32(x[i].d));
        const __m256 dlo = _mm256_mul_ps(vd, tlo);
        const __m256 dhi = _mm256_mul_ps(vd, thi);
        float * yb = y + i*QK_TURBO;
        for (int b = 0; b < 64; b += 8) {
            const __m256i q = turbo_load8_u8(x[i].qs + b);
            const __m256i i0 = _mm256_and_si256(q, m15);
            const __m256i i1 = _mm256_srli_epi32(q, 4);
            // bit 3 of the index selects the upper half of the table: move it to the sign bit
            const __m256 r0 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(dlo, i0), _mm256_permutevar8x32_ps(dhi, i0),
                                               _mm256_castsi256_ps(_mm256_slli_epi32(i0, 28)));
            const __m256 r1 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(dlo, i1), _mm256_permutevar8x32_ps(dhi, i1),
                                               _mm256_castsi256_ps(_mm256_slli_epi32(i1, 28)));
            _mm256_storeu_ps(yb + b,      r0);
            _mm256_storeu_ps(yb + b + 64, r1);
        }
    }
}

static int turbo_have_avx2(void) {
    static volatile int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return have;
}
#endif

void dequantize_row_turbo2(const block_turbo2 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_TURBO == 0);
#ifdef TURBO_X86_DISPATCH
    if (turbo_have_avx2()) {
        dequantize_row_turbo2_avx2(x, y, k);
        return;
    }
#endif
    dequantize_row_turbo2_scalar(x, y, k);
}

void dequantize_row_turbo3(const block_turbo3 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_TURBO == 0);
#ifdef TURBO_X86_DISPATCH
    if (turbo_have_avx2()) {
        dequantize_row_turbo3_avx2(x, y, k);
        return;
    }
#endif
    dequantize_row_turbo3_scalar(x, y, k);
}

void dequantize_row_turbo4(const block_turbo4 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    assert(k % QK_TURBO == 0);
#ifdef TURBO_X86_DISPATCH
    if (turbo_have_avx2()) {
        dequantize_row_turbo4_avx2(x, y, k);
        return;
    }
#endif
    dequantize_row_turbo4_scalar(x, y, k);
}

// ---- ggml_quantize_chunk back ends

size_t quantize_turbo2(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix) {
    (void) imatrix;
    const size_t row_size = ggml_row_size(GGML_TYPE_TURBO2, n_per_row);
    for (int64_t r = 0; r < nrows; ++r) {
        quantize_row_turbo2_ref(src + r*n_per_row, (block_turbo2 *) ((char *) dst + r*row_size), n_per_row);
    }
    return nrows * row_size;
}

size_t quantize_turbo3(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix) {
    (void) imatrix;
    const size_t row_size = ggml_row_size(GGML_TYPE_TURBO3, n_per_row);
    for (int64_t r = 0; r < nrows; ++r) {
        quantize_row_turbo3_ref(src + r*n_per_row, (block_turbo3 *) ((char *) dst + r*row_size), n_per_row);
    }
    return nrows * row_size;
}

size_t quantize_turbo4(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix) {
    (void) imatrix;
    const size_t row_size = ggml_row_size(GGML_TYPE_TURBO4, n_per_row);
    for (int64_t r = 0; r < nrows; ++r) {
        quantize_row_turbo4_ref(src + r*n_per_row, (block_turbo4 *) ((char *) dst + r*row_size), n_per_row);
    }
    return nrows * row_size;
}

bool ggml_turbo_validate_blocks(enum ggml_type type, const void * data, size_t nb) {
    const size_t ts = ggml_type_size(type);
    const uint8_t * p = (const uint8_t *) data;
    for (size_t i = 0; i < nb; ++i) {
        ggml_fp16_t d;
        memcpy(&d, p + i*ts, sizeof(d)); // d is the first field of every turbo block
        if ((d & 0x7C00) == 0x7C00) {
            return false;
        }
    }
    return true;
}
