// int4 linear for decode: y[M, N] = x[M, K] @ W^T (+ bias), fp32 in and out. Two entry points
// read the same weights: tandem_int4_linear rounds x to int16 per row (below), and
// tandem_int4a8_linear to int8 per group of 32 (the "a8" section further down).
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
// not reduce: one vpmaddwd (or vpdpwssd, in the avx512vnni build) per 32 weights and row.
// Fewer needs int8 activations (vpdpbusd, 64 per instruction): the a8 variant below; or
// AMX tiles, with these very integer dots (int4_amx.cpp, the "q4_1x" layout).
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

// Bytes from run t of a chunk's weights to run t + 1: 32 in a whole chunk, 2 part in a row's
// stored tail of `part` < 16 groups (to_chunk_order); part 0 names a whole chunk.
static inline int run_stride(int part) { return part ? 2 * part : 32; }

// x [M, ldx] fp32 -> xq [M, kq] int16 (chunk order, zero-padded), dx [M], sums [M, ldd] (per
// group; the caller zeroes the padding to whole chunks)
static void quantize_rows(const float* x, int64_t m, int64_t k, int64_t ldx, int16_t* xq, int64_t kq,
                          float* dx, float* sums, int64_t ldd) {
    const int64_t groups = k / 32;
    for (int64_t r = 0; r < m; r++) {
        const float* xr = x + r * ldx;
        const float amax = abs_max(xr, k);
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        int16_t* qr = xq + r * kq;
        memset(qr, 0, (size_t)kq * sizeof(int16_t));
        for (int64_t g = 0; g < groups; g++) {
            const float* xg = xr + g * 32;
            int16_t* qc = qr + (g / CHUNK_GROUPS) * CHUNK_XQ;
            const int gl = (int)(g % CHUNK_GROUPS);
#if defined(__AVX512F__) && defined(__AVX512BW__)
            // The scalar loop below, 16 lanes at a time: cvtps rounds to nearest even, as lrintf
            // does; |x * inv| <= 32767 never saturates. xq_lane puts the pair (x_2t, x_2t+1) in
            // int32 unit 32 t + gl of the chunk and (x_16+2t, x_17+2t) in unit 32 t + 16 + gl.
            const __m512 v0 = _mm512_loadu_ps(xg), v1 = _mm512_loadu_ps(xg + 16);
            const __m512 vinv = _mm512_set1_ps(inv);
            alignas(32) int32_t units[16];  // 0..7: t's pair of x_0..15; 8..15: of x_16..31
            _mm256_store_si256((__m256i*)units, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv))));
            _mm256_store_si256((__m256i*)(units + 8),
                               _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv))));
            for (int t = 0; t < 8; t++) {
                memcpy(qc + 64 * t + 2 * gl, units + t, 4);
                memcpy(qc + 64 * t + 32 + 2 * gl, units + 8 + t, 4);
            }
            sums[r * ldd + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
#else
            float sum = 0.f;
            for (int e = 0; e < 32; e++) {
                sum += xg[e];
                qc[xq_lane(gl, e)] = (int16_t)lrintf(xg[e] * inv);
            }
            sums[r * ldd + g] = sum;
#endif
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Run t (0..7) of a chunk's bytes (the 32 that hold byte pair t of each of its 16 groups). A
// whole chunk (tail 0) has them at 32 t; a row's last chunk of `tail` < 16 groups is stored
// compactly, 2 tail bytes a run (to_chunk_order), and is read where it lies: a masked load
// gives the run's bytes and zeros for the absent groups, and touches no byte past them (so
// no per-row copy into a padded chunk, which cost 8 small memcpy calls a weight row).
static inline __m256i chunk_run(const uint8_t* w, int t, int tail) {
    return tail ? _mm256_maskz_loadu_epi8((__mmask32)((1ull << (2 * tail)) - 1), w + run_stride(tail) * t)
                : _mm256_loadu_si256((const __m256i*)(w + 32 * t));
}

// The first 16 bytes of run t of a tail of 1..8 groups (groups 0..7), read in place.
static inline __m128i tail_run_half(const uint8_t* w, int t, int tail) {
    return _mm_maskz_loadu_epi8((__mmask16)((1u << (2 * tail)) - 1), w + run_stride(tail) * t);
}

// One chunk's integer dots for R rows of int16 x (row_tile): A independent chains per row (the
// lo half of load t into chain 2t mod A, the hi half into 2t+1 mod A), summed by the caller:
// one vpdpwssd depends on the last (5 cycles), so a lone row's 16 in one chain ran at a fifth
// of the unit's rate. Integer sums are exact: the chunk's dot does not depend on A.
// Masked: the chunk is a stored tail of `tail` groups (chunk_run); a separate instantiation,
// so whole chunks keep plain loads and no branch (at M = 8 a per-load choice cost ~10%).
template <int R, int A, bool Masked>
static inline void chunk_dots16(const uint8_t* w, int tail, const int16_t* xc, int64_t kq, __m512i (&dot)[R][A]) {
    const __m512i mask = _mm512_set1_epi16(0x000f);
    for (int r = 0; r < R; r++)
        for (int a = 0; a < A; a++) dot[r][a] = _mm512_setzero_si512();
    for (int t = 0; t < 8; t++) {
        const __m256i raw = Masked ? chunk_run(w, t, tail) : _mm256_loadu_si256((const __m256i*)(w + 32 * t));
        const __m512i v = _mm512_cvtepu8_epi16(raw);
        const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_srli_epi16(v, 4);
        for (int r = 0; r < R; r++) {
            const int16_t* xt = xc + r * kq + 64 * t;
            __m512i& d0 = dot[r][(2 * t) % A];
            __m512i& d1 = dot[r][(2 * t + 1) % A];
#if defined(__AVX512VNNI__)
            d0 = _mm512_dpwssd_epi32(d0, lo, _mm512_loadu_si512((const void*)xt));
            d1 = _mm512_dpwssd_epi32(d1, hi, _mm512_loadu_si512((const void*)(xt + 32)));
#else
            d0 = _mm512_add_epi32(d0, _mm512_madd_epi16(lo, _mm512_loadu_si512((const void*)xt)));
            d1 = _mm512_add_epi32(d1, _mm512_madd_epi16(hi, _mm512_loadu_si512((const void*)(xt + 32))));
#endif
        }
    }
}

// The same for int8 x (row_tile_a8): load t into chain t mod A.
template <int R, int A, bool Masked>
static inline void chunk_dots8(const uint8_t* w, int tail, const int8_t* xc, int64_t kq, __m512i (&dot)[R][A]) {
    const __m512i mask = _mm512_set1_epi32(0x0f0f);
#if !defined(__AVX512VNNI__)
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    for (int r = 0; r < R; r++)
        for (int a = 0; a < A; a++) dot[r][a] = _mm512_setzero_si512();
    for (int t = 0; t < 8; t++) {
        // lane g: group g's bytes 2t, 2t+1 -> [lo, lo, hi, hi] nibbles as u8
        const __m256i raw = Masked ? chunk_run(w, t, tail) : _mm256_loadu_si256((const __m256i*)(w + 32 * t));
        const __m512i v = _mm512_cvtepu16_epi32(raw);
        const __m512i q = _mm512_or_si512(_mm512_and_si512(v, mask),
                                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 4), mask), 16));
        for (int r = 0; r < R; r++) {
            const __m512i xv = _mm512_loadu_si512((const void*)(xc + r * kq + 64 * t));
            __m512i& dt = dot[r][t % A];
#if defined(__AVX512VNNI__)
            dt = _mm512_dpbusd_epi32(dt, q, xv);
#else
            dt = _mm512_add_epi32(dt, _mm512_madd_epi16(_mm512_maddubs_epi16(q, xv), ones));
#endif
        }
    }
}
#endif

// out[r] = sum_g (d_g dx_r) * (q_g . xq[r, g]) + m_g * S[r, g] over the row's chunks. chunk(c):
// the bytes of chunk c; the last one, of `tail` groups when that is not 0, as stored (runs of
// 2 tail bytes, to_chunk_order), read where it lies by every build (tail_runs below); d, mn:
// per group, S: per row (stride ldd) and group, all zero-padded to whole chunks; dx: per row.
// The m term joins the chunk's accumulator, as row_tile_a8's does: a separate 64-float dot per
// output cost ~a quarter of the integer work at K = 2048 and M = 1.
template <int R, class ChunkPtr>
static inline void row_tile(const ChunkPtr& chunk, const float* d, const float* mn, int64_t chunks,
                            int tail, const int16_t* xq, int64_t kq, const float* dx, const float* S,
                            int64_t ldd, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    constexpr int A = dot_chains(R);
    __m512 acc[R], vdx[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), vdx[r] = _mm512_set1_ps(dx[r]);
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* w = chunk(c);
        const int16_t* xc = xq + c * CHUNK_XQ;
        const int part = c == chunks - 1 ? tail : 0;  // groups of this chunk when it is short
        if (part && part <= CHUNK_GROUPS / 2) {
            // A tail of <= 8 groups (K = 576: 18 groups, a tail of 2): groups 8..15 are padding
            // (q, d, m, x all 0) whose lanes would add exactly 0, so the groups 0..7 run at half
            // width, lane for lane the same integer and float operations as the full chunk's
            // lanes 0..7 (the result is bit-identical). The full width cost the tail a whole
            // chunk: 2 chunks of work for 18 groups.
            const __m256i mask8 = _mm256_set1_epi16(0x000f);
            __m256i dh[R][A];
            for (int r = 0; r < R; r++)
                for (int a = 0; a < A; a++) dh[r][a] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_cvtepu8_epi16(tail_run_half(w, t, part));
                const __m256i lo = _mm256_and_si256(v, mask8), hi = _mm256_srli_epi16(v, 4);
                for (int r = 0; r < R; r++) {
                    const int16_t* xt = xc + r * kq + 64 * t;
                    __m256i& d0 = dh[r][(2 * t) % A];
                    __m256i& d1 = dh[r][(2 * t + 1) % A];
#if defined(__AVX512VNNI__)
                    d0 = _mm256_dpwssd_epi32(d0, lo, _mm256_loadu_si256((const __m256i*)xt));
                    d1 = _mm256_dpwssd_epi32(d1, hi, _mm256_loadu_si256((const __m256i*)(xt + 32)));
#else
                    d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)xt)));
                    d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)(xt + 32))));
#endif
                }
            }
            const __m256 vd = _mm256_loadu_ps(d + c * CHUNK_GROUPS), vm = _mm256_loadu_ps(mn + c * CHUNK_GROUPS);
            for (int r = 0; r < R; r++) {
                __m256 a = _mm512_castps512_ps256(acc[r]);
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_chains256<A>(dh[r])),
                                    _mm256_mul_ps(vd, _mm512_castps512_ps256(vdx[r])), a);
                a = _mm256_fmadd_ps(vm, _mm256_loadu_ps(S + r * ldd + c * CHUNK_GROUPS), a);
                acc[r] = _mm512_insertf32x8(acc[r], a, 0);
            }
            continue;
        }
        __m512i dot[R][A];
        if (part)  // a tail of 9..15 groups, at full width
            chunk_dots16<R, A, true>(w, part, xc, kq, dot);
        else
            chunk_dots16<R, A, false>(w, 0, xc, kq, dot);
        // lane g: group g's d and m
        const __m512 vd = _mm512_loadu_ps(d + c * CHUNK_GROUPS), vm = _mm512_loadu_ps(mn + c * CHUNK_GROUPS);
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_chains<A>(dot[r])), _mm512_mul_ps(vd, vdx[r]), acc[r]);
            acc[r] = _mm512_fmadd_ps(vm, _mm512_loadu_ps(S + r * ldd + c * CHUNK_GROUPS), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi16(0x000f);
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* w = chunk(c);
        const int part = c == chunks - 1 ? tail : 0, run = run_stride(part);  // tail_runs
        const int halves = part && part <= CHUNK_GROUPS / 2 ? 1 : 2;  // groups 8..15 absent
        for (int h = 0; h < halves; h++) {  // groups 8 h .. 8 h + 7
            const int16_t* xc = xq + c * CHUNK_XQ + 16 * h;
            __m256i dot[R];
            for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(w + run * t + 16 * h)));
                const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_srli_epi16(v, 4);
                for (int r = 0; r < R; r++) {
                    const int16_t* xt = xc + r * kq + 64 * t;
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_add_epi32(
                        _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)xt)),
                        _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)(xt + 32)))));
                }
            }
            const __m256 vd = _mm256_loadu_ps(d + c * CHUNK_GROUPS + 8 * h);
            const __m256 vm = _mm256_loadu_ps(mn + c * CHUNK_GROUPS + 8 * h);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(vd, _mm256_set1_ps(dx[r])), acc[r]);
                acc[r] = _mm256_fmadd_ps(vm, _mm256_loadu_ps(S + r * ldd + c * CHUNK_GROUPS + 8 * h), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = vsum(acc[r]);  // simd.h's AVX2 reduction
#else
    for (int r = 0; r < R; r++) out[r] = 0.f;
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* w = chunk(c);
        const int part = c == chunks - 1 ? tail : 0, run = run_stride(part);
        for (int g = 0; g < (part ? part : CHUNK_GROUPS); g++) {
            for (int r = 0; r < R; r++) {
                const int16_t* xc = xq + r * kq + c * CHUNK_XQ;
                int32_t dot = 0;
                for (int t = 0; t < 8; t++)
                    for (int b = 0; b < 2; b++) {
                        const uint8_t byte = w[run * t + 2 * g + b];
                        const int lane = 64 * t + 2 * g + b;
                        dot += (byte & 0x0f) * xc[lane] + (byte >> 4) * xc[lane + 32];
                    }
                const int64_t i = c * CHUNK_GROUPS + g;
                out[r] += d[i] * dx[r] * (float)dot + mn[i] * S[r * ldd + i];
            }
        }
    }
#endif
}

// ---- int8 activations (the "a8" variant: tandem_int4a8_linear) ----
//
// Each group of 32 of x gets its own scale (dx_g = max|x_g| / 127, xq = round(x / dx_g): what
// llama.cpp's Q8_0/Q8_1 activations are), so
//
//     y[r, n] = sum_g d_g * dx[r, g] * (q_g . xq[r, g])  +  sum_g m_g * S[r, g]
//
// Why: one vpdpbusd multiplies and sums 64 4-bit weights (as u8) by 64 int8 of x, against two
// vpdpwssd for the int16 variant: the per-row cost of a batch halves. The price is x rounded to
// 1 part in 254 of its group's range rather than 65534 of its row's (quality: benchmarks/quality,
// README). |q . xq| <= 32 * 15 * 127 < 2^16: the int32 sums and their floats stay exact, so
// VNNI or not, and the order of the integer adds, change nothing.
//
// xq8 order per row and chunk c (512 bytes at 512 c): for load t (0..7), 64 bytes at 64 t; the
// int32 lane g of those holds x_{g, 2t}, x_{g, 2t+1}, x_{g, 16+2t}, x_{g, 16+2t+1}: the same
// four elements whose nibbles the weight unpack below puts in lane g. dx8 [M, 16 * chunks], zero
// padded.
static inline int xq8_byte(int g, int i) {  // the reference for quantize_rows_i8's stores
    const int s = i >= 16, e = i - 16 * s;  // s: high nibble; e = 2 t + b
    return 64 * (e >> 1) + 4 * g + 2 * s + (e & 1);
}

// xq, dx and sums come zero-filled (aligned_zeros): the padding past the last group stays 0.
static void quantize_rows_i8(const float* x, int64_t m, int64_t k, int64_t ldx, int8_t* xq, int64_t kq,
                             float* dx, int64_t ldd, float* sums) {
    const int64_t groups = k / 32;
    for (int64_t r = 0; r < m; r++) {
        const float* xr = x + r * ldx;
        for (int64_t g = 0; g < groups; g++) {
            const float* xg = xr + g * 32;
            int8_t* qc = xq + r * kq + (g / CHUNK_GROUPS) * CHUNK_XQ + 4 * (g % CHUNK_GROUPS);
            float amax, sum;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            // The scalar loop below, 16 lanes at a time (it cost ~10 cycles an element, as much
            // as a 1024-row layer's dot products at M = 8): cvtps rounds to nearest even, as
            // lrintf does; the saturating int32 -> int8 narrowing never saturates (|q| <= 127).
            const __m512 v0 = _mm512_loadu_ps(xg), v1 = _mm512_loadu_ps(xg + 16);
            amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
            const __m512 vinv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            const __m128i b0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv)));
            const __m128i b1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv)));
            // 16-bit units (x_{2t}, x_{2t+1}) and (x_{16+2t}, x_{17+2t}) side by side: t's 4 bytes
            alignas(16) int32_t units[8];  // unit t: x_{2t}, x_{2t+1}, x_{16+2t}, x_{17+2t}
            _mm_store_si128((__m128i*)units, _mm_unpacklo_epi16(b0, b1));
            _mm_store_si128((__m128i*)(units + 4), _mm_unpackhi_epi16(b0, b1));
            for (int t = 0; t < 8; t++) memcpy(qc + 64 * t, units + t, 4);
#else
            amax = 0.f;
            sum = 0.f;
            for (int i = 0; i < 32; i++) {
                amax = fabsf(xg[i]) > amax ? fabsf(xg[i]) : amax;
                sum += xg[i];
            }
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            int8_t q[32];
            for (int i = 0; i < 32; i++) q[i] = (int8_t)lrintf(xg[i] * inv);
            for (int t = 0; t < 8; t++) {  // xq8_byte(g, i) for the group's 32 elements
                qc[64 * t] = q[2 * t];
                qc[64 * t + 1] = q[2 * t + 1];
                qc[64 * t + 2] = q[16 + 2 * t];
                qc[64 * t + 3] = q[17 + 2 * t];
            }
#endif
            dx[r * ldd + g] = amax / 127.f;
            sums[r * ldd + g] = sum;
        }
    }
}

// out[r] = sum_g d_g * dx[r, g] * (q_g . xq[r, g]) + m_g * S[r, g] over the row's chunks (chunk,
// d: as row_tile; m: per group, zero-padded like d; S [R, ldd] the group sums). The m term
// joins the same per-chunk accumulator, so one reduction per row ends the sum: a separate dot
// of m and S per output cost a third as much as the integer work at K = 2048.
template <int R, class ChunkPtr>
static inline void row_tile_a8(const ChunkPtr& chunk, const float* d, const float* mn, int64_t chunks,
                               int tail, const int8_t* xq, int64_t kq, const float* dx, const float* S,
                               int64_t ldd, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    constexpr int A = dot_chains(R);  // of the chunk's 8 loads
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* w = chunk(c);
        const int8_t* xc = xq + c * CHUNK_XQ;
        const int part = c == chunks - 1 ? tail : 0;
        if (part && part <= CHUNK_GROUPS / 2) {  // a tail of <= 8 groups at half width (row_tile's)
            const __m256i mask8 = _mm256_set1_epi32(0x0f0f);
#if !defined(__AVX512VNNI__)
            const __m256i ones8 = _mm256_set1_epi16(1);
#endif
            __m256i dh[R][A];
            for (int r = 0; r < R; r++)
                for (int a = 0; a < A; a++) dh[r][a] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_cvtepu16_epi32(tail_run_half(w, t, part));
                const __m256i q = _mm256_or_si256(_mm256_and_si256(v, mask8),
                                                  _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 4), mask8), 16));
                for (int r = 0; r < R; r++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i*)(xc + r * kq + 64 * t));
                    __m256i& dt = dh[r][t % A];
#if defined(__AVX512VNNI__)
                    dt = _mm256_dpbusd_epi32(dt, q, xv);
#else
                    dt = _mm256_add_epi32(dt, _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones8));
#endif
                }
            }
            const __m256 vd = _mm256_loadu_ps(d + c * CHUNK_GROUPS), vm = _mm256_loadu_ps(mn + c * CHUNK_GROUPS);
            for (int r = 0; r < R; r++) {
                __m256 a = _mm512_castps512_ps256(acc[r]);
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_chains256<A>(dh[r])),
                                    _mm256_mul_ps(vd, _mm256_loadu_ps(dx + r * ldd + c * CHUNK_GROUPS)), a);
                a = _mm256_fmadd_ps(vm, _mm256_loadu_ps(S + r * ldd + c * CHUNK_GROUPS), a);
                acc[r] = _mm512_insertf32x8(acc[r], a, 0);
            }
            continue;
        }
        __m512i dot[R][A];
        if (part)  // a tail of 9..15 groups, at full width
            chunk_dots8<R, A, true>(w, part, xc, kq, dot);
        else
            chunk_dots8<R, A, false>(w, 0, xc, kq, dot);
        const __m512 vd = _mm512_loadu_ps(d + c * CHUNK_GROUPS), vm = _mm512_loadu_ps(mn + c * CHUNK_GROUPS);
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_chains<A>(dot[r])),
                                     _mm512_mul_ps(vd, _mm512_loadu_ps(dx + r * ldd + c * CHUNK_GROUPS)), acc[r]);
            acc[r] = _mm512_fmadd_ps(vm, _mm512_loadu_ps(S + r * ldd + c * CHUNK_GROUPS), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi32(0x0f0f), ones = _mm256_set1_epi16(1);
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* w = chunk(c);
        const int part = c == chunks - 1 ? tail : 0, run = run_stride(part);
        const int halves = part && part <= CHUNK_GROUPS / 2 ? 1 : 2;
        for (int h = 0; h < halves; h++) {  // groups 8 h .. 8 h + 7
            const int8_t* xc = xq + c * CHUNK_XQ + 32 * h;
            __m256i dot[R];
            for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + run * t + 16 * h)));
                const __m256i q = _mm256_or_si256(_mm256_and_si256(v, mask),
                                                  _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 4), mask), 16));
                for (int r = 0; r < R; r++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i*)(xc + r * kq + 64 * t));
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones));
                }
            }
            const __m256 vd = _mm256_loadu_ps(d + c * CHUNK_GROUPS + 8 * h);
            const __m256 vm = _mm256_loadu_ps(mn + c * CHUNK_GROUPS + 8 * h);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                                         _mm256_mul_ps(vd, _mm256_loadu_ps(dx + r * ldd + c * CHUNK_GROUPS + 8 * h)), acc[r]);
                acc[r] = _mm256_fmadd_ps(vm, _mm256_loadu_ps(S + r * ldd + c * CHUNK_GROUPS + 8 * h), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = vsum(acc[r]);  // simd.h's AVX2 reduction
#else
    for (int r = 0; r < R; r++) out[r] = 0.f;
    for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* w = chunk(c);
        const int part = c == chunks - 1 ? tail : 0, run = run_stride(part);
        for (int g = 0; g < (part ? part : CHUNK_GROUPS); g++) {
            for (int r = 0; r < R; r++) {
                const int8_t* xc = xq + r * kq + c * CHUNK_XQ;
                int32_t dot = 0;
                for (int t = 0; t < 8; t++)
                    for (int b = 0; b < 2; b++) {
                        const uint8_t byte = w[run * t + 2 * g + b];
                        dot += (byte & 0x0f) * xc[xq8_byte(g, 2 * t + b)] + (byte >> 4) * xc[xq8_byte(g, 16 + 2 * t + b)];
                    }
                const int64_t i = c * CHUNK_GROUPS + g;
                out[r] += d[i] * dx[r * ldd + i] * (float)dot + mn[i] * S[r * ldd + i];
            }
        }
    }
#endif
}

// Per-group float scales of one weight row, as the tiles read them: d[g] and mn[g] with
// w = q d[g] + mn[g] for group g < groups (entries past the row's groups stay 0, the padding).
// Two sources: fp16 d and m per group (Q4_1Scales: the "q4_1" layout), or Q4_K's super-block
// scales (Q4KScales), decoded per weight row so each is paid once whatever M is.
struct Q41Scales {
    const uint16_t* d16;  // [N, groups]
    const uint16_t* m16;  // [N, groups]
    int64_t groups;
    void operator()(int64_t j, float* d, float* mn) const {
        fp16_row_to_float(d16 + j * groups, groups, d);
        fp16_row_to_float(m16 + j * groups, groups, mn);
    }
};

// Q4_K (ggml-common.h): each super-block of 8 groups has fp16 d and dmin and, per group, 6-bit
// sc and mn (stored here one a byte, unpacked from the block's 12 bytes at load time), and
//     w = (d * sc) * q - dmin * mn
// d * sc and dmin * mn are exact in fp32 (an 11-bit significand times a 6-bit integer), and
// are the very products ggml's dequantizer forms: the layer's weights are the file's, exactly.
// (The "q4_1" layout would round them to fp16.) Bytes per 32 weights: 16 + 2 + 4 / 8 = 18.5,
// against Q4_K's 18 and the "q4_1" layout's 20.
struct Q4KScales {
    const uint8_t* sc;    // [N, groups]
    const uint8_t* mins;  // [N, groups]
    const uint16_t* dm;   // [N, groups / 8, 2]: (d, dmin) per super-block
    int64_t groups;
    // Vectorized: a scalar loop here cost a weight row as much as its M = 1 dot products
    // (measured, 2048 x 5632 layers in cache: 5.0 ms against the "q4_1" layout's 2.8).
    void operator()(int64_t j, float* d, float* mn) const {
        const uint8_t* s = sc + j * groups;
        const uint8_t* mi = mins + j * groups;
        const uint16_t* h = dm + j * (groups / 8) * 2;
        const int64_t supers = groups / 8;
        int64_t b = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        // Two super-blocks (16 groups) a step: (d0, dmin0, d1, dmin1) converted at once and
        // spread over the 8 lanes of each super-block.
        const __m512i pick_d = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i pick_m = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
        for (; b + 2 <= supers; b += 2) {
            const __m512 four = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(h + 2 * b))));
            const __m512 vs = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(s + 8 * b))));
            const __m512 vm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mi + 8 * b))));
            _mm512_storeu_ps(d + 8 * b, _mm512_mul_ps(_mm512_permutexvar_ps(pick_d, four), vs));
            // -(dmin * mn): the negation is exact, and after the one rounding of the product
            _mm512_storeu_ps(mn + 8 * b, _mm512_sub_ps(_mm512_setzero_ps(),
                                                       _mm512_mul_ps(_mm512_permutexvar_ps(pick_m, four), vm)));
        }
#endif
#if defined(__AVX2__)
        for (; b < supers; b++) {
            const __m256 vs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s + 8 * b))));
            const __m256 vm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(mi + 8 * b))));
            _mm256_storeu_ps(d + 8 * b, _mm256_mul_ps(_mm256_set1_ps(fp16_to_float(h[2 * b])), vs));
            _mm256_storeu_ps(mn + 8 * b, _mm256_sub_ps(_mm256_setzero_ps(),
                                                       _mm256_mul_ps(_mm256_set1_ps(fp16_to_float(h[2 * b + 1])), vm)));
        }
#endif
        for (; b < supers; b++) {
            const float db = fp16_to_float(h[2 * b]), mb = fp16_to_float(h[2 * b + 1]);
            for (int i = 0; i < 8; i++) {
                d[8 * b + i] = db * (float)s[8 * b + i];
                mn[8 * b + i] = -(mb * (float)mi[8 * b + i]);
            }
        }
    }
};

// Output rows [j0, j1) of y from the quantized activations: the serial kernel over a slice of N.
// Tile(r, chunk, d, m, chunks, tail, m0, out) writes out[0..r) for rows m0.. of x: one weight
// row's outputs before the bias; tail: groups of the row's last chunk when it is short, else 0.
// scales(j, d, mn): weight row j's per-group floats (Q41Scales, Q4KScales).
template <class Tile, class Scales>
static void int4_rows(const Tile& tile, int64_t m, int64_t k, const uint8_t* qs, const Scales& scales,
                      int64_t n, const float* bias, float* y, int64_t ldy, int64_t j0, int64_t j1) {
    const int64_t groups = k / 32, row_bytes = k / 2;
    const int64_t full = groups / CHUNK_GROUPS, tail = groups % CHUNK_GROUPS;
    const int64_t chunks = full + (tail > 0);
    std::vector<float> d((size_t)(chunks * CHUNK_GROUPS), 0.f), mn((size_t)(chunks * CHUNK_GROUPS), 0.f);
    // tail_runs: the AVX2 build reads a tail's run t as 16 bytes at 2 tail t (+ 16 for groups
    // 8..15), so up to 16 bytes past the tail's last run. Those bytes are the next weight row's,
    // in the lanes of absent groups, where x is 0 (quantize_rows' padding) and d = m = 0: they
    // add exactly 0. Past the matrix's last row they may be unmapped, so that row's tail is read
    // from this copy with the slack. (Before: each row's tail was spread into a padded chunk, 8
    // small memcpy calls a row: ~10% of SmolLM2's decode step on an AVX2 host, where K = 576
    // leaves a tail of 2 groups in most layers.)
    alignas(64) uint8_t tail_copy[CHUNK_BYTES + 64] = {0};
    const char* end = (const char*)(qs + n * row_bytes);
    float out[MB];
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t* row = qs + j * row_bytes;
        // The hardware streamer alone kept one core at ~3 GB/s from memory here (measured).
        // Into every cache level (prefetcht0): with the non-temporal hint a line could leave
        // before its row was reached once a batch made each row's work long (a 256 MB layer,
        // K = 2048, Sapphire Rapids class, one thread: M = 8 int8 activations 115 ms with it,
        // 56 ms with t0; M = 1 32-35 ms and 31 ms).
        for (int64_t off = 0; off < row_bytes; off += 64)
            if ((const char*)row + PREFETCH_BYTES + off < end) __builtin_prefetch((const char*)row + PREFETCH_BYTES + off, 0, 3);
        scales(j, d.data(), mn.data());
#if defined(__AVX512F__) && defined(__AVX512BW__)
        (void)tail_copy;  // masked loads touch no byte past the tail (chunk_run)
        const auto chunk = [&](int64_t c) { return row + c * CHUNK_BYTES; };
#else
        const uint8_t* tail_runs = row + full * CHUNK_BYTES;
        if (tail && (const char*)(row + row_bytes) + 16 > end) {
            memcpy(tail_copy, tail_runs, (size_t)(16 * tail));
            tail_runs = tail_copy;
        }
        const auto chunk = [&](int64_t c) { return c < full ? row + c * CHUNK_BYTES : tail_runs; };
#endif
        const float b = bias ? bias[j] : 0.f;
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            const int64_t r = m - m0 < MB ? m - m0 : MB;
            tile(r, chunk, d.data(), mn.data(), chunks, (int)tail, m0, out);
            for (int64_t i = 0; i < r; i++)
                y[(m0 + i) * ldy + j] = out[i] + b;
        }
    }
}

// Dispatches a runtime row count r (1..MB) to the kernel compiled for it.
#define TANDEM_TILE_SWITCH(r, CALL)                      \
    switch (r) {                                         \
        case 1: CALL(1); break;                          \
        case 2: CALL(2); break;                          \
        case 3: CALL(3); break;                          \
        case 4: CALL(4); break;                          \
        case 5: CALL(5); break;                          \
        case 6: CALL(6); break;                          \
        case 7: CALL(7); break;                          \
        default: CALL(8); break;                         \
    }

// x rounded to int16 per row (row_tile), any source of scales.
template <class Scales>
static int int4_linear16(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* qs,
                         const Scales& scales, int64_t n, const float* bias, float* y, int64_t ldy) {
    const int64_t groups = k / 32, chunks = (groups + CHUNK_GROUPS - 1) / CHUNK_GROUPS;
    const int64_t kq = chunks * CHUNK_XQ, ldd = chunks * CHUNK_GROUPS;
    const auto xq = aligned_zeros<int16_t>((size_t)(m * kq));
    const auto dx = aligned_zeros<float>((size_t)m), sums = aligned_zeros<float>((size_t)(m * ldd));
    // x is quantized once, before the split: every thread reads the same xq, dx and sums.
    quantize_rows(x, m, k, ldx, xq.get(), kq, dx.get(), sums.get(), ldd);
    const int16_t* xqp = xq.get();
    const float *dxp = dx.get(), *sp = sums.get();
    const auto tile = [&](int64_t r, const auto& chunk, const float* d, const float* mn, int64_t nchunks,
                          int tail, int64_t m0, float* out) {
#define TANDEM_TILE16(R) \
    row_tile<R>(chunk, d, mn, nchunks, tail, xqp + m0 * kq, kq, dxp + m0, sp + m0 * ldd, ldd, out)
        TANDEM_TILE_SWITCH(r, TANDEM_TILE16)
#undef TANDEM_TILE16
    };
    // Threads take contiguous slices of N (16 rows at least: a 64-byte line of y per row of x),
    // so each weight row is still read from memory once, by one thread.
    tandem::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
        int4_rows(tile, m, k, qs, scales, n, bias, y, ldy, j0, j1);
    });
    return 0;
}

// x rounded to int8 per group of 32 (row_tile_a8's comment), any source of scales.
template <class Scales>
static int int4_linear8(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* qs,
                        const Scales& scales, int64_t n, const float* bias, float* y, int64_t ldy) {
    const int64_t groups = k / 32, chunks = (groups + CHUNK_GROUPS - 1) / CHUNK_GROUPS;
    const int64_t kq = chunks * CHUNK_XQ, ldd = chunks * CHUNK_GROUPS;
    const auto xq = aligned_zeros<int8_t>((size_t)(m * kq));
    const auto dx = aligned_zeros<float>((size_t)(m * ldd)), sums = aligned_zeros<float>((size_t)(m * ldd));
    quantize_rows_i8(x, m, k, ldx, xq.get(), kq, dx.get(), ldd, sums.get());
    const int8_t* xqp = xq.get();
    const float *dxp = dx.get(), *sp = sums.get();
    const auto tile = [&](int64_t r, const auto& chunk, const float* d, const float* mn, int64_t nchunks,
                          int tail, int64_t m0, float* out) {
#define TANDEM_TILE8(R) \
    row_tile_a8<R>(chunk, d, mn, nchunks, tail, xqp + m0 * kq, kq, dxp + m0 * ldd, sp + m0 * ldd, ldd, out)
        TANDEM_TILE_SWITCH(r, TANDEM_TILE8)
#undef TANDEM_TILE8
    };
    tandem::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
        int4_rows(tile, m, k, qs, scales, n, bias, y, ldy, j0, j1);
    });
    return 0;
}

TANDEM_API int tandem_int4_linear(const float* x, int64_t m, int64_t k, int64_t ldx,
                                  const uint8_t* qs, const uint16_t* d16, const uint16_t* m16,
                                  int64_t n, const float* bias, float* y, int64_t ldy) {
    if (k % 32) return 1;
    if (m < 0 || n < 0) return 2;
    return int4_linear16(x, m, k, ldx, qs, Q41Scales{d16, m16, k / 32}, n, bias, y, ldy);
}

// The same layer with x rounded to int8 per group of 32 (row_tile_a8's comment).
TANDEM_API int tandem_int4a8_linear(const float* x, int64_t m, int64_t k, int64_t ldx,
                                    const uint8_t* qs, const uint16_t* d16, const uint16_t* m16,
                                    int64_t n, const float* bias, float* y, int64_t ldy) {
    if (k % 32) return 1;
    if (m < 0 || n < 0) return 2;
    return int4_linear8(x, m, k, ldx, qs, Q41Scales{d16, m16, k / 32}, n, bias, y, ldy);
}

// Q4_K's layer (the "q4_k" layout, Q4KScales): the nibbles in the "q4_1" chunk order, so the
// same tiles; a8 != 0 rounds x to int8 per group (int4a8), else to int16 per row.
TANDEM_API int tandem_q4k_linear(const float* x, int64_t m, int64_t k, int64_t ldx,
                                 const uint8_t* qs, const uint8_t* sc, const uint8_t* mins,
                                 const uint16_t* dm, int64_t n, const float* bias, float* y,
                                 int64_t ldy, int a8) {
    if (k % 256) return 1;
    if (m < 0 || n < 0) return 2;
    const Q4KScales scales{sc, mins, dm, k / 32};
    return a8 ? int4_linear8(x, m, k, ldx, qs, scales, n, bias, y, ldy)
              : int4_linear16(x, m, k, ldx, qs, scales, n, bias, y, ldy);
}
