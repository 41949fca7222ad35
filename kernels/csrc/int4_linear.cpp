// int4 linear for decode: y[M, N] = x[M, K] @ W^T (+ bias), fp32 in and out.
//
// W holds the values of ggml Q4_1 blocks (group 32) in three arrays:
//
//     qs [N, K/2]  uint8   group g of row n at qs[n, 16 g .. 16 g + 16): byte i = q_i | q_{16+i} << 4
//     d  [N, K/32] fp16    w[n, 32 g + i] = q_i * d[n, g] + m[n, g],   q_i in 0..15
//     m  [N, K/32] fp16
//
// A Q4_1 GGUF is split into them byte for byte (Q4_0 with m = -8 d, exact); the bytes are the
// GGUF's (20 per 32 weights). Split rather than interleaved so that a row's d and m convert to
// fp32 eight at a time and the m term becomes one short dot product per row.
//
// The dot product is integer: each row of x is first quantized to int16 with one fp32 scale
// (xq = round(x / dx), dx = max|x| / 32767), and each group's exact float sum S is kept, so that
//
//     y[r, n] = dx[r] * sum_g d_g * (q_g . xq[r, g])  +  sum_g m_g * S[r, g]
//
// Only x is rounded (to 1 part in 65534 of its row's range; the m term uses the exact sums);
// kernels/quant_int4.py `reference` is that formula in torch. Why integer: converting every
// 4-bit weight to float costs more instructions than the dot itself (a float version of this
// kernel read 6-7 GB/s, compute-bound), while vpmaddwd multiplies and pairs 16 weights in one
// instruction. Why int16 and not llama.cpp's int8 activations (vpmaddubsw): int8 groups cost
// SmolLM2 +1.1% perplexity and 93% top-1 agreement with fp32; int16 keeps the weight-only
// figures. One scale per row rather than per group keeps a multiply and a broadcast per row
// and group out of the inner loop (-25% at 8 rows, measured).
//
// Nibbles are unpacked without shuffles: the 16 bytes of a group are broadcast to both halves
// of a ymm, and two variable shifts + masks leave, per 16-bit lane,
//
//     lo: half 0 lane w = q_{2w},     half 1 lane w = q_{16+2w}       (w = 0..7)
//     hi: half 0 lane w = q_{2w+1},   half 1 lane w = q_{17+2w}
//
// and xq is stored once per call in that same lane order (quantize_rows), so vpmaddwd pairs
// every weight with its own activation.
//
// Loop order: n outermost, so each weight row is read from memory once whatever M is (with a
// software prefetch ahead of it); within a row, tiles of up to MB rows of x share each unpacked
// group. With more than one thread (thread_pool.h) each thread takes contiguous slices of N:
// still one read of each weight row, and each output computed exactly as serially.
#include <vector>

#include "simd.h"
#include "thread_pool.h"

#define MB 8  // rows of x per tile: 8 accumulators + 2 weight vectors fit in 16 ymm
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// Where element i of a 32-group sits in xq (see the lane order above).
static inline int lane_of(int i) {
#if defined(__AVX2__)  // also the AVX-512 order
    const int hi_nibble = i >= 16, j = i - 16 * hi_nibble;  // j: byte index, 0..15
    return 16 * (j & 1) + 8 * hi_nibble + (j >> 1);
#else
    return i;
#endif
}

// x [M, ldx] fp32 -> xq [M, K] int16 (lane order), dx [M], sums [M, G]
static void quantize_rows(const float* x, int64_t m, int64_t k, int64_t ldx, int16_t* xq, float* dx,
                          float* sums) {
    const int64_t groups = k / 32;
    int lanes[32];
    for (int i = 0; i < 32; i++) lanes[i] = lane_of(i);
    for (int64_t r = 0; r < m; r++) {
        const float* xr = x + r * ldx;
        float amax = 0.f;
        for (int64_t i = 0; i < k; i++) amax = fabsf(xr[i]) > amax ? fabsf(xr[i]) : amax;
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        for (int64_t g = 0; g < groups; g++) {
            const float* xg = xr + g * 32;
            int16_t* qg = xq + r * k + g * 32;
            float sum = 0.f;
            for (int i = 0; i < 32; i++) {
                sum += xg[i];
                qg[lanes[i]] = (int16_t)lrintf(xg[i] * inv);
            }
            sums[r * groups + g] = sum;
        }
        dx[r] = amax / 32767.f;
    }
}

static inline void fp16_row_to_float(const uint16_t* h, int64_t n, float* out) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
#endif
    for (; i < n; i++) out[i] = fp16_to_float(h[i]);
}

template <int R>
static inline void row_tile(const uint8_t* qs, const float* d, int64_t groups, const int16_t* xq,
                            int64_t k, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // The whole group in one zmm of 32 int16: the 16 bytes broadcast to four 128-bit lanes,
    // shifted by 0, 4, 8, 12 and masked: lanes 0-7 q_{2w}, 8-15 q_{16+2w}, 16-23 q_{2w+1},
    // 24-31 q_{17+2w}, the same order as the two ymm halves below (lane_of).
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi32(0x000f000f);
    const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    for (int64_t g = 0; g < groups; g++) {
        const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(qs + g * 16)));
        const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(v, shifts), mask);
        const __m512 vd = _mm512_set1_ps(d[g]);
        for (int r = 0; r < R; r++) {
            const __m512i p = _mm512_madd_epi16(q, _mm512_loadu_si512((const void*)(xq + r * k + g * 32)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), vd, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi32(0x000f000f);
    const __m256i shift_lo = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    const __m256i shift_hi = _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12);
    for (int64_t g = 0; g < groups; g++) {
        const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(qs + g * 16)));
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(v, shift_lo), mask);
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(v, shift_hi), mask);
        const __m256 vd = _mm256_broadcast_ss(d + g);
        for (int r = 0; r < R; r++) {
            const int16_t* xg = xq + r * k + g * 32;
            // Each int32 lane sums 4 products of at most 15 * 32767: no overflow.
            const __m256i p = _mm256_add_epi32(
                _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)xg)),
                _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)(xg + 16))));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), vd, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[r] = _mm_cvtss_f32(s);
    }
#else
    for (int r = 0; r < R; r++) out[r] = 0.f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t* b = qs + g * 16;
        for (int r = 0; r < R; r++) {
            const int16_t* xg = xq + r * k + g * 32;
            int32_t dot = 0;
            for (int i = 0; i < 16; i++) dot += (b[i] & 0x0f) * xg[i] + (b[i] >> 4) * xg[16 + i];
            out[r] += d[g] * (float)dot;
        }
    }
#endif
}

static inline float dot_f32(const float* a, const float* b, int64_t n) {
    vf acc = vzero();
    int64_t i = 0;
    for (; i + TANDEM_VL <= n; i += TANDEM_VL) acc = vfma(vload(a + i), vload(b + i), acc);
    float s = vsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

// Output rows [j0, j1) of y from the quantized activations: the serial kernel over a slice of N.
static void int4_rows(const int16_t* xq, const float* dx, const float* sums, int64_t m, int64_t k,
                      const uint8_t* qs, const uint16_t* d16, const uint16_t* m16, int64_t n,
                      const float* bias, float* y, int64_t ldy, int64_t j0, int64_t j1) {
    const int64_t groups = k / 32, row_bytes = k / 2;
    std::vector<float> d((size_t)groups), mn((size_t)groups);
    const char* end = (const char*)(qs + n * row_bytes);
    float out[MB];
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t* row = qs + j * row_bytes;
        // The hardware streamer alone kept one core at ~3 GB/s from memory here (measured).
        for (int64_t off = 0; off < row_bytes; off += 64)
            if ((const char*)row + PREFETCH_BYTES + off < end) __builtin_prefetch((const char*)row + PREFETCH_BYTES + off, 0, 0);
        fp16_row_to_float(d16 + j * groups, groups, d.data());
        fp16_row_to_float(m16 + j * groups, groups, mn.data());
        const float b = bias ? bias[j] : 0.f;
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int64_t r = m - m0 < MB ? m - m0 : MB;
            const int16_t* xr = xq + m0 * k;
            switch (r) {
                case 1: row_tile<1>(row, d.data(), groups, xr, k, out); break;
                case 2: row_tile<2>(row, d.data(), groups, xr, k, out); break;
                case 3: row_tile<3>(row, d.data(), groups, xr, k, out); break;
                case 4: row_tile<4>(row, d.data(), groups, xr, k, out); break;
                case 5: row_tile<5>(row, d.data(), groups, xr, k, out); break;
                case 6: row_tile<6>(row, d.data(), groups, xr, k, out); break;
                case 7: row_tile<7>(row, d.data(), groups, xr, k, out); break;
                default: row_tile<8>(row, d.data(), groups, xr, k, out); break;
            }
            for (int64_t i = 0; i < r; i++)
                y[(m0 + i) * ldy + j] = out[i] * dx[m0 + i] + dot_f32(mn.data(), sums + (m0 + i) * groups, groups) + b;
        }
    }
}

TANDEM_API int tandem_int4_linear(const float* x, int64_t m, int64_t k, int64_t ldx,
                                  const uint8_t* qs, const uint16_t* d16, const uint16_t* m16,
                                  int64_t n, const float* bias, float* y, int64_t ldy) {
    if (k % 32) return 1;
    if (m < 0 || n < 0) return 2;
    const int64_t groups = k / 32;
    std::vector<int16_t> xq((size_t)(m * k));
    std::vector<float> dx((size_t)m), sums((size_t)(m * groups));
    // x is quantized once, before the split: every thread reads the same xq, dx and sums.
    quantize_rows(x, m, k, ldx, xq.data(), dx.data(), sums.data());
    // Threads take contiguous slices of N (16 rows at least: a 64-byte line of y per row of x),
    // so each weight row is still read from memory once, by one thread.
    tandem::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
        int4_rows(xq.data(), dx.data(), sums.data(), m, k, qs, d16, m16, n, bias, y, ldy, j0, j1);
    });
    return 0;
}
