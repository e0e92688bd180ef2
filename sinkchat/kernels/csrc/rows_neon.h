// The neon variant's row loops, one per weight family, each taking the layout's scale-forming step (matmul_neon.c:
// q4, q8g; matmul_neon_k.c: q4k, q8k): rows512.h's one-row loops and steps (see there for why a step passed in, and
// the span) with each 16-row group as four 4-row registers i (rows 4i..4i+3). Prefill runs them row by row.
#pragma once
#include "simd_neon.h"

#define SC_LOOP static inline __attribute__((always_inline))

// Rows 4i..4i+3 of block j of scale struct t (row group g's block b: t = (g*K/32 + b) / span, j = b % span) of a
// 4-bit layout -> their ds and mt; an 8-bit layout's also takes the half block k (columns 16k..16k+15).
typedef void (*q4_scales_fn)(const void* sw, size_t t, int j, int i, float32x4_t* ds, float32x4_t* mt);
typedef void (*q8_scales_fn)(const void* sw, size_t t, int j, int k, int i, float32x4_t* ds, float32x4_t* mt);

// acc + isum*(ds*dx), then + mt*sx, each fused: rows512.h's q_step per lane (mt: m, or the K-quants' -(dmin*mn)).
static inline float32x4_t q_step(float32x4_t acc, int32x4_t isum, float32x4_t ds, float32x4_t mt, float dx, float sx) {
    acc = vfmaq_f32(acc, vcvtq_f32_s32(isum), vmulq_f32(ds, vdupq_n_f32(dx)));
    return vfmaq_f32(acc, mt, vdupq_n_f32(sx));
}

// 4-bit nibbles: row m of the input, row groups g0..g1-1.
SC_LOOP void q4_row(const sc_xq* xa, int m, int K, int N, int g0, int g1, const sc_q4_block* qw, const void* sw,
                    const float* bias, float* y, q4_scales_fn scales, const int span) {
    int nb = K / QB;
    const int8_t* xm = xa->xq + (size_t)m * K;
    const float *dx = xa->dx + (size_t)m * nb, *sx = xa->sx + (size_t)m * nb;
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
        for (int b0 = 0; b0 < nb; b0 += span)
            for (int j = 0, b = b0; j < span; j++, b++) {
                int8x16x2_t x = xblock(xm + b * QB);
                for (int i = 0; i < 4; i++) {
                    float32x4_t ds, mt;
                    scales(sw, ((size_t)g * nb + b0) / span, j, i, &ds, &mt);
                    acc[i] = q_step(acc[i], q4_dot(wg + b, i, x), ds, mt, dx[b], sx[b]);
                }
            }
        for (int i = 0; i < 4; i++) put4(y + (size_t)m * N, g, i, acc[i], bias);
    }
}

// 8-bit bytes: per half block k its own accumulators, the two summed last (q8_dot: the exact dot(q, x)).
SC_LOOP void q8_row(const sc_xq* xa, const sc_x16* xh, int m, int K, int N, int g0, int g1, const sc_q8_block* hw,
                    const void* sw, const float* bias, float* y, q8_scales_fn scales, const int span) {
    int nb = K / QB, nh = K / 16;
    const int8_t* xm = xa->xq + (size_t)m * K;
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        float32x4_t acc[2][4];
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < 4; i++) acc[k][i] = vdupq_n_f32(0);
        for (int b0 = 0; b0 < nb; b0 += span)
            for (int j = 0, b = b0; j < span; j++, b++) {
                int8x16x2_t x = xblock(xm + b * QB);
                float dx = xa->dx[(size_t)m * nb + b];
                for (int k = 0; k < 2; k++) {
                    float s16 = xh->sx16[(size_t)m * nh + 2 * b + k];
                    for (int i = 0; i < 4; i++) {
                        float32x4_t ds, mt;
                        scales(sw, ((size_t)g * nb + b0) / span, j, k, i, &ds, &mt);
                        acc[k][i] = q_step(acc[k][i], q8_dot(wg + b, k, i, x.val[k]), ds, mt, dx, s16);
                    }
                }
            }
        for (int i = 0; i < 4; i++) put4(y + (size_t)m * N, g, i, vaddq_f32(acc[0][i], acc[1][i]), bias);
    }
}
