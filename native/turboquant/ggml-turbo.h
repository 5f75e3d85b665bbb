// TurboQuant-mse KV-cache types for ggml: turbo2, turbo3, turbo4 (clickpaca patch set).
//
// A block is 128 values of an already rotated vector (mainline llama.cpp applies a Hadamard
// rotation to Q, K and V whenever the cache type is quantized). Per block: an fp16 gain d and
// one 2/3/4-bit index per value into a fixed Lloyd-Max codebook for N(0, 1/128). Value
// j reconstructs as fp32(d) * level[idx_j]. The exact rules (norm, ties, NaN, saturation,
// packing) are specified by clickpaca/turboquant.py, the numpy reference that this code must
// match bit for bit.
//
// Copied into ggml/src/ by native/turboquant/apply.py.
#pragma once

#include "ggml.h"

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QK_TURBO 128

// turbo2: qs[b] holds the 2-bit indices of values b, b+32, b+64, b+96 (bits 0-1, 2-3, 4-5, 6-7).
typedef struct {
    ggml_fp16_t d;
    uint8_t     qs[QK_TURBO / 4];
} block_turbo2;

// turbo3: qs as turbo2 for the low 2 bits; qh[b] holds bit 2 of values b, b+16, ..., b+112.
typedef struct {
    ggml_fp16_t d;
    uint8_t     qs[QK_TURBO / 4];
    uint8_t     qh[QK_TURBO / 8];
} block_turbo3;

// turbo4: qs[b] holds value b in its low nibble and value b+64 in its high nibble.
typedef struct {
    ggml_fp16_t d;
    uint8_t     qs[QK_TURBO / 2];
} block_turbo4;

#if defined(__cplusplus)
static_assert(sizeof(block_turbo2) == 34, "block_turbo2 size");
static_assert(sizeof(block_turbo3) == 50, "block_turbo3 size");
static_assert(sizeof(block_turbo4) == 66, "block_turbo4 size");
#else
_Static_assert(sizeof(block_turbo2) == 34, "block_turbo2 size");
_Static_assert(sizeof(block_turbo3) == 50, "block_turbo3 size");
_Static_assert(sizeof(block_turbo4) == 66, "block_turbo4 size");
#endif

// The codebooks (ascending levels) and decision boundaries, float32, for bits = 2, 3, 4.
GGML_API const float * ggml_turbo_levels(int bits);
GGML_API const float * ggml_turbo_bounds(int bits);

// Reference quantization (from_float_ref) and dequantization (to_float); k % 128 == 0.
GGML_API void quantize_row_turbo2_ref(const float * GGML_RESTRICT x, block_turbo2 * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turbo3_ref(const float * GGML_RESTRICT x, block_turbo3 * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turbo4_ref(const float * GGML_RESTRICT x, block_turbo4 * GGML_RESTRICT y, int64_t k);

GGML_API void dequantize_row_turbo2(const block_turbo2 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turbo3(const block_turbo3 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turbo4(const block_turbo4 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);

// ggml_quantize_chunk back ends (imatrix is ignored).
GGML_API size_t quantize_turbo2(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turbo3(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turbo4(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

// ggml_validate_row_data: false when a block's d is NaN or inf (nb = number of blocks).
GGML_API bool ggml_turbo_validate_blocks(enum ggml_type type, const void * data, size_t nb);

// What d holds: 0 = ||x|| ("plain"), 1 = ||x|| / ||level[idx]|| ("preserve"),
// 2 = <x, level[idx]> / ||level[idx]||^2 ("lsq", the default). Read once from the
// environment variable GGML_TURBO_NORM (plain | preserve | lsq); meant for experiments.
GGML_API int ggml_turbo_norm_mode(void);

// ---- hook helpers: expanded inside ggml's own tables and switches by the patch set ----

#define GGML_TURBO_TYPE_TRAITS                                                   \
    [GGML_TYPE_TURBO2] = {                                                       \
        .type_name      = "turbo2",                                              \
        .blck_size      = QK_TURBO,                                              \
        .type_size      = sizeof(block_turbo2),                                  \
        .is_quantized   = true,                                                  \
        .to_float       = (ggml_to_float_t) dequantize_row_turbo2,               \
        .from_float_ref = (ggml_from_float_t) quantize_row_turbo2_ref,           \
    },                                                                           \
    [GGML_TYPE_TURBO3] = {                                                       \
        .type_name      = "turbo3",                                              \
        .blck_size      = QK_TURBO,                                              \
        .type_size      = sizeof(block_turbo3),                                  \
        .is_quantized   = true,                                                  \
        .to_float       = (ggml_to_float_t) dequantize_row_turbo3,               \
        .from_float_ref = (ggml_from_float_t) quantize_row_turbo3_ref,           \
    },                                                                           \
    [GGML_TYPE_TURBO4] = {                                                       \
        .type_name      = "turbo4",                                              \
        .blck_size      = QK_TURBO,                                              \
        .type_size      = sizeof(block_turbo4),                                  \
        .is_quantized   = true,                                                  \
        .to_float       = (ggml_to_float_t) dequantize_row_turbo4,               \
        .from_float_ref = (ggml_from_float_t) quantize_row_turbo4_ref,           \
    },

#define GGML_TURBO_QUANTIZE_CASES                                                                                     \
    case GGML_TYPE_TURBO2: result = quantize_turbo2(src + start, (char *) dst + start_row * row_size, nrows, n_per_row, imatrix); break; \
    case GGML_TYPE_TURBO3: result = quantize_turbo3(src + start, (char *) dst + start_row * row_size, nrows, n_per_row, imatrix); break; \
    case GGML_TYPE_TURBO4: result = quantize_turbo4(src + start, (char *) dst + start_row * row_size, nrows, n_per_row, imatrix); break;

#define GGML_TURBO_VALIDATE_CASES                                                \
    case GGML_TYPE_TURBO2:                                                       \
    case GGML_TYPE_TURBO3:                                                       \
    case GGML_TYPE_TURBO4:                                                       \
        if (!ggml_turbo_validate_blocks(type, data, nb)) {                       \
            return false;                                                        \
        }                                                                        \
        break;

#ifdef __cplusplus
}
#endif
