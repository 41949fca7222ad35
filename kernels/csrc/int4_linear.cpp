// int4 linear for decode: y[M, N] = x[M, K] @ W^T (+ bias), fp32 in and out.
//
// W holds the values of ggml Q4_1 blocks (group 32) in three arrays:
//
//     qs [N, K/2]  uint8   the nibbles, in chunks of 16 groups (below)
//     d  [N, K/32] fp16    w[n, 32 g + i] = q_i * d[n, g] + m[n, g],   q_i in 0..15
//     m  [N, K/32] fp16
//
// In ggml's own block, byte i (0..15) of a group is q_i | q_{16+i} << 4. Here a row's groups
// are taken 16 at a time (a chunk of 256 bytes; the row's last chunk may hold C < 16 groups)
// and, within a chunk of C groups, that byte i = 2 t + b of group g sits at
//
//     qs[n, chunk start + 2 C t + 2 g + b]        t = 0..7, g = 0..C-1, b = 0..1
//
// (a transpose of 16-bit units: ggml's [group][t] becomes [t][group]). kernels/quant_int4.py
// packs and unpacks it; the bytes are the GGUF's, only their order differs. d and m keep group
// order.
//
// The dot product is integer: each row of x is first quantized to int16 with one fp32 scale
// (xq = round(x / dx), dx = max|x| / 32767), and each group's exact float sum S is kept, so that
//
//     y[r, n] = dx[r] * sum_g d_g * (q_g . xq[r, g])  +  sum_g m_g * S[r, g]
//
// Only x is rounded (to 1 part in 65534 of its row's range; the m term uses the exact sums);
// kernels/quant_int4.py `reference` is that formula in torch. Why integer: converting every
// 4-bit weight to float costs more instructions than the dot itself, while vpmaddwd multiplies
// and pairs 16 weights in one instruction. Why int16 and not llama.cpp's int8 activations
// (vpmaddubsw): int8 groups cost SmolLM2 +1.1% perplexity and 93% top-1 agreement with fp32;
// int16 keeps the weight-only figures.
//
// Why the chunk order: a group's integer dot must become a float once (its own d), and that
// conversion, not the multiply, was the per-row cost (vpmaddwd + cvtdq2ps + fma per 32 weights
// and row). With the transposed chunk, the 32 int16 lanes one 32-byte load unpacks to hold two
// weights of each of 16 groups, so each int32 lane of an accumulator collects one group's whole
// dot over 16 vpmaddwd (vpdpwssd with VNNI), and one cvtdq2ps + one fma per 16 groups and row
// scale all 16. |dot| <= 32 * 15 * 32767 < 2^24: the int32 sum and its float are exact, so
// the integer order (and VNNI or not) changes nothing.
//
// What bounds it (measured on a 2-core Sapphire Rapids class VM, shared, thread CPU time of one
// decode step's GEMVs of a random 1B LLaMA, 640 MB of weights, with a throw-away harness): the
// per-group layout took 155-194 ms at M = 1 and 373-414 ms at M = 8, this one 122-150 and
// 348-389. At M = 8 both are bound by the 512-bit integer multiplies, which the reorder does
// not reduce: one vpmaddwd (or vpdpwssd: no faster here) per 32 weights and row. Fewer
// needs int8 activations (vpdpbusd, 64 per instruction): a prototype with int8 per group took
// 253-286 ms at M = 8, at a quality cost not yet judged (above).
//
// xq is stored in the matching order (quantize_rows), per row KQ = 512 * chunks int16, a tail
// chunk zero-padded; for chunk c and load t, 32 lanes at 512 c + 64 t hold x_{g, 2t+b} and the
// next 32 x_{g, 16+2t+b}, lane 2 g + b. AVX2 reads each 32 lanes as two halves of 8 groups.
//
// Batch invariance: a row of x goes through the same instructions in the same order whatever
// tile (MB rows) it falls in and whatever the thread count: integer sums are exact, and the
// float ones (one fma per chunk into a per-row accumulator, then one reduction) do not depend
// on the other rows.
//
// Loop order: n outermost, so each weight row is read from memory once whatever M is (with a
// software prefetch ahead of it); within a row, tiles of up to MB rows of x share each unpacked
// load. With more than one thread (thread_pool.h) each thread takes contiguous slices of N:
// still one read of each weight row, and each output computed exactly as serially.
#include <vector>

#include "simd.h"
#include "thread_pool.h"

#define MB 8  // rows of x per tile: 8 int32 + 8 float accumulators + weights fit in 32 zmm
#define CHUNK_GROUPS 16
#define CHUNK_BYTES 256  // 16 groups of 32 nibbles
#define CHUNK_XQ 512     // int16 of x per chunk
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// Where element i of local group g (0..15) of a chunk sits in that chunk's 512 xq lanes.
static inline int xq_lane(int g, int i) {
    const int s = i >= 16, e = i - 16 * s;  // s: high nibble; e = 2 t + b
    return 64 * (e >> 1) + 32 * s + 2 * g + (e & 1);
}

// x [M, ldx] fp32 -> xq [M, kq] int16 (chunk order, zero-padded), dx [M], sums [M, G]
static void quantize_rows(const float* x, int64_t m, int64_t k, int64_t ldx, int16_t* xq, int64_t kq,
                          float* dx, float* sums) {
    const int64_t groups = k / 32;
    for (int64_t r = 0; r < m; r++) {
        const float* xr = x + r * ldx;
        float amax = 0.f;
        for (int64_t i = 0; i < k; i++) amax = fabsf(xr[i]) > amax ? fabsf(xr[i]) : amax;
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        int16_t* qr = xq + r * kq;
        memset(qr, 0, (size_t)kq * sizeof(int16_t));
        for (int64_t g = 0; g < groups; g++) {
            const float* xg = xr + g * 32;
            int16_t* qc = qr + (g / CHUNK_GROUPS) * CHUNK_XQ;
            const int gl = (int)(g % CHUNK_GROUPS);
            float sum = 0.f;
            for (int i = 0; i < 32; i++) {
                sum += xg[i];
                qc[xq_lane(gl, i)] = (int16_t)lrintf(xg[i] * inv);
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

// out[r] = sum_g d_g * (q_g . xq[r, g]) over the row's chunks. chunk(c): the 256 bytes of
// chunk c in the full-chunk order (the tail is passed zero-padded); d: per group, zero-padded
// to whole chunks.
template <int R, class ChunkPtr>
static inline void row_tile(const ChunkPtr& chunk, const float* d, int64_t chunks, const int16_t* xq,
                            int64_t kq, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi16(0x000f);
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* w = chunk(c);
        const int16_t* xc = xq + c * CHUNK_XQ;
        __m512i dot[R];
        for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
        for (int t = 0; t < 8; t++) {
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + 32 * t)));
            const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_srli_epi16(v, 4);
            for (int r = 0; r < R; r++) {
                const int16_t* xt = xc + r * kq + 64 * t;
#if defined(__AVX512VNNI__)
                dot[r] = _mm512_dpwssd_epi32(dot[r], lo, _mm512_loadu_si512((const void*)xt));
                dot[r] = _mm512_dpwssd_epi32(dot[r], hi, _mm512_loadu_si512((const void*)(xt + 32)));
#else
                dot[r] = _mm512_add_epi32(dot[r], _mm512_madd_epi16(lo, _mm512_loadu_si512((const void*)xt)));
                dot[r] = _mm512_add_epi32(dot[r], _mm512_madd_epi16(hi, _mm512_loadu_si512((const void*)(xt + 32))));
#endif
            }
        }
        const __m512 vd = _mm512_loadu_ps(d + c * CHUNK_GROUPS);  // lane g: group g's d
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), vd, acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi16(0x000f);
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* w = chunk(c);
        for (int h = 0; h < 2; h++) {  // groups 8 h .. 8 h + 7
            const int16_t* xc = xq + c * CHUNK_XQ + 16 * h;
            __m256i dot[R];
            for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + 32 * t + 16 * h)));
                const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_srli_epi16(v, 4);
                for (int r = 0; r < R; r++) {
                    const int16_t* xt = xc + r * kq + 64 * t;
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_add_epi32(
                        _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)xt)),
                        _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)(xt + 32)))));
                }
            }
            const __m256 vd = _mm256_loadu_ps(d + c * CHUNK_GROUPS + 8 * h);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), vd, acc[r]);
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
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* w = chunk(c);
        for (int g = 0; g < CHUNK_GROUPS; g++) {
            for (int r = 0; r < R; r++) {
                const int16_t* xc = xq + r * kq + c * CHUNK_XQ;
                int32_t dot = 0;
                for (int t = 0; t < 8; t++)
                    for (int b = 0; b < 2; b++) {
                        const uint8_t byte = w[32 * t + 2 * g + b];
                        const int lane = 64 * t + 2 * g + b;
                        dot += (byte & 0x0f) * xc[lane] + (byte >> 4) * xc[lane + 32];
                    }
                out[r] += d[c * CHUNK_GROUPS + g] * (float)dot;
            }
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
static void int4_rows(const int16_t* xq, int64_t kq, const float* dx, const float* sums, int64_t m,
                      int64_t k, const uint8_t* qs, const uint16_t* d16, const uint16_t* m16, int64_t n,
                      const float* bias, float* y, int64_t ldy, int64_t j0, int64_t j1) {
    const int64_t groups = k / 32, row_bytes = k / 2;
    const int64_t full = groups / CHUNK_GROUPS, tail = groups % CHUNK_GROUPS;
    const int64_t chunks = full + (tail > 0);
    std::vector<float> d((size_t)(chunks * CHUNK_GROUPS), 0.f), mn((size_t)groups);
    alignas(64) uint8_t tail_chunk[CHUNK_BYTES] = {0};  // groups >= tail stay 0 (q = 0, d = 0)
    const char* end = (const char*)(qs + n * row_bytes);
    float out[MB];
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t* row = qs + j * row_bytes;
        // The hardware streamer alone kept one core at ~3 GB/s from memory here (measured).
        for (int64_t off = 0; off < row_bytes; off += 64)
            if ((const char*)row + PREFETCH_BYTES + off < end) __builtin_prefetch((const char*)row + PREFETCH_BYTES + off, 0, 0);
        fp16_row_to_float(d16 + j * groups, groups, d.data());
        fp16_row_to_float(m16 + j * groups, groups, mn.data());
        if (tail)  // the tail chunk's 2 C bytes per t, spread to the full chunk's 32
            for (int t = 0; t < 8; t++)
                memcpy(tail_chunk + 32 * t, row + full * CHUNK_BYTES + 2 * tail * t, (size_t)(2 * tail));
        const auto chunk = [&](int64_t c) { return c < full ? row + c * CHUNK_BYTES : tail_chunk; };
        const float b = bias ? bias[j] : 0.f;
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int64_t r = m - m0 < MB ? m - m0 : MB;
            const int16_t* xr = xq + m0 * kq;
            switch (r) {
                case 1: row_tile<1>(chunk, d.data(), chunks, xr, kq, out); break;
                case 2: row_tile<2>(chunk, d.data(), chunks, xr, kq, out); break;
                case 3: row_tile<3>(chunk, d.data(), chunks, xr, kq, out); break;
                case 4: row_tile<4>(chunk, d.data(), chunks, xr, kq, out); break;
                case 5: row_tile<5>(chunk, d.data(), chunks, xr, kq, out); break;
                case 6: row_tile<6>(chunk, d.data(), chunks, xr, kq, out); break;
                case 7: row_tile<7>(chunk, d.data(), chunks, xr, kq, out); break;
                default: row_tile<8>(chunk, d.data(), chunks, xr, kq, out); break;
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
    const int64_t kq = (groups + CHUNK_GROUPS - 1) / CHUNK_GROUPS * CHUNK_XQ;
    std::vector<int16_t> xq((size_t)(m * kq));
    std::vector<float> dx((size_t)m), sums((size_t)(m * groups));
    // x is quantized once, before the split: every thread reads the same xq, dx and sums.
    quantize_rows(x, m, k, ldx, xq.data(), kq, dx.data(), sums.data());
    // Threads take contiguous slices of N (16 rows at least: a 64-byte line of y per row of x),
    // so each weight row is still read from memory once, by one thread.
    tandem::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
        int4_rows(xq.data(), kq, dx.data(), sums.data(), m, k, qs, d16, m16, n, bias, y, ldy, j0, j1);
    });
    return 0;
}
