// Weight-only int8 linear for decode: y[M, N] = (x[M, K] @ q^T) * scale[n] (+ bias), fp32 in/out.
//
// q: int8 [N, ldq] (K valid, K % VL == 0), per-output-channel symmetric scales fp32 [N]. The
// scale is applied once per output after the dot product, so the inner loop is int8 -> float
// and one FMA per weight. Rows of x are taken MB at a time so each weight row read from memory
// serves the whole tile (the lm_head's 49152 x 576 matrix is the largest read of a decode step).
// Threads (thread_pool.h) take contiguous slices of N; each output is computed as serially.
#include "simd.h"
#include "thread_pool.h"

#if defined(__AVX512F__)
#define MB 8
#else
#define MB 4
#endif

template <int R>
static inline void row_tile(const int8_t* qr, int64_t k, const float* x, int64_t ldx, float* out) {
    vf acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = vzero();
    int64_t i = 0;
    for (; i + 2 * TANDEM_VL <= k; i += 2 * TANDEM_VL) {
        const vf w0 = vload_i8(qr + i), w1 = vload_i8(qr + i + TANDEM_VL);
        for (int r = 0; r < R; r++) {
            acc[r][0] = vfma(w0, vload(x + r * ldx + i), acc[r][0]);
            acc[r][1] = vfma(w1, vload(x + r * ldx + i + TANDEM_VL), acc[r][1]);
        }
    }
    for (; i < k; i += TANDEM_VL) {
        const vf w0 = vload_i8(qr + i);
        for (int r = 0; r < R; r++) acc[r][0] = vfma(w0, vload(x + r * ldx + i), acc[r][0]);
    }
    for (int r = 0; r < R; r++) out[r] = vsum(vadd(acc[r][0], acc[r][1]));
}

// Output rows [j0, j1) of y: the serial kernel over a slice of N.
static void int8_rows(const float* x, int64_t m, int64_t k, int64_t ldx, const int8_t* q, int64_t ldq,
                      const float* scales, const float* bias, float* y, int64_t ldy, int64_t j0, int64_t j1) {
    float out[MB];
    // n outermost: each weight row is read from memory once and serves every tile of x rows.
    for (int64_t j = j0; j < j1; j++) {
        const int8_t* qr = q + j * ldq;
        const float s = scales[j], b = bias ? bias[j] : 0.f;
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const float* xr = x + m0 * ldx;
            const int64_t r = m - m0 < MB ? m - m0 : MB;
            switch (r) {
                case 1: row_tile<1>(qr, k, xr, ldx, out); break;
                case 2: row_tile<2>(qr, k, xr, ldx, out); break;
                case 3: row_tile<3>(qr, k, xr, ldx, out); break;
#if MB > 4
                case 4: row_tile<4>(qr, k, xr, ldx, out); break;
                case 5: row_tile<5>(qr, k, xr, ldx, out); break;
                case 6: row_tile<6>(qr, k, xr, ldx, out); break;
                case 7: row_tile<7>(qr, k, xr, ldx, out); break;
                default: row_tile<8>(qr, k, xr, ldx, out); break;
#else
                default: row_tile<4>(qr, k, xr, ldx, out); break;
#endif
            }
            for (int64_t i = 0; i < r; i++) y[(m0 + i) * ldy + j] = out[i] * s + b;
        }
    }
}

TANDEM_API int tandem_int8_linear(const float* x, int64_t m, int64_t k, int64_t ldx,
                                  const int8_t* q, int64_t n, int64_t ldq, const float* scales,
                                  const float* bias, float* y, int64_t ldy) {
    if (k % TANDEM_VL) return 1;
    if (m < 0 || n < 0) return 2;
    // Threads take contiguous slices of N (16 rows at least: a 64-byte line of y per row of x);
    // each weight row is read once, by one thread.
    tandem::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
        int8_rows(x, m, k, ldx, q, ldq, scales, bias, y, ldy, j0, j1);
    });
    return 0;
}
