// The neon variant's row loops, one per weight family, each taking the layout's scale-forming step (matmul_neon.c:
// q4, q8g; matmul_neon_k.c: q4k, q8k, q6k) and, 8-bit, its weight-unpack step (q8_bytes, q6k_bytes): rows512.h's
// one-row loops and steps (see there for why a step passed in, and the span) with each 16-row group as four 4-row
// registers i (rows 4i..4i+3). Prefill runs them row by row.
#pragma once
#include "simd_neon.h"

#define SC_LOOP static inline __attribute__((always_inline))

// Rows 4i..4i+3 of block j of scale struct t (row group g's block b: t = (g*K/32 + b) / span, j = b % span) of a
// 4-bit layout -> their ds and mt; an 8-bit layout's also takes the half block k (columns 16k..16k+15).
typedef void (*q4_scales_fn)(const void* sw, size_t t, int j, int i, float32x4_t* ds, float32x4_t* mt);
typedef void (*q8_scales_fn)(const void* sw, size_t t, int j, int k, int i, float32x4_t* ds, float32x4_t* mt);
// The 8-bit family's weight-unpack step (rows512.h: q8_load_fn): rows 4i..4i+3 of half block k (sub-blocks
// 4k..4k+3) of block blk (g*K/32 + b) as their signed q (q8_bytes: from the stored q + 128; q6k_bytes: rebuilt).
typedef void (*q8_load_fn)(const void* hw, size_t blk, int k, int i, int8x16_t w[4]);

static inline void q8_bytes(const void* hw, size_t blk, int k, int i, int8x16_t w[4]) {
    q8_load((const sc_q8_block*)hw + blk, k, i, w);
}

// q6k (rows512.h: q6k_bytes): half block k is nibble tiles 2k, 2k + 1 and plane k; q = (nibble | 2 bits << 4) - 32.
static inline void q6k_bytes(const void* hw, size_t blk, int k, int i, int8x16_t w[4]) {
    const sc_q6k_block* wb = (const sc_q6k_block*)hw + blk;
    const uint8x16_t lo4 = vdupq_n_u8(0x0F), hi2 = vdupq_n_u8(0x30), off = vdupq_n_u8(32);
    uint8x16_t p = vld1q_u8(wb->h[k][4 * i]);
    uint8x16_t hs[4] = {vshlq_n_u8(p, 4), vshlq_n_u8(p, 2), p, vshrq_n_u8(p, 2)};
    for (int n = 0; n < 2; n++) {
        uint8x16_t v = vld1q_u8(wb->q[2 * k + n][4 * i]);
        uint8x16_t u[2] = {vandq_u8(v, lo4), vshrq_n_u8(v, 4)};
        for (int e = 0; e < 2; e++)
            w[2 * n + e] = vreinterpretq_s8_u8(vsubq_u8(vorrq_u8(u[e], vandq_u8(hs[2 * n + e], hi2)), off));
    }
}

// q5 blocks (rows512.h: q5_bytes): half block k is nibble tiles 2k, 2k + 1 and bits 4k..4k+3 of the plane;
// q = (nibble | bit << 4) - off (q50: 16; q51, q5k: 0).
static inline void q5_bytes(const void* hw, size_t blk, int k, int i, int8x16_t w[4], int off) {
    const sc_q5_block* wb = (const sc_q5_block*)hw + blk;
    const uint8x16_t lo4 = vdupq_n_u8(0x0F), one = vdupq_n_u8(1), o = vdupq_n_u8((uint8_t)off);
    uint8x16_t p = vld1q_u8(wb->h[4 * i]);
    for (int n = 0; n < 2; n++) {
        uint8x16_t v = vld1q_u8(wb->q[2 * k + n][4 * i]);
        uint8x16_t u[2] = {vandq_u8(v, lo4), vshrq_n_u8(v, 4)};
        for (int e = 0; e < 2; e++) {
            uint8x16_t bit = vandq_u8(vshlq_u8(p, vdupq_n_s8((int8_t)-(4 * k + 2 * n + e))), one);  // right: to bit 0
            w[2 * n + e] = vreinterpretq_s8_u8(vsubq_u8(vorrq_u8(u[e], vshlq_n_u8(bit, 4)), o));
        }
    }
}
static inline void q50_bytes(const void* hw, size_t blk, int k, int i, int8x16_t w[4]) {
    q5_bytes(hw, blk, k, i, w, 16);
}
static inline void q51_bytes(const void* hw, size_t blk, int k, int i, int8x16_t w[4]) {
    q5_bytes(hw, blk, k, i, w, 0);
}

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
            #pragma GCC unroll 8  // a super-block's 8 blocks: q4k_v's word index and shift fold to constants
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
SC_LOOP void q8_row(const sc_xq* xa, const sc_x16* xh, int m, int K, int N, int g0, int g1, const void* hw,
                    const void* sw, const float* bias, float* y, q8_load_fn load, q8_scales_fn scales,
                    const int span) {
    int nb = K / QB, nh = K / 16;
    const int8_t* xm = xa->xq + (size_t)m * K;
    for (int g = g0; g < g1; g++) {
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
                        int8x16_t w[4];
                        load(hw, (size_t)g * nb + b, k, i, w);
                        scales(sw, ((size_t)g * nb + b0) / span, j, k, i, &ds, &mt);
                        acc[k][i] = q_step(acc[k][i], q8_wdot(w, x.val[k]), ds, mt, dx, s16);
                    }
                }
            }
        for (int i = 0; i < 4; i++) put4(y + (size_t)m * N, g, i, vaddq_f32(acc[0][i], acc[1][i]), bias);
    }
}
