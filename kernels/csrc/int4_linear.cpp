// Weight-only int4 linear for decode: y[M, N] = x[M, K] @ W^T (+ bias), fp32 in and out.
//
// W is stored as ggml Q4_1 blocks, row after row: row n holds K / 32 blocks of 20 bytes
//
//     [ d: fp16 | m: fp16 | qs: 16 bytes ]     w[n, 32 g + i] = q_i * d + m,  q_i in 0..15
//     qs byte i = q_i | q_{16 + i} << 4
//
// which is the GGUF's own Q4_1 block, so a Q4_1 model is used as stored (Q4_0 maps to it with
// m = -8 d exactly). The kernel streams each row once, dequantizes a group into registers and
// multiplies it into up to MB rows of x at a time (MB accumulators per row held in registers),
// so a batch of M rows reads the weights once per tile of MB rows from L1, not from memory.
#include "simd.h"

#if defined(__AVX512F__)
#define MB 8
#else
#define MB 4
#endif

static const int BLOCK_BYTES = 20;

template <int R>
static inline void row_tile(const uint8_t* wrow, int64_t groups, const float* x, int64_t ldx,
                            float* out /* [R] */) {
    vf acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = vzero();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t* blk = wrow + g * BLOCK_BYTES;
        uint16_t dh, mh;
        memcpy(&dh, blk, 2);
        memcpy(&mh, blk + 2, 2);
        vf w[TANDEM_Q4_VECS];
        vdequant_q4(blk + 4, fp16_to_float(dh), fp16_to_float(mh), w);
        const float* xg = x + g * 32;
        for (int r = 0; r < R; r++)
            for (int j = 0; j < TANDEM_Q4_VECS; j++)
                acc[r][j & 1] = vfma(w[j], vload(xg + r * ldx + j * TANDEM_VL), acc[r][j & 1]);
    }
    for (int r = 0; r < R; r++) out[r] = vsum(vadd(acc[r][0], acc[r][1]));
}

// All M rows against output n: full tiles of MB rows, then one tile of the remainder. The loop
// over n is outermost so that each weight row is read from memory once whatever M is.
static inline int row_all(const uint8_t* wrow, int64_t groups, const float* x, int64_t m, int64_t ldx,
                          float bias, float* y, int64_t ldy) {
    float out[MB];
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        const float* xr = x + m0 * ldx;
        const int64_t r = m - m0 < MB ? m - m0 : MB;
        switch (r) {
            case 1: row_tile<1>(wrow, groups, xr, ldx, out); break;
            case 2: row_tile<2>(wrow, groups, xr, ldx, out); break;
            case 3: row_tile<3>(wrow, groups, xr, ldx, out); break;
            case 4: row_tile<4>(wrow, groups, xr, ldx, out); break;
#if MB > 4
            case 5: row_tile<5>(wrow, groups, xr, ldx, out); break;
            case 6: row_tile<6>(wrow, groups, xr, ldx, out); break;
            case 7: row_tile<7>(wrow, groups, xr, ldx, out); break;
            case 8: row_tile<8>(wrow, groups, xr, ldx, out); break;
#endif
            default: return 2;
        }
        for (int64_t i = 0; i < r; i++) y[(m0 + i) * ldy] = out[i] + bias;
    }
    return 0;
}

TANDEM_API int tandem_int4_linear(const float* x, int64_t m, int64_t k, int64_t ldx,
                                  const uint8_t* w, int64_t n, const float* bias,
                                  float* y, int64_t ldy) {
    if (k % 32) return 1;
    const int64_t groups = k / 32;
    for (int64_t j = 0; j < n; j++)
        if (row_all(w + j * groups * BLOCK_BYTES, groups, x, m, ldx, bias ? bias[j] : 0.f, y + j, ldy)) return 2;
    return 0;
}
