// NEON helpers of the neon variant (matmul_neon.c, matmul_neon_k.c, rows_neon.h, attend_neon.c), built with
// -march=armv8.2-a+dotprod: the sdot instruction (vdotq_laneq_s32), 4 int8 products per 32-bit lane.
//
// A 16-row group is four 128-bit registers here (rows 4i..4i+3: bytes 16i..16i+15 of each sub-block), each lane
// doing the avx512 variant's per-lane operations in its order, so the matmuls are bit-exact to ref.c. sdot is
// signed x signed: the 4-bit weights (0..15) are non-negative int8 as they are; the 8-bit ones (stored q + 128) are
// turned back into q (flip the top bit), so dot(q, x) is the integer the x86 code gets as dot(q + 128, x) - c16.
// Not tuned on hardware (none here): tested bit for bit under qemu-aarch64 (tests/test_neon.py), speed unmeasured.
#pragma once
#include <arm_neon.h>

#include "kernels.h"

static inline float32x4_t f16x4(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

static inline float32x4_t u8x4(const uint8_t* p) {  // 4 unsigned bytes to floats (exact)
    uint32_t v;
    memcpy(&v, p, 4);
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(v)))));
}

static inline float32x4_t i8x4(const int8_t* p) {  // 4 signed bytes to floats (exact)
    uint32_t v;
    memcpy(&v, p, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vcreate_s8(v)))));
}

// One block's 32 int8 activations: x.val[0] words 0..3, x.val[1] words 4..7 (word w: the 4 values sub-block w meets
// in the q8 layouts; in q4, word 2s the low nibbles of sub-block s, 2s+1 the high ones).
static inline int8x16x2_t xblock(const int8_t* p) { return (int8x16x2_t){{vld1q_s8(p), vld1q_s8(p + 16)}}; }

// The exact dot of rows 4i..4i+3 of a q4 block with its 32 activations.
static inline int32x4_t q4_dot(const sc_q4_block* wb, int i, int8x16x2_t x) {
    const uint8x16_t lo4 = vdupq_n_u8(0x0F);
    int8x16_t w[8];
    for (int s = 0; s < 4; s++) {
        uint8x16_t v = vld1q_u8(wb->q[s][4 * i]);
        w[2 * s] = vreinterpretq_s8_u8(vandq_u8(v, lo4));
        w[2 * s + 1] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    }
    int32x4_t a = vdupq_n_s32(0), b = vdupq_n_s32(0);  // two chains, as the x86 code
    a = vdotq_laneq_s32(a, w[0], x.val[0], 0);
    b = vdotq_laneq_s32(b, w[1], x.val[0], 1);
    a = vdotq_laneq_s32(a, w[2], x.val[0], 2);
    b = vdotq_laneq_s32(b, w[3], x.val[0], 3);
    a = vdotq_laneq_s32(a, w[4], x.val[1], 0);
    b = vdotq_laneq_s32(b, w[5], x.val[1], 1);
    a = vdotq_laneq_s32(a, w[6], x.val[1], 2);
    b = vdotq_laneq_s32(b, w[7], x.val[1], 3);
    return vaddq_s32(a, b);
}

// The exact dot(q, x) of rows 4i..4i+3 of half block k (sub-blocks 4k..4k+3) of a q8 block (stored q + 128) with
// its 16 activations xk: the x86 code's dot(q + 128, x) - c16.
// q8_wdot: the same from the four sub-blocks' q values already in registers (rows_neon.h's weight-unpack steps).
static inline int32x4_t q8_wdot(const int8x16_t w[4], int8x16_t xk) {
    int32x4_t a = vdupq_n_s32(0), b = vdupq_n_s32(0);
    a = vdotq_laneq_s32(a, w[0], xk, 0);
    b = vdotq_laneq_s32(b, w[1], xk, 1);
    a = vdotq_laneq_s32(a, w[2], xk, 2);
    b = vdotq_laneq_s32(b, w[3], xk, 3);
    return vaddq_s32(a, b);
}

static inline void q8_load(const sc_q8_block* wb, int k, int i, int8x16_t w[4]) {  // q from the stored q + 128
    const uint8x16_t top = vdupq_n_u8(0x80);
    for (int s = 0; s < 4; s++) w[s] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(wb->q[4 * k + s][4 * i]), top));
}

static inline int32x4_t q8_dot(const sc_q8_block* wb, int k, int i, int8x16_t xk) {
    int8x16_t w[4];
    q8_load(wb, k, i, w);
    return q8_wdot(w, xk);
}

static inline void put4(float* y, int g, int i, float32x4_t acc, const float* bias) {
    if (bias) acc = vaddq_f32(acc, vld1q_f32(bias + g * RG + 4 * i));
    vst1q_f32(y + g * RG + 4 * i, acc);
}

// ---- floats: the avx512 variant's 16-lane registers as four 128-bit ones (attend_neon.c) ---------------------------
static inline float32x4_t bf16x4(const uint16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

static inline float32x4_t kv4(const void* base, size_t i, int bf16) {  // 4 floats of a K or V row
    return bf16 ? bf16x4((const uint16_t*)base + i) : vld1q_f32((const float*)base + i);
}

// e^x, ~1 ulp on [-87, 0]: simd512.h's exp512 lane for lane (c - a*b fused is vfmsq_f32(c, a, b), as vfnmadd).
static inline float32x4_t exp4(float32x4_t x) {
    x = vmaxq_f32(x, vdupq_n_f32(-87.0f));
    float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
