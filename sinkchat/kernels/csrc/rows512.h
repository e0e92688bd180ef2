// The avx512 variant's row loops, one per weight family and path: the 4-bit nibbles (q4, q40, q4k) and the 8-bit
// bytes (q8g, q80, q50, q51; q8k, q6k, q5k), each for one row (decode) and for many (prefill). A layout is its
// family's loop plus its scale-forming step (matmul.c: q4, q40, q8g, q80, q51; matmul_k.c: q4k, q8k, q6k, q5k): the
// layouts of a family share their integer dots and float steps and differ only in how a block's (q8: half block's)
// scales are formed, so the step is what is passed in; the 8-bit loops also take a weight-unpack step (q8_bytes,
// q6k_bytes, q50_bytes, q51_bytes: how a block's bytes are formed).
//
// Why a step passed to an always_inline loop: every caller passes a constant step, so after inlining the loop GCC
// calls the step directly and inlines it too (no indirect call is left: benchmarks/kernel_dedup.py checks the
// objects), and each instantiation is the code the former hand-written copy was, at its speed (docs/speed.md).
#pragma once
#include "simd512.h"

#define SC_LOOP static inline __attribute__((always_inline))

// A layout's scales are an array of structs, each for `span` blocks of 32 along K of one row group (span 1: q4, q8g;
// 8: the K-quants' super-blocks), so row group g's block b is block j = b % span of struct t = (g*K/32 + b) / span.
// The decode loops run j innermost, so a struct's fp16 d / dmin are widened once for its span (the compiler hoists
// them; widened per block, the q4k decode in L2 measured 8% slower). The prefill forms each block's scales once anyway.
// Block j of struct t of a 4-bit layout -> ds and mt of its 16 rows (see q_step).
typedef void (*q4_scales_fn)(const void* sw, size_t t, int j, __m512* ds, __m512* mt);
// Half k (columns 16k..16k+15) of block j of struct t of an 8-bit layout -> its ds and mt.
typedef void (*q8_scales_fn)(const void* sw, size_t t, int j, int k, __m512* ds, __m512* mt);
// Whether any m term of row group g (nb blocks) can be non-zero: where none can, the prefill leaves them out
// (q8_half0).
typedef int (*q8_mins_fn)(const void* sw, size_t g, int nb);
// The 8-bit family's weight-unpack step, beside its scale-forming one: block blk (g*K/32 + b) of a layout's weights
// -> its 8 sub-blocks as q + 128 bytes (q8_bytes: q8g, q8k load them as stored; q6k_bytes rebuilds them).
typedef void (*q8_load_fn)(const void* hw, size_t blk, __m512i w[8]);

// Every layout's per-lane arithmetic (kernels.h: sc_lin_run): acc + isum*(ds*dx), then + mt*sx, each step fused.
// mt is the m term's factor: m (q4, q8g) or -(dmin*mn) (the K-quants: matmul_k.c's k_neg forms it exactly, so this
// fused add is the bits of acc - (dmin*mn)*sx).
static inline __m512 q_step(__m512 acc, __m512i isum, __m512 ds, __m512 mt, float dx, float sx) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ds, _mm512_set1_ps(dx)), acc);
    return _mm512_fmadd_ps(mt, _mm512_set1_ps(sx), acc);
}

static inline void put16(float* y, int g, __m512 acc, const float* bias) {
    if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + g * RG));
    _mm512_storeu_ps(y + g * RG, acc);
}

// ---- 4-bit nibbles (sc_q4_block) ----------------------------------------------------------------------------------
// The exact integer dot of one block's 16 rows with the 32 int8 values at xm (8 int32 words), two dpbusd chains.
static inline __m512i q4_isum(const sc_q4_block* wb, const int32_t* xm, __m512i lo4) {
    __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
    for (int s = 0; s < 4; s++) {
        __m512i v = _mm512_loadu_si512((const void*)wb->q[s]);
        i0 = _mm512_dpbusd_epi32(i0, _mm512_and_si512(v, lo4), _mm512_set1_epi32(xm[2 * s]));
        i1 = _mm512_dpbusd_epi32(i1, _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4), _mm512_set1_epi32(xm[2 * s + 1]));
    }
    return _mm512_add_epi32(i0, i1);
}

// One row (decode), row groups g0..g1-1: the accumulator in a register (through q4_rows a decode step measured 2%
// slower).
SC_LOOP void q4_row(const sc_xq* xa, int K, int g0, int g1, const sc_q4_block* qw, const void* sw, const float* bias,
                    float* y, q4_scales_fn scales, const int span) {
    int nb = K / QB;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        __m512 acc = _mm512_setzero_ps();
        for (int b0 = 0; b0 < nb; b0 += span)
            #pragma GCC unroll 8  // a super-block's 8 blocks: q4k_v's word index and shift fold to constants
            for (int j = 0, b = b0; j < span; j++, b++) {
                __m512i isum = q4_isum(wg + b, xm + 8 * b, lo4);
                __m512 ds, mt;
                scales(sw, ((size_t)g * nb + b0) / span, j, &ds, &mt);
                acc = q_step(acc, isum, ds, mt, xa->dx[b], xa->sx[b]);
            }
        put16(y, g, acc, bias);
    }
}

// Many rows (prefill): each weight block is unpacked (and its scales formed) once and used for every row of the pass
// (m0..m0+mn-1, mn <= SC_MB), the rows' accumulators in an L1-sized buffer `acc_buf` [SC_MB][16], instead of
// unpacking it again per row (2x the work per row). Row groups g0..g1-1.
SC_LOOP void q4_rows(const sc_xq* xa, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const sc_q4_block* qw, const void* sw, const float* bias, float* y, q4_scales_fn scales,
                     const int span) {
    int nb = K / QB;
    __m512* acc = (__m512*)acc_buf;  // 64-byte aligned: sc_take
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int g = g0; g < g1; g++) {
        const sc_q4_block* wg = qw + (size_t)g * nb;
        for (int m = 0; m < mn; m++) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512i w[8];
            for (int s = 0; s < 4; s++) {
                __m512i v = _mm512_loadu_si512((const void*)wg[b].q[s]);
                w[2 * s] = _mm512_and_si512(v, lo4);
                w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            }
            __m512 ds, mt;
            scales(sw, ((size_t)g * nb + b) / span, b % span, &ds, &mt);
            for (int m = 0; m < mn; m++) {
                const int32_t* xm = (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8;
                __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
                for (int s = 0; s < 4; s++) {
                    i0 = _mm512_dpbusd_epi32(i0, w[2 * s], _mm512_set1_epi32(xm[2 * s]));
                    i1 = _mm512_dpbusd_epi32(i1, w[2 * s + 1], _mm512_set1_epi32(xm[2 * s + 1]));
                }
                size_t at = (size_t)(m0 + m) * nb + b;
                acc[m] = q_step(acc[m], _mm512_add_epi32(i0, i1), ds, mt, xa->dx[at], xa->sx[at]);
            }
        }
        for (int m = 0; m < mn; m++) put16(y + (size_t)(m0 + m) * N, g, acc[m], bias);
    }
}

// ---- 8-bit bytes (sc_q8_block, stored q + 128) --------------------------------------------------------------------
// One half block (16 weights) of 16 rows: isum = dot(q + 128, xq) - 128*sum(xq), exact (c16 holds the 128*sum).
static inline __m512 q8_half(__m512 acc, __m512i i0, __m512i i1, int32_t c16, __m512 ds, __m512 mt, float dx,
                             float sx16) {
    return q_step(acc, _mm512_sub_epi32(_mm512_add_epi32(i0, i1), _mm512_set1_epi32(c16)), ds, mt, dx, sx16);
}

// q8_half without the m term, for row groups whose m terms are all +-0 (q8k's Q6_K): there every m step is
// acc + (+-0)*sx, which is acc unless acc is -0, and without m steps no accumulator is ever -0 (each starts at +0; an
// isum step's exact result is 0 only when isum is, and +0 + +-0 is +0), so the same bits, two FMAs of 16 fewer.
// Measured: Q6_K is 16% of a ~1B Q4_K_M prefill's time at 2 threads; this ~3% of that prefill.
static inline __m512 q8_half0(__m512 acc, __m512i i0, __m512i i1, int32_t c16, __m512 ds, float dx) {
    __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(i0, i1), _mm512_set1_epi32(c16));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ds, _mm512_set1_ps(dx)), acc);
}

// The four dpbusd chains of one block against the 32 int8 values at xm (q8g_chain: halves 0 | 1 in 0, 1 | 2, 3).
static inline void q8_chains(const __m512i w[8], const int32_t* xm, __m512i i[4]) {
    for (int c = 0; c < 4; c++) i[c] = _mm512_setzero_si512();
    for (int s = 0; s < 8; s++) i[q8g_chain(s)] = _mm512_dpbusd_epi32(i[q8g_chain(s)], w[s], _mm512_set1_epi32(xm[s]));
}

static inline void q8_bytes(const void* hw, size_t blk, __m512i w[8]) {
    const sc_q8_block* wb = (const sc_q8_block*)hw + blk;
    for (int s = 0; s < 8; s++) w[s] = _mm512_loadu_si512((const void*)wb->q[s]);
}

// q6k (layouts.h: sc_q6k_block): sub-block s's bytes are (its nibbles | its 2 high bits << 4) + 96, i.e. u + 96 =
// q + 128, the very bytes q8k holds for the tensor. Sub-block s = 4p + i has its high bits at bits 2i of plane p:
// shifted to bits 4..5 (within each byte: the 16-bit shifts' spill is masked off). 6 loads of 64 bytes for q8k's 8.
// In L2 (512 x 2048 repeated, one row: the unpack is the bound) q6k takes 1.34x q8k's time. Dotting u itself (lift
// 32, c16 / 4 off) with one vpternlogd a byte register cut that to 1.17x, but streamed from memory, as decode reads
// weights, it measured ~10% slower than this in 8 of 8 interleaved runs (min of 25 each: 0.72-0.97 of q8k's time
// here against 0.81-1.15; 1 thread, a busy 2-core AVX-512 VM), so this is kept.
static inline void q6k_bytes(const void* hw, size_t blk, __m512i w[8]) {
    const sc_q6k_block* wb = (const sc_q6k_block*)hw + blk;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(96);
    __m512i p0 = _mm512_loadu_si512((const void*)wb->h[0]), p1 = _mm512_loadu_si512((const void*)wb->h[1]);
    __m512i hs[8] = {_mm512_slli_epi16(p0, 4), _mm512_slli_epi16(p0, 2), p0, _mm512_srli_epi16(p0, 2),
                     _mm512_slli_epi16(p1, 4), _mm512_slli_epi16(p1, 2), p1, _mm512_srli_epi16(p1, 2)};
    for (int s = 0; s < 4; s++) {
        __m512i v = _mm512_loadu_si512((const void*)wb->q[s]);
        __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        w[2 * s] = _mm512_add_epi8(_mm512_or_si512(lo, _mm512_and_si512(hs[2 * s], hi2)), off);
        w[2 * s + 1] = _mm512_add_epi8(_mm512_or_si512(hi, _mm512_and_si512(hs[2 * s + 1], hi2)), off);
    }
}

// q5 blocks (layouts.h: sc_q5_block): sub-block s's bytes are its nibbles | bit s of the plane moved to bit 4 (16-bit
// shifts, the spill masked off within each byte), plus `off`: q + 128 is u + 112 for q50 (q = u - 16), u + 128 for
// q51 and q5k (q = u). 5 loads of 64 bytes for q8g's 8: the bytes of q8g's / q8k's layout for the tensor, rebuilt.
static inline void q5_bytes(const void* hw, size_t blk, __m512i w[8], int off) {
    const sc_q5_block* wb = (const sc_q5_block*)hw + blk;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10), o = _mm512_set1_epi8((char)off);
    __m512i p = _mm512_loadu_si512((const void*)wb->h);
    __m512i hs[8] = {_mm512_slli_epi16(p, 4), _mm512_slli_epi16(p, 3), _mm512_slli_epi16(p, 2), _mm512_slli_epi16(p, 1),
                     p, _mm512_srli_epi16(p, 1), _mm512_srli_epi16(p, 2), _mm512_srli_epi16(p, 3)};
    for (int s = 0; s < 4; s++) {
        __m512i v = _mm512_loadu_si512((const void*)wb->q[s]);
        __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        w[2 * s] = _mm512_add_epi8(_mm512_or_si512(lo, _mm512_and_si512(hs[2 * s], b4)), o);
        w[2 * s + 1] = _mm512_add_epi8(_mm512_or_si512(hi, _mm512_and_si512(hs[2 * s + 1], b4)), o);
    }
}
static inline void q50_bytes(const void* hw, size_t blk, __m512i w[8]) { q5_bytes(hw, blk, w, 112); }
static inline void q51_bytes(const void* hw, size_t blk, __m512i w[8]) { q5_bytes(hw, blk, w, 128); }

// One row (decode): two accumulators (one per half block) in registers, summed last.
SC_LOOP void q8_row(const sc_xq* xa, const sc_x16* xh, int K, int g0, int g1, const void* hw, const void* sw,
                    const float* bias, float* y, q8_load_fn load, q8_scales_fn scales, const int span) {
    int nb = K / QB;
    const int32_t* xm = (const int32_t*)xa->xq;
    for (int g = g0; g < g1; g++) {
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int b0 = 0; b0 < nb; b0 += span)
            for (int j = 0, b = b0; j < span; j++, b++) {
                __m512i w[8], i[4];
                load(hw, (size_t)g * nb + b, w);
                q8_chains(w, xm + 8 * b, i);
                for (int k = 0; k < 2; k++) {
                    __m512 ds, mt;
                    scales(sw, ((size_t)g * nb + b0) / span, j, k, &ds, &mt);
                    acc[k] = q8_half(acc[k], i[2 * k], i[2 * k + 1], xh->c16[2 * b + k], ds, mt, xa->dx[b],
                                     xh->sx16[2 * b + k]);
                }
            }
        put16(y, g, _mm512_add_ps(acc[0], acc[1]), bias);
    }
}

// Many rows (prefill): as q4_rows, each block's bytes loaded and scales formed once for every row of the pass
// (m0..m0+mn-1, mn <= SC_MB8), the rows' two accumulators in `acc_buf` [SC_MB8][2][16]; row groups g0..g1-1.
SC_LOOP void q8_rows(const sc_xq* xa, const sc_x16* xh, float* acc_buf, int m0, int mn, int K, int N, int g0, int g1,
                     const void* hw, const void* sw, const float* bias, float* y, q8_load_fn load,
                     q8_scales_fn scales, q8_mins_fn mins_of, const int span) {
    int nb = K / QB, nh = K / 16;
    __m512* acc = (__m512*)acc_buf;  // 64-byte aligned: sc_take
    for (int g = g0; g < g1; g++) {
        int mins = mins_of(sw, g, nb);
        for (int m = 0; m < 2 * mn; m++) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512i w[8];
            __m512 ds[2], mt[2];
            load(hw, (size_t)g * nb + b, w);
            for (int k = 0; k < 2; k++) scales(sw, ((size_t)g * nb + b) / span, b % span, k, &ds[k], &mt[k]);
            for (int m = 0; m < mn; m++) {
                __m512i i[4];
                q8_chains(w, (const int32_t*)(xa->xq + (size_t)(m0 + m) * K) + b * 8, i);
                float dx = xa->dx[(size_t)(m0 + m) * nb + b];
                size_t h = (size_t)(m0 + m) * nh + 2 * b;
                for (int k = 0; k < 2; k++)
                    acc[2 * m + k] = mins ? q8_half(acc[2 * m + k], i[2 * k], i[2 * k + 1], xh->c16[h + k], ds[k],
                                                    mt[k], dx, xh->sx16[h + k])
                                          : q8_half0(acc[2 * m + k], i[2 * k], i[2 * k + 1], xh->c16[h + k], ds[k], dx);
            }
        }
        for (int m = 0; m < mn; m++)
            put16(y + (size_t)(m0 + m) * N, g, _mm512_add_ps(acc[2 * m], acc[2 * m + 1]), bias);
    }
}
