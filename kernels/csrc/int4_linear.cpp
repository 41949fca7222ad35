// int4 linear for decode: y[M, N] = x[M, K] @ W^T (+ bias), fp32 in and out.
//
// W is stored as ggml Q4_1 blocks, row after row: row n holds K / 32 blocks of 20 bytes
//
//     [ d: fp16 | m: fp16 | qs: 16 bytes ]     w[n, 32 g + i] = q_i * d + m,  q_i in 0..15
//     qs byte i = q_i | q_{16 + i} << 4
//
// which is the GGUF's own Q4_1 block, so a Q4_1 model is used as stored (Q4_0 maps to it with
// m = -8 d exactly).
//
// The dot product is integer: each row of x is first quantized to int16 with one fp32 scale
// (xq = round(x / dx), dx = max|x| / 32767), and each group's exact float sum S is kept, so that
//
//     y[r, n] = dx[r] * sum_g d_g * (q_g . xq[r, g])  +  sum_g m_g * S[r, g]
//
// Only x is rounded (to 1 part in 65534 of its row's range; the m term uses the exact sums);
// kernels/quant_int4.py `reference` is that formula in torch. Why integer: converting every
// 4-bit weight to float costs more instructions than the dot itself (the float version of this
// kernel read 6-7 GB/s, compute-bound), while vpmaddwd multiplies and pairs 16 weights in one
// instruction. Why int16 and not llama.cpp's int8 activations (vpmaddubsw, 32 per instruction):
// int8 groups cost SmolLM2 +1.1% perplexity and 93% top-1 agreement with fp32; int16 keeps the
// weight-only figures. One scale per row rather than per group takes a multiply and a
// broadcast per row and group out of the inner loop (m = 8: -25% time, measured).
// 256-bit vectors even on AVX-512 builds: a zmm version (one group per vpmaddwd) measured
// 20-30% slower on a Sapphire Rapids host.
//
// Loop order: n outermost, so each weight row is read from memory once whatever M is; within
// a row, tiles of up to MB rows of x share each unpacked group.
#include <vector>

#include "simd.h"

#define MB 8  // rows of x per tile: 8 accumulators + 2 weight vectors fit in 16 ymm
static const int BLOCK_BYTES = 20;
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// x [M, ldx] fp32 -> xq [M, K] int16, dx [M], sums [M, G]
static void quantize_rows(const float* x, int64_t m, int64_t k, int64_t ldx, int16_t* xq, float* dx,
                          float* sums) {
    const int64_t groups = k / 32;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float* xg = x + r * ldx + g * 32;
            float sum = 0.f;
            for (int i = 0; i < 32; i++) sum += xg[i];
            sums[r * groups + g] = sum;
        }
        float amax = 0.f;
        for (int64_t i = 0; i < k; i++) amax = fabsf(x[r * ldx + i]) > amax ? fabsf(x[r * ldx + i]) : amax;
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        for (int64_t i = 0; i < k; i++) xq[r * k + i] = (int16_t)nearbyintf(x[r * ldx + i] * inv);
        dx[r] = amax / 32767.f;
    }
}

#if defined(__AVX2__)
// 32 nibbles of one block as two vectors of 16 int16: lo = elements 0..15, hi = 16..31.
static inline void unpack_nibbles(const uint8_t* qs, __m256i* lo, __m256i* hi) {
    const __m128i b = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(0x0f);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(b, mask));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
}
#endif

template <int R>
static inline void row_tile(const uint8_t* wrow, int64_t groups, const int16_t* xq, int64_t k,
                            const float* dx, const float* sums, float* out) {
#if defined(__AVX2__)
    __m256 acc[R];
    float macc[R];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.f; }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t* blk = wrow + g * BLOCK_BYTES;
        uint16_t dh, mh;
        memcpy(&dh, blk, 2);
        memcpy(&mh, blk + 2, 2);
        const float d = fp16_to_float(dh), mn = fp16_to_float(mh);
        __m256i qlo, qhi;
        unpack_nibbles(blk + 4, &qlo, &qhi);
        const __m256 vd = _mm256_set1_ps(d);
        for (int r = 0; r < R; r++) {
            const int16_t* xg = xq + r * k + g * 32;
            // Each int32 lane sums 4 products of at most 15 * 32767: no overflow.
            const __m256i p = _mm256_add_epi32(
                _mm256_madd_epi16(qlo, _mm256_loadu_si256((const __m256i*)xg)),
                _mm256_madd_epi16(qhi, _mm256_loadu_si256((const __m256i*)(xg + 16))));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), vd, acc[r]);
            macc[r] += mn * sums[r * groups + g];
        }
    }
    for (int r = 0; r < R; r++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[r] = _mm_cvtss_f32(s) * dx[r] + macc[r];
    }
#else
    float macc[R];
    for (int r = 0; r < R; r++) out[r] = macc[r] = 0.f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t* blk = wrow + g * BLOCK_BYTES;
        uint16_t dh, mh;
        memcpy(&dh, blk, 2);
        memcpy(&mh, blk + 2, 2);
        const float d = fp16_to_float(dh), mn = fp16_to_float(mh);
        for (int r = 0; r < R; r++) {
            const int16_t* xg = xq + r * k + g * 32;
            int32_t dot = 0;
            for (int i = 0; i < 16; i++) dot += (blk[4 + i] & 0x0f) * xg[i] + (blk[4 + i] >> 4) * xg[16 + i];
            out[r] += d * (float)dot;
            macc[r] += mn * sums[r * groups + g];
        }
    }
    for (int r = 0; r < R; r++) out[r] = out[r] * dx[r] + macc[r];
#endif
}

TANDEM_API int tandem_int4_linear(const float* x, int64_t m, int64_t k, int64_t ldx,
                                  const uint8_t* w, int64_t n, const float* bias,
                                  float* y, int64_t ldy) {
    if (k % 32) return 1;
    const int64_t groups = k / 32;
    std::vector<int16_t> xq((size_t)(m * k));
    std::vector<float> dx((size_t)m), sums((size_t)(m * groups));
    quantize_rows(x, m, k, ldx, xq.data(), dx.data(), sums.data());
    float out[MB];
    const int64_t row_bytes = groups * BLOCK_BYTES;
    for (int64_t j = 0; j < n; j++) {
        const uint8_t* wrow = w + j * row_bytes;
        const float b = bias ? bias[j] : 0.f;
        // Software prefetch PREFETCH_BYTES ahead: the hardware streamer alone kept one core at
        // ~3 GB/s from memory on this access pattern (measured; 10+ GB/s with it).
        if (j + 1 < n) {
            const char* ahead = (const char*)wrow + PREFETCH_BYTES;
            const char* end = (const char*)(w + n * row_bytes);
            for (int64_t off = 0; off < row_bytes; off += 64)
                if (ahead + off < end) __builtin_prefetch(ahead + off, 0, 0);
        }
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int64_t r = m - m0 < MB ? m - m0 : MB;
            const int16_t* xr = xq.data() + m0 * k;
            const float* dr = dx.data() + m0;
            const float* sr = sums.data() + m0 * groups;
            switch (r) {
                case 1: row_tile<1>(wrow, groups, xr, k, dr, sr, out); break;
                case 2: row_tile<2>(wrow, groups, xr, k, dr, sr, out); break;
                case 3: row_tile<3>(wrow, groups, xr, k, dr, sr, out); break;
                case 4: row_tile<4>(wrow, groups, xr, k, dr, sr, out); break;
                case 5: row_tile<5>(wrow, groups, xr, k, dr, sr, out); break;
                case 6: row_tile<6>(wrow, groups, xr, k, dr, sr, out); break;
                case 7: row_tile<7>(wrow, groups, xr, k, dr, sr, out); break;
                case 8: row_tile<8>(wrow, groups, xr, k, dr, sr, out); break;
                default: return 2;
            }
            for (int64_t i = 0; i < r; i++) y[(m0 + i) * ldy + j] = out[i] + b;
        }
    }
    return 0;
}
