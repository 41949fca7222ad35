// Paged decode attention on the CPU: one query token per sequence, K/V read in place from the
// paged cache (no gather copy), all the batch's decode sequences in one call.
//
//     k_cache, v_cache  [num_blocks, block_size, Hkv, D]  fp32 or bf16, block b at b * block_stride
//     position p of a sequence lives in block table[p / block_size] at offset p % block_size
//     query head h reads kv head h / (Hq / Hkv) (GQA): the G = Hq / Hkv heads of one kv head
//     are computed together so each K/V row is read once per group.
//
// Per (sequence, kv head): scores = q . k * scale for every position, softmax in fp32 (two
// passes over a scores buffer: max, then exp), then the weighted sum of V. The (sequence, kv
// head) pairs are independent: threads (thread_pool.h) take contiguous slices of them.
//
// Where D is a multiple of the vector width (decode_pair_tiled; every LLaMA-family head size),
// the loops are arranged for the CPU rather than for the formula, since a naive q . k per
// position was bound by its horizontal sum (~10 dependent instructions for 4 fmas at D = 64):
//   scores: for VL positions at a time, each head's q . k is kept as a vector of partial sums
//     and the VL vectors are reduced together by one transpose-and-add tree (simd.h
//     vsum_lanes), so a position's reduction costs ~3 instructions;
//   P.V: per D-chunk of up to 8 vectors held in registers, per query head, over tiles of
//     PV_TILE positions whose V rows stay in L1 across the group's heads: an fma per vector
//     and position, no load or store of the accumulator per position.
// Measured on a Sapphire Rapids class host, one thread, SmolLM2-135M's heads (3 kv heads of 64,
// group 3), fp32 KV: one call for 8 sequences at context 320 from 297 to 220 us with the cache
// warm (a throw-away C++ harness), and a whole decode step's attention (30 layers, the KV
// streamed from memory) from 22.0 to 15.9 ms. On the way: a division per position to find its
// block, and a scalar max over the scores, had each cost a tenth to a fifth of the time.
#include <vector>

#include "simd.h"
#include "thread_pool.h"

template <bool BF16>
static inline float dot(const float* q, const void* kv, int64_t d) {
    vf acc = vzero();
    int64_t i = 0;
    for (; i + TANDEM_VL <= d; i += TANDEM_VL) {
        const vf k = BF16 ? vload_bf16((const uint16_t*)kv + i) : vload((const float*)kv + i);
        acc = vfma(vload(q + i), k, acc);
    }
    float s = vsum(acc);
    for (; i < d; i++) s += q[i] * (BF16 ? bf16_to_float(((const uint16_t*)kv)[i]) : ((const float*)kv)[i]);
    return s;
}

template <bool BF16>
static inline void axpy(float a, const void* kv, float* acc, int64_t d) {
    const vf va = vset1(a);
    int64_t i = 0;
    for (; i + TANDEM_VL <= d; i += TANDEM_VL) {
        const vf v = BF16 ? vload_bf16((const uint16_t*)kv + i) : vload((const float*)kv + i);
        vstore(acc + i, vfma(va, v, vload(acc + i)));
    }
    for (; i < d; i++) acc[i] += a * (BF16 ? bf16_to_float(((const uint16_t*)kv)[i]) : ((const float*)kv)[i]);
}

#define PV_TILE 32  // positions per tile of the P.V loop (their V rows: 8 KB at D = 64, fp32)

template <bool BF16>
static inline vf kv_load(const char* row, int64_t i) {
    return BF16 ? vload_bf16((const uint16_t*)row + i) : vload((const float*)row + i);
}

// Softmax of each head's len scores (row stride lenp) in place, unnormalized: exp(s - max);
// inv_sum[g] = 1 / the row's sum.
static inline void softmax_rows(float* scores, int64_t group, int64_t len, int64_t lenp, float* inv_sum) {
    for (int64_t g = 0; g < group; g++) {
        float* sg = scores + g * lenp;
        // The max by vectors: a scalar loop here is one dependent compare per position (it was
        // a fifth of the kernel's time at context 320).
        vf vm = vset1(-INFINITY);
        int64_t q = 0;
        for (; q + TANDEM_VL <= len; q += TANDEM_VL) vm = vmax(vm, vload(sg + q));
        float mx = vmax_lanes(vm);
        for (; q < len; q++) mx = sg[q] > mx ? sg[q] : mx;
        const vf vmx = vset1(mx);
        vf vs = vzero();
        int64_t p = 0;
        for (; p + TANDEM_VL <= len; p += TANDEM_VL) {
            const vf e = vexp_neg(vadd(vload(sg + p), vmul(vmx, vset1(-1.f))));
            vstore(sg + p, e);
            vs = vadd(vs, e);
        }
        float sum = vsum(vs);
        for (; p < len; p++) { sg[p] = exp_neg_scalar(sg[p] - mx); sum += sg[p]; }
        inv_sum[g] = 1.f / sum;
    }
}

// One (sequence, kv head) pair, D = DV vectors (the loop order in the header's comment; DV a
// compile-time constant so the short loops over D unroll into independent chains); the P.V
// accumulators are DC = min(DV, 8) vectors. scores: group rows of lenp >= len rounded up to VL
// floats; acc: group * d floats.
template <bool BF16, int DV>
static void decode_pair_tiled(const float* qh, const char* kc, const char* vc, const int32_t* table,
                              int64_t block_stride, int64_t bs, int64_t hkv, int64_t h, int64_t d,
                              int64_t group, int64_t len, float scale, float* scores, int64_t lenp,
                              float* acc, float* oh) {
    constexpr int DC = DV < 8 ? DV : 8;
    const int64_t esize = BF16 ? 2 : 4, dv = DV;
    // Byte offsets of positions [p0, p0 + n) in the cache, walking the block table (a division
    // per position, twice per head, had been most of the kernel's time).
    const auto rows_of = [&](int64_t p0, int64_t n, int64_t* out) {
        int64_t blk = p0 / bs, off = p0 % bs;
        for (int64_t i = 0; i < n; i++) {
            out[i] = ((int64_t)table[blk] * block_stride + (off * hkv + h) * d) * esize;
            if (++off == bs) off = 0, blk++;
        }
    };
    const vf vscale = vset1(scale);
    int64_t rows[PV_TILE > TANDEM_VL ? PV_TILE : TANDEM_VL];
    for (int64_t p0 = 0; p0 < len; p0 += TANDEM_VL) {
        const int64_t np = len - p0 < TANDEM_VL ? len - p0 : TANDEM_VL;
        const char* kr[TANDEM_VL];
        rows_of(p0, np, rows);
        for (int64_t i = 0; i < np; i++) kr[i] = kc + rows[i];
        for (int64_t g = 0; g < group; g++) {
            const float* qg = qh + g * d;
            vf part[TANDEM_VL];  // the VL positions' partial sums, lanes still to be added
            for (int64_t i = 0; i < TANDEM_VL; i++) {
                // two chains over D (an fma waits ~4 cycles for the last into its register)
                vf a0 = vzero(), a1 = vzero();
                if (i < np) {
                    for (int c = 0; c + 1 < DV; c += 2) {
                        a0 = vfma(vload(qg + c * TANDEM_VL), kv_load<BF16>(kr[i], c * TANDEM_VL), a0);
                        a1 = vfma(vload(qg + (c + 1) * TANDEM_VL), kv_load<BF16>(kr[i], (c + 1) * TANDEM_VL), a1);
                    }
                    if (DV % 2) a0 = vfma(vload(qg + (DV - 1) * TANDEM_VL), kv_load<BF16>(kr[i], (DV - 1) * TANDEM_VL), a0);
                }
                part[i] = vadd(a0, a1);
            }
            vstore(scores + g * lenp + p0, vmul(vsum_lanes(part), vscale));
        }
    }
    float inv_sum[64];
    softmax_rows(scores, group, len, lenp, inv_sum);
    for (int64_t e = 0; e < group * d; e++) acc[e] = 0.f;
    for (int64_t c0 = 0; c0 < dv; c0 += DC) {
        for (int64_t p0 = 0; p0 < len; p0 += PV_TILE) {
            const int64_t p1 = p0 + PV_TILE < len ? p0 + PV_TILE : len;
            rows_of(p0, p1 - p0, rows);
            for (int64_t g = 0; g < group; g++) {
                const float* sg = scores + g * lenp;
                float* ag = acc + g * d + c0 * TANDEM_VL;
                // Two sets of accumulators, alternate positions: each fma chain then waits for
                // every other position's, not for each one's.
                vf a[DC], b[DC];
                for (int c = 0; c < DC; c++) a[c] = vload(ag + c * TANDEM_VL), b[c] = vzero();
                int64_t p = p0;
                for (; p + 1 < p1; p += 2) {
                    const vf w0 = vset1(sg[p]), w1 = vset1(sg[p + 1]);
                    const char* v0 = vc + rows[p - p0];
                    const char* v1 = vc + rows[p + 1 - p0];
                    for (int c = 0; c < DC; c++) {
                        a[c] = vfma(w0, kv_load<BF16>(v0, (c0 + c) * TANDEM_VL), a[c]);
                        b[c] = vfma(w1, kv_load<BF16>(v1, (c0 + c) * TANDEM_VL), b[c]);
                    }
                }
                if (p < p1) {
                    const vf w = vset1(sg[p]);
                    const char* vr = vc + rows[p - p0];
                    for (int c = 0; c < DC; c++) a[c] = vfma(w, kv_load<BF16>(vr, (c0 + c) * TANDEM_VL), a[c]);
                }
                for (int c = 0; c < DC; c++) vstore(ag + c * TANDEM_VL, vadd(a[c], b[c]));
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t e = 0; e < d; e++) oh[g * d + e] = acc[g * d + e] * inv_sum[g];
}

// Pairs [i0, i1) of (sequence s, kv head h), i = s * hkv + h: the serial kernel over a slice.
template <bool BF16>
static void decode_pairs(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                         int64_t block_stride, int64_t bs, int64_t hkv, int64_t hq, int64_t d,
                         const int32_t* rows, const int32_t* lens, const int32_t* tables,
                         int64_t table_stride, float scale, float* out, int64_t out_stride,
                         int64_t i0, int64_t i1) {
    const int64_t group = hq / hkv, esize = BF16 ? 2 : 4;
    const char* kc = (const char*)k_cache;
    const char* vc = (const char*)v_cache;
    int64_t max_len = 0;
    for (int64_t i = i0; i < i1; i++) max_len = lens[i / hkv] > max_len ? lens[i / hkv] : max_len;
    const int64_t max_lenp = (max_len + TANDEM_VL - 1) / TANDEM_VL * TANDEM_VL;
    std::vector<float> scores((size_t)(group * max_lenp)), acc((size_t)(group * d));
    const int64_t dv = d % TANDEM_VL ? 0 : d / TANDEM_VL;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t s = i / hkv, h = i % hkv;
        const int64_t len = lens[s];
        const int32_t* table = tables + s * table_stride;
        const float* qh = q + rows[s] * q_stride + h * group * d;
        float* oh = out + rows[s] * out_stride + h * group * d;
        if (dv) {
            const int64_t lenp = (len + TANDEM_VL - 1) / TANDEM_VL * TANDEM_VL;
#define TANDEM_PAIR(DV)                                                                              \
    decode_pair_tiled<BF16, DV>(qh, kc, vc, table, block_stride, bs, hkv, h, d, group, len, scale,  \
                                scores.data(), lenp, acc.data(), oh)
            switch (dv) {  // head sizes 32-256 (AVX-512) or 16-128 (AVX2, portable)
                case 2: TANDEM_PAIR(2); continue;
                case 4: TANDEM_PAIR(4); continue;
                case 8: TANDEM_PAIR(8); continue;
                case 16: TANDEM_PAIR(16); continue;
                default: break;  // another head size: the generic loops below
            }
#undef TANDEM_PAIR
        }
        for (int64_t p = 0; p < len; p++) {
            const int64_t off = ((int64_t)table[p / bs] * block_stride + ((p % bs) * hkv + h) * d) * esize;
            for (int64_t g = 0; g < group; g++)
                scores[g * len + p] = dot<BF16>(qh + g * d, kc + off, d) * scale;
        }
        float inv_sum[64];
        softmax_rows(scores.data(), group, len, len, inv_sum);
        for (int64_t e = 0; e < group * d; e++) acc[e] = 0.f;
        for (int64_t p = 0; p < len; p++) {
            const int64_t off = ((int64_t)table[p / bs] * block_stride + ((p % bs) * hkv + h) * d) * esize;
            for (int64_t g = 0; g < group; g++) axpy<BF16>(scores[g * len + p], vc + off, acc.data() + g * d, d);
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t e = 0; e < d; e++) oh[g * d + e] = acc[g * d + e] * inv_sum[g];
    }
}

TANDEM_API int tandem_paged_decode(const float* q, int64_t q_stride, const void* k_cache,
                                   const void* v_cache, int kv_bf16, int64_t block_stride,
                                   int64_t bs, int64_t hkv, int64_t hq, int64_t d,
                                   const int32_t* rows, const int32_t* lens, const int32_t* tables,
                                   int64_t table_stride, int64_t n, float scale, float* out,
                                   int64_t out_stride) {
    if (hkv <= 0 || hq % hkv || hq / hkv > 64) return 1;
    for (int64_t s = 0; s < n; s++)
        if (lens[s] <= 0) return 2;  // a decode row attends to at least its own token
    // Threads take contiguous slices of the (sequence, kv head) pairs; each pair is computed
    // whole by one thread, in the serial order.
    tandem::parallel_for(0, n * hkv, 1, [&](int64_t i0, int64_t i1) {
        if (kv_bf16)
            decode_pairs<true>(q, q_stride, k_cache, v_cache, block_stride, bs, hkv, hq, d, rows, lens,
                               tables, table_stride, scale, out, out_stride, i0, i1);
        else
            decode_pairs<false>(q, q_stride, k_cache, v_cache, block_stride, bs, hkv, hq, d, rows, lens,
                                tables, table_stride, scale, out, out_stride, i0, i1);
    });
    return 0;
}
