// The attention prologue of one layer, fused: split the fused qkv projection, rotate q and k
// (RoPE, rotate-half "NeoX" convention), write k and v into the paged cache.
//
//     qkv   [T, ldqkv] fp32: q heads (Hq * D), then k heads (Hkv * D), then v heads (Hkv * D)
//     q_out [T, Hq, D] fp32, contiguous
//     cos, sin [max_position, D / 2] fp32;  c = cos[pos], s = sin[pos]
//         out[:D/2] = x[:D/2] * c - x[D/2:] * s,   out[D/2:] = x[D/2:] * c + x[:D/2] * s
//     k_cache, v_cache [num_blocks * block_size, Hkv, D] (token slots), fp32 or bf16 (rounded
//         to nearest even, as torch's .to(torch.bfloat16))
//     slot_mapping [T] int64: the cache slot of token t; negative = do not write (padding)
//
// One pass over each token's qkv row instead of the split, two rotations, two casts and two
// index copies of the unfused torch ops (kernels/rotary.py, kernels/kv_cache_write.py: the
// definitions this is tested against).
#include "simd.h"

static inline void rotate(const float* x, const float* c, const float* s, int64_t half, float* out) {
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[half + i];
        out[i] = a * c[i] - b * s[i];
        out[half + i] = b * c[i] + a * s[i];
    }
}

TANDEM_API int tandem_rotary_kv_write(const float* qkv, int64_t ldqkv, const int64_t* positions,
                                      const float* cos, const float* sin, int64_t max_position,
                                      int64_t t, int64_t hq, int64_t hkv, int64_t d, float* q_out,
                                      void* k_cache, void* v_cache, int kv_bf16, int64_t num_slots,
                                      const int64_t* slot_mapping) {
    if (d % 2 || d > 1024) return 1;
    const int64_t half = d / 2;
    float kbuf[1024];
    for (int64_t r = 0; r < t; r++) {
        const int64_t pos = positions[r];
        if (pos < 0 || pos >= max_position) return 2;
        const float* c = cos + pos * half;
        const float* s = sin + pos * half;
        const float* row = qkv + r * ldqkv;
        for (int64_t h = 0; h < hq; h++) rotate(row + h * d, c, s, half, q_out + (r * hq + h) * d);
        const int64_t slot = slot_mapping[r];
        if (slot < 0) continue;
        if (slot >= num_slots) return 3;
        for (int64_t h = 0; h < hkv; h++) {
            const float* k = row + (hq + h) * d;
            const float* v = row + (hq + hkv + h) * d;
            rotate(k, c, s, half, kbuf);
            const int64_t off = (slot * hkv + h) * d;
            if (kv_bf16) {
                uint16_t* kc = (uint16_t*)k_cache + off;
                uint16_t* vc = (uint16_t*)v_cache + off;
                for (int64_t i = 0; i < d; i++) { kc[i] = float_to_bf16(kbuf[i]); vc[i] = float_to_bf16(v[i]); }
            } else {
                memcpy((float*)k_cache + off, kbuf, (size_t)d * 4);
                memcpy((float*)v_cache + off, v, (size_t)d * 4);
            }
        }
    }
    return 0;
}
