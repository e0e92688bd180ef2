// The K-quant matmuls on NEON (the neon variant): matmul_k.c's q4k, q8k and q6k (see there for why these layouts),
// their scale-forming steps on rows_neon.h's loops, every lane ref.c's operations in its order (bit-exact), row by row.
#include "rows_neon.h"

// -(dmin*mn), exactly (matmul_k.c: k_neg): -0 - dmin*mn fused is the negated rounded product (-0 for a +0 one), so
// q_step's acc + mt*sx is the fused acc - (dmin*mn)*sx.
static inline float32x4_t k_neg(float32x4_t dmin, float32x4_t mn) { return vfmsq_f32(vdupq_n_f32(-0.0f), dmin, mn); }

// q4k's v_k of rows 4i..4i+3 as floats (layouts.h: sc_q4k_v; matmul_k.c: q4k_v, why words).
static inline float32x4_t q4k_v(const sc_q4k_scales* s, int k, int i) {
    if (k < 15) {
        uint32x4_t w = vshlq_u32(vld1q_u32(s->w[k / 5] + 4 * i), vdupq_n_s32(-6 * (k % 5)));  // negative: right
        return vcvtq_f32_u32(vandq_u32(w, vdupq_n_u32(63)));
    }
    uint32x4_t a = vshrq_n_u32(vld1q_u32(s->w[0] + 4 * i), 30), b = vshrq_n_u32(vld1q_u32(s->w[1] + 4 * i), 30);
    uint32x4_t c = vshrq_n_u32(vld1q_u32(s->w[2] + 4 * i), 30);
    return vcvtq_f32_u32(vorrq_u32(a, vorrq_u32(vshlq_n_u32(b, 2), vshlq_n_u32(c, 4))));
}

// q4k: block j of super-block t, rows 4i..4i+3 (span 8).
static inline void q4k_scales(const void* sw, size_t t, int j, int i, float32x4_t* ds, float32x4_t* mt) {
    const sc_q4k_scales* s = (const sc_q4k_scales*)sw + t;
    *ds = vmulq_f32(f16x4(s->d + 4 * i), q4k_v(s, j, i));
    *mt = k_neg(f16x4(s->dmin + 4 * i), q4k_v(s, 8 + j, i));
}

// q8k: half k of block j is 16-weight sub-block 2j + k of super-block t (signed scales, unsigned mins; span 8).
static inline void q8k_scales(const void* sw, size_t t, int j, int k, int i, float32x4_t* ds, float32x4_t* mt) {
    const sc_q8k_scales* s = (const sc_q8k_scales*)sw + t;
    *ds = vmulq_f32(f16x4(s->d + 4 * i), i8x4(s->sc[2 * j + k] + 4 * i));
    *mt = k_neg(f16x4(s->dmin + 4 * i), u8x4(s->mn[2 * j + k] + 4 * i));
}

void sc_q4k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++) q4_row(&a->x, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q4k_scales, 8);
}

void sc_q8k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++)
        q8_row(&a->x, &a->h, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, q8k_scales, 8);
}

// q5k: Q5_K's sc_j, mn_j per 32 for both halves k of block j, rows 4i..4i+3 (matmul_k.c's q5k_scales; span 8).
static inline void q5k_scales(const void* sw, size_t t, int j, int k, int i, float32x4_t* ds, float32x4_t* mt) {
    (void)k, q4k_scales(sw, t, j, i, ds, mt);
}

void sc_q5k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++)
        q8_row(&a->x, &a->h, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, q5k_scales, 8);
}

// q6k: Q6_K's d and int8 scale of sub-block 2j + k of super-block t, rows 4i..4i+3; mt q8k's -(0*0) = -0 (span 8).
static inline void q6k_scales(const void* sw, size_t t, int j, int k, int i, float32x4_t* ds, float32x4_t* mt) {
    const sc_q6k_scales* s = (const sc_q6k_scales*)sw + t;
    *ds = vmulq_f32(f16x4(s->d + 4 * i), i8x4(s->sc[2 * j + k] + 4 * i));
    *mt = vdupq_n_f32(-0.0f);
}

void sc_q6k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;
    for (int m = m0; m < m0 + mn; m++)
        q8_row(&a->x, &a->h, m, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q6k_bytes, q6k_scales, 8);
}
