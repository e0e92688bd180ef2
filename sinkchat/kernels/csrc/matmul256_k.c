// The K-quant matmuls on 256-bit registers (avx2 / avxvnni): matmul_k.c's q4k and q8k (see there for why these
// layouts) with each 16-row group as two 8-row halves, every lane ref.c's operations in its order (bit-exact).
#include "simd256.h"

// acc + isum*((d*sc)*dx) - (dmin*mn)*sx: two fused steps, ds = d*sc and dm = dmin*mn exact (ref.c: q4k_run).
static inline __m256 k_step(__m256 acc, __m256i isum, __m256 ds, __m256 dm, float dx, float sx) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ds, _mm256_set1_ps(dx)), acc);
    return _mm256_fnmadd_ps(dm, _mm256_set1_ps(sx), acc);
}

static inline void put8(float* y, int g, int h, __m256 acc, const float* bias) {
    if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + g * RG + 8 * h));
    _mm256_storeu_ps(y + g * RG + 8 * h, acc);
}

// ds and dm of sub-block j, rows 8h..8h+7 of a q4k super-block.
static inline void q4k_scales(const sc_q4k_scales* ss, int j, int h, __m256* ds, __m256* dm) {
    *ds = _mm256_mul_ps(f16x8(ss->d + 8 * h), u8x8(ss->sc[j] + 8 * h));
    *dm = _mm256_mul_ps(f16x8(ss->dmin + 8 * h), u8x8(ss->mn[j] + 8 * h));
}

// One row (decode): both halves' accumulators in registers.
static void q4k_row(const sc_xq* xa, int K, int g0, int g1, const sc_q4_block* qw, const sc_q4k_scales* sw,
                    const float* bias, float* y) {
    int nb = K / QB, ns = K / SC_QK;
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        const sc_q4k_scales* sg = sw + (size_t)g * ns;
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {
                __m256i w[8];
                __m256 ds, dm;
                q4_unpack(wg + b, h, w);
                q4k_scales(sg + b / 8, b % 8, h, &ds, &dm);
                acc[h] = k_step(acc[h], q4_dot(w, xm + 8 * b), ds, dm, xa->dx[b], xa->sx[b]);
            }
        for (int h = 0; h < 2; h++) put8(y, g, h, acc[h], bias);
    }
}

// Many rows (prefill): each block half's nibbles and scales unpacked once for every row of the pass (m0..m0+mn-1),
// the rows' accumulators in `acc_buf` [SC_MB][16] (row m's half h at 2m + h).
static void q4k_rows(const sc_xq* xa, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const sc_q4_block* qw, const sc_q4k_scales* sw, const float* bias, float* y) {
    int nb = K / QB, ns = K / SC_QK;
    __m256* acc = (__m256*)acc_buf;  // 64-byte aligned: sc_take
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        const sc_q4k_scales* sg = sw + (size_t)g * ns;
        for (int m = 0; m < 2 * mn; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {
                __m256i w[8];
                __m256 ds, dm;
                q4_unpack(wg + b, h, w);
                q4k_scales(sg + b / 8, b % 8, h, &ds, &dm);
                for (int m = 0; m < mn; m++) {
                    const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8;
                    size_t at = (size_t)(m0 + m) * nb + b;
                    acc[2 * m + h] = k_step(acc[2 * m + h], q4_dot(w, xm), ds, dm, xa->dx[at], xa->sx[at]);
                }
            }
        for (int m = 0; m < mn; m++)
            for (int h = 0; h < 2; h++) put8(y + (size_t)(m0 + m) * N, g, h, acc[2 * m + h], bias);
    }
}

// kernels.h: sc_lin_run for q4k (W: sc_q4_block [N/16][K/32], sc_q4k_scales [N/16][K/256]).
void sc_q4k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1)
        q4k_row(&a->x, a->K, g0, g1, l->w, l->s, l->bias, l->y);
    else
        q4k_rows(&a->x, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y);
}

// ---- q8k ------------------------------------------------------------------------------------------------------------
// ds and dm of 16-weight sub-block j, rows 8h..8h+7 of a q8k super-block (signed scales, unsigned mins).
static inline void q8k_scales(const sc_q8k_scales* ss, int j, int h, __m256* ds, __m256* dm) {
    *ds = _mm256_mul_ps(f16x8(ss->d + 8 * h), i8x8(ss->sc[j] + 8 * h));
    *dm = _mm256_mul_ps(f16x8(ss->dmin + 8 * h), u8x8(ss->mn[j] + 8 * h));
}

// Half block k of block b (sub-block j = 2*(b % 8) + k of its super-block), rows 8h..8h+7, for the row whose
// int8 values of that half block are at xm: k_step on isum = dot(q + 128, x) - c16 (exact).
static inline __m256 q8k_half(__m256 acc, const q8w* w, const int32_t* xm, int32_t c16, __m256 ds, __m256 dm,
                              float dx, float sx16) {
    return k_step(acc, _mm256_sub_epi32(q8_dot(w, xm), _mm256_set1_epi32(c16)), ds, dm, dx, sx16);
}

// One row (decode): per half h, one accumulator per half block k (acc[2k + h]), the two summed last.
static void q8k_row(const sc_xq* xa, const sc_x16* xh, int K, int g0, int g1, const sc_q8_block* hw,
                    const sc_q8k_scales* sw, const float* bias, float* y) {
    int nb = K / QB, ns = K / SC_QK;
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        const sc_q8k_scales* sg = sw + (size_t)g * ns;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int b = 0; b < nb; b++)
            for (int k = 0; k < 2; k++)
                for (int h = 0; h < 2; h++) {
                    q8w w;
                    __m256 ds, dm;
                    q8_load(wg + b, 4 * k, h, &w);
                    q8k_scales(sg + b / 8, 2 * (b % 8) + k, h, &ds, &dm);
                    acc[2 * k + h] = q8k_half(acc[2 * k + h], &w, xm + 8 * b + 4 * k, xh->c16[2 * b + k], ds, dm,
                                              xa->dx[b], xh->sx16[2 * b + k]);
                }
        for (int h = 0; h < 2; h++) put8(y, g, h, _mm256_add_ps(acc[h], acc[2 + h]), bias);
    }
}

// Many rows (prefill): each half block's bytes and scales loaded once for every row of the pass (m0..m0+mn-1), the
// rows' accumulators in `acc_buf` [SC_MB8][2][16] (row m, half block k, half h at 4m + 2k + h).
static void q8k_rows(const sc_xq* xa, const sc_x16* xh, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const sc_q8_block* hw, const sc_q8k_scales* sw, const float* bias, float* y) {
    int nb = K / QB, nh = K / 16, ns = K / SC_QK;
    __m256* acc = (__m256*)acc_buf;  // 64-byte aligned: sc_take
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        const sc_q8k_scales* sg = sw + (size_t)g * ns;
        for (int m = 0; m < 4 * mn; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++)
            for (int k = 0; k < 2; k++)
                for (int h = 0; h < 2; h++) {
                    q8w w;
                    __m256 ds, dm;
                    q8_load(wg + b, 4 * k, h, &w);
                    q8k_scales(sg + b / 8, 2 * (b % 8) + k, h, &ds, &dm);
                    for (int m = 0; m < mn; m++) {
                        const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8 + 4 * k;
                        size_t at = (size_t)(m0 + m) * nh + 2 * b + k;
                        acc[4 * m + 2 * k + h] = q8k_half(acc[4 * m + 2 * k + h], &w, xm, xh->c16[at], ds, dm,
                                                          xa->dx[(size_t)(m0 + m) * nb + b], xh->sx16[at]);
                    }
                }
        for (int m = 0; m < mn; m++)
            for (int h = 0; h < 2; h++)
                put8(y + (size_t)(m0 + m) * N, g, h, _mm256_add_ps(acc[4 * m + h], acc[4 * m + 2 + h]), bias);
    }
}

// kernels.h: sc_lin_run for q8k (W: sc_q8_block [N/16][K/32], q + 128, and sc_q8k_scales [N/16][K/256]).
void sc_q8k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1)
        q8k_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y);
    else
        q8k_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y);
}
