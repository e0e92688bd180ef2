// sinkchat's CPU matmuls on ARM NEON with the dot-product extension (sdot): the neon variant. The same functions as
// matmul.c (avx512) with each 16-row group as four 4-row registers, every lane ref.c's operations in its order
// (bit-exact; simd_neon.h). Prefill runs the one-row code row by row: the same bits, none of the x86 prefill's
// weight reuse (not tuned: no ARM hardware here to measure it on).
#include "rows_neon.h"

const int sc_variant_id = SC_VARIANT_NEON;

// vcvtnq rounds to nearest even as vcvtps2dq does, but saturates where x86 gives INT32_MIN (NaN, |p| >= 2^31): that
// case is put back by hand, so the int8 values and the (wrapping) sums are ref.c's for every input.
static inline int32x4_t cvt_rne(float32x4_t p) {
    uint32x4_t ok = vcltq_f32(vabsq_f32(p), vdupq_n_f32(2147483648.0f));  // false for NaN
    return vbslq_s32(ok, vcvtnq_s32_f32(p), vdupq_n_s32(INT32_MIN));
}

// One row of K floats to int8 per 32 values (matmul.c: quant_row says why sx sums the rounded values). amax ignores
// NaN as ref.c does (vmaxnm takes the number).
static void quant_row(const float* x, int K, int8_t* xq, float* dx, float* sx) {
    for (int b = 0; b < K / QB; b++) {
        float32x4_t v[8], a = vdupq_n_f32(0.0f);
        for (int i = 0; i < 8; i++) {
            v[i] = vld1q_f32(x + b * QB + 4 * i);
            a = vmaxnmq_f32(a, vabsq_f32(v[i]));
        }
        float d = vmaxnmvq_f32(a) / 127.0f;
        float id = d > 0 ? 1.0f / d : 0.0f;
        int32x4_t sum = vdupq_n_s32(0);
        for (int i = 0; i < 8; i += 2) {
            int32x4_t q0 = cvt_rne(vmulq_f32(v[i], vdupq_n_f32(id)));
            int32x4_t q1 = cvt_rne(vmulq_f32(v[i + 1], vdupq_n_f32(id)));
            sum = vaddq_s32(sum, vaddq_s32(q0, q1));
            int16x8_t h = vcombine_s16(vqmovn_s32(q0), vqmovn_s32(q1));
            vst1_s8(xq + b * QB + 4 * i, vqmovn_s16(h));
        }
        dx[b] = d;
        sx[b] = d * (float)vaddvq_s32(sum);
    }
}

void sc_quant_rows(const float* x, int M, int K, int8_t* xq, float* dx, float* sx) {
    int nb = K / QB;
    for (int m = 0; m < M; m++)
        quant_row(x + (size_t)m * K, K, xq + (size_t)m * K, dx + (size_t)m * nb, sx + (size_t)m * nb);
}

// ---- the int8 table: y[m, n] = (x[m] . (w[n] + 128) - corr[m]) * ws[n] (matmul.c: q8_table) ------------------------
// dot(w + 128, x) = dot(q, x) + 128 * sum(x): both exact integers, so the float the x86 code converts.
static void q8_table(const sc_xq* xa, int m, int K, int N, int g0, int g1, const sc_q8_block* hw, const float* ws,
                     float* y) {
    int nb = K / QB;
    const int8_t* xm = xa->xq + (size_t)m * K;
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
        for (int b = 0; b < nb; b++) {
            int8x16x2_t x = xblock(xm + b * QB);
            int32x4_t off = vdupq_n_s32(128 * (vaddlvq_s8(x.val[0]) + vaddlvq_s8(x.val[1])));
            float32x4_t dx = vdupq_n_f32(xa->dx[(size_t)m * nb + b]);
            for (int i = 0; i < 4; i++) {
                int32x4_t isum = vaddq_s32(q8_dot(wg + b, 0, i, x.val[0]), q8_dot(wg + b, 1, i, x.val[1]));
                isum = vaddq_s32(isum, off);
                acc[i] = vfmaq_f32(acc[i], vcvtq_f32_s32(isum), dx);
            }
        }
        for (int i = 0; i < 4; i++) {
            float32x4_t v = vsubq_f32(acc[i], vdupq_n_f32(xa->corr[m]));
            vst1q_f32(y + (size_t)m * N + g * RG + 4 * i, vmulq_f32(v, vld1q_f32(ws + g * RG + 4 * i)));
        }
    }
}

// ---- the layouts' scale-forming steps and run functions (kernels.h), row by row -----------------------------------
// q4: fp16 d and m per block of 32, rows 4i..4i+3 (span 1: j is 0).
static inline void q4_scales(const void* sw, size_t t, int j, int i, float32x4_t* ds, float32x4_t* mt) {
    const sc_q4_scales* s = (const sc_q4_scales*)sw + t + j;
    *ds = f16x4(s->d + 4 * i), *mt = f16x4(s->m + 4 * i);
}

// q40: Q4_0's fp16 d per block of 32, rows 4i..4i+3, and m = -8*d in fp32 (exact: matmul.c's q40_scales; span 1).
static inline void q40_scales(const void* sw, size_t t, int j, int i, float32x4_t* ds, float32x4_t* mt) {
    const sc_q40_scales* s = (const sc_q40_scales*)sw + t + j;
    *ds = f16x4(s->d + 4 * i), *mt = vmulq_f32(*ds, vdupq_n_f32(-8.0f));
}

// q8g: fp16 d and m per half block k of 16 (span 1).
static inline void q8g_scales(const void* sw, size_t t, int j, int k, int i, float32x4_t* ds, float32x4_t* mt) {
    const sc_q8g_scales* s = (const sc_q8g_scales*)sw + t + j;
    *ds = f16x4(s->d[k] + 4 * i), *mt = f16x4(s->m[k] + 4 * i);
}

// q80: Q8_0's fp16 d per block of 32 for both halves k, rows 4i..4i+3, mt = +0: q8g's values for a Q8_0 tensor
// (matmul.c's q80_scales; span 1).
static inline void q80_scales(const void* sw, size_t t, int j, int k, int i, float32x4_t* ds, float32x4_t* mt) {
    const sc_q80_scales* s = (const sc_q80_scales*)sw + t + j;
    (void)k, *ds = f16x4(s->d + 4 * i), *mt = vdupq_n_f32(0.0f);
}

void sc_q4_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;  // every row's accumulators are registers here
    for (int m = m0; m < m0 + mn; m++) q4_row(&a->x, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q4_scales, 1);
}

void sc_q40_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++) q4_row(&a->x, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q40_scales, 1);
}

void sc_q8g_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++)
        q8_row(&a->x, &a->h, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, q8g_scales, 1);
}

void sc_q80_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++)
        q8_row(&a->x, &a->h, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, q80_scales, 1);
}

// q51: Q5_1's fp16 d and m per block of 32 for both halves k, rows 4i..4i+3 (matmul.c's q51_scales; span 1).
static inline void q51_scales(const void* sw, size_t t, int j, int k, int i, float32x4_t* ds, float32x4_t* mt) {
    const sc_q4_scales* s = (const sc_q4_scales*)sw + t + j;
    (void)k, *ds = f16x4(s->d + 4 * i), *mt = f16x4(s->m + 4 * i);
}

void sc_q50_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++)
        q8_row(&a->x, &a->h, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q50_bytes, q80_scales, 1);
}

void sc_q51_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++)
        q8_row(&a->x, &a->h, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, q51_scales, 1);
}

void sc_table_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++) q8_table(&a->x, m, a->K, l->N, g0, g1, l->w, l->s, l->y);
}
