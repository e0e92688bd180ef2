// sinkchat's CPU matmuls on ARM NEON with the dot-product extension (sdot): the neon variant. The same functions as
// matmul.c (avx512) with each 16-row group as four 4-row registers, every lane ref.c's operations in its order
// (bit-exact; simd_neon.h). Prefill runs the one-row code row by row: the same bits, none of the x86 prefill's
// weight reuse (not tuned: no ARM hardware here to measure it on).
#include "simd_neon.h"

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

// ---- q4: row m of the input, row groups g0..g1-1 ----------------------------------------------------------------
static void q4_row(const sc_xq* xa, int m, int K, int N, int g0, int g1, const sc_q4_block* qw,
                   const sc_q4_scales* sw, const float* bias, float* y) {
    int nb = K / QB;
    const int8_t* xm = xa->xq + (size_t)m * K;
    const float *dx = xa->dx + (size_t)m * nb, *sx = xa->sx + (size_t)m * nb;
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        const sc_q4_scales* sg = sw + (size_t)g * nb;
        float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
        for (int b = 0; b < nb; b++) {
            int8x16x2_t x = xblock(xm + b * QB);
            for (int i = 0; i < 4; i++) {
                float32x4_t isum = vcvtq_f32_s32(q4_dot(wg + b, i, x));
                acc[i] = vfmaq_f32(acc[i], isum, vmulq_f32(f16x4(sg[b].d + 4 * i), vdupq_n_f32(dx[b])));
                acc[i] = vfmaq_f32(acc[i], f16x4(sg[b].m + 4 * i), vdupq_n_f32(sx[b]));
            }
        }
        for (int i = 0; i < 4; i++) put4(y + (size_t)m * N, g, i, acc[i], bias);
    }
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

// ---- q8g: per half block k, acc_k + dot(q, x)*(d*dx), then + m*sx16 (ref.c: q8g_run); the halves summed last ------
static void q8g_row(const sc_xq* xa, const sc_x16* xh, int m, int K, int N, int g0, int g1, const sc_q8_block* hw,
                    const sc_q8g_scales* sw, const float* bias, float* y) {
    int nb = K / QB, nh = K / 16;
    const int8_t* xm = xa->xq + (size_t)m * K;
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        const sc_q8g_scales* sg = sw + (size_t)g * nb;
        float32x4_t acc[2][4];
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < 4; i++) acc[k][i] = vdupq_n_f32(0);
        for (int b = 0; b < nb; b++) {
            int8x16x2_t x = xblock(xm + b * QB);
            float32x4_t dx = vdupq_n_f32(xa->dx[(size_t)m * nb + b]);
            for (int k = 0; k < 2; k++) {
                float32x4_t s16 = vdupq_n_f32(xh->sx16[(size_t)m * nh + 2 * b + k]);
                for (int i = 0; i < 4; i++) {
                    float32x4_t isum = vcvtq_f32_s32(q8_dot(wg + b, k, i, x.val[k]));
                    acc[k][i] = vfmaq_f32(acc[k][i], isum, vmulq_f32(f16x4(sg[b].d[k] + 4 * i), dx));
                    acc[k][i] = vfmaq_f32(acc[k][i], f16x4(sg[b].m[k] + 4 * i), s16);
                }
            }
        }
        for (int i = 0; i < 4; i++) put4(y + (size_t)m * N, g, i, vaddq_f32(acc[0][i], acc[1][i]), bias);
    }
}

// kernels.h: row groups [g0, g1) of one linear for rows [m0, m0 + mn), row by row.
void sc_lin_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;  // every row's accumulators are registers here
    for (int m = m0; m < m0 + mn; m++) switch (l->type) {
            case SC_LIN_TABLE: q8_table(&a->x, m, a->K, l->N, g0, g1, l->w, l->s, l->y); break;
            case SC_LIN_Q8G: q8g_row(&a->x, &a->h, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y); break;
            case SC_LIN_Q4K: sc_q4k_run(l, a, m, 1, g0, g1, NULL); break;
            case SC_LIN_Q8K: sc_q8k_run(l, a, m, 1, g0, g1, NULL); break;
            default: q4_row(&a->x, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y);
        }
}
