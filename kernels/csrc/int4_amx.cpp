// int4 linear for decode on AMX-INT8 tiles: y[M, N] = x[M, K] @ W^T (+ bias), fp32 in and out,
// the "q4_1x" layout (kernels/quant_int4.py). The same arithmetic as tandem_int4_linear
// (int4_linear.cpp): x rounded to int16 per row with one fp32 scale, each group's exact float
// sum S kept, and
//
//     y[r, n] = dx[r] * sum_g d_g * (q_g . xq[r, g])  +  sum_g m_g * S[r, g]
//
// where each group's integer dot q_g . xq[r, g] is the very number the AVX-512 kernel sums;
// only the float order of the two sums differs (kernels/quant_int4.py `reference` bounds both).
//
// Why: at batch 8 the AVX-512 kernel is bound by its integer multiplies (one vpdpwssd per 32
// weights and row), so a step at M = 8 cost 1.9x one at M = 1 on a 1B model's 672 MB of
// weights. One tdpbusd multiplies a 16 x 32 tile of activations by a 32 x 16 tile of weights.
// Measured with a throw-away harness on a Sapphire Rapids class core (one thread, a 524,288 x
// 2,048 matrix streamed from memory): M = 8 over M = 1 1.90x for the AVX-512 kernel, 1.36-1.46x
// for this scheme, and M = 1 as fast as the AVX-512 kernel's.
//
// int16 activations on an int8 unit: xq = 256 hi + lo with lo = xq & 255 (u8) and
// hi' = (xq >> 8) + 128 (u8), so with Q the sum of a group's 32 q,
//
//     q . xq = 256 (hi' . q) + lo . q - 32768 Q
//
// One tdpbusd per group takes an A tile of 2R rows (the R rows' hi' then their lo, 32 bytes:
// one group) and a B tile of the group's q for 16 weight rows (8 rows of 64 bytes, VNNI order:
// tile row kk holds, per weight row n, q[n][4 kk .. 4 kk + 3] as int8). |hi' . q| <= 32 * 255 *
// 15 < 2^17: every int32 is exact, and so is the float of the group's dot (< 2^24).
//
// Weights ("q4_1x"), per block of 16 weight rows b and group g, 256 bytes at (b G + g) 256:
// 4 runs c of 64 bytes, byte j of run c = q[16 b + j / 4][32 g + 8 c + j % 4]
// | q[16 b + j / 4][32 g + 8 c + 4 + j % 4] << 4, so a run's low nibbles are B tile row 2 c and
// its high nibbles row 2 c + 1 (build_tile: two ands and a shift a run). d and m: fp16
// [N / 16, G, 16], the 16 weight rows' scales of group g side by side (one load per step).
// N % 16 == 0 and K % 32 == 0 (the layout's packer guarantees both). The "q4_kx" layout: a
// Q4_K matrix's nibbles in the same order and its own scales in tile rows (Q4KTileScales).
//
// The "q6_kx" layout (Q6_K, tandem_q6k_amx_linear): the integer dots of q6k_linear.cpp, a step
// per sub-block of 16 (A tiles of 16 bytes, B tiles of 4 rows holding q - 32 as int8, so the
// only offset is -32768 times the sum of q - 32; each sub-block's dot scaled by its own d sc).
// A step per pair of sub-blocks (each sub-block's x in A rows of its own, zeros elsewhere)
// halved the tile operations and ran M = 1 1.3x faster, but M = 8 0.8x (an 8192 x 2048 matrix
// in cache, one thread), as a tile then held 4 rows of x: not kept, since batches are what the
// tiles are for.
//
// Pipelining (measured in the harness): a tileloadd of a buffer stored just before costs ~70
// cycles (stores are not forwarded to tile loads), so B tiles are built LA steps ahead into a
// ring, and a C tile's int32 are read back LE steps after its tilestored, which itself waits
// for the next step's tdpbusd to be issued (amx_blocks). The steps run over (block, group)
// flattened, so the pipeline does not drain at each block's end.
//
// Batch invariance: a row of x goes through the same integer dots (exact) and the same float
// epilogue in the same order whatever row tile it falls in, whatever M and thread count.
// Threads take contiguous slices of blocks; each output is computed by one thread.
//
// Availability: only the avx512vnni build compiles the tiles (native.py adds -mamx-tile
// -mamx-int8 there); the OS must grant this process the tile data state (Linux
// arch_prctl(ARCH_REQ_XCOMP_PERM), which a VM may refuse: a tile instruction then dies with
// SIGILL). tandem_amx_available() asks once; kernels/quant_int4.py offers the layout only where
// it says 1, and tandem_int4_amx_linear refuses to run (code 3) where it does not.
#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "thread_pool.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define TANDEM_HAS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#endif

#ifdef TANDEM_HAS_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_MR 8          // rows of x per tile: A and C tiles hold 2 * 8 = 16 rows
#define LA 6              // B tiles built this many steps ahead
#define LE 2              // C tiles read back this many steps behind
#define RING 8            // >= LA + 2 and >= LE + 2, a power of 2
#define QRING 16          // qsum ring: written LA ahead, read LE behind
#define PF_BYTES 4096     // weight prefetch distance
#define SUB_BYTES 262144  // M > 8: weight bytes per sub-slice, re-read (from L2) by each row tile
static_assert(LA + 2 <= RING && LE + 2 <= RING && LA + LE + 2 <= QRING, "rings");

static int amx_permission() {
    // Granted per process; asking again is harmless. The CPUID bits are checked first so an old
    // kernel's EINVAL and a CPU without AMX read the same: no.
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    if (!tile || !int8) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 0;
}

static int amx_ok() {
    static std::atomic<int> state{-1};
    int s = state.load(std::memory_order_acquire);
    if (s < 0) {
        s = amx_permission();
        state.store(s, std::memory_order_release);
    }
    return s;
}

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// tmm0/tmm3: A (2R rows x KSTEP bytes); tmm1/tmm4: B (KSTEP / 4 rows x 64 bytes); tmm2/tmm5: C
// (2R x 16 int32). Per thread: the configuration is thread state.
static void configure_tiles(int rows_a, int kstep) {
    alignas(64) TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[3] = (uint8_t)rows_a, c.colsb[0] = c.colsb[3] = (uint16_t)kstep;
    c.rows[1] = c.rows[4] = (uint8_t)(kstep / 4), c.colsb[1] = c.colsb[4] = 64;
    c.rows[2] = c.rows[5] = (uint8_t)rows_a, c.colsb[2] = c.colsb[5] = 64;
    _tile_loadconfig(&c);
}

// One group's 256 packed bytes -> its B tile [8][64] of q as int8, and qsum[n] = 32768 * Q_n.
static inline void build_tile(const uint8_t* p, uint8_t* buf, int32_t* qsum) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i s = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512((const void*)(p + 64 * c));
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        _mm512_store_si512(buf + 64 * (2 * c), lo);
        _mm512_store_si512(buf + 64 * (2 * c + 1), hi);
        s = _mm512_add_epi8(s, _mm512_add_epi8(lo, hi));  // <= 8 * 15 per byte
    }
    // The 4 bytes of lane n are weight row n's: one dpbusd by ones sums them (Q_n <= 480).
    _mm512_store_si512(qsum, _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), s, _mm512_set1_epi8(1)), 15));
}

// One Q6_K step's 192 packed bytes (16 weight rows x one sub-block of 16) -> its B tile [4][64]
// of q - 32 as int8, and qsum[n] = 32768 * sum(q - 32). Bytes 0..127: run c's low nibbles are
// tile row 2 c's low 4 bits, its high nibbles row 2 c + 1's; bytes 128..191: bits 2 k, 2 k + 1
// of byte j are tile row k's byte j's high 2 bits (kernels/quant_q6_k.py `to_tile_order`).
static inline void build_q6_tile(const uint8_t* p, uint8_t* buf, int32_t* qsum) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(3), b32 = _mm512_set1_epi8(32);
    const __m512i h = _mm512_loadu_si512((const void*)(p + 128));
    __m512i s = _mm512_setzero_si512();
    for (int c = 0; c < 2; c++) {
        const __m512i v = _mm512_loadu_si512((const void*)(p + 64 * c));
        // 16-bit shifts: each byte is masked after, and a byte's high bits (<= 3) shifted left
        // by 4 stay inside it.
        const __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(h, 4 * c), m3);
        const __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(h, 4 * c + 2), m3);
        const __m512i r0 = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(v, m4), _mm512_slli_epi16(h0, 4)), b32);
        const __m512i r1 = _mm512_sub_epi8(
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_slli_epi16(h1, 4)), b32);
        _mm512_store_si512(buf + 64 * (2 * c), r0);
        _mm512_store_si512(buf + 64 * (2 * c + 1), r1);
        s = _mm512_add_epi8(s, _mm512_add_epi8(r0, r1));  // 4 values in -32..31: -128..124, an int8
    }
    // Lane n's 4 signed bytes are weight row n's: one dpbusd of ones by them sums them.
    _mm512_store_si512(qsum, _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), s), 15));
}

// x [M, ldx] -> per row tile (rows m0.. of up to AMX_MR), 2 R rows of K bytes at xa + 2 m0 K:
// hi' of its R rows, then their lo; dx [M]; S [M, G] exact group sums. The rounding is
// int4_linear.cpp quantize_rows': xq = rne(x * (32767 / max|x|)).
static void quantize_split(const float* x, int64_t m, int64_t k, int64_t ldx, uint8_t* xa, float* dx, float* S) {
    const int64_t groups = k / 32;
    for (int64_t r = 0; r < m; r++) {
        const int64_t m0 = r / AMX_MR * AMX_MR, rt = m - m0 < AMX_MR ? m - m0 : AMX_MR;
        uint8_t* hi_row = xa + (2 * m0 + (r - m0)) * k;
        uint8_t* lo_row = xa + (2 * m0 + rt + (r - m0)) * k;
        const float* xr = x + r * ldx;
        const float amax = abs_max(xr, k);
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i b255 = _mm512_set1_epi32(255), b128 = _mm512_set1_epi32(128);
        for (int64_t g = 0; g < groups; g++) {
            const __m512 v0 = _mm512_loadu_ps(xr + 32 * g), v1 = _mm512_loadu_ps(xr + 32 * g + 16);
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(h ? v1 : v0, vinv));  // |q| <= 32767
                const __m512i hi = _mm512_xor_si512(_mm512_and_si512(_mm512_srai_epi32(q, 8), b255), b128);
                _mm_storeu_si128((__m128i*)(hi_row + 32 * g + 16 * h), _mm512_cvtepi32_epi8(hi));
                _mm_storeu_si128((__m128i*)(lo_row + 32 * g + 16 * h), _mm512_cvtepi32_epi8(_mm512_and_si512(q, b255)));
            }
            S[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        }
        dx[r] = amax / 32767.f;
    }
}

// The float scales of step (block b, group g) for its 16 weight rows, w = q d + m: the
// "q4_1x" layout's fp16 d and m, or the "q4_kx" layout's Q4_K scales (int4_linear.cpp
// Q4KScales: d sc and -(dmin mn), exact in fp32, the products ggml's dequantizer forms).
// A step is one group of 32 weights of a block: A tiles of 32 bytes, B tiles of 8 rows, a
// 256-byte step of nibbles, and an offset term m S.
struct Int4Step {
    static constexpr int KSTEP = 32, STEP_BYTES = 256;
    static constexpr bool HAS_MIN = true;
    static inline void build(const uint8_t* p, uint8_t* buf, int32_t* qsum) { build_tile(p, buf, qsum); }
};
struct Q41TileScales : Int4Step {
    const uint16_t* d16;  // [N / 16, G, 16]
    const uint16_t* m16;  // [N / 16, G, 16]
    int64_t groups;
    inline void operator()(int64_t b, int64_t g, __m512& dv, __m512& mv) const {
        const int64_t at = (b * groups + g) * 16;
        dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d16 + at)));
        mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m16 + at)));
    }
};
struct Q4KTileScales : Int4Step {
    const uint8_t* sc;    // [N / 16, G, 16]
    const uint8_t* mins;  // [N / 16, G, 16]
    const uint16_t* dm;   // [N / 16, G / 8, 2, 16]: per super-block the rows' d, then their dmin
    int64_t groups;
    inline void operator()(int64_t b, int64_t g, __m512& dv, __m512& mv) const {
        const int64_t at = (b * groups + g) * 16;
        const uint16_t* h = dm + (b * (groups / 8) + g / 8) * 32;
        const __m512 vs = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sc + at))));
        const __m512 vm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mins + at))));
        dv = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h)), vs);
        mv = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + 16))), vm));
    }
};
// The "q6_kx" layout (Q6_K): a step is one sub-block of 16 (A tiles of 16 bytes, B tiles of 4
// rows, 192 bytes of 6-bit q), w = (d sc) (q - 32) with q - 32 in the B tile itself, so no
// offset term: dv = d sc (exact in fp32: 11 by 8 significant bits), mv unused.
struct Q6KStep {
    static constexpr int KSTEP = 16, STEP_BYTES = 192;
    static constexpr bool HAS_MIN = false;
    static inline void build(const uint8_t* p, uint8_t* buf, int32_t* qsum) { build_q6_tile(p, buf, qsum); }
};
struct Q6KTileScales : Q6KStep {
    const int8_t* sc;   // [N / 16, K / 16, 16]
    const uint16_t* d;  // [N / 16, K / 256, 16]
    int64_t groups;     // sub-blocks a row: K / 16
    inline void operator()(int64_t b, int64_t g, __m512& dv, __m512&) const {
        const int64_t at = (b * groups + g) * 16;
        const __m512 vs = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sc + at))));
        dv = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + (b * (groups / 16) + g / 16) * 16))), vs);
    }
};

template <class Scales>
struct AmxArgs {
    int64_t k, groups, n;  // groups: steps a row, K / KSTEP
    const uint8_t* qs;
    Scales scales;
    const float* bias;
    const uint8_t* xa;
    const float* dx;
    const float* S;
    float* y;
    int64_t ldy;
};

// Blocks [b0, b1) for rows m0 .. m0 + R of x (tiles configured for 2R rows).
// pre, preq (or null): the B tiles and qsums of these blocks' steps, built beforehand (M > 8:
// once per sub-slice, for every row tile); else each is built LA steps ahead into a ring.
template <int R, class Scales>
static void amx_blocks(const AmxArgs<Scales>& a, int64_t m0, int64_t b0, int64_t b1, const uint8_t* pre,
                       const int32_t* preq) {
    constexpr int KSTEP = Scales::KSTEP, SB = Scales::STEP_BYTES, BT = 16 * KSTEP;  // BT: a B tile's bytes
    const int64_t G = a.groups, K = a.k, T = (b1 - b0) * G;
    alignas(64) uint8_t bbuf[RING][BT];
    alignas(64) int32_t qring[QRING][16];
    alignas(64) int32_t cbuf[RING][2 * AMX_MR * 16];
    const uint8_t* w0 = a.qs + b0 * G * SB;
    const char* wend = (const char*)(a.qs + (a.n / 16) * G * SB);
    const uint8_t* xa = a.xa + 2 * m0 * K;
    const float* S = Scales::HAS_MIN ? a.S + m0 * G : nullptr;  // group sums: int4 steps only
    __m512 acc1[R], acc2[R];
    for (int r = 0; r < R; r++) acc1[r] = acc2[r] = _mm512_setzero_ps();
    if (!pre)
        for (int64_t i = 0; i < LA && i < T; i++) Scales::build(w0 + i * SB, bbuf[i % RING], qring[i % QRING]);
    // Step j is (block b0 + j / G, group j % G). Both walks are sequential, so they keep
    // (block, group) counters rather than a 64-bit division each per step (tens of cycles, of
    // a step that takes ~50 at M = 1).
    int64_t eb = b0, eg = 0;  // the next epilogue's step
    const auto epilogue = [&](int64_t j) {
        const int64_t b = eb, g = eg;
        if (++eg == G) eg = 0, eb++;
        __m512 dv, mv = _mm512_setzero_ps();
        a.scales(b, g, dv, mv);
        const int32_t* c = cbuf[j % RING];
        const __m512i qq = _mm512_load_si512(pre ? preq + 16 * j : qring[j % QRING]);
        for (int r = 0; r < R; r++) {
            const __m512i hi = _mm512_load_si512(c + 16 * r), lo = _mm512_load_si512(c + 16 * (R + r));
            const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo), qq);
            acc1[r] = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(dot), acc1[r]);
            if constexpr (Scales::HAS_MIN) acc2[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(S[r * G + g]), acc2[r]);
        }
        if (g == G - 1) {
            const __m512 vb = a.bias ? _mm512_loadu_ps(a.bias + 16 * b) : _mm512_setzero_ps();
            for (int r = 0; r < R; r++) {
                const __m512 out = _mm512_fmadd_ps(_mm512_set1_ps(a.dx[m0 + r]), acc1[r], acc2[r]);
                _mm512_storeu_ps(a.y + (m0 + r) * a.ldy + 16 * b, _mm512_add_ps(out, vb));
                acc1[r] = acc2[r] = _mm512_setzero_ps();
            }
        }
    };
    // Step i: build tile i + LA, multiply tile i; the tile registers alternate so consecutive
    // steps do not wait on each other.
    // A C tile is stored after the next step's tdpbusd is issued, not right after its own: a
    // tilestored behind the tdpbusd that writes its tile waits out that multiply's latency
    // (measured: half of a Q6_K pass at M = 1 sat on that store).
#define TANDEM_AMX_STEP(i, g, TA, TB, TC)                                                          \
    do {                                                                                           \
        if (!pre && (i) + LA < T)                                                                  \
            Scales::build(w0 + ((i) + LA) * SB, bbuf[((i) + LA) % RING], qring[((i) + LA) % QRING]); \
        _tile_loadd(TB, pre ? pre + BT * (i) : bbuf[(i) % RING], 64);                              \
        _tile_loadd(TA, xa + KSTEP * (g), K);                                                      \
        _tile_zero(TC);                                                                            \
        _tile_dpbusd(TC, TA, TB);                                                                  \
    } while (0)
    int64_t done = 0;  // steps whose epilogue ran
    int64_t g0 = 0;    // step i's group
    for (int64_t i = 0; i < T; i += 2) {
        const int64_t g1 = g0 + 1 == G ? 0 : g0 + 1;
        const char* p = (const char*)(w0 + (i + LA) * SB) + PF_BYTES;
        if (!pre)
            for (int off = 0; off < 2 * SB; off += 64)
                if (p + off < wend) _mm_prefetch(p + off, _MM_HINT_T0);
        TANDEM_AMX_STEP(i, g0, 0, 1, 2);
        if (i > 0) _tile_stored(5, cbuf[(i - 1) % RING], 64);
        if (i + 1 < T) TANDEM_AMX_STEP(i + 1, g1, 3, 4, 5);
        _tile_stored(2, cbuf[i % RING], 64);
        g0 = g1 + 1 == G ? 0 : g1 + 1;
        // C of steps <= i - 2 was stored an iteration ago: LE steps behind its store
        for (; done + LE < i + 1 && done < T; done++) epilogue(done);
    }
    if (T % 2 == 0 && T > 0) _tile_stored(5, cbuf[(T - 1) % RING], 64);
#undef TANDEM_AMX_STEP
    for (; done < T; done++) epilogue(done);
}

template <class Scales>
static void amx_rows(const AmxArgs<Scales>& a, int64_t m, int64_t b0, int64_t b1) {
    // One row tile: the whole slice in one pipeline, each tile built once. More: sub-slices
    // whose tiles, built once up front, stay in L2 while every row tile passes over them, so
    // the weights come from memory once and each tile is built once whatever M is.
    constexpr int SB = Scales::STEP_BYTES, BT = 16 * Scales::KSTEP;
    const int64_t G = a.groups;
    const int64_t sub = m <= AMX_MR ? b1 - b0 : (SUB_BYTES / (G * SB) > 1 ? SUB_BYTES / (G * SB) : 1);
    AlignedBuffer<uint8_t> pre;
    AlignedBuffer<int32_t> preq;
    if (m > AMX_MR) pre = aligned_zeros<uint8_t>((size_t)(sub * G * BT)), preq = aligned_zeros<int32_t>((size_t)(sub * G * 16));
    for (int64_t s0 = b0; s0 < b1; s0 += sub) {
        const int64_t s1 = s0 + sub < b1 ? s0 + sub : b1;
        if (m > AMX_MR)
            for (int64_t i = 0; i < (s1 - s0) * G; i++)
                Scales::build(a.qs + (s0 * G + i) * SB, pre.get() + BT * i, preq.get() + 16 * i);
        for (int64_t m0 = 0; m0 < m; m0 += AMX_MR) {
            const int r = (int)(m - m0 < AMX_MR ? m - m0 : AMX_MR);
            configure_tiles(2 * r, Scales::KSTEP);
#define TANDEM_AMX_TILE(R) amx_blocks<R>(a, m0, s0, s1, m > AMX_MR ? pre.get() : nullptr, preq.get())
            switch (r) {
                case 1: TANDEM_AMX_TILE(1); break;
                case 2: TANDEM_AMX_TILE(2); break;
                case 3: TANDEM_AMX_TILE(3); break;
                case 4: TANDEM_AMX_TILE(4); break;
                case 5: TANDEM_AMX_TILE(5); break;
                case 6: TANDEM_AMX_TILE(6); break;
                case 7: TANDEM_AMX_TILE(7); break;
                default: TANDEM_AMX_TILE(8); break;
            }
#undef TANDEM_AMX_TILE
        }
    }
    _tile_release();
}
#endif  // TANDEM_HAS_AMX

// 1 where this build has the tile kernels and the OS lets this process use them (asked once).
TANDEM_API int tandem_amx_available() {
#ifdef TANDEM_HAS_AMX
    return amx_ok();
#else
    return 0;
#endif
}

#ifdef TANDEM_HAS_AMX
template <class Scales>
static int amx_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* qs, const Scales& scales,
                      int64_t n, const float* bias, float* y, int64_t ldy) {
    if (!amx_ok()) return 3;
    if (m == 0 || n == 0) return 0;
    const int64_t groups = k / 32;
    const auto xa = aligned_zeros<uint8_t>((size_t)(2 * m * k));
    const auto dx = aligned_zeros<float>((size_t)m), sums = aligned_zeros<float>((size_t)(m * groups));
    // x is quantized once, before the split: every thread reads the same xa, dx and sums.
    quantize_split(x, m, k, ldx, xa.get(), dx.get(), sums.get());
    const AmxArgs<Scales> args{k, k / Scales::KSTEP, n, qs, scales, bias, xa.get(), dx.get(), sums.get(), y, ldy};
    tandem::parallel_for(0, n / 16, 1, [&](int64_t b0, int64_t b1) { amx_rows(args, m, b0, b1); });
    return 0;
}
#endif

// The "q4_1x" layer (header comment). Codes: 1 K % 32, 2 negative sizes or N % 16, 3 no AMX here.
TANDEM_API int tandem_int4_amx_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* qs,
                                      const uint16_t* d16, const uint16_t* m16, int64_t n, const float* bias,
                                      float* y, int64_t ldy) {
    if (k % 32) return 1;
    if (m < 0 || n < 0 || n % 16) return 2;
#ifdef TANDEM_HAS_AMX
    return amx_linear(x, m, k, ldx, qs, Q41TileScales{{}, d16, m16, k / 32}, n, bias, y, ldy);
#else
    (void)x, (void)ldx, (void)qs, (void)d16, (void)m16, (void)bias, (void)y, (void)ldy;
    return 3;
#endif
}

// The "q4_kx" layer: a Q4_K matrix's nibbles in the same tile order, its own scales (sc and mn
// per group, fp16 d and dmin per super-block of 8 groups) in tile rows. Codes: 1 K % 256, else
// as above.
TANDEM_API int tandem_q4k_amx_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* qs,
                                     const uint8_t* sc, const uint8_t* mins, const uint16_t* dm, int64_t n,
                                     const float* bias, float* y, int64_t ldy) {
    if (k % 256) return 1;
    if (m < 0 || n < 0 || n % 16) return 2;
#ifdef TANDEM_HAS_AMX
    return amx_linear(x, m, k, ldx, qs, Q4KTileScales{{}, sc, mins, dm, k / 32}, n, bias, y, ldy);
#else
    (void)x, (void)ldx, (void)qs, (void)sc, (void)mins, (void)dm, (void)bias, (void)y, (void)ldy;
    return 3;
#endif
}

// The "q6_kx" layer: a Q6_K matrix's 6-bit q in tile order (blocks of 16 weight rows, 192 bytes
// a sub-block of 16), sc int8 [N / 16, K / 16, 16] and d fp16 [N / 16, K / 256, 16] in tile
// rows (kernels/quant_q6_k.py). The same integer dots as tandem_q6k_linear (q6k_linear.cpp),
// |xq . (q - 32)| <= 16 * 32768 * 32 = 2^24 exact in int32 and in its float; the float sums run
// per weight row over sub-blocks in order. Codes: 1 K % 256, 2 negative sizes or N % 16, 3 no
// AMX here.
TANDEM_API int tandem_q6k_amx_linear(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* qs,
                                     const int8_t* sc, const uint16_t* d, int64_t n, const float* bias, float* y,
                                     int64_t ldy) {
    if (k % 256) return 1;
    if (m < 0 || n < 0 || n % 16) return 2;
#ifdef TANDEM_HAS_AMX
    return amx_linear(x, m, k, ldx, qs, Q6KTileScales{{}, sc, d, k / 16}, n, bias, y, ldy);
#else
    (void)x, (void)ldx, (void)qs, (void)sc, (void)d, (void)bias, (void)y, (void)ldy;
    return 3;
#endif
}
