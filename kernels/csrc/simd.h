// Vector helpers shared by the native CPU kernels, one definition per instruction-set level.
//
// Each kernel source is compiled three times (kernels/native.py): plain x86-64 ("default",
// the compiler may still auto-vectorize with SSE2), -mavx2 -mfma -mf16c ("avx2") and
// -mavx512f/bw/vl ("avx512"). The level a process uses follows aten's own dispatch level
// (ATEN_CPU_CAPABILITY), so one host can run and test every level up to what it has.
//
// vf is one vector of VL floats. Every kernel is written against these helpers only.
#pragma once

// The only symbols a library exports (it is built with -fvisibility=hidden).
#define TANDEM_API extern "C" __attribute__((visibility("default")))

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// A zero-filled buffer of n T aligned to a 64-byte cache line. Why: std::vector's storage is
// only 16-byte aligned, and then every 64-byte vector load of it spans two cache lines; the
// activation buffers the int4 kernels read once per weight row ran ~2x slower that way
// (measured, kernels/csrc/int4_linear.cpp).
#ifdef __cplusplus
#include <cstdlib>
#include <memory>
#include <new>
struct FreeDeleter { void operator()(void* p) const { std::free(p); } };
template <class T>
using AlignedBuffer = std::unique_ptr<T[], FreeDeleter>;
template <class T>
static inline AlignedBuffer<T> aligned_zeros(size_t n) {
    const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes ? bytes : 64);
    if (!p) throw std::bad_alloc();
    memset(p, 0, bytes ? bytes : 64);
    return AlignedBuffer<T>(static_cast<T*>(p));
}
#endif

static inline float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

// Round-to-nearest-even fp32 -> bf16, as torch's .to(torch.bfloat16) does (NaN kept quiet).
static inline uint16_t float_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float fp16_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {  // zero or subnormal: mant * 2^-24
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
#endif
}

// max |x_i| over n floats (the activation quantizers' row scale)
static inline float abs_max(const float* x, int64_t n) {
    float amax = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return amax;
}

#if defined(__AVX512F__)
#define TANDEM_VL 16
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vmax_lanes(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vload_bf16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// 16 int8 -> 16 floats
static inline vf vload_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// VL vectors -> one whose lane i is the sum of v[i]'s lanes: a transpose-and-add tree of 45
// instructions for 16 vectors, where 16 separate reductions take ~10 each and serialize.
static inline vf vsum_lanes(const vf* v) {
    __m512 u[8], w[4], z[2];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: x0+x2, y0+y2, x1+x3, y1+y3
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per 128-bit lane: the lane's sums of vectors 4i .. 4i+3
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)  // 128-bit lanes 0+1 and 2+3 of w[2i], then of w[2i+1]
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
// One 32-weight group of 4-bit values, ggml order (element i < 16: low nibble of byte i,
// element 16 + i: its high nibble), dequantized as q * d + m into out[0..32/VL).
// Independent int32 accumulators per row of x for a tile of R rows: an integer dot (vpdpwssd,
// vpdpbusd) waits ~5 cycles for the previous one into the same register, so ~8 chains in
// flight keep the unit busy; R rows give R chains already (measured on a Sapphire Rapids class
// Xeon).
// TANDEM_SPLIT_ZMM (kernels/native.py sets it on AMD Zen 4, which runs each 512-bit op as two
// 256-bit halves, so one 512-bit dot issues every ~2 cycles however many chains wait): there
// two chains for one or two rows keep that rate, and eight cost register spills and the adds
// that join them. A Q4_K layer at M = 1, weights streamed from memory, one thread, both builds
// alternating in one process: 0.82-0.89x the time (medians of 12-24 pairs, four runs).
// Integer sums are exact, so the chain count never changes a result.
#if defined(TANDEM_SPLIT_ZMM)
static constexpr int dot_chains(int rows) { return rows <= 4 ? 2 : 1; }
#else
static constexpr int dot_chains(int rows) { return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1; }
#endif

// The sum of A integer chains, as a tree (exact: the order changes nothing).
template <int A>
static inline __m512i sum_chains(const __m512i* c) {
    if constexpr (A == 1) {
        return c[0];
    } else {
        return _mm512_add_epi32(sum_chains<A / 2>(c), sum_chains<A / 2>(c + A / 2));
    }
}

// The same for 256-bit chains (a half-width tail chunk, int4_linear.cpp).
template <int A>
static inline __m256i sum_chains256(const __m256i* c) {
    if constexpr (A == 1) {
        return c[0];
    } else {
        return _mm256_add_epi32(sum_chains256<A / 2>(c), sum_chains256<A / 2>(c + A / 2));
    }
}

static inline void vdequant_q4(const uint8_t* qs, float d, float m, vf* out) {
    const __m128i b = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(0x0f);
    const vf vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    out[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), vd, vm);
    out[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask))), vd, vm);
}

#elif defined(__AVX2__)
#define TANDEM_VL 8
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vmax_lanes(vf a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vload_bf16(const uint16_t* p) {
    __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vload_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
// 8 vectors -> one whose lane i is the sum of v[i]'s lanes (a transpose-and-add tree).
static inline vf vsum_lanes(const vf* v) {
    __m256 u[4], w[2];
    for (int i = 0; i < 4; i++)
        u[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        w[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31));
}
static inline void vdequant_q4(const uint8_t* qs, float d, float m, vf* out) {
    const __m128i b = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const vf vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    out[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm);
    out[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm);
    out[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm);
    out[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm);
}

#else
// Portable level: a "vector" of 8 floats in a struct; loops the compiler may vectorize.
#define TANDEM_VL 8
typedef struct { float v[8]; } vf;
static inline vf vzero() { vf r; for (int i = 0; i < 8; i++) r.v[i] = 0.f; return r; }
static inline vf vset1(float a) { vf r; for (int i = 0; i < 8; i++) r.v[i] = a; return r; }
static inline vf vload(const float* p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
static inline void vstore(float* p, vf a) { memcpy(p, a.v, sizeof a.v); }
static inline vf vadd(vf a, vf b) { for (int i = 0; i < 8; i++) a.v[i] += b.v[i]; return a; }
static inline vf vmul(vf a, vf b) { for (int i = 0; i < 8; i++) a.v[i] *= b.v[i]; return a; }
static inline vf vfma(vf a, vf b, vf c) { for (int i = 0; i < 8; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
static inline vf vmax(vf a, vf b) { for (int i = 0; i < 8; i++) a.v[i] = b.v[i] > a.v[i] ? b.v[i] : a.v[i]; return a; }
static inline float vmax_lanes(vf a) {
    float m = a.v[0];
    for (int i = 1; i < 8; i++) m = a.v[i] > m ? a.v[i] : m;
    return m;
}
static inline float vsum(vf a) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += a.v[i];
    return s;
}
static inline vf vload_bf16(const uint16_t* p) { vf r; for (int i = 0; i < 8; i++) r.v[i] = bf16_to_float(p[i]); return r; }
static inline vf vload_i8(const int8_t* p) { vf r; for (int i = 0; i < 8; i++) r.v[i] = (float)p[i]; return r; }
static inline vf vsum_lanes(const vf* v) { vf r; for (int i = 0; i < 8; i++) r.v[i] = vsum(v[i]); return r; }
static inline void vdequant_q4(const uint8_t* qs, float d, float m, vf* out) {
    for (int i = 0; i < 16; i++) {
        out[i / 8].v[i % 8] = (float)(qs[i] & 0x0f) * d + m;
        out[2 + i / 8].v[i % 8] = (float)(qs[i] >> 4) * d + m;
    }
}
#endif

#define TANDEM_Q4_VECS (32 / TANDEM_VL)  // vectors per 32-weight group

// exp(x) for x <= 0 (softmax after subtracting the max), lane by lane: 2^(x log2 e) split into
// 2^n * 2^f with f in [-0.5, 0.5], 2^f by a degree-6 polynomial (relative error < 2e-7),
// 2^n added to the exponent bits. Inputs below -87 give 0 (exp underflows there anyway).
// libm's expf per element was most of the paged decode's time (measured).
static inline float exp_neg_scalar(float x) {
    if (x < -87.f) return 0.f;
    const float t = x * 1.44269504088896341f;
    const float n = nearbyintf(t), f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    uint32_t u;
    memcpy(&u, &p, 4);
    u += (uint32_t)((int32_t)n << 23);
    return bits_to_float(u);
}

#if defined(__AVX512F__)
static inline vf vexp_neg(vf x) {
    const __m512 lo = _mm512_set1_ps(-87.f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    const __m512 r = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
    return _mm512_mask_mov_ps(r, under, _mm512_setzero_ps());
}
#elif defined(__AVX2__)
static inline vf vexp_neg(vf x) {
    const __m256 lo = _mm256_set1_ps(-87.f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    const __m256 r = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
    return _mm256_andnot_ps(under, r);
}
#else
static inline vf vexp_neg(vf x) {
    for (int i = 0; i < 8; i++) x.v[i] = exp_neg_scalar(x.v[i]);
    return x;
}
#endif
