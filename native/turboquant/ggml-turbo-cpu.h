// CPU back end of the turbo2 / turbo3 / turbo4 types (clickpaca patch set): from_float and
// the dot product against an F32 vector in the rotated domain. Copied into ggml/src/ggml-cpu/.
#pragma once

#include "ggml-turbo.h"

#ifdef __cplusplus
extern "C" {
#endif

void quantize_row_turbo2(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turbo3(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turbo4(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);

// s[0] = sum over blocks of d * sum_j level[idx_j] * y_j; y is F32 (vec_dot_type), nrc == 1.
void ggml_vec_dot_turbo2_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turbo3_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turbo4_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);

// True when flash attention's tiled (GEMM) CPU path should take this K/V pair: at least one
// turbo type, and each of K and V a turbo type, F16 or F32. The path then dequantizes K and V
// tiles to F32 with the types' to_float, as it converts F16 tiles.
bool ggml_turbo_fa_tiled(enum ggml_type k, enum ggml_type v);

#define GGML_TURBO_TYPE_TRAITS_CPU                                               \
    [GGML_TYPE_TURBO2] = {                                                       \
        .from_float   = quantize_row_turbo2,                                     \
        .vec_dot      = ggml_vec_dot_turbo2_f32,                                 \
        .vec_dot_type = GGML_TYPE_F32,                                           \
        .nrows        = 1,                                                       \
    },                                                                           \
    [GGML_TYPE_TURBO3] = {                                                       \
        .from_float   = quantize_row_turbo3,                                     \
        .vec_dot      = ggml_vec_dot_turbo3_f32,                                 \
        .vec_dot_type = GGML_TYPE_F32,                                           \
        .nrows        = 1,                                                       \
    },                                                                           \
    [GGML_TYPE_TURBO4] = {                                                       \
        .from_float   = quantize_row_turbo4,                                     \
        .vec_dot      = ggml_vec_dot_turbo4_f32,                                 \
        .vec_dot_type = GGML_TYPE_F32,                                           \
        .nrows        = 1,                                                       \
    },

#ifdef __cplusplus
}
#endif
