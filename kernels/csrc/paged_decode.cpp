// Paged decode attention on the CPU: one query token per sequence, K/V read in place from the
// paged cache (no gather copy), all the batch's decode sequences in one call.
//
//     k_cache, v_cache  [num_blocks, block_size, Hkv, D]  fp32 or bf16, block b at b * block_stride
//     position p of a sequence lives in block table[p / block_size] at offset p % block_size
//     query head h reads kv head h / (Hq / Hkv) (GQA): the G = Hq / Hkv heads of one kv head
//     are computed together so each K/V row is read once per group.
//
// Per (sequence, kv head): scores = q . k * scale for every position, softmax in fp32 (two
// passes over a scores buffer: max, then exp and the weighted sum of V). The (sequence, kv head)
// pairs are independent: threads (thread_pool.h) take contiguous slices of them.
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
    std::vector<float> scores((size_t)(group * max_len)), acc((size_t)(group * d));
    for (int64_t i = i0; i < i1; i++) {
        const int64_t s = i / hkv, h = i % hkv;
        const int64_t len = lens[s];
        const int32_t* table = tables + s * table_stride;
        const float* qh = q + rows[s] * q_stride + h * group * d;
        float* oh = out + rows[s] * out_stride + h * group * d;
        for (int64_t p = 0; p < len; p++) {
            const int64_t off = ((int64_t)table[p / bs] * block_stride + ((p % bs) * hkv + h) * d) * esize;
            for (int64_t g = 0; g < group; g++)
                scores[g * len + p] = dot<BF16>(qh + g * d, kc + off, d) * scale;
        }
        float inv_sum[64];
        for (int64_t g = 0; g < group; g++) {
            float* sg = scores.data() + g * len;
            float mx = -INFINITY;
            for (int64_t p = 0; p < len; p++) mx = sg[p] > mx ? sg[p] : mx;
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
