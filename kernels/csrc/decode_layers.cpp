// A decode pass's decoder layers in one call: the same kernels, with the same arguments and in
// the same order, as engine/models/llama.py's Python loop runs for a pass of decode tokens
// (rms_norm -> q|k|v -> [q/k norm] -> RoPE + KV write -> paged decode attention -> o ->
// rms_norm -> gate|up -> SiLU-and-mul -> down, per layer), so the result is the same bits.
// Why: that loop makes ~9 Python-level calls a layer, each a few microseconds of dispatch and
// tensor bookkeeping around a kernel that, for a small model's decode step, takes not much
// longer; a 30-layer model of hidden size 64 spent 3.9 ms a step in the loop, about a third of
// SmolLM2-135M's whole step on 2 cores. engine/native_decode.py builds the layer table once,
// decides when a pass qualifies (decode rows only, every projection in a native layout) and
// keeps the Python loop for everything else.
//
// Buffers (fp32, row-major, T rows): the caller's hidden (in: the embeddings; out: the last
// layer's output) and residual (out: the residual stream, to which the final norm adds the
// output); scratch for x, q|k|v, q, the attention output and gate|up comes from here.
#include <vector>

#include "simd.h"
#include "thread_pool.h"

extern "C" {
int tandem_int4_linear(const float*, int64_t, int64_t, int64_t, const uint8_t*, const uint16_t*,
                       const uint16_t*, int64_t, const float*, float*, int64_t);
int tandem_int4a8_linear(const float*, int64_t, int64_t, int64_t, const uint8_t*, const uint16_t*,
                         const uint16_t*, int64_t, const float*, float*, int64_t);
int tandem_int4_amx_linear(const float*, int64_t, int64_t, int64_t, const uint8_t*, const uint16_t*,
                           const uint16_t*, int64_t, const float*, float*, int64_t);
int tandem_q4k_amx_linear(const float*, int64_t, int64_t, int64_t, const uint8_t*, const uint8_t*,
                          const uint8_t*, const uint16_t*, int64_t, const float*, float*, int64_t);
int tandem_q4k_linear(const float*, int64_t, int64_t, int64_t, const uint8_t*, const uint8_t*,
                      const uint8_t*, const uint16_t*, int64_t, const float*, float*, int64_t, int);
int tandem_int8_linear(const float*, int64_t, int64_t, int64_t, const int8_t*, int64_t, int64_t,
                       const float*, const float*, float*, int64_t);
int tandem_q6k_linear(const float*, int64_t, int64_t, int64_t, const uint8_t*, const int8_t*,
                      const uint16_t*, int64_t, const float*, float*, int64_t);
int tandem_q6k_amx_linear(const float*, int64_t, int64_t, int64_t, const uint8_t*, const int8_t*,
                          const uint16_t*, int64_t, const float*, float*, int64_t);
int tandem_q8_0_linear(const float*, int64_t, int64_t, int64_t, const int8_t*, const uint16_t*, int64_t,
                       const float*, float*, int64_t);
int tandem_q5k_linear(const float*, int64_t, int64_t, int64_t, const uint8_t*, const uint8_t*, const uint8_t*,
                      const uint16_t*, int64_t, const float*, float*, int64_t);
int tandem_rms_norm(const float*, int64_t, const float*, int64_t, const float*, float*, float*,
                    int64_t, int64_t, float);
int tandem_rotary_kv_write(const float*, int64_t, const int64_t*, const float*, const float*, int64_t,
                           int64_t, int64_t, int64_t, int64_t, float*, void*, void*, int, int64_t,
                           const int64_t*);
int tandem_paged_decode(const float*, int64_t, const void*, const void*, int, int64_t, int64_t, int64_t,
                        int64_t, int64_t, const int32_t*, const int32_t*, const int32_t*, int64_t, int64_t,
                        float, float*, int64_t);
int tandem_silu_and_mul(const float*, int64_t, int64_t, int64_t, float*);
}

// One native linear: its layout (engine/native_decode.py KINDS) and arrays, as the Python
// wrappers pass them. A projection is 1 to 3 of them side by side in the output (a stack).
struct TandemLinear {
    int64_t kind, n, k;
    const void* w;
    const void* a;
    const void* b;
    const void* c;
    const float* bias;
};
struct TandemProj {
    int64_t nparts;
    TandemLinear parts[3];
};
struct TandemLayer {
    const float* input_norm;
    const float* post_norm;
    const float* q_norm;  // null unless the model norms q and k per head (Qwen3)
    const float* k_norm;
    TandemProj qkv, o, gate_up, down;
};
struct TandemDecodeArgs {
    int64_t t, hidden, hq, hkv, d, inter;
    float eps, scale;
    const int64_t* positions;
    const int64_t* slot_mapping;
    const float* cos;
    const float* sin;
    int64_t max_position;
    void* kv;  // [layers, 2, blocks, block_size, hkv, d], fp32 or bf16
    int64_t kv_bf16, num_blocks, block_size;
    const int32_t* rows32;  // the pass's decode plan (kernels/paged_attention.py DecodePlan)
    const int32_t* lens32;
    const int32_t* table32;
    int64_t table_stride, nseq;
};

enum { INT4 = 1, INT4A8 = 2, Q4K = 3, Q4KA8 = 4, INT8 = 5, Q6K = 6, Q8_0 = 7, Q5K = 8, INT4AMX = 9, Q4KAMX = 10, Q6KAMX = 11 };

static int projection_width(const TandemProj& p) {
    int64_t n = 0;
    for (int64_t i = 0; i < p.nparts; i++) n += p.parts[i].n;
    return (int)n;
}

// y [m, ldy] = x [m, k] @ W^T for every part of p, each in its own columns.
static int project(const TandemProj& p, const float* x, int64_t m, float* y, int64_t ldy) {
    int64_t col = 0;
    for (int64_t i = 0; i < p.nparts; i++) {
        const TandemLinear& l = p.parts[i];
        float* out = y + col;
        int rc;
        switch (l.kind) {
            case INT4:
                rc = tandem_int4_linear(x, m, l.k, l.k, (const uint8_t*)l.w, (const uint16_t*)l.a,
                                        (const uint16_t*)l.b, l.n, l.bias, out, ldy);
                break;
            case INT4A8:
                rc = tandem_int4a8_linear(x, m, l.k, l.k, (const uint8_t*)l.w, (const uint16_t*)l.a,
                                          (const uint16_t*)l.b, l.n, l.bias, out, ldy);
                break;
            case INT4AMX:
                rc = tandem_int4_amx_linear(x, m, l.k, l.k, (const uint8_t*)l.w, (const uint16_t*)l.a,
                                            (const uint16_t*)l.b, l.n, l.bias, out, ldy);
                break;
            case Q4KAMX:
                rc = tandem_q4k_amx_linear(x, m, l.k, l.k, (const uint8_t*)l.w, (const uint8_t*)l.a,
                                           (const uint8_t*)l.b, (const uint16_t*)l.c, l.n, l.bias, out, ldy);
                break;
            case Q4K:
            case Q4KA8:
                rc = tandem_q4k_linear(x, m, l.k, l.k, (const uint8_t*)l.w, (const uint8_t*)l.a,
                                       (const uint8_t*)l.b, (const uint16_t*)l.c, l.n, l.bias, out, ldy,
                                       l.kind == Q4KA8);
                break;
            case INT8:
                rc = tandem_int8_linear(x, m, l.k, l.k, (const int8_t*)l.w, l.n, l.k, (const float*)l.a,
                                        l.bias, out, ldy);
                break;
            case Q6K:
            case Q6KAMX:  // the same arrays, in AMX tile order
                rc = (l.kind == Q6K ? tandem_q6k_linear : tandem_q6k_amx_linear)(
                    x, m, l.k, l.k, (const uint8_t*)l.w, (const int8_t*)l.a, (const uint16_t*)l.b, l.n, l.bias, out,
                    ldy);
                break;
            case Q8_0:
                rc = tandem_q8_0_linear(x, m, l.k, l.k, (const int8_t*)l.w, (const uint16_t*)l.a, l.n,
                                        l.bias, out, ldy);
                break;
            case Q5K:
                rc = tandem_q5k_linear(x, m, l.k, l.k, (const uint8_t*)l.w, (const uint8_t*)l.a,
                                       (const uint8_t*)l.b, (const uint16_t*)l.c, l.n, l.bias, out, ldy);
                break;
            default:
                return 100;
        }
        if (rc) return 100 + rc;
        col += l.n;
    }
    return 0;
}

TANDEM_API int tandem_decode_layers(const TandemLayer* layers, int64_t num_layers, const TandemDecodeArgs* a,
                                    float* hidden, float* residual) {
    const int64_t t = a->t, h = a->hidden, qd = a->hq * a->d;
    if (t <= 0 || num_layers <= 0) return 1;
    const int64_t esize = a->kv_bf16 ? 2 : 4;
    const int64_t layer_elems = a->num_blocks * a->block_size * a->hkv * a->d;  // one of K or V
    const int64_t block_stride = a->block_size * a->hkv * a->d;
    int64_t qkv_w = 0, gu_w = 0;
    for (int64_t i = 0; i < num_layers; i++) {
        qkv_w = projection_width(layers[i].qkv) > qkv_w ? projection_width(layers[i].qkv) : qkv_w;
        gu_w = projection_width(layers[i].gate_up) > gu_w ? projection_width(layers[i].gate_up) : gu_w;
    }
    const auto x = aligned_zeros<float>((size_t)(t * h));
    const auto qkv = aligned_zeros<float>((size_t)(t * qkv_w));
    const auto q = aligned_zeros<float>((size_t)(t * qd));
    const auto attn = aligned_zeros<float>((size_t)(t * qd));
    const auto gu = aligned_zeros<float>((size_t)(t * gu_w));
    const auto act = aligned_zeros<float>((size_t)(t * (gu_w / 2)));
    int rc;
    // Layer 0's norm has no residual yet: the embeddings are the residual stream.
    memcpy(residual, hidden, (size_t)(t * h) * sizeof(float));
    for (int64_t i = 0; i < num_layers; i++) {
        const TandemLayer& L = layers[i];
        if (i == 0)
            rc = tandem_rms_norm(residual, h, nullptr, 0, L.input_norm, x.get(), x.get(), t, h, a->eps);
        else
            rc = tandem_rms_norm(hidden, h, residual, h, L.input_norm, x.get(), residual, t, h, a->eps);
        if (rc) return 200 + rc;
        const int64_t wq = projection_width(L.qkv);
        if ((rc = project(L.qkv, x.get(), t, qkv.get(), wq))) return rc;
        if (L.q_norm) {  // per head, in place: as kernels/rms_norm.py on each head's row
            for (int64_t r = 0; r < t; r++) {
                float* row = qkv.get() + r * wq;
                if ((rc = tandem_rms_norm(row, a->d, nullptr, 0, L.q_norm, row, row, a->hq, a->d, a->eps)) ||
                    (rc = tandem_rms_norm(row + qd, a->d, nullptr, 0, L.k_norm, row + qd, row + qd, a->hkv,
                                          a->d, a->eps)))
                    return 300 + rc;
            }
        }
        char* k_cache = (char*)a->kv + (2 * i) * layer_elems * esize;
        char* v_cache = (char*)a->kv + (2 * i + 1) * layer_elems * esize;
        if ((rc = tandem_rotary_kv_write(qkv.get(), wq, a->positions, a->cos, a->sin, a->max_position, t, a->hq,
                                         a->hkv, a->d, q.get(), k_cache, v_cache, (int)a->kv_bf16,
                                         a->num_blocks * a->block_size, a->slot_mapping)))
            return 400 + rc;
        if ((rc = tandem_paged_decode(q.get(), qd, k_cache, v_cache, (int)a->kv_bf16, block_stride, a->block_size,
                                      a->hkv, a->hq, a->d, a->rows32, a->lens32, a->table32, a->table_stride,
                                      a->nseq, a->scale, attn.get(), qd)))
            return 500 + rc;
        if ((rc = project(L.o, attn.get(), t, hidden, h))) return rc;
        if ((rc = tandem_rms_norm(hidden, h, residual, h, L.post_norm, x.get(), residual, t, h, a->eps)))
            return 200 + rc;
        const int64_t wg = projection_width(L.gate_up);
        if ((rc = project(L.gate_up, x.get(), t, gu.get(), wg))) return rc;
        if ((rc = tandem_silu_and_mul(gu.get(), t, wg / 2, wg, act.get()))) return 600 + rc;
        if ((rc = project(L.down, act.get(), t, hidden, h))) return rc;
    }
    return 0;
}
