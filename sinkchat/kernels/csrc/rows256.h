// The 256-bit variants' row loops (avx2, avxvnni), one per weight family and path, each taking the layout's
// scale-forming step (matmul256.c: q4, q8g; matmul256_k.c: q4k, q8k, q6k) and, 8-bit, its weight-unpack step:
// rows512.h's loops and steps (see there for why a step passed in, and the span) with each 16-row group as two 8-row
// halves h (rows 8h..8h+7).
#pragma once
#include "simd256.h"

#define SC_LOOP static inline __attribute__((always_inline))

// Half h of block j of scale struct t (row group g's block b: t = (g*K/32 + b) / span, j = b % span) of a 4-bit
// layout -> ds and mt of its 8 rows; an 8-bit layout's also takes the half block k (columns 16k..16k+15).
typedef void (*q4_scales_fn)(const void* sw, size_t t, int j, int h, __m256* ds, __m256* mt);
typedef void (*q8_scales_fn)(const void* sw, size_t t, int j, int k, int h, __m256* ds, __m256* mt);
// The 8-bit family's weight-unpack step (rows512.h: q8_load_fn): rows 8h..8h+7 of sub-blocks s0..s0+3 of block blk
// (g*K/32 + b) as q8_dot takes them, bytes q + lift (q8_bytes: as stored, lift 128; q6k_bytes: rebuilt, lift 32).
// The loops take lift as shr = log2(128 / lift) and subtract c16 >> shr (c16 is 128 x the sum of x, so the shift is
// exact): isum is the exact dot(q, x) whatever the lift, the same integer and bits.
typedef void (*q8_load_fn)(const void* hw, size_t blk, int s0, int h, q8w* w);

// acc + isum*(ds*dx), then + mt*sx, each fused: rows512.h's q_step per lane (mt: m, or the K-quants' -(dmin*mn)).
static inline __m256 q_step(__m256 acc, __m256i isum, __m256 ds, __m256 mt, float dx, float sx) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ds, _mm256_set1_ps(dx)), acc);
    return _mm256_fmadd_ps(mt, _mm256_set1_ps(sx), acc);
}

// Store half h (8 lanes) of row group g's outputs, plus the bias.
static inline void put8(float* y, int g, int h, __m256 acc, const float* bias) {
    if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + g * RG + 8 * h));
    _mm256_storeu_ps(y + g * RG + 8 * h, acc);
}

// ---- 4-bit nibbles ------------------------------------------------------------------------------------------------
// One row (decode): both halves' accumulators in registers. Row groups g0..g1-1.
SC_LOOP void q4_row(const sc_xq* xa, int K, int g0, int g1, const sc_q4_block* qw, const void* sw, const float* bias,
                    float* y, q4_scales_fn scales, const int span) {
    int nb = K / QB;
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int b0 = 0; b0 < nb; b0 += span)
            #pragma GCC unroll 8  // a super-block's 8 blocks: q4k_v's word index and shift fold to constants
            for (int j = 0, b = b0; j < span; j++, b++)
                for (int h = 0; h < 2; h++) {
                    __m256i w[8];
                    __m256 ds, mt;
                    q4_unpack(wg + b, h, w);
                    __m256i isum = q4_dot(w, xm + 8 * b);
                    scales(sw, ((size_t)g * nb + b0) / span, j, h, &ds, &mt);
                    acc[h] = q_step(acc[h], isum, ds, mt, xa->dx[b], xa->sx[b]);
                }
        for (int h = 0; h < 2; h++) put8(y, g, h, acc[h], bias);
    }
}

// Many rows (prefill): each block half unpacked (and its scales formed) once and used for every row of the pass
// (m0..m0+mn-1, mn <= SC_MB), the rows' accumulators in `acc_buf` [SC_MB][16] (row m's half h at 2m + h).
SC_LOOP void q4_rows(const sc_xq* xa, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const sc_q4_block* qw, const void* sw, const float* bias, float* y, q4_scales_fn scales,
                     const int span) {
    int nb = K / QB;
    __m256* acc = (__m256*)acc_buf;  // 64-byte aligned: sc_take
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        for (int m = 0; m < 2 * mn; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {
                __m256i w[8];
                __m256 ds, mt;
                q4_unpack(wg + b, h, w);
                scales(sw, ((size_t)g * nb + b) / span, b % span, h, &ds, &mt);
                for (int m = 0; m < mn; m++) {
                    size_t at = (size_t)(m0 + m) * nb + b;
                    const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8;
                    acc[2 * m + h] = q_step(acc[2 * m + h], q4_dot(w, xm), ds, mt, xa->dx[at], xa->sx[at]);
                }
            }
        for (int m = 0; m < mn; m++)
            for (int h = 0; h < 2; h++) put8(y + (size_t)(m0 + m) * N, g, h, acc[2 * m + h], bias);
    }
}

// ---- 8-bit bytes (stored q + 128) ---------------------------------------------------------------------------------
static inline void q8_bytes(const void* hw, size_t blk, int s0, int h, q8w* w) {
    q8_load((const sc_q8_block*)hw + blk, s0, h, w);
}

// q6k (rows512.h: q6k_bytes, rows 8h..8h+7): sub-blocks s0..s0+3 are nibble tiles s0/2, s0/2 + 1 and plane s0/4,
// sub-block s0 + i's high bits at bits 2i. As q8_dot takes them: u = nibble | high bits << 4 (lift 32: the loops
// subtract c16 >> 2), or, avx2, u's two nibbles directly (the nibble, and the high bits as the "high nibble"): no
// byte to split as q8_load must. In L2 (512 x 2048 repeated, one row) q6k / q8k: avx2 0.96, avxvnni 1.28.
static inline void q6k_bytes(const void* hw, size_t blk, int s0, int h, q8w* w) {
    const sc_q6k_block* wb = (const sc_q6k_block*)hw + blk;
    __m256i p = _mm256_loadu_si256((const __m256i*)wb->h[s0 / 4][8 * h]);
#ifdef SC_DP
    const __m256i hi2 = _mm256_set1_epi8(0x30);
    __m256i hs[4] = {_mm256_slli_epi16(p, 4), _mm256_slli_epi16(p, 2), p, _mm256_srli_epi16(p, 2)};  // to bits 4, 5
#else
    const __m256i hi2 = _mm256_set1_epi8(0x03);
    __m256i hs[4] = {p, _mm256_srli_epi16(p, 2), _mm256_srli_epi16(p, 4), _mm256_srli_epi16(p, 6)};  // to bits 0, 1
#endif
    for (int n = 0; n < 2; n++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)wb->q[s0 / 2 + n][8 * h]);
        __m256i u[2] = {lo_nib(v), hi_nib(v)};
        for (int e = 0; e < 2; e++) {
            __m256i top = _mm256_and_si256(hs[2 * n + e], hi2);
#ifdef SC_DP
            w->v[2 * n + e] = _mm256_or_si256(u[e], top);
#else
            w->lo[2 * n + e] = u[e], w->hi[2 * n + e] = top;
#endif
        }
    }
}

// q5 blocks (rows512.h: q5_bytes, rows 8h..8h+7): sub-blocks s0..s0+3 are nibble tiles s0/2, s0/2 + 1 and bits
// s0..s0+3 of the plane. As q8_dot takes them: q50 u itself (lift 16: the loops subtract c16 >> 3), q51 / q5k u + 128
// (lift 128, shr 0; `top`); avx2 u's two nibbles directly (the nibble, and the fifth bit (+ 8) as the high one).
static inline void q5_bytes(const void* hw, size_t blk, int s0, int h, q8w* w, int top) {
    const sc_q5_block* wb = (const sc_q5_block*)hw + blk;
    __m256i p = _mm256_loadu_si256((const __m256i*)wb->h[8 * h]), one = _mm256_set1_epi8(1);
    for (int n = 0; n < 2; n++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)wb->q[s0 / 2 + n][8 * h]);
        __m256i u[2] = {lo_nib(v), hi_nib(v)};
        for (int e = 0; e < 2; e++) {
            __m256i bit = _mm256_and_si256(_mm256_srl_epi16(p, _mm_cvtsi32_si128(s0 + 2 * n + e)), one);  // to bit 0
#ifdef SC_DP
            w->v[2 * n + e] = _mm256_or_si256(_mm256_or_si256(u[e], _mm256_slli_epi16(bit, 4)),
                                              _mm256_set1_epi8((char)(top ? 0x80 : 0)));
#else
            w->lo[2 * n + e] = u[e], w->hi[2 * n + e] = _mm256_or_si256(bit, _mm256_set1_epi8((char)(top ? 8 : 0)));
#endif
        }
    }
}
static inline void q50_bytes(const void* hw, size_t blk, int s0, int h, q8w* w) { q5_bytes(hw, blk, s0, h, w, 0); }
static inline void q51_bytes(const void* hw, size_t blk, int s0, int h, q8w* w) { q5_bytes(hw, blk, s0, h, w, 1); }

// isum = dot(q + lift, x) - c16 (lift x the sum) of one half block's 8 rows with its 16 int8 values at xm: exact.
static inline __m256i q8_isum(const q8w* w, const int32_t* xm, int32_t c16) {
    return _mm256_sub_epi32(q8_dot(w, xm), _mm256_set1_epi32(c16));
}

// One row (decode): per half h, one accumulator per half block k (acc[2k + h]), the two summed last.
SC_LOOP void q8_row(const sc_xq* xa, const sc_x16* xh, int K, int g0, int g1, const void* hw, const void* sw,
                    const float* bias, float* y, q8_load_fn load, const int shr, q8_scales_fn scales,
                    const int span) {
    int nb = K / QB;
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int b0 = 0; b0 < nb; b0 += span)
            #pragma GCC unroll 8  // q5k: q4k_v's word index and shift constants (1.39x -> 1.12x q8k's time in L2)
            for (int j = 0, b = b0; j < span; j++, b++)
                for (int k = 0; k < 2; k++)
                    for (int h = 0; h < 2; h++) {
                        q8w w;
                        __m256 ds, mt;
                        load(hw, (size_t)g * nb + b, 4 * k, h, &w);
                        __m256i isum = q8_isum(&w, xm + 8 * b + 4 * k, xh->c16[2 * b + k] >> shr);
                        scales(sw, ((size_t)g * nb + b0) / span, j, k, h, &ds, &mt);
                        acc[2 * k + h] = q_step(acc[2 * k + h], isum, ds, mt, xa->dx[b], xh->sx16[2 * b + k]);
                    }
        for (int h = 0; h < 2; h++) put8(y, g, h, _mm256_add_ps(acc[h], acc[2 + h]), bias);
    }
}

// Many rows (prefill): each half block's bytes loaded (and split) and scales formed once for every row of the pass
// (m0..m0+mn-1, mn <= SC_MB8), the rows' accumulators in `acc_buf` [SC_MB8][2][16] (row m, half block k, half h at
// 4m + 2k + h).
SC_LOOP void q8_rows(const sc_xq* xa, const sc_x16* xh, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const void* hw, const void* sw, const float* bias, float* y, q8_load_fn load, const int shr,
                     q8_scales_fn scales, const int span) {
    int nb = K / QB, nh = K / 16;
    __m256* acc = (__m256*)acc_buf;  // 64-byte aligned: sc_take
    for (int g = g0; g < g1; g++) {
        for (int m = 0; m < 4 * mn; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++)
            for (int k = 0; k < 2; k++)
                for (int h = 0; h < 2; h++) {
                    q8w w;
                    __m256 ds, mt;
                    load(hw, (size_t)g * nb + b, 4 * k, h, &w);
                    scales(sw, ((size_t)g * nb + b) / span, b % span, k, h, &ds, &mt);
                    for (int m = 0; m < mn; m++) {
                        const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8 + 4 * k;
                        size_t at = (size_t)(m0 + m) * nh + 2 * b + k;
                        __m256* am = acc + 4 * m + 2 * k + h;
                        __m256i isum = q8_isum(&w, xm, xh->c16[at] >> shr);
                        *am = q_step(*am, isum, ds, mt, xa->dx[(size_t)(m0 + m) * nb + b], xh->sx16[at]);
                    }
                }
        for (int m = 0; m < mn; m++)
            for (int h = 0; h < 2; h++)
                put8(y + (size_t)(m0 + m) * N, g, h, _mm256_add_ps(acc[4 * m + h], acc[4 * m + 2 + h]), bias);
    }
}
