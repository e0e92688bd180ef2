// sinkchat's CPU matmuls: 4-bit (Q4_1-style) and 8-bit weights times int8 activations (AVX-512 VNNI).
#include "simd.h"

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

// Many rows (prefill): each weight block is unpacked once into registers and used for every row, with the rows'
// accumulators in an L1-sized buffer, instead of unpacking it again per row (2x the work per row).
static int q4_rows(const int8_t* xq, const float* dx, const float* sx, int M, int K, int N, const uint8_t* qw,
                   const uint16_t* sw, const float* bias, float* y) {
    int nb = K / QB;
    const int MB = 256;  // rows per pass: 16 KB of accumulators
    __m512* acc = aligned_alloc(64, sizeof(__m512) * MB);
    if (!acc) return -1;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int m0 = 0; m0 < M; m0 += MB) {
        int mn = M - m0 < MB ? M - m0 : MB;
        for (int g = 0; g < N / RG; g++) {
            const uint8_t* wg = qw + (size_t)g * nb * 256;
            const uint16_t* sg = sw + (size_t)g * nb * 32;
            for (int m = 0; m < mn; m++) acc[m] = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m512i w[8];
                for (int s = 0; s < 4; s++) {
                    __m512i v = _mm512_loadu_si512((const void*)(wg + b * 256 + s * 64));
                    w[2 * s] = _mm512_and_si512(v, lo4);
                    w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                }
                __m512 d = f16x16(sg + b * 32), mn16 = f16x16(sg + b * 32 + 16);
                for (int m = 0; m < mn; m++) {
                    const int32_t* xm = (const int32_t*)(xq + (size_t)(m0 + m) * K) + b * 8;
                    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
                    for (int s = 0; s < 4; s++) {
                        i0 = _mm512_dpbusd_epi32(i0, w[2 * s], _mm512_set1_epi32(xm[2 * s]));
                        i1 = _mm512_dpbusd_epi32(i1, w[2 * s + 1], _mm512_set1_epi32(xm[2 * s + 1]));
                    }
                    __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
                    size_t at = (size_t)(m0 + m) * nb + b;
                    __m512 a = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(dx[at])), acc[m]);
                    acc[m] = _mm512_fmadd_ps(mn16, _mm512_set1_ps(sx[at]), a);
                }
            }
            for (int m = 0; m < mn; m++) {
                __m512 a = bias ? _mm512_add_ps(acc[m], _mm512_loadu_ps(bias + g * RG)) : acc[m];
                _mm512_storeu_ps(y + (size_t)(m0 + m) * N + g * RG, a);
            }
        }
    }
    free(acc);
    return 0;
}

// y[M, N] = x[M, K] @ W^T (+ bias), W 4-bit: qw [N/16][K/32][4][16][4] bytes (sub-block s, row r, byte t holds
// q[r, 8s+t] in its low nibble and q[r, 8s+4+t] in its high one), sw fp16 [N/16][K/32][2][16] (d, then m:
// w = d*q + m).
int q4_matmul(const float* x, int M, int K, int N, const uint8_t* qw, const uint16_t* sw, const float* bias,
              float* y) {
    int nb = K / QB;
    int8_t* xq = malloc((size_t)M * K);
    float* dx = malloc(sizeof(float) * (size_t)M * nb * 2);
    if (!xq || !dx) {
        free(xq);
        free(dx);
        return -1;
    }
    float* sx = dx + M * nb;
    for (int m = 0; m < M; m++) quant_row(x + (size_t)m * K, K, xq + (size_t)m * K, dx + m * nb, sx + m * nb);
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    // one row (decode) keeps its accumulator in a register: through q4_rows a decode step measured 2% slower
    if (M > 1) {
        int rc = q4_rows(xq, dx, sx, M, K, N, qw, sw, bias, y);
        free(xq);
        free(dx);
        return rc;
    }
    for (int g = 0; g < N / RG; g++) {
        const uint8_t* wg = qw + (size_t)g * nb * 256;
        const uint16_t* sg = sw + (size_t)g * nb * 32;
        for (int m = 0; m < M; m++) {
            const int32_t* xm = (const int32_t*)(xq + (size_t)m * K);
            const float* dxm = dx + m * nb;
            const float* sxm = sx + m * nb;
            __m512 acc = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const uint8_t* wb = wg + b * 256;
                __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
                for (int s = 0; s < 4; s++) {
                    __m512i v = _mm512_loadu_si512((const void*)(wb + s * 64));
                    __m512i lo = _mm512_and_si512(v, lo4);
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    i0 = _mm512_dpbusd_epi32(i0, lo, _mm512_set1_epi32(xm[b * 8 + 2 * s]));
                    i1 = _mm512_dpbusd_epi32(i1, hi, _mm512_set1_epi32(xm[b * 8 + 2 * s + 1]));
                }
                __m512 d = f16x16(sg + b * 32), mn = f16x16(sg + b * 32 + 16);
                __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
                acc = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(dxm[b])), acc);
                acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(sxm[b]), acc);
            }
            if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + g * RG));
            _mm512_storeu_ps(y + (size_t)m * N + g * RG, acc);
        }
    }
    free(xq);
    free(dx);
    return 0;
}

// y[M, N] = x[M, K] @ W^T * ws, W int8 stored +128 as uint8: hw [N/16][K/4][16][4], ws fp32 [N] (per-row scale).
int q8_matmul(const float* x, int M, int K, int N, const uint8_t* hw, const float* ws, float* y) {
    int nb = K / QB;
    int8_t* xq = malloc((size_t)M * K);
    float* dx = malloc(sizeof(float) * ((size_t)M * nb * 2 + M));
    if (!xq || !dx) {
        free(xq);
        free(dx);
        return -1;
    }
    float* sx = dx + M * nb;
    float* corr = sx + M * nb;
    for (int m = 0; m < M; m++) {
        quant_row(x + (size_t)m * K, K, xq + (size_t)m * K, dx + m * nb, sx + m * nb);
        float c = 0;  // sum over blocks of dx * sum(xq): the +128 offset's share, the same for every row
        for (int b = 0; b < nb; b++) {
            int s = 0;
            for (int k = 0; k < QB; k++) s += xq[(size_t)m * K + b * QB + k];
            c += dx[m * nb + b] * s;
        }
        corr[m] = 128.0f * c;
    }
    for (int g = 0; g < N / RG; g++) {
        const uint8_t* wg = hw + (size_t)g * K * RG;
        __m512 scale = _mm512_loadu_ps(ws + g * RG);
        for (int m = 0; m < M; m++) {
            const int32_t* xm = (const int32_t*)(xq + (size_t)m * K);
            const float* dxm = dx + m * nb;
            __m512 acc = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const uint8_t* wb = wg + b * QB * RG;
                __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
                for (int s = 0; s < 8; s += 2) {
                    i0 = _mm512_dpbusd_epi32(i0, _mm512_loadu_si512((const void*)(wb + s * 64)),
                                             _mm512_set1_epi32(xm[b * 8 + s]));
                    i1 = _mm512_dpbusd_epi32(i1, _mm512_loadu_si512((const void*)(wb + s * 64 + 64)),
                                             _mm512_set1_epi32(xm[b * 8 + s + 1]));
                }
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), _mm512_set1_ps(dxm[b]), acc);
            }
            acc = _mm512_mul_ps(_mm512_sub_ps(acc, _mm512_set1_ps(corr[m])), scale);
            _mm512_storeu_ps(y + (size_t)m * N + g * RG, acc);
        }
    }
    free(xq);
    free(dx);
    return 0;
}
