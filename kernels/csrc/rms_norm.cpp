// RMSNorm fused with the residual add before it, fp32, one pass per token:
//
//     h = x + residual            (residual may be null: h = x)
//     y = h / sqrt(mean(h^2) + eps) * weight
//
// x, residual, y, h: [T, H] with row strides; weight [H]. Same definition as
// kernels/rms_norm.py's reference; the sum of squares accumulates in fp32 in vector lanes.
#include "simd.h"

TANDEM_API int tandem_rms_norm(const float* x, int64_t ldx, const float* residual, int64_t ldr,
                               const float* weight, float* y, float* h, int64_t t, int64_t hidden,
                               float eps) {
    if (hidden <= 0) return 1;
    for (int64_t r = 0; r < t; r++) {
        const float* xr = x + r * ldx;
        float* hr = h + r * hidden;
        float* yr = y + r * hidden;
        vf ss = vzero();
        int64_t i = 0;
        for (; i + TANDEM_VL <= hidden; i += TANDEM_VL) {
            vf v = vload(xr + i);
            if (residual) v = vadd(v, vload(residual + r * ldr + i));
            vstore(hr + i, v);
            ss = vfma(v, v, ss);
        }
        float sum = vsum(ss);
        for (; i < hidden; i++) {
            const float v = xr[i] + (residual ? residual[r * ldr + i] : 0.f);
            hr[i] = v;
            sum += v * v;
        }
        const float inv = 1.f / sqrtf(sum / (float)hidden + eps);
        const vf vinv = vset1(inv);
        i = 0;
        for (; i + TANDEM_VL <= hidden; i += TANDEM_VL) vstore(yr + i, vmul(vmul(vload(hr + i), vinv), vload(weight + i)));
        for (; i < hidden; i++) yr[i] = hr[i] * inv * weight[i];
    }
    return 0;
}
