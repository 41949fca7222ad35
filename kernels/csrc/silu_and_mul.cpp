// SiLU-and-multiply, the SwiGLU gate, fp32: y[r, j] = silu(x[r, j]) * x[r, i + j], j < i,
// silu(g) = g * sigmoid(g). Same definition as kernels/activation.py's reference; sigmoid by
// simd.h's exp on the non-positive side only (e = exp(-|g|): sigmoid(g) = 1 / (1 + e) for
// g >= 0, e / (1 + e) below), so no exp of a large argument ever overflows.
#include "simd.h"

static inline float silu_scalar(float g) {
    const float e = exp_neg_scalar(-fabsf(g));
    return g * ((g >= 0.f ? 1.f : e) / (1.f + e));
}

TANDEM_API int tandem_silu_and_mul(const float* x, int64_t t, int64_t i, int64_t ldx, float* y) {
    if (i <= 0 || ldx < 2 * i) return 1;
    for (int64_t r = 0; r < t; r++) {
        const float* gate = x + r * ldx;
        const float* up = gate + i;
        float* out = y + r * i;
        int64_t j = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
        for (; j + 16 <= i; j += 16) {
            const __m512 g = _mm512_loadu_ps(gate + j);
            const __m512 e = vexp_neg(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
            const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, zero, _CMP_GE_OQ), e, one);
            _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e))),
                                                    _mm512_loadu_ps(up + j)));
        }
#elif defined(__AVX2__)
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (; j + 8 <= i; j += 8) {
            const __m256 g = _mm256_loadu_ps(gate + j);
            const __m256 e = vexp_neg(_mm256_or_ps(g, sign));  // -|g|
            const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(one, e))),
                                                    _mm256_loadu_ps(up + j)));
        }
#endif
        for (; j < i; j++) out[j] = silu_scalar(gate[j]) * up[j];
    }
    return 0;
}
