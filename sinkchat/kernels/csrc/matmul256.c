// sinkchat's CPU matmuls on 256-bit registers: the avx2 variant (vpmaddubsw) and, built with -mavxvnni, the avxvnni
// one (vpdpbusd); simd256.h holds the one place they differ, the integer dot. The same functions as matmul.c (the
// avx512 variant) with each 16-row group as two 8-row halves: the quantizer, the int8 table and q4's and q8g's
// scale-forming steps on rows256.h's row loops. ref.c holds the scalar reference, and the tests hold
// every variant bit-exact to it (the integer dots are exact, the float steps are ref.c's per lane, in its order).
#include "rows256.h"

#ifdef SC_DP
const int sc_variant_id = SC_VARIANT_AVXVNNI;
#else
const int sc_variant_id = SC_VARIANT_AVX2;
#endif

// One row of K floats to int8 per 32 values (matmul.c: quant_row says why sx sums the rounded values). amax
// ignores NaN as ref.c does (vmaxps returns its second operand when either is NaN); the int32 -> int8 saturation
// is two saturating packs, whose lane interleave the final permute undoes.
static void quant_row(const float* x, int K, int8_t* xq, float* dx, float* sx) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < K / QB; b++) {
        __m256 v[4], a = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QB + 8 * i);
            a = _mm256_max_ps(_mm256_and_ps(v[i], absm), a);
        }
        float d = hmax8(a) / 127.0f;
        float id = d > 0 ? 1.0f / d : 0.0f;
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));  // to even
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i*)(xq + b * QB), _mm256_permutevar8x32_epi32(p, order));
        dx[b] = d;
        sx[b] = d * (float)hsum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    }
}

void sc_quant_rows(const float* x, int M, int K, int8_t* xq, float* dx, float* sx) {
    int nb = K / QB;
    for (int m = 0; m < M; m++)
        quant_row(x + (size_t)m * K, K, xq + (size_t)m * K, dx + (size_t)m * nb, sx + (size_t)m * nb);
}

// ---- the int8 table -----------------------------------------------------------------------------------------------
// y[m, n] = (x[m] . (w[n] + 128) - corr[m]) * ws[n] (matmul.c: q8_table); rows m0..m0+mn-1, groups g0..g1-1.
static void q8_table(const sc_xq* xa, int m0, int mn, int K, int N, int g0, int g1, const sc_q8_block* hw,
                     const float* ws, float* y) {
    int nb = K / QB;
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        for (int m = m0; m < m0 + mn; m++) {
            const int32_t* xm = (const int32_t*)(xa->xq + (size_t)m * K);
            __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int b = 0; b < nb; b++) {
                __m256 dx = _mm256_set1_ps(xa->dx[(size_t)m * nb + b]);
                for (int h = 0; h < 2; h++) {
                    q8w lo, hi;
                    q8_load(wg + b, 0, h, &lo);
                    q8_load(wg + b, 4, h, &hi);
                    __m256i isum = _mm256_add_epi32(q8_dot(&lo, xm + 8 * b), q8_dot(&hi, xm + 8 * b + 4));
                    acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dx, acc[h]);
                }
            }
            for (int h = 0; h < 2; h++) {
                __m256 v = _mm256_sub_ps(acc[h], _mm256_set1_ps(xa->corr[m]));
                v = _mm256_mul_ps(v, _mm256_loadu_ps(ws + g * RG + 8 * h));
                _mm256_storeu_ps(y + (size_t)m * N + g * RG + 8 * h, v);
            }
        }
    }
}

// ---- the layouts' scale-forming steps and run functions (kernels.h) -----------------------------------------------
// q4: fp16 d and m per block of 32, rows 8h..8h+7 (span 1: j is 0).
static inline void q4_scales(const void* sw, size_t t, int j, int h, __m256* ds, __m256* mt) {
    const sc_q4_scales* s = (const sc_q4_scales*)sw + t + j;
    *ds = f16x8(s->d + 8 * h), *mt = f16x8(s->m + 8 * h);
}

// q40: Q4_0's fp16 d per block of 32, rows 8h..8h+7, and m = -8*d in fp32 (exact: matmul.c's q40_scales; span 1).
static inline void q40_scales(const void* sw, size_t t, int j, int h, __m256* ds, __m256* mt) {
    const sc_q40_scales* s = (const sc_q40_scales*)sw + t + j;
    *ds = f16x8(s->d + 8 * h), *mt = _mm256_mul_ps(*ds, _mm256_set1_ps(-8.0f));
}

// q8g: fp16 d and m per half block k of 16, rows 8h..8h+7 (span 1).
static inline void q8g_scales(const void* sw, size_t t, int j, int k, int h, __m256* ds, __m256* mt) {
    const sc_q8g_scales* s = (const sc_q8g_scales*)sw + t + j;
    *ds = f16x8(s->d[k] + 8 * h), *mt = f16x8(s->m[k] + 8 * h);
}

// q80: Q8_0's fp16 d per block of 32 for both halves k, rows 8h..8h+7, mt = +0: q8g's values for a Q8_0 tensor
// (matmul.c's q80_scales; span 1).
static inline void q80_scales(const void* sw, size_t t, int j, int k, int h, __m256* ds, __m256* mt) {
    const sc_q80_scales* s = (const sc_q80_scales*)sw + t + j;
    (void)k, *ds = f16x8(s->d + 8 * h), *mt = _mm256_setzero_ps();
}

// The one-row paths when the input has one row, the prefill ones otherwise.
void sc_q4_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q4_row(&a->x, a->K, g0, g1, l->w, l->s, l->bias, l->y, q4_scales, 1);
    else q4_rows(&a->x, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q4_scales, 1);
}

void sc_q40_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q4_row(&a->x, a->K, g0, g1, l->w, l->s, l->bias, l->y, q40_scales, 1);
    else q4_rows(&a->x, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q40_scales, 1);
}

void sc_q8g_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, 0, q8g_scales, 1);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, 0, q8g_scales, 1);
}

void sc_q80_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, 0, q80_scales, 1);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, 0, q80_scales, 1);
}

// q51: Q5_1's fp16 d and m per block of 32 for both halves k, rows 8h..8h+7 (matmul.c's q51_scales; span 1).
static inline void q51_scales(const void* sw, size_t t, int j, int k, int h, __m256* ds, __m256* mt) {
    const sc_q4_scales* s = (const sc_q4_scales*)sw + t + j;
    (void)k, *ds = f16x8(s->d + 8 * h), *mt = f16x8(s->m + 8 * h);
}

void sc_q50_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {  // u, lift 16: shr 3
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q50_bytes, 3, q80_scales, 1);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q50_bytes, 3, q80_scales, 1);
}

void sc_q51_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, 0, q51_scales, 1);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, 0, q51_scales, 1);
}

void sc_table_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;  // its accumulators are registers, a row at a time
    q8_table(&a->x, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->y);
}
