// sinkchat's CPU matmuls, SIMD variant: 4-bit (Q4_1-style), 8-bit grouped (q8g) and 8-bit table weights times
// int8 activations (AVX-512 VNNI): the quantizer, the int8 table, and q4's and q8g's scale-forming steps on rows512.h's
// row loops (matmul_k.c: the K-quants'). ref.c holds the scalar reference of each function; the tests hold the two
// bit-exact to each other (the integer dot products are exact, and the float steps are the same operations in the
// same order: see ref.c).
#include "rows512.h"

const int sc_variant_id = SC_VARIANT_AVX512;

// Quantize one row of K floats to int8 in blocks of 32: xq, per-block scale dx, and sx = dx * sum(xq), the block
// sum of the *rounded* values (as ggml's Q8_1): the zero-point term m * sx then carries the same rounding as the
// d * q * x term, and the two cancel for a block centred on zero. The exact sum doubled the matmul error on the
// bundled model's k_proj (+1.6% perplexity, measured).
static void quant_row(const float* x, int K, int8_t* xq, float* dx, float* sx) {
    for (int b = 0; b < K / QB; b++) {
        const float* xb = x + b * QB;
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        __m512 a = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
        float amax = _mm512_reduce_max_ps(a);
        float d = amax / 127.0f;
        float id = d > 0 ? 1.0f / d : 0.0f;
        __m512 s = _mm512_set1_ps(id);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, s));  // round to nearest even
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, s));
        _mm_storeu_si128((__m128i*)(xq + b * QB), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(xq + b * QB + 16), _mm512_cvtsepi32_epi8(q1));
        dx[b] = d;
        sx[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

void sc_quant_rows(const float* x, int M, int K, int8_t* xq, float* dx, float* sx) {
    int nb = K / QB;
    for (int m = 0; m < M; m++)
        quant_row(x + (size_t)m * K, K, xq + (size_t)m * K, dx + (size_t)m * nb, sx + (size_t)m * nb);
}

// The int8 table (q8_matmul): y[m, n] = (x[m] . (w[n] + 128) - corr[m]) * ws[n], W stored +128 as sc_q8_block
// [N/16][K/32], ws fp32 [N] (per-row scale); rows m0..m0+mn-1 (each with its accumulator in a register), groups
// g0..g1-1.
static void q8_table(const sc_xq* xa, int m0, int mn, int K, int N, int g0, int g1, const sc_q8_block* hw,
                     const float* ws, float* y) {
    int nb = K / QB;
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        __m512 scale = _mm512_loadu_ps(ws + g * RG);
        for (int m = m0; m < m0 + mn; m++) {
            const int32_t* xm = (const int32_t*)(xa->xq + (size_t)m * K);
            const float* dxm = xa->dx + (size_t)m * nb;
            __m512 acc = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
                for (int s = 0; s < 8; s += 2) {
                    i0 = _mm512_dpbusd_epi32(i0, _mm512_loadu_si512((const void*)wg[b].q[s]),
                                             _mm512_set1_epi32(xm[b * 8 + s]));
                    i1 = _mm512_dpbusd_epi32(i1, _mm512_loadu_si512((const void*)wg[b].q[s + 1]),
                                             _mm512_set1_epi32(xm[b * 8 + s + 1]));
                }
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), _mm512_set1_ps(dxm[b]), acc);
            }
            acc = _mm512_mul_ps(_mm512_sub_ps(acc, _mm512_set1_ps(xa->corr[m])), scale);
            _mm512_storeu_ps(y + (size_t)m * N + g * RG, acc);
        }
    }
}

// ---- the layouts' scale-forming steps and run functions (kernels.h) -----------------------------------------------
// q4: fp16 d and m per block of 32 (sw [N/16][K/32] of sc_q4_scales).
static inline void q4_scales(const void* sw, size_t t, int j, __m512* ds, __m512* mt) {
    const sc_q4_scales* s = (const sc_q4_scales*)sw + t + j;  // j is 0: span 1
    *ds = f16x16(s->d), *mt = f16x16(s->m);
}

// q40: Q4_0's fp16 d per block of 32 (sw [N/16][K/32] of sc_q40_scales) and m = -8*d, formed here in fp32: exact,
// the value q4 stored as fp16 for the same tensor (ref.c: q40_scales), so the same bits from 18 bytes of 20.
static inline void q40_scales(const void* sw, size_t t, int j, __m512* ds, __m512* mt) {
    const sc_q40_scales* s = (const sc_q40_scales*)sw + t + j;  // j is 0: span 1
    *ds = f16x16(s->d), *mt = _mm512_mul_ps(*ds, _mm512_set1_ps(-8.0f));
}

// q8g: fp16 d and m per half block of 16 (sw [N/16][K/32] of sc_q8g_scales); every m term can be non-zero.
static inline void q8g_scales(const void* sw, size_t t, int j, int k, __m512* ds, __m512* mt) {
    const sc_q8g_scales* s = (const sc_q8g_scales*)sw + t + j;  // j is 0: span 1
    *ds = f16x16(s->d[k]), *mt = f16x16(s->m[k]);
}
static inline int q8g_mins(const void* sw, size_t g, int nb) {
    (void)sw, (void)g, (void)nb;
    return 1;
}

// q80: Q8_0's fp16 d per block of 32 for both halves k, mt = +0 (sw [N/16][K/32] of sc_q80_scales): q8g's values
// for a Q8_0 tensor, so its bits; no m term can be non-zero, so the prefill leaves them out (q8_half0: the same bits).
static inline void q80_scales(const void* sw, size_t t, int j, int k, __m512* ds, __m512* mt) {
    const sc_q80_scales* s = (const sc_q80_scales*)sw + t + j;  // j is 0: span 1
    (void)k, *ds = f16x16(s->d), *mt = _mm512_setzero_ps();
}
static inline int q80_mins(const void* sw, size_t g, int nb) {
    (void)sw, (void)g, (void)nb;
    return 0;
}

// The one-row paths when the input has one row (through the prefill path a decode step measured 2% slower), the
// prefill ones otherwise.
void sc_q4_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q4_row(&a->x, a->K, g0, g1, l->w, l->s, l->bias, l->y, q4_scales, 1);
    else q4_rows(&a->x, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q4_scales, 1);
}

void sc_q40_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q4_row(&a->x, a->K, g0, g1, l->w, l->s, l->bias, l->y, q40_scales, 1);
    else q4_rows(&a->x, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q40_scales, 1);
}

void sc_q8g_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, q8g_scales, 1);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, q8g_scales,
                 q8g_mins, 1);
}

void sc_q80_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, q80_scales, 1);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, q80_scales,
                 q80_mins, 1);
}

// q51: Q5_1's fp16 d and m per block of 32 for both halves k (sw [N/16][K/32] of sc_q4_scales): q8g's values for a
// Q5_1 tensor, so its bits (q50 takes q80_scales: Q5_0 is d*q, m +0).
static inline void q51_scales(const void* sw, size_t t, int j, int k, __m512* ds, __m512* mt) {
    const sc_q4_scales* s = (const sc_q4_scales*)sw + t + j;  // j is 0: span 1
    (void)k, *ds = f16x16(s->d), *mt = f16x16(s->m);
}

void sc_q50_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q50_bytes, q80_scales, 1);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q50_bytes, q80_scales,
                 q80_mins, 1);
}

void sc_q51_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, q51_scales, 1);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, q51_scales,
                 q8g_mins, 1);
}

void sc_table_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;  // its accumulators are registers, a row at a time
    q8_table(&a->x, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->y);
}
