// The K-quant matmuls, SIMD variant: q4k (the q4 nibbles with Q4_K's super-block scales) and q8k (the q8 bytes with
// Q5_K / Q6_K's), each held bit-exact to its scalar twin in ref.c (the same float operations in the same order).
//
// Why their own layouts: llama.cpp's K-quants scale each 32 (Q4_K, Q5_K) or 16 (Q6_K) weights by d*sc_j with d fp16
// and sc_j a 6- or 8-bit integer. Rounding d*sc_j to fp16 (the q4 / q8g way) changes the weights by up to half an
// fp16 ulp, and those layouts' per-32 / per-16 fp16 pairs take more bytes than the file (q4: 0.625 bytes a weight
// against Q4_K's 0.5625; q8g 1.25 against Q6_K's 0.82). Here the file's integers and fp16 super-block scales are
// stored as they are (q4k 0.578, q8k 1.14 bytes a weight) and d*sc_j is formed in fp32 (exact: 11 x 8 bits).
//
// The integer dot products are q4's and q8g's; per 32-block the scales cost two byte widenings and two multiplies
// more than q4's two fp16 loads. Measured at one row (decode), on one core of the 2-core AVX-512 dev VM (medians,
// the layouts interleaved): with the weights streaming from memory, which is what decode reads, N x K = 2048 x 2048:
// q4 124 us, q4k 112-117; q8g 199-203, q8k 190-198; 8192 x 2048: q4 468, q4k 419; q8g 947, q8k 776; 2048 x 8192:
// q4 519-603, q4k 510-519; q8g 850, q8k 817-871 (fewer bytes, no slower). In L2 (2048 x 2048 repeated): q4 43-44,
// q4k 45 (+3-5%: the widenings); q8g 68-71, q8k 66-67.
#include "simd512.h"

// The exact integer dot of one q4 block's 16 rows with the 32 int8 values at xm (8 int32 words): as q4_row's.
static inline __m512i q4_isum(const sc_q4_block* wb, const int32_t* xm, __m512i lo4) {
    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
    for (int s = 0; s < 4; s++) {
        __m512i v = _mm512_loadu_si512((const void*)wb->q[s]);
        i0 = _mm512_dpbusd_epi32(i0, _mm512_and_si512(v, lo4), _mm512_set1_epi32(xm[2 * s]));
        i1 = _mm512_dpbusd_epi32(i1, _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4), _mm512_set1_epi32(xm[2 * s + 1]));
    }
    return _mm512_add_epi32(i0, i1);
}

// acc + isum*((d*sc)*dx) - (dmin*mn)*sx: two fused steps, ds = d*sc and dm = dmin*mn exact (ref.c: q4k_run).
static inline __m512 k_step(__m512 acc, __m512i isum, __m512 ds, __m512 dm, float dx, float sx) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ds, _mm512_set1_ps(dx)), acc);
    return _mm512_fnmadd_ps(dm, _mm512_set1_ps(sx), acc);
}

// One row (decode): the accumulator in a register, each super-block's d and dmin widened once for its 8 blocks.
static void q4k_row(const sc_xq* xa, int K, int g0, int g1, const sc_q4_block* qw, const sc_q4k_scales* sw,
                    const float* bias, float* y) {
    int nb = K / QB, ns = K / SC_QK;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        const sc_q4k_scales* sg = sw + (size_t)g * ns;
        __m512 acc = _mm512_setzero_ps();
        for (int s = 0; s < ns; s++) {
            __m512 d = f16x16(sg[s].d), dmin = f16x16(sg[s].dmin);
            for (int j = 0; j < 8; j++) {
                int b = 8 * s + j;
                __m512i isum = q4_isum(wg + b, xm + 8 * b, lo4);
                __m512 ds = _mm512_mul_ps(d, u8x16(sg[s].sc[j])), dm = _mm512_mul_ps(dmin, u8x16(sg[s].mn[j]));
                acc = k_step(acc, isum, ds, dm, xa->dx[b], xa->sx[b]);
            }
        }
        if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + g * RG));
        _mm512_storeu_ps(y + (size_t)g * RG, acc);
    }
}

// Many rows (prefill): as q4_rows, each block's nibbles and scales unpacked once and used for every row of the pass
// (m0..m0+mn-1), the rows' accumulators in `acc_buf` [SC_MB][16]; row groups g0..g1-1.
static void q4k_rows(const sc_xq* xa, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const sc_q4_block* qw, const sc_q4k_scales* sw, const float* bias, float* y) {
    int nb = K / QB, ns = K / SC_QK;
    __m512* acc = (__m512*)acc_buf;  // 64-byte aligned: sc_take
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        const sc_q4k_scales* sg = sw + (size_t)g * ns;
        for (int m = 0; m < mn; m++) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512i w[8];
            for (int s = 0; s < 4; s++) {
                __m512i v = _mm512_loadu_si512((const void*)wg[b].q[s]);
                w[2 * s] = _mm512_and_si512(v, lo4);
                w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            }
            const sc_q4k_scales* ss = sg + b / 8;
            __m512 ds = _mm512_mul_ps(f16x16(ss->d), u8x16(ss->sc[b % 8]));
            __m512 dm = _mm512_mul_ps(f16x16(ss->dmin), u8x16(ss->mn[b % 8]));
            for (int m = 0; m < mn; m++) {
                const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8;
                __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
                for (int s = 0; s < 4; s++) {
                    i0 = _mm512_dpbusd_epi32(i0, w[2 * s], _mm512_set1_epi32(xm[2 * s]));
                    i1 = _mm512_dpbusd_epi32(i1, w[2 * s + 1], _mm512_set1_epi32(xm[2 * s + 1]));
                }
                size_t at = (size_t)(m0 + m) * nb + b;
                acc[m] = k_step(acc[m], _mm512_add_epi32(i0, i1), ds, dm, xa->dx[at], xa->sx[at]);
            }
        }
        for (int m = 0; m < mn; m++) {
            __m512 a = bias ? _mm512_add_ps(acc[m], _mm512_loadu_ps(bias + g * RG)) : acc[m];
            _mm512_storeu_ps(y + (size_t)(m0 + m) * N + g * RG, a);
        }
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
// One half block (16 weights) of 16 rows: isum = dot(q + 128, xq) - 128*sum(xq) exact (as q8g_half), then k_step.
static inline __m512 q8k_half(__m512 acc, __m512i i0, __m512i i1, int32_t c16, __m512 ds, __m512 dm, float dx,
                              float sx16) {
    return k_step(acc, _mm512_sub_epi32(_mm512_add_epi32(i0, i1), _mm512_set1_epi32(c16)), ds, dm, dx, sx16);
}

// The four dpbusd chains of one q8 block against the 32 int8 values at xm (q8g_chain: halves 0 | 1 in 0, 1 | 2, 3).
static inline void q8_chains(const sc_q8_block* wb, const int32_t* xm, __m512i i[4]) {
    for (int c = 0; c < 4; c++) i[c] = _mm512_setzero_si512();
    for (int s = 0; s < 8; s++)
        i[q8g_chain(s)] = _mm512_dpbusd_epi32(i[q8g_chain(s)], _mm512_loadu_si512((const void*)wb->q[s]),
                                              _mm512_set1_epi32(xm[s]));
}

// One row (decode): two accumulators (one per half block) in registers, summed last.
static void q8k_row(const sc_xq* xa, const sc_x16* xh, int K, int g0, int g1, const sc_q8_block* hw,
                    const sc_q8k_scales* sw, const float* bias, float* y) {
    int nb = K / QB, ns = K / SC_QK;
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        const sc_q8k_scales* sg = sw + (size_t)g * ns;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (int s = 0; s < ns; s++) {
            __m512 d = f16x16(sg[s].d), dmin = f16x16(sg[s].dmin);
            for (int j = 0; j < 8; j++) {
                int b = 8 * s + j;
                __m512i i[4];
                q8_chains(wg + b, xm + 8 * b, i);
                __m512 ds0 = _mm512_mul_ps(d, i8x16(sg[s].sc[2 * j]));
                __m512 dm0 = _mm512_mul_ps(dmin, u8x16(sg[s].mn[2 * j]));
                __m512 ds1 = _mm512_mul_ps(d, i8x16(sg[s].sc[2 * j + 1]));
                __m512 dm1 = _mm512_mul_ps(dmin, u8x16(sg[s].mn[2 * j + 1]));
                acc0 = q8k_half(acc0, i[0], i[1], xh->c16[2 * b], ds0, dm0, xa->dx[b], xh->sx16[2 * b]);
                acc1 = q8k_half(acc1, i[2], i[3], xh->c16[2 * b + 1], ds1, dm1, xa->dx[b], xh->sx16[2 * b + 1]);
            }
        }
        __m512 acc = _mm512_add_ps(acc0, acc1);
        if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + g * RG));
        _mm512_storeu_ps(y + (size_t)g * RG, acc);
    }
}

// q8k_half without the m term, for row groups whose dmin is 0 throughout (Q6_K): there every m step is
// acc - (+-0)*sx, which is acc unless acc is -0, and without m steps no accumulator is ever -0 (each starts at +0; an
// isum step's exact result is 0 only when isum is, and +0 + +-0 is +0), so the same bits, two FMAs of 16 fewer.
// Measured: Q6_K is 16% of a ~1B Q4_K_M prefill's time at 2 threads; this ~3% of that prefill.
static inline __m512 q8k_half0(__m512 acc, __m512i i0, __m512i i1, int32_t c16, __m512 ds, float dx) {
    __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(i0, i1), _mm512_set1_epi32(c16));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ds, _mm512_set1_ps(dx)), acc);
}

// Many rows (prefill): as q8g_rows, each block's bytes and scales loaded once for every row of the pass (m0..m0+mn-1),
// the rows' two accumulators in `acc_buf` [SC_MB8][2][16]; row groups g0..g1-1.
static void q8k_rows(const sc_xq* xa, const sc_x16* xh, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const sc_q8_block* hw, const sc_q8k_scales* sw, const float* bias, float* y) {
    int nb = K / QB, nh = K / 16, ns = K / SC_QK;
    __m512* acc = (__m512*)acc_buf;  // 64-byte aligned: sc_take
    for (int g = g0; g < g1; g++) {
        const sc_q8_block* wg = hw + (size_t)g * nb;
        const sc_q8k_scales* sg = sw + (size_t)g * ns;
        int mins = 0;  // any dmin of the group not +-0 (Q5_K); Q6_K has none
        for (int s = 0; s < ns; s++)
            for (int r = 0; r < RG; r++) mins |= sg[s].dmin[r] & 0x7FFF;
        for (int m = 0; m < 2 * mn; m++) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512i w[8];
            for (int s = 0; s < 8; s++) w[s] = _mm512_loadu_si512((const void*)wg[b].q[s]);
            const sc_q8k_scales* ss = sg + b / 8;
            int j = 2 * (b % 8);
            __m512 d = f16x16(ss->d), dmin = f16x16(ss->dmin);
            __m512 ds0 = _mm512_mul_ps(d, i8x16(ss->sc[j])), dm0 = _mm512_mul_ps(dmin, u8x16(ss->mn[j]));
            __m512 ds1 = _mm512_mul_ps(d, i8x16(ss->sc[j + 1])), dm1 = _mm512_mul_ps(dmin, u8x16(ss->mn[j + 1]));
            for (int m = 0; m < mn; m++) {
                const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8;
                __m512i i[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                                _mm512_setzero_si512()};
                for (int s = 0; s < 8; s++)
                    i[q8g_chain(s)] = _mm512_dpbusd_epi32(i[q8g_chain(s)], w[s], _mm512_set1_epi32(xm[s]));
                float dx = xa->dx[(size_t)(m0 + m) * nb + b];
                size_t h = (size_t)(m0 + m) * nh + 2 * b;
                if (mins) {
                    acc[2 * m] = q8k_half(acc[2 * m], i[0], i[1], xh->c16[h], ds0, dm0, dx, xh->sx16[h]);
                    acc[2 * m + 1] =
                        q8k_half(acc[2 * m + 1], i[2], i[3], xh->c16[h + 1], ds1, dm1, dx, xh->sx16[h + 1]);
                } else {
                    acc[2 * m] = q8k_half0(acc[2 * m], i[0], i[1], xh->c16[h], ds0, dx);
                    acc[2 * m + 1] = q8k_half0(acc[2 * m + 1], i[2], i[3], xh->c16[h + 1], ds1, dx);
                }
            }
        }
        for (int m = 0; m < mn; m++) {
            __m512 a = _mm512_add_ps(acc[2 * m], acc[2 * m + 1]);
            if (bias) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + g * RG));
            _mm512_storeu_ps(y + (size_t)(m0 + m) * N + g * RG, a);
        }
    }
}

// kernels.h: sc_lin_run for q8k (W: sc_q8_block [N/16][K/32], q + 128, and sc_q8k_scales [N/16][K/256]).
void sc_q8k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1)
        q8k_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y);
    else
        q8k_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y);
}
