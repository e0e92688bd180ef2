// sinkchat's CPU matmuls, SIMD variant: 4-bit (Q4_1-style) and 8-bit weights times int8 activations (AVX-512
// VNNI). ref.c holds the scalar reference of each function; the tests hold the two bit-exact to each other (the
// integer dot products are exact, and the float steps are the same operations in the same order: see ref.c).
#include "simd.h"

const int sc_variant_id = SC_VARIANT_SIMD;

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

// Many rows (prefill): each weight block is unpacked once into registers and used for every row, with the rows'
// accumulators in an L1-sized buffer `acc` [SC_MB][16], instead of unpacking it again per row (2x the work per row).
static void q4_rows(const sc_xq* xa, float* acc_buf, int M, int K, int N, const sc_q4_block* qw,
                    const sc_q4_scales* sw, const float* bias, float* y) {
    int nb = K / QB;
    __m512* acc = (__m512*)acc_buf;  // 64-byte aligned: sc_take
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int m0 = 0; m0 < M; m0 += SC_MB) {
        int mn = M - m0 < SC_MB ? M - m0 : SC_MB;
        for (int g = 0; g < N / RG; g++) {
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
}

// One row (decode) keeps its accumulator in a register: through q4_rows a decode step measured 2% slower.
static void q4_row(const sc_xq* xa, int K, int N, const sc_q4_block* qw, const sc_q4_scales* sw, const float* bias,
                   float* y) {
    int nb = K / QB;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = 0; g < N / RG; g++) {
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

// y[M, N] = x[M, K] @ W^T (+ bias), W as sc_q4_block / sc_q4_scales [N/16][K/32] (w = d*q + m).
int sc_q4_mm(sc_arena* a, const float* x, int M, int K, int N, const sc_q4_block* qw, const sc_q4_scales* sw,
             const float* bias, float* y) {
    sc_xq xa;
    float* acc;
    if (M <= 0) return SC_OK;  // no rows: nothing to write (q4_row would write one)
    if (sc_take_q4(a, M, K, &xa, &acc)) return SC_EWORK;
    sc_quant_rows(x, M, K, xa.xq, xa.dx, xa.sx);
    if (M > 1)
        q4_rows(&xa, acc, M, K, N, qw, sw, bias, y);
    else
        q4_row(&xa, K, N, qw, sw, bias, y);
    return SC_OK;
}

// y[M, N] = x[M, K] @ W^T * ws, W int8 stored +128 as sc_q8_block [N/16][K/32], ws fp32 [N] (per-row scale).
int sc_q8_mm(sc_arena* a, const float* x, int M, int K, int N, const sc_q8_block* hw, const float* ws, float* y) {
    int nb = K / QB;
    sc_xq xa;
    if (sc_take_xq(a, M, K, &xa)) return SC_EWORK;
    sc_quant_rows(x, M, K, xa.xq, xa.dx, xa.sx);
    sc_q8_corr(xa.sx, M, nb, xa.corr);
    for (int g = 0; g < N / RG; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        __m512 scale = _mm512_loadu_ps(ws + g * RG);
        for (int m = 0; m < M; m++) {
            const int32_t* xm = (const int32_t*)(xa.xq + (size_t)m * K);
            const float* dxm = xa.dx + (size_t)m * nb;
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
            acc = _mm512_mul_ps(_mm512_sub_ps(acc, _mm512_set1_ps(xa.corr[m])), scale);
            _mm512_storeu_ps(y + (size_t)m * N + g * RG, acc);
        }
    }
    return SC_OK;
}
