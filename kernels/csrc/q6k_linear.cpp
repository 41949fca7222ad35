// Q6_K linear for decode: y[M, N] = x[M, K] @ W^T (+ bias), fp32 in and out, W the ggml Q6_K
// blocks of a GGUF (llama.cpp keeps the lm_head, and in Q4_K_M half of ffn_down and attn_v, in
// Q6_K). The bytes are the file's, reordered at load (kernels/quant_q6_k.py `pack`), so a
// decode step reads 6.5625 bits a weight, and the weights are exactly the file's. The same
// tiles read Q8_0 and Q5_K blocks (below the Q6_K description): one template over the three.
//
// A super-block holds 256 weights of a row: 16 sub-blocks g of 16, each with an int8 scale,
// one fp16 d, and 6-bit q (0..63):
//
//     w[16 g + e] = (d * sc[g]) * (q[g][e] - 32)
//
// Per super-block the kernel reads 192 bytes, in runs of 32 that the unpack below turns into
// int16 vectors of 32 lanes, lane L = 2 g + b holding element e = 2 v + b of sub-block g for
// vector v = 0..7 (so vpmaddwd / vpdpwssd sums one sub-block's pair into int32 lane g, and eight
// of them its whole dot: one float step per 256 weights and row, as int4_linear.cpp's chunk
// order does per 512):
//
//     bytes 0..127   run t = 0..3: byte L's low nibble is the low 4 bits of vector 2 t's
//                    lane L, its high nibble those of vector 2 t + 1
//     bytes 128..191 run s = 0..1: bits 2 k, 2 k + 1 of byte L are the high 2 bits of vector
//                    4 s + k's lane L
//
// beside sc int8 [N, K / 16] and d fp16 [N, K / 256]. x is rounded to int16 per row (as the
// int4 and int8 kernels do: xq = round(x / dx), dx = max|x| / 32767), stored in the same lane
// order per super-block, with XS[g] = the sum of sub-block g's xq, so that
//
//     y[r, n] = dx[r] * sum_c sum_g (d_c * sc[c, g]) * (q[c, g] . xq[r, c, g] - 32 XS[r, c, g])
//
// kernels/quant_int8.py `q6_k_reference` is that formula in torch. Exactness: |q . xq| <=
// 16 * 63 * 32767 < 2^31 and |q . xq - 32 XS| <= 16 * 32 * 32767 < 2^24, so the integer dot,
// the offset and their float are exact; d * sc is exact in fp32 (11 by 8 significant bits).
// The per-row float sums run in a fixed order, one fma per super-block and row, so a row's
// result does not depend on its tile or the thread count (batch invariance).
//
// Unpack cost per 64 weights: a zero-extension, an and, a shift, two shifts of the high bits
// and two or-with-mask (vpternlogd), against int4_linear.cpp's three: shared by the tile's rows.
//
// Q8_0 (tandem_q8_0_linear) runs the same tiles: its blocks of 32 int8 q with an fp16 d each
// (w = d * q) are stored per 256 weights as 8 runs of 32 bytes, run v's byte L being vector v's
// lane L in the order above (sub-blocks of 16, two to a Q8_0 block, share its d), so the unpack
// is one sign extension per 32 weights, d * sc becomes the block's d, and there is no offset:
//
//     y[r, n] = dx[r] * sum_c sum_g d[c, g / 2] * (q[c, g] . xq[r, c, g])
//
// |q . xq| <= 16 * 128 * 32767 < 2^27 is exact as an integer but rounds when converted to
// fp32 (24 bits): the same rounding on every path, so results stay tile- and thread-invariant;
// `kernels/quant_q8_0.py reference` computes the exact sum and tests compare within fp32 error.
//
// Q5_K (tandem_q5k_linear) keeps its 5-bit q (0..31) in the Q6_K byte order (the sixth bit
// zero: 6 bits stored where the file has 5, against 8 for the int8 format's requantization),
// and its sub-blocks of 32 have a 6-bit scale and min each under the super-block's fp16 d and
// dmin (w = d sc q - dmin m), so each sub-block of 16 takes its pair's d * sc and dmin * m and
// the offset is a float term:
//
//     y[r, n] = dx[r] * sum_c sum_g ((d sc)[c, g / 2] * (q[c, g] . xq[r, c, g])
//                                   - (dmin m)[c, g / 2] * XS[r, c, g])
//
// exact in its integers (|q . xq| <= 16 * 31 * 32767 < 2^24, |XS| < 2^24) and products (11 by
// 6 bits), rounded in the two fmas a super-block and row, in a fixed order.
#include "simd.h"
#include "thread_pool.h"

#define MB 8  // rows of x per tile
#define SB_WEIGHTS 256
#define SB_BYTES 192  // 128 bytes of low nibbles, 64 of high bit pairs
#define Q8_SB_BYTES 256  // Q8_0: one int8 q per weight

enum class Blocks { Q6K, Q8_0, Q5K };

template <Blocks F>
constexpr int64_t sb_bytes() { return F == Blocks::Q8_0 ? Q8_SB_BYTES : SB_BYTES; }
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// Where element e (0..15) of sub-block g (0..15) sits among a super-block's 256 xq lanes.
static inline int xq6_lane(int g, int e) { return 32 * (e >> 1) + 2 * g + (e & 1); }

// x [M, ldx] fp32 -> xq [M, k] int16 (super-block lane order), dx [M], xs [M, k / 16] int32
static void quantize_rows_q6(const float* x, int64_t m, int64_t k, int64_t ldx, int16_t* xq, float* dx,
                             int32_t* xs) {
    const int64_t subs = k / 16;
    for (int64_t r = 0; r < m; r++) {
        const float* xr = x + r * ldx;
        const float amax = abs_max(xr, k);
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        int16_t* qr = xq + r * k;
        for (int64_t s = 0; s < subs; s++) {
            const int64_t c = s / 16;
            const int g = (int)(s % 16);
            int16_t* qc = qr + c * SB_WEIGHTS;
            int32_t sum = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            // cvtps rounds to nearest even, as lrintf does; |x * inv| <= 32767 never saturates.
            alignas(32) int32_t pairs[8];  // pair v: elements 2 v, 2 v + 1 as one 32-bit unit
            const __m256i v16 = _mm512_cvtsepi32_epi16(
                _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + 16 * s), _mm512_set1_ps(inv))));
            _mm256_store_si256((__m256i*)pairs, v16);
            for (int v = 0; v < 8; v++) memcpy(qc + 32 * v + 2 * g, pairs + v, 4);
            const int16_t* e16 = (const int16_t*)pairs;
            for (int e = 0; e < 16; e++) sum += e16[e];
#else
            for (int e = 0; e < 16; e++) {
                const int16_t q = (int16_t)lrintf(xr[16 * s + e] * inv);
                qc[xq6_lane(g, e)] = q;
                sum += q;
            }
#endif
            xs[r * subs + s] = sum;
        }
        dx[r] = amax / 32767.f;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Vectors 2 t and 2 t + 1 of a super-block (w: its 192 bytes) as int16 q in 0..63.
static inline void q6_vectors(const uint8_t* w, int t, __m512i& q0, __m512i& q1) {
    const __m512i low4 = _mm512_set1_epi16(0x000f), top2 = _mm512_set1_epi16(0x0030);
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + 32 * t)));
    const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + 128 + 32 * (t >> 1))));
    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
    // fields k = 2 (t & 1) and k + 1 of h, moved to bits 4..5: a | (b & c) is vpternlog 0xF8
    __m512i h0, h1;
    if (t & 1) {
        h0 = h;                           // bits 4..5: field 2
        h1 = _mm512_srli_epi16(h, 2);     // field 3
    } else {
        h0 = _mm512_slli_epi16(h, 4);     // field 0
        h1 = _mm512_slli_epi16(h, 2);     // field 1
    }
    q0 = _mm512_ternarylogic_epi32(lo, h0, top2, 0xF8);
    q1 = _mm512_ternarylogic_epi32(hi, h1, top2, 0xF8);
}

// Q8_0: vectors 2 t and 2 t + 1 of a super-block (w: its 256 bytes) as int16 q.
static inline void q8_vectors(const uint8_t* w, int t, __m512i& q0, __m512i& q1) {
    q0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + 64 * t)));
    q1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + 64 * t + 32)));
}
#endif

// out[r] = dx-free sum over the row's super-blocks (the caller multiplies by dx[r]): for R
// rows of x at xq (stride k) with their XS at xs (stride k / 16; Q8_0 has no offset and reads
// none). w: the weight row's bytes, ds: d * sc (Q8_0: d) per sub-block of the row (fp32, 16
// per super-block), mn: Q5_K's dmin * m per sub-block (else unused).
template <int R, Blocks F>
static inline void row_tile(const uint8_t* w, const float* ds, const float* mn, int64_t blocks,
                            const int16_t* xq, int64_t k, const int32_t* xs, float* out) {
    const int64_t ldxs = k / 16;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // Two chains for a lone row, one otherwise: a super-block's 8 dot products end in one sum
    // anyway, and more chains only added adds (measured, 2048 x 5632: 8 chains 19.1, 2 chains
    // 20.4 G weights/s at M = 1 in cache; 12.0 and 12.9 streamed from memory).
    constexpr int A = R == 1 ? 2 : 1;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t* wc = w + c * sb_bytes<F>();
        __m512i dot[R][A];
        for (int r = 0; r < R; r++)
            for (int a = 0; a < A; a++) dot[r][a] = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
            __m512i q0, q1;
            if (F == Blocks::Q8_0)
                q8_vectors(wc, t, q0, q1);
            else
                q6_vectors(wc, t, q0, q1);
            for (int r = 0; r < R; r++) {
                const int16_t* xt = xq + r * k + c * SB_WEIGHTS + 64 * t;
                __m512i& d0 = dot[r][(2 * t) % A];
                __m512i& d1 = dot[r][(2 * t + 1) % A];
#if defined(__AVX512VNNI__)
                d0 = _mm512_dpwssd_epi32(d0, q0, _mm512_loadu_si512((const void*)xt));
                d1 = _mm512_dpwssd_epi32(d1, q1, _mm512_loadu_si512((const void*)(xt + 32)));
#else
                d0 = _mm512_add_epi32(d0, _mm512_madd_epi16(q0, _mm512_loadu_si512((const void*)xt)));
                d1 = _mm512_add_epi32(d1, _mm512_madd_epi16(q1, _mm512_loadu_si512((const void*)(xt + 32))));
#endif
            }
        }
        const __m512 vds = _mm512_loadu_ps(ds + 16 * c);
        for (int r = 0; r < R; r++) {
            __m512i total = sum_chains<A>(dot[r]);
            if (F == Blocks::Q6K)
                total = _mm512_sub_epi32(total, _mm512_slli_epi32(
                    _mm512_loadu_si512((const void*)(xs + r * ldxs + 16 * c)), 5));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), vds, acc[r]);
            if (F == Blocks::Q5K)
                acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)(xs + r * ldxs + 16 * c))),
                                          _mm512_loadu_ps(mn + 16 * c), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__)
    // Each run read as two halves of 16 bytes: sub-blocks 8 h .. 8 h + 7.
    const __m256i low4 = _mm256_set1_epi16(0x000f), top2 = _mm256_set1_epi16(0x0030);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t* wc = w + c * sb_bytes<F>();
        for (int h = 0; h < 2; h++) {
            __m256i dot[R];
            for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++) {
                __m256i q0, q1;
                if (F != Blocks::Q8_0) {
                    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wc + 32 * t + 16 * h)));
                    const __m256i hb = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wc + 128 + 32 * (t >> 1) + 16 * h)));
                    const __m256i h0 = (t & 1) ? hb : _mm256_slli_epi16(hb, 4);
                    const __m256i h1 = (t & 1) ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 2);
                    q0 = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(h0, top2));
                    q1 = _mm256_or_si256(_mm256_srli_epi16(v, 4), _mm256_and_si256(h1, top2));
                } else {
                    q0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wc + 64 * t + 16 * h)));
                    q1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wc + 64 * t + 32 + 16 * h)));
                }
                for (int r = 0; r < R; r++) {
                    const int16_t* xt = xq + r * k + c * SB_WEIGHTS + 64 * t + 16 * h;
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_add_epi32(
                        _mm256_madd_epi16(q0, _mm256_loadu_si256((const __m256i*)xt)),
                        _mm256_madd_epi16(q1, _mm256_loadu_si256((const __m256i*)(xt + 32)))));
                }
            }
            const __m256 vds = _mm256_loadu_ps(ds + 16 * c + 8 * h);
            for (int r = 0; r < R; r++) {
                __m256i total = dot[r];
                if (F == Blocks::Q6K)
                    total = _mm256_sub_epi32(total, _mm256_slli_epi32(
                        _mm256_loadu_si256((const __m256i*)(xs + r * ldxs + 16 * c + 8 * h)), 5));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), vds, acc[r]);
                if (F == Blocks::Q5K)
                    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(
                        (const __m256i*)(xs + r * ldxs + 16 * c + 8 * h))), _mm256_loadu_ps(mn + 16 * c + 8 * h), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = vsum(acc[r]);  // simd.h's AVX2 reduction
#else
    for (int r = 0; r < R; r++) {
        float acc = 0.f;
        for (int64_t c = 0; c < blocks; c++) {
            const uint8_t* wc = w + c * sb_bytes<F>();
            for (int g = 0; g < 16; g++) {
                int32_t dot = 0;
                for (int e = 0; e < 16; e++) {
                    const int v = e >> 1, lane = 2 * g + (e & 1), t = v >> 1, s = v >> 2, f = v & 3;
                    int q;
                    if (F != Blocks::Q8_0) {
                        const uint8_t lo = wc[32 * t + lane], hb = wc[128 + 32 * s + lane];
                        q = ((v & 1) ? lo >> 4 : lo & 15) | (((hb >> (2 * f)) & 3) << 4);
                    } else {
                        q = (int8_t)wc[32 * v + lane];
                    }
                    dot += q * xq[r * k + c * SB_WEIGHTS + xq6_lane(g, e)];
                }
                if (F == Blocks::Q6K) dot -= 32 * xs[r * ldxs + 16 * c + g];
                acc += ds[16 * c + g] * (float)dot;
                if (F == Blocks::Q5K) acc -= mn[16 * c + g] * (float)xs[r * ldxs + 16 * c + g];
            }
        }
        out[r] = acc;
    }
#endif
}

// Output rows [j0, j1) of y: the serial kernel over a slice of N; each weight row read once.
// Q6K: sc int8 [N, K / 16] and d16 one fp16 d per super-block; Q8_0: sc unused, d16 one fp16 d
// per block of 32; Q5K: sc and m5 uint8 [N, K / 32] (6-bit scale and min per sub-block of 32),
// d16 the fp16 pair (d, dmin) per super-block.
template <Blocks F>
static void block_rows(const int16_t* xq, const float* dx, const int32_t* xs, int64_t m, int64_t k,
                       const uint8_t* qb, const int8_t* sc, const uint8_t* m5, const uint16_t* d16,
                       const float* bias, float* y, int64_t ldy, int64_t j0, int64_t j1) {
    const int64_t blocks = k / SB_WEIGHTS, row_bytes = blocks * sb_bytes<F>();
    const auto ds = aligned_zeros<float>((size_t)(16 * blocks));
    const auto mns = aligned_zeros<float>(F == Blocks::Q5K ? (size_t)(16 * blocks) : 1);
    const char* end = (const char*)(qb + j1 * row_bytes);
    float out[MB];
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t* row = qb + j * row_bytes;
        // Ahead of the hardware streamer, into every cache level (int4_linear.cpp measured why).
        for (int64_t off = 0; off < row_bytes; off += 64)
            if ((const char*)row + PREFETCH_BYTES + off < end) __builtin_prefetch((const char*)row + PREFETCH_BYTES + off, 0, 3);
        // Per-row scales are vectorized for every type: a scalar loop over them cost as much as
        // the row's dot products at M = 1 (a 5632 x 2048 layer in cache: Q5_K 1.14 -> 0.62 ms, Q8_0
        // 0.67 -> 0.53).
        if (F == Blocks::Q8_0) {
            // d per block of 32: sub-blocks 2 b and 2 b + 1 share block b's (exact fp16 -> fp32).
            const uint16_t* dr = d16 + j * 8 * blocks;
            int64_t b = 0;
#if defined(__AVX512F__)
            const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
            const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
            for (; b + 16 <= 8 * blocks; b += 16) {
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dr + b)));
                _mm512_store_ps(ds.get() + 2 * b, _mm512_permutexvar_ps(lo, d));
                _mm512_store_ps(ds.get() + 2 * b + 16, _mm512_permutexvar_ps(hi, d));
            }
#endif
            for (; b < 8 * blocks; b++) ds[2 * b] = ds[2 * b + 1] = fp16_to_float(dr[b]);
        } else if (F == Blocks::Q5K) {
            // d * sc and dmin * m per sub-block of 32, for both its halves of 16 (exact products).
            const uint8_t* scr = (const uint8_t*)sc + j * 8 * blocks;
            const uint8_t* mr = m5 + j * 8 * blocks;
            for (int64_t c = 0; c < blocks; c++) {
                const float d = fp16_to_float(d16[(j * blocks + c) * 2]);
                const float dmin = fp16_to_float(d16[(j * blocks + c) * 2 + 1]);
#if defined(__AVX512F__)
                const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
                const __m512 vs = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(
                    pairs, _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(scr + 8 * c)))));
                const __m512 vm = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(
                    pairs, _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(mr + 8 * c)))));
                _mm512_store_ps(ds.get() + 16 * c, _mm512_mul_ps(_mm512_set1_ps(d), vs));
                _mm512_store_ps(mns.get() + 16 * c, _mm512_mul_ps(_mm512_set1_ps(dmin), vm));
#elif defined(__AVX2__)
                const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
                for (int h = 0; h < 2; h++) {
                    int32_t s4, m4;
                    memcpy(&s4, scr + 8 * c + 4 * h, 4);
                    memcpy(&m4, mr + 8 * c + 4 * h, 4);
                    const __m256 vs = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(
                        _mm256_cvtepu8_epi32(_mm_cvtsi32_si128(s4)), pairs));
                    const __m256 vm = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(
                        _mm256_cvtepu8_epi32(_mm_cvtsi32_si128(m4)), pairs));
                    _mm256_store_ps(ds.get() + 16 * c + 8 * h, _mm256_mul_ps(_mm256_set1_ps(d), vs));
                    _mm256_store_ps(mns.get() + 16 * c + 8 * h, _mm256_mul_ps(_mm256_set1_ps(dmin), vm));
                }
#else
                for (int s = 0; s < 8; s++) {
                    ds[16 * c + 2 * s] = ds[16 * c + 2 * s + 1] = d * (float)scr[8 * c + s];
                    mns[16 * c + 2 * s] = mns[16 * c + 2 * s + 1] = dmin * (float)mr[8 * c + s];
                }
#endif
            }
        } else {
            const int8_t* scr = sc + j * 16 * blocks;
            // d * sc per sub-block, vectorized: the scalar loop (one int-to-float conversion per
            // 16 weights) cost as much as the row's dot products at M = 1 (measured: 12 -> 20 G
            // weights/s for a 2048 x 5632 layer in cache).
            for (int64_t c = 0; c < blocks; c++) {
                const float d = fp16_to_float(d16[j * blocks + c]);
#if defined(__AVX512F__)
                _mm512_store_ps(ds.get() + 16 * c, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(scr + 16 * c))))));
#elif defined(__AVX2__)
                for (int h = 0; h < 2; h++)
                    _mm256_store_ps(ds.get() + 16 * c + 8 * h, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(scr + 16 * c + 8 * h))))));
#else
                for (int g = 0; g < 16; g++) ds[16 * c + g] = d * (float)scr[16 * c + g];
#endif
            }
        }
        const float b = bias ? bias[j] : 0.f;
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int64_t r = m - m0 < MB ? m - m0 : MB;
            const int16_t* xr = xq + m0 * k;
            const int32_t* xsr = xs + m0 * (k / 16);
            switch (r) {
                case 1: row_tile<1, F>(row, ds.get(), mns.get(), blocks, xr, k, xsr, out); break;
                case 2: row_tile<2, F>(row, ds.get(), mns.get(), blocks, xr, k, xsr, out); break;
                case 3: row_tile<3, F>(row, ds.get(), mns.get(), blocks, xr, k, xsr, out); break;
                case 4: row_tile<4, F>(row, ds.get(), mns.get(), blocks, xr, k, xsr, out); break;
                case 5: row_tile<5, F>(row, ds.get(), mns.get(), blocks, xr, k, xsr, out); break;
                case 6: row_tile<6, F>(row, ds.get(), mns.get(), blocks, xr, k, xsr, out); break;
                case 7: row_tile<7, F>(row, ds.get(), mns.get(), blocks, xr, k, xsr, out); break;
                default: row_tile<8, F>(row, ds.get(), mns.get(), blocks, xr, k, xsr, out); break;
            }
            for (int64_t i = 0; i < r; i++) y[(m0 + i) * ldy + j] = out[i] * dx[m0 + i] + b;
        }
    }
}

template <Blocks F>
static int block_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* qb, const int8_t* sc,
                        const uint8_t* m5, const uint16_t* d16, int64_t n, const float* bias, float* y,
                        int64_t ldy) {
    if (k % SB_WEIGHTS) return 1;
    if (m < 0 || n < 0) return 2;
    const auto xq = aligned_zeros<int16_t>((size_t)(m * k));
    const auto dx = aligned_zeros<float>((size_t)m);
    const auto xs = aligned_zeros<int32_t>((size_t)(m * (k / 16)));
    // x is rounded once, before the split: every thread reads the same xq, dx and xs.
    quantize_rows_q6(x, m, k, ldx, xq.get(), dx.get(), xs.get());
    tandem::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
        block_rows<F>(xq.get(), dx.get(), xs.get(), m, k, qb, sc, m5, d16, bias, y, ldy, j0, j1);
    });
    return 0;
}

// qb uint8 [N, K / 256 * 192] (the order above), sc int8 [N, K / 16], d16 fp16 [N, K / 256].
TANDEM_API int tandem_q6k_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* qb,
                                 const int8_t* sc, const uint16_t* d16, int64_t n, const float* bias,
                                 float* y, int64_t ldy) {
    return block_linear<Blocks::Q6K>(x, m, k, ldx, qb, sc, nullptr, d16, n, bias, y, ldy);
}

// qb int8 [N, K] (runs of 32 per 256 weights, the order above), d16 fp16 [N, K / 32].
TANDEM_API int tandem_q8_0_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const int8_t* qb,
                                  const uint16_t* d16, int64_t n, const float* bias, float* y, int64_t ldy) {
    return block_linear<Blocks::Q8_0>(x, m, k, ldx, (const uint8_t*)qb, nullptr, nullptr, d16, n, bias, y, ldy);
}

// qb uint8 [N, K / 256 * 192] (Q6_K's order, q in 0..31), sc and m5 uint8 [N, K / 32], dd fp16
// [N, K / 256, 2] (d, dmin).
TANDEM_API int tandem_q5k_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* qb,
                                 const uint8_t* sc, const uint8_t* m5, const uint16_t* dd, int64_t n,
                                 const float* bias, float* y, int64_t ldy) {
    return block_linear<Blocks::Q5K>(x, m, k, ldx, qb, (const int8_t*)sc, m5, dd, n, bias, y, ldy);
}
