// sinkchat's CPU matmuls, SIMD variant: 4-bit (Q4_1-style), 8-bit grouped (q8g) and 8-bit table weights times
// int8 activations (AVX-512 VNNI). ref.c holds the scalar reference of each function; the tests hold the two
// bit-exact to each other (the integer dot products are exact, and the float steps are the same operations in the
// same order: see ref.c).
#include "simd512.h"

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

// Many rows (prefill): each weight block is unpacked once into registers and used for every row of the pass (rows
// m0..m0+mn-1, mn <= SC_MB), with the rows' accumulators in an L1-sized buffer `acc` [SC_MB][16], instead of
// unpacking it again per row (2x the work per row). Row groups g0..g1-1.
static void q4_rows(const sc_xq* xa, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                    const sc_q4_block* qw, const sc_q4_scales* sw, const float* bias, float* y) {
    int nb = K / QB;
    __m512* acc = (__m512*)acc_buf;  // 64-byte aligned: sc_take
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        const sc_q4_scales* sg = sw + (size_t)g * nb;
        for (int m = 0; m < mn; m++) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512i w[8];
            for (int s = 0; s < 4; s++) {
                __m512i v = _mm512_loadu_si512((const void*)wg[b].q[s]);
                w[2 * s] = _mm512_and_si512(v, lo4);
                w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            }
            __m512 d = f16x16(sg[b].d), mn16 = f16x16(sg[b].m);
            for (int m = 0; m < mn; m++) {
                const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8;
                __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
                for (int s = 0; s < 4; s++) {
                    i0 = _mm512_dpbusd_epi32(i0, w[2 * s], _mm512_set1_epi32(xm[2 * s]));
                    i1 = _mm512_dpbusd_epi32(i1, w[2 * s + 1], _mm512_set1_epi32(xm[2 * s + 1]));
                }
                __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
                size_t at = (size_t)(m0 + m) * nb + b;
                __m512 a = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(xa->dx[at])), acc[m]);
                acc[m] = _mm512_fmadd_ps(mn16, _mm512_set1_ps(xa->sx[at]), a);
            }
        }
        for (int m = 0; m < mn; m++) {
            __m512 a = bias ? _mm512_add_ps(acc[m], _mm512_loadu_ps(bias + g * RG)) : acc[m];
            _mm512_storeu_ps(y + (size_t)(m0 + m) * N + g * RG, a);
        }
    }
}

// One row (decode) keeps its accumulator in a register: through q4_rows a decode step measured 2% slower. Row groups
// g0..g1-1.
static void q4_row(const sc_xq* xa, int K, int g0, int g1, const sc_q4_block* qw, const sc_q4_scales* sw,
                   const float* bias, float* y) {
    int nb = K / QB;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        const sc_q4_scales* sg = sw + (size_t)g * nb;
        __m512 acc = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
            for (int s = 0; s < 4; s++) {
                __m512i v = _mm512_loadu_si512((const void*)wg[b].q[s]);
                __m512i lo = _mm512_and_si512(v, lo4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                i0 = _mm512_dpbusd_epi32(i0, lo, _mm512_set1_epi32(xm[b * 8 + 2 * s]));
                i1 = _mm512_dpbusd_epi32(i1, hi, _mm512_set1_epi32(xm[b * 8 + 2 * s + 1]));
            }
            __m512 d = f16x16(sg[b].d), mn = f16x16(sg[b].m);
            __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
            acc = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(xa->dx[b])), acc);
            acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(xa->sx[b]), acc);
        }
        if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + g * RG));
        _mm512_storeu_ps(y + (size_t)g * RG, acc);
    }
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

// ---- q8g: int8 weights (stored q + 128) with an fp16 (d, m) pair per 16 along K -----------------------------------
// One half block (16 weights, 4 sub-blocks) of 16 rows: acc = fmaf(isum, d*dx, acc), then fmaf(m, sx16, acc), where
// isum = dot(q + 128, xq) - 128*sum(xq) is exact (c16 holds the 128*sum). ref.c: q8g_run does the same per lane.
static inline __m512 q8g_half(__m512 acc, __m512i i0, __m512i i1, int32_t c16, __m512 d, __m512 m, float dx,
                              float sx16) {
    __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(i0, i1), _mm512_set1_epi32(c16));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc);
    return _mm512_fmadd_ps(m, _mm512_set1_ps(sx16), acc);
}

// One row (decode): two accumulators (one per half block) in registers.
static void q8g_row(const sc_xq* xa, const sc_x16* xh, int K, int g0, int g1, const sc_q8_block* hw,
                    const sc_q8g_scales* sw, const float* bias, float* y) {
    int nb = K / QB;
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        const sc_q8g_scales* sg = sw + (size_t)g * nb;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512i i[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                            _mm512_setzero_si512()};  // half 0: sub-blocks 0, 2 | 1, 3; half 1: 4, 6 | 5, 7
            for (int s = 0; s < 8; s++)
                i[q8g_chain(s)] = _mm512_dpbusd_epi32(i[q8g_chain(s)], _mm512_loadu_si512((const void*)wg[b].q[s]),
                                                      _mm512_set1_epi32(xm[b * 8 + s]));
            acc0 = q8g_half(acc0, i[0], i[1], xh->c16[2 * b], f16x16(sg[b].d[0]), f16x16(sg[b].m[0]), xa->dx[b],
                            xh->sx16[2 * b]);
            acc1 = q8g_half(acc1, i[2], i[3], xh->c16[2 * b + 1], f16x16(sg[b].d[1]), f16x16(sg[b].m[1]), xa->dx[b],
                            xh->sx16[2 * b + 1]);
        }
        __m512 acc = _mm512_add_ps(acc0, acc1);
        if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + g * RG));
        _mm512_storeu_ps(y + (size_t)g * RG, acc);
    }
}

// Many rows (prefill): as q4_rows, each weight block is loaded once and used for every row of the pass (m0..m0+mn-1,
// mn <= SC_MB8), with the rows' two accumulators in `acc_buf` [SC_MB8][2][16]; row groups g0..g1-1.
static void q8g_rows(const sc_xq* xa, const sc_x16* xh, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const sc_q8_block* hw, const sc_q8g_scales* sw, const float* bias, float* y) {
    int nb = K / QB, nh = K / 16;
    __m512* acc = (__m512*)acc_buf;  // 64-byte aligned: sc_take
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        const sc_q8g_scales* sg = sw + (size_t)g * nb;
        for (int m = 0; m < 2 * mn; m++) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512i w[8];
            for (int s = 0; s < 8; s++) w[s] = _mm512_loadu_si512((const void*)wg[b].q[s]);
            __m512 d0 = f16x16(sg[b].d[0]), d1 = f16x16(sg[b].d[1]);
            __m512 n0 = f16x16(sg[b].m[0]), n1 = f16x16(sg[b].m[1]);
            for (int m = 0; m < mn; m++) {
                const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8;
                __m512i i[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                                _mm512_setzero_si512()};
                for (int s = 0; s < 8; s++)
                    i[q8g_chain(s)] = _mm512_dpbusd_epi32(i[q8g_chain(s)], w[s], _mm512_set1_epi32(xm[s]));
                float dx = xa->dx[(size_t)(m0 + m) * nb + b];
                size_t h = (size_t)(m0 + m) * nh + 2 * b;
                acc[2 * m] = q8g_half(acc[2 * m], i[0], i[1], xh->c16[h], d0, n0, dx, xh->sx16[h]);
                acc[2 * m + 1] = q8g_half(acc[2 * m + 1], i[2], i[3], xh->c16[h + 1], d1, n1, dx, xh->sx16[h + 1]);
            }
        }
        for (int m = 0; m < mn; m++) {
            __m512 a = _mm512_add_ps(acc[2 * m], acc[2 * m + 1]);
            if (bias) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + g * RG));
            _mm512_storeu_ps(y + (size_t)(m0 + m) * N + g * RG, a);
        }
    }
}

// kernels.h: row groups [g0, g1) of one linear for rows [m0, m0 + mn); the one-row paths when the input has one row
// (through the prefill path a decode step measured 2% slower), the prefill ones otherwise.
void sc_lin_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    int K = a->K, one = a->M == 1;
    switch (l->type) {
        case SC_LIN_TABLE: q8_table(&a->x, m0, mn, K, l->N, g0, g1, l->w, l->s, l->y); break;
        case SC_LIN_Q8G:
            if (one) q8g_row(&a->x, &a->h, K, g0, g1, l->w, l->s, l->bias, l->y);
            else q8g_rows(&a->x, &a->h, acc, m0, mn, K, l->N, g0, g1, l->w, l->s, l->bias, l->y);
            break;
        case SC_LIN_Q4K: sc_q4k_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q8K: sc_q8k_run(l, a, m0, mn, g0, g1, acc); break;
        default:
            if (one) q4_row(&a->x, K, g0, g1, l->w, l->s, l->bias, l->y);
            else q4_rows(&a->x, acc, m0, mn, K, l->N, g0, g1, l->w, l->s, l->bias, l->y);
    }
}
