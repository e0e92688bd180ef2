// The K-quant matmuls on NEON (the neon variant): matmul_k.c's q4k and q8k (see there for why these layouts) with
// each 16-row group as four 4-row registers, every lane ref.c's operations in its order (bit-exact), row by row.
#include "simd_neon.h"

// acc + isum*((d*sc)*dx) - (dmin*mn)*sx: two fused steps, ds and dm exact (ref.c: q4k_run; vfmsq is vfnmadd).
static inline float32x4_t k_step(float32x4_t acc, int32x4_t isum, float32x4_t ds, float32x4_t dm, float dx, float sx) {
    acc = vfmaq_f32(acc, vcvtq_f32_s32(isum), vmulq_f32(ds, vdupq_n_f32(dx)));
    return vfmsq_f32(acc, dm, vdupq_n_f32(sx));
}

// Rows [m0, m0 + mn) of a q4k linear, row groups g0..g1-1 (W: sc_q4_block [N/16][K/32], sc_q4k_scales
// [N/16][K/256]).
void sc_q4k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* unused) {
    int K = a->K, nb = K / QB, ns = K / SC_QK;
    const sc_q4_block* qw = l->w;
    const sc_q4k_scales* sw = l->s;
    (void)unused;
    for (int m = m0; m < m0 + mn; m++) {
        const int8_t* xm = a->x.xq + (size_t)m * K;
        const float *dx = a->x.dx + (size_t)m * nb, *sx = a->x.sx + (size_t)m * nb;
        for (int g = g0; g < g1; g++) {
            const sc_q4_block* wg = qw + (size_t)g * nb;
            const sc_q4k_scales* sg = sw + (size_t)g * ns;
            float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
            for (int b = 0; b < nb; b++) {
                const sc_q4k_scales* ss = sg + b / 8;
                int8x16x2_t x = xblock(xm + b * QB);
                for (int i = 0; i < 4; i++) {
                    float32x4_t ds = vmulq_f32(f16x4(ss->d + 4 * i), u8x4(ss->sc[b % 8] + 4 * i));
                    float32x4_t dm = vmulq_f32(f16x4(ss->dmin + 4 * i), u8x4(ss->mn[b % 8] + 4 * i));
                    acc[i] = k_step(acc[i], q4_dot(wg + b, i, x), ds, dm, dx[b], sx[b]);
                }
            }
            for (int i = 0; i < 4; i++) put4(l->y + (size_t)m * l->N, g, i, acc[i], l->bias);
        }
    }
}

// Rows [m0, m0 + mn) of a q8k linear (W: sc_q8_block [N/16][K/32], q + 128, and sc_q8k_scales [N/16][K/256]): per
// half block k (sub-block j = 2*(b % 8) + k of its super-block) its own accumulator, the two summed last.
void sc_q8k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* unused) {
    int K = a->K, nb = K / QB, nh = K / 16, ns = K / SC_QK;
    const sc_q8_block* hw = l->w;
    const sc_q8k_scales* sw = l->s;
    (void)unused;
    for (int m = m0; m < m0 + mn; m++) {
        const int8_t* xm = a->x.xq + (size_t)m * K;
        for (int g = g0; g < g1; g++) {
            const sc_q8_block* wg = hw + (size_t)g * nb;
            const sc_q8k_scales* sg = sw + (size_t)g * ns;
            float32x4_t acc[2][4];
            for (int k = 0; k < 2; k++)
                for (int i = 0; i < 4; i++) acc[k][i] = vdupq_n_f32(0);
            for (int b = 0; b < nb; b++) {
                const sc_q8k_scales* ss = sg + b / 8;
                int8x16x2_t x = xblock(xm + b * QB);
                float dx = a->x.dx[(size_t)m * nb + b];
                for (int k = 0; k < 2; k++) {
                    int j = 2 * (b % 8) + k;
                    float s16 = a->h.sx16[(size_t)m * nh + 2 * b + k];
                    for (int i = 0; i < 4; i++) {
                        float32x4_t ds = vmulq_f32(f16x4(ss->d + 4 * i), i8x4(ss->sc[j] + 4 * i));
                        float32x4_t dm = vmulq_f32(f16x4(ss->dmin + 4 * i), u8x4(ss->mn[j] + 4 * i));
                        acc[k][i] = k_step(acc[k][i], q8_dot(wg + b, k, i, x.val[k]), ds, dm, dx, s16);
                    }
                }
            }
            for (int i = 0; i < 4; i++) put4(l->y + (size_t)m * l->N, g, i, vaddq_f32(acc[0][i], acc[1][i]), l->bias);
        }
    }
}
