// sinkchat's CPU matmuls on 256-bit registers: the avx2 variant (vpmaddubsw) and, built with -mavxvnni, the avxvnni
// one (vpdpbusd); simd256.h holds the one place they differ, the integer dot. The same functions as matmul.c (the
// avx512 variant) with each 16-row group as two 8-row halves; ref.c holds the scalar reference, and the tests hold
// every variant bit-exact to it (the integer dots are exact, the float steps are ref.c's per lane, in its order).
#include "simd256.h"

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

// Store half h (8 lanes) of row group g's outputs, plus the bias.
static inline void put8(float* y, int g, int h, __m256 acc, const float* bias) {
    if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + g * RG + 8 * h));
    _mm256_storeu_ps(y + g * RG + 8 * h, acc);
}

// ---- q4 ---------------------------------------------------------------------------------------------------------
// acc + isum*(d*dx), then + m*sx: ref.c's q4_run per lane.
static inline __m256 q4_step(__m256 acc, __m256i isum, __m256 d, __m256 m, float dx, float sx) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc);
    return _mm256_fmadd_ps(m, _mm256_set1_ps(sx), acc);
}

// One row (decode): both halves' accumulators in registers. Row groups g0..g1-1.
static void q4_row(const sc_xq* xa, int K, int g0, int g1, const sc_q4_block* qw, const sc_q4_scales* sw,
                   const float* bias, float* y) {
    int nb = K / QB;
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        const sc_q4_scales* sg = sw + (size_t)g * nb;
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {
                __m256i w[8];
                q4_unpack(wg + b, h, w);
                acc[h] = q4_step(acc[h], q4_dot(w, xm + 8 * b), f16x8(sg[b].d + 8 * h), f16x8(sg[b].m + 8 * h),
                                 xa->dx[b], xa->sx[b]);
            }
        for (int h = 0; h < 2; h++) put8(y, g, h, acc[h], bias);
    }
}

// Many rows (prefill): each block half unpacked once and used for every row of the pass (m0..m0+mn-1, mn <= SC_MB),
// the rows' accumulators in `acc_buf` [SC_MB][16] (row m's half h at 2m + h). Row groups g0..g1-1.
static void q4_rows(const sc_xq* xa, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                    const sc_q4_block* qw, const sc_q4_scales* sw, const float* bias, float* y) {
    int nb = K / QB;
    __m256* acc = (__m256*)acc_buf;  // 64-byte aligned: sc_take
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        const sc_q4_scales* sg = sw + (size_t)g * nb;
        for (int m = 0; m < 2 * mn; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {
                __m256i w[8];
                q4_unpack(wg + b, h, w);
                __m256 d = f16x8(sg[b].d + 8 * h), mh = f16x8(sg[b].m + 8 * h);
                for (int m = 0; m < mn; m++) {
                    size_t at = (size_t)(m0 + m) * nb + b;
                    const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8;
                    acc[2 * m + h] = q4_step(acc[2 * m + h], q4_dot(w, xm), d, mh, xa->dx[at], xa->sx[at]);
                }
            }
        for (int m = 0; m < mn; m++)
            for (int h = 0; h < 2; h++) put8(y + (size_t)(m0 + m) * N, g, h, acc[2 * m + h], bias);
    }
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

// ---- q8g: int8 weights (stored q + 128) with an fp16 (d, m) pair per 16 along K -----------------------------------
// Half block k (sub-blocks 4k..4k+3) of block b, rows 8h..8h+7: acc + (dot - c16)*(d*dx), then + m*sx16 (ref.c:
// q8g_run per lane).
static inline __m256 q8g_half(__m256 acc, const sc_q8_block* wb, const sc_q8g_scales* sb, int k, int h,
                              const int32_t* xm, int32_t c16, float dx, float sx16) {
    q8w w;
    q8_load(wb, 4 * k, h, &w);
    __m256i isum = _mm256_sub_epi32(q8_dot(&w, xm + 4 * k), _mm256_set1_epi32(c16));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(f16x8(sb->d[k] + 8 * h), _mm256_set1_ps(dx)), acc);
    return _mm256_fmadd_ps(f16x8(sb->m[k] + 8 * h), _mm256_set1_ps(sx16), acc);
}

// One row (decode): per half h, one accumulator per half block k (acc[2k + h]), the two summed last.
static void q8g_row(const sc_xq* xa, const sc_x16* xh, int K, int g0, int g1, const sc_q8_block* hw,
                    const sc_q8g_scales* sw, const float* bias, float* y) {
    int nb = K / QB;
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        const sc_q8g_scales* sg = sw + (size_t)g * nb;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int b = 0; b < nb; b++)
            for (int k = 0; k < 2; k++)
                for (int h = 0; h < 2; h++)
                    acc[2 * k + h] = q8g_half(acc[2 * k + h], wg + b, sg + b, k, h, xm + 8 * b, xh->c16[2 * b + k],
                                              xa->dx[b], xh->sx16[2 * b + k]);
        for (int h = 0; h < 2; h++) put8(y, g, h, _mm256_add_ps(acc[h], acc[2 + h]), bias);
    }
}

// Many rows (prefill): each half block's bytes loaded (and split) once for every row of the pass (m0..m0+mn-1,
// mn <= SC_MB8), the rows' accumulators in `acc_buf` [SC_MB8][2][16] (row m, half block k, half h at 4m + 2k + h).
static void q8g_rows(const sc_xq* xa, const sc_x16* xh, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const sc_q8_block* hw, const sc_q8g_scales* sw, const float* bias, float* y) {
    int nb = K / QB, nh = K / 16;
    __m256* acc = (__m256*)acc_buf;  // 64-byte aligned: sc_take
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        const sc_q8g_scales* sg = sw + (size_t)g * nb;
        for (int m = 0; m < 4 * mn; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++)
            for (int k = 0; k < 2; k++)
                for (int h = 0; h < 2; h++) {
                    q8w w;
                    q8_load(wg + b, 4 * k, h, &w);
                    __m256 d = f16x8(sg[b].d[k] + 8 * h), mk = f16x8(sg[b].m[k] + 8 * h);
                    for (int m = 0; m < mn; m++) {
                        const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8 + 4 * k;
                        size_t at = (size_t)(m0 + m) * nh + 2 * b + k;
                        __m256i isum = _mm256_sub_epi32(q8_dot(&w, xm), _mm256_set1_epi32(xh->c16[at]));
                        __m256 dx = _mm256_set1_ps(xa->dx[(size_t)(m0 + m) * nb + b]);
                        __m256* am = acc + 4 * m + 2 * k + h;
                        __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx), *am);
                        *am = _mm256_fmadd_ps(mk, _mm256_set1_ps(xh->sx16[at]), a);
                    }
                }
        for (int m = 0; m < mn; m++)
            for (int h = 0; h < 2; h++)
                put8(y + (size_t)(m0 + m) * N, g, h, _mm256_add_ps(acc[4 * m + h], acc[4 * m + 2 + h]), bias);
    }
}

// kernels.h: row groups [g0, g1) of one linear for rows [m0, m0 + mn); the one-row paths when the input has one row.
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
