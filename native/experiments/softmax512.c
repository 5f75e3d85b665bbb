// clickpaca experiment (issue #27 item 3), compiled into a throwaway copy of ggml-cpu's
// vec.cpp by native/experiments/softmax512.py, never into a real build.
//
// ggml_vec_soft_max_f32 as an AVX-512 build computes it, on an AVX2 + FMA CPU: blocks of
// 16 values, each exponential by the AVX-512 ggml_v_expf (its last step adds 1 inside the
// polynomial's FMA and scales by 2^n with scalef, where the AVX2 one computes k + j*k),
// each block summed in the order of GCC's _mm512_reduce_add_ps (upper 8 + lower 8, upper
// 4 + lower 4, lanes 0+2 and 1+3, then those two), the rest one by one. Every float
// operation is the one the AVX-512 code performs, in the same order, so the results are
// the same bits.

static inline __m256 clickpaca_expf512(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)),
                        u, _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_fmadd_ps(_mm256_set1_ps(0x1.ffffecp-1f), b, _mm256_set1_ps(1.0f)));
    float jv[8], nv[8], out[8];
    _mm256_storeu_ps(jv, j);
    _mm256_storeu_ps(nv, n);
    for (int l = 0; l < 8; l++) {
        if (fabsf(nv[l]) > 192.0f) {          // _CMP_GT_OQ: false for NaN
            out[l] = nv[l] <= 0.0f ? 0.0f : INFINITY;
        } else if (nv[l] != nv[l]) {
            out[l] = nv[l];                   // scalef propagates the NaN
        } else {
            out[l] = ldexpf(jv[l], (int) nv[l]);  // scalef: j * 2^n, rounded once
        }
    }
    return _mm256_loadu_ps(out);
}

static ggml_float clickpaca_soft_max_f32_avx512(const int n, float * y, const float * x, float max) {
    int i = 0;
    ggml_float sum = 0;
    for (; i + 15 < n; i += 16) {
        const __m256 lo = clickpaca_expf512(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(max)));
        const __m256 hi = clickpaca_expf512(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), _mm256_set1_ps(max)));
        _mm256_storeu_ps(y + i, lo);
        _mm256_storeu_ps(y + i + 8, hi);
        const __m256 t3 = _mm256_add_ps(hi, lo);
        const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
        const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
        sum += (ggml_float)(_mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1)));
    }
    for (; i < n; ++i) {
        float val = expf(x[i] - max);
        sum += (ggml_float)val;
        y[i] = val;
    }
    return sum;
}
