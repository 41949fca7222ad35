// Weight-only int8 linear for decode: y[M, N] = (x[M, K] @ q^T) * scale[n] (+ bias), fp32 in/out.
//
// q: int8 [N, ldq] (K valid, K % 16 == 0), per-output-channel symmetric scales fp32 [N]. Rows of
// x are taken MB at a time so each weight row read from memory serves the whole tile (the
// lm_head's 49152 x 576 or x 2048 matrix is the largest read of a decode step). Threads
// (thread_pool.h) take contiguous slices of N; each output is computed as serially.
//
// The dot product is integer, as the int16 variant of kernels/csrc/int4_linear.cpp's: each row
// of x is first rounded to int16 with one fp32 scale (xq = round(x / dx), dx = max|x| / 32767),
// so that
//
//     y[r, n] = dx[r] * scale[n] * (q[n] . xq[r])
//
// kernels/quant_int8.py `reference` is that formula in torch. Why: with fp32 activations every
// weight was converted to float (two instructions per 16) and took one fma per row; at M = 8 the
// lm_head of a 1B model cost 2.5x its M = 1 time, compute-bound (measured). Here one vpmaddwd
// (vpdpwssd with VNNI) multiplies and pairs 32 weights of a row, and a weight load is one
// sign extension for the whole tile. int16 keeps x to 1 part in 65534 of its row's range, the
// accuracy of the int4 kernel's weight-only variant (not int8's 1 in 254: quality, README).
//
// Overflow: an int32 lane collects 2 products per 32 (AVX2: 16) weights, each |q xq| <= 127 *
// 32767 < 2^22, so a lane is exact over any KB = 2048 weights (<= 256 products < 2^30). The
// row's sum is kept in fp32 lanes, one conversion and add per KB weights and row; the order is
// fixed per row, so a row's result does not depend on its tile or the thread count.
#include "simd.h"
#include "thread_pool.h"

#if defined(__AVX512F__)
#define MB 8
#else
#define MB 4
#endif
#define KB 2048  // weights per int32 block (the overflow bound above)
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// x [M, ldx] fp32 -> xq [M, kq] int16 (kq >= k, the tail zero), dx [M]
static void quantize_rows_i16(const float* x, int64_t m, int64_t k, int64_t ldx, int16_t* xq, int64_t kq,
                              float* dx) {
    for (int64_t r = 0; r < m; r++) {
        const float* xr = x + r * ldx;
        int16_t* qr = xq + r * kq;
        const float amax = abs_max(xr, k);
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        int64_t i = 0;
#if defined(__AVX512F__)
        // cvtps rounds to nearest even, as lrintf does; |x * inv| <= 32767 never saturates.
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; i + 16 <= k; i += 16)
            _mm256_storeu_si256((__m256i*)(qr + i),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + i), vinv))));
#endif
        for (; i < k; i++) qr[i] = (int16_t)lrintf(xr[i] * inv);
        dx[r] = amax / 32767.f;
    }
}

// out[r] = q_row . xq[r] for the R rows of x at xq (stride kq), as a float.
template <int R>
static inline void row_tile(const int8_t* qr, int64_t k, const int16_t* xq, int64_t kq, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    constexpr int A = dot_chains(R);
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < k; b0 += KB) {
        const int64_t b1 = b0 + KB < k ? b0 + KB : k;
        // A independent chains per row (32 weights at a time, in turn), summed at the block's
        // end: exact, so nothing after depends on A (simd.h's dot_chains says why).
        __m512i dot[R][A];
        for (int r = 0; r < R; r++)
            for (int a = 0; a < A; a++) dot[r][a] = _mm512_setzero_si512();
        for (int64_t i0 = b0; i0 < b1; i0 += 32 * A) {
            for (int a = 0; a < A; a++) {
                const int64_t i = i0 + 32 * a;
                if (i >= b1) break;
                // The row's last 16 weights when K % 32 == 16: a masked load reads no byte past
                // it (xq's lanes there are zero either way).
                const __mmask32 keep = b1 - i >= 32 ? 0xffffffffu : 0x0000ffffu;
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(keep, qr + i));
                for (int r = 0; r < R; r++) {
                    const __m512i xv = _mm512_loadu_si512((const void*)(xq + r * kq + i));
#if defined(__AVX512VNNI__)
                    dot[r][a] = _mm512_dpwssd_epi32(dot[r][a], w, xv);
#else
                    dot[r][a] = _mm512_add_epi32(dot[r][a], _mm512_madd_epi16(w, xv));
#endif
                }
            }
        }
        for (int r = 0; r < R; r++) acc[r] = _mm512_add_ps(acc[r], _mm512_cvtepi32_ps(sum_chains<A>(dot[r])));
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < k; b0 += KB) {
        const int64_t b1 = b0 + KB < k ? b0 + KB : k;
        __m256i dot[R];
        for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
        for (int64_t i = b0; i < b1; i += 16) {
            const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(qr + i)));
            for (int r = 0; r < R; r++)
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i*)(xq + r * kq + i))));
        }
        for (int r = 0; r < R; r++) acc[r] = _mm256_add_ps(acc[r], _mm256_cvtepi32_ps(dot[r]));
    }
    for (int r = 0; r < R; r++) out[r] = vsum(acc[r]);  // simd.h's AVX2 reduction
#else
    for (int r = 0; r < R; r++) {
        float acc = 0.f;
        for (int64_t b0 = 0; b0 < k; b0 += KB) {
            const int64_t b1 = b0 + KB < k ? b0 + KB : k;
            int32_t dot = 0;
            for (int64_t i = b0; i < b1; i++) dot += (int32_t)qr[i] * xq[r * kq + i];
            acc += (float)dot;
        }
        out[r] = acc;
    }
#endif
}

// Output rows [j0, j1) of y: the serial kernel over a slice of N.
static void int8_rows(const int16_t* xq, const float* dx, int64_t m, int64_t k, int64_t kq, const int8_t* q,
                      int64_t ldq, const float* scales, const float* bias, float* y, int64_t ldy, int64_t j0,
                      int64_t j1) {
    float out[MB];
    const char* end = (const char*)(q + j1 * ldq);
    // n outermost: each weight row is read from memory once and serves every tile of x rows.
    for (int64_t j = j0; j < j1; j++) {
        const int8_t* qr = q + j * ldq;
        // Ahead of the hardware streamer, into every cache level, as int4_linear.cpp does (its
        // comment has the measurements); never past this thread's slice.
        for (int64_t off = 0; off < k; off += 64)
            if ((const char*)qr + PREFETCH_BYTES + off < end) __builtin_prefetch((const char*)qr + PREFETCH_BYTES + off, 0, 3);
        const float s = scales[j], b = bias ? bias[j] : 0.f;
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int16_t* xr = xq + m0 * kq;
            const int64_t r = m - m0 < MB ? m - m0 : MB;
            switch (r) {
                case 1: row_tile<1>(qr, k, xr, kq, out); break;
                case 2: row_tile<2>(qr, k, xr, kq, out); break;
                case 3: row_tile<3>(qr, k, xr, kq, out); break;
#if MB > 4
                case 4: row_tile<4>(qr, k, xr, kq, out); break;
                case 5: row_tile<5>(qr, k, xr, kq, out); break;
                case 6: row_tile<6>(qr, k, xr, kq, out); break;
                case 7: row_tile<7>(qr, k, xr, kq, out); break;
                default: row_tile<8>(qr, k, xr, kq, out); break;
#else
                default: row_tile<4>(qr, k, xr, kq, out); break;
#endif
            }
            for (int64_t i = 0; i < r; i++) y[(m0 + i) * ldy + j] = out[i] * (dx[m0 + i] * s) + b;
        }
    }
}

TANDEM_API int tandem_int8_linear(const float* x, int64_t m, int64_t k, int64_t ldx,
                                  const int8_t* q, int64_t n, int64_t ldq, const float* scales,
                                  const float* bias, float* y, int64_t ldy) {
    if (k % 16) return 1;
    if (m < 0 || n < 0) return 2;
    // Each row of xq is padded to 32 int16 (a 64-byte line): the AVX-512 loop reads 32 lanes at
    // a time and the lanes past K stay zero.
    const int64_t kq = (k + 31) / 32 * 32;
    const auto xq = aligned_zeros<int16_t>((size_t)(m * kq));
    const auto dx = aligned_zeros<float>((size_t)m);
    // x is rounded once, before the split: every thread reads the same xq and dx.
    quantize_rows_i16(x, m, k, ldx, xq.get(), kq, dx.get());
    // Threads take contiguous slices of N (16 rows at least: a 64-byte line of y per row of x);
    // each weight row is read once, by one thread.
    tandem::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
        int8_rows(xq.get(), dx.get(), m, k, kq, q, ldq, scales, bias, y, ldy, j0, j1);
    });
    return 0;
}
