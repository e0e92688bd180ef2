// The K-quant matmuls, SIMD variant: q4k (the q4 nibbles with Q4_K's super-block scales), q8k (the q8 bytes with
// Q5_K / Q6_K's) and q6k (Q6_K at its own 6.56 bits: rows512.h's q6k_bytes), their scale-forming steps on rows512.h's
// row loops, each held bit-exact to its scalar twin in ref.c (the same float operations in the same order).
//
// Why their own layouts: llama.cpp's K-quants scale each 32 (Q4_K, Q5_K) or 16 (Q6_K) weights by d*sc_j with d fp16
// and sc_j a 6- or 8-bit integer. Rounding d*sc_j to fp16 (the q4 / q8g way) changes the weights by up to half an
// fp16 ulp, and those layouts' per-32 / per-16 fp16 pairs take more bytes than the file (q4: 0.625 bytes a weight
// against Q4_K's 0.5625; q8g 1.25 against Q6_K's 0.82). Here the file's integers and fp16 super-block scales are
// stored as they are (q4k 0.5625, the file's: 6-bit sc, mn in words, q4k_v; q8k 1.14 bytes a weight) and d*sc_j is
// formed in fp32 (exact: 11 x 8 bits). The timings below are ABI 11's byte-per-scale q4k (docs/gguf.md: the words').
//
// The integer dot products are q4's and q8g's; per 32-block the scales cost two byte widenings and two multiplies
// more than q4's two fp16 loads. Measured at one row (decode), on one core of the 2-core AVX-512 dev VM (medians,
// the layouts interleaved): with the weights streaming from memory, which is what decode reads, N x K = 2048 x 2048:
// q4 124 us, q4k 112-117; q8g 199-203, q8k 190-198; 8192 x 2048: q4 468, q4k 419; q8g 947, q8k 776; 2048 x 8192:
// q4 519-603, q4k 510-519; q8g 850, q8k 817-871 (fewer bytes, no slower). In L2 (2048 x 2048 repeated): q4 43-44,
// q4k 45 (+3-5%: the widenings); q8g 68-71, q8k 66-67.
#include "rows512.h"

// -(dmin*mn), exactly: fnmadd with -0 is one rounding of -(dmin*mn) + -0, the negated rounded product (-0 for a +0
// product), so q_step's acc + mt*sx is the bits of the fused acc - (dmin*mn)*sx (ref.c: k_neg).
static inline __m512 k_neg(__m512 dmin, __m512 mn) { return _mm512_fnmadd_ps(dmin, mn, _mm512_set1_ps(-0.0f)); }

// q4k's v_k of 16 rows as floats (layouts.h: sc_q4k_v; sc_j = v_j, mn_j = v_{8+j}): each row's word in its lane,
// one shift and one and (v_15, mn_7: its three 2-bit parts). A per-byte packing of the 6 bits (the low nibbles, then
// 2-bit planes, as Q4_K) took 8 byte operations and a widening more per block: 1.22x ABI 11's time for a q4k decode
// in L2 (one row, 1024 x 1024 repeated); this is within noise of it (benchmarks/kernel_dedup.py --layouts q4k).
static inline __m512 q4k_v(const sc_q4k_scales* s, int k) {
    if (k < 15) {
        __m512i w = _mm512_loadu_si512((const void*)s->w[k / 5]);
        w = _mm512_and_si512(_mm512_srl_epi32(w, _mm_cvtsi32_si128(6 * (k % 5))), _mm512_set1_epi32(63));
        return _mm512_cvtepi32_ps(w);
    }
    __m512i a = _mm512_srli_epi32(_mm512_loadu_si512((const void*)s->w[0]), 30);
    __m512i b = _mm512_srli_epi32(_mm512_loadu_si512((const void*)s->w[1]), 30);
    __m512i c = _mm512_srli_epi32(_mm512_loadu_si512((const void*)s->w[2]), 30);
    return _mm512_cvtepi32_ps(_mm512_or_si512(a, _mm512_or_si512(_mm512_slli_epi32(b, 2), _mm512_slli_epi32(c, 4))));
}

// q4k: block j of super-block t (sw [N/16][K/256] of sc_q4k_scales: span 8).
static inline void q4k_scales(const void* sw, size_t t, int j, __m512* ds, __m512* mt) {
    const sc_q4k_scales* s = (const sc_q4k_scales*)sw + t;
    *ds = _mm512_mul_ps(f16x16(s->d), q4k_v(s, j));
    *mt = k_neg(f16x16(s->dmin), q4k_v(s, 8 + j));
}

// q8k: half k of block j is 16-weight sub-block 2j + k of super-block t (signed scales, unsigned mins; span 8).
static inline void q8k_scales(const void* sw, size_t t, int j, int k, __m512* ds, __m512* mt) {
    const sc_q8k_scales* s = (const sc_q8k_scales*)sw + t;
    *ds = _mm512_mul_ps(f16x16(s->d), i8x16(s->sc[2 * j + k]));
    *mt = k_neg(f16x16(s->dmin), u8x16(s->mn[2 * j + k]));
}

// q5k: Q5_K's sc_j, mn_j per 32 (sc_q4k_scales' words) for both halves k of block j: q8k's values for a Q5_K tensor.
static inline void q5k_scales(const void* sw, size_t t, int j, int k, __m512* ds, __m512* mt) {
    (void)k, q4k_scales(sw, t, j, ds, mt);
}
static inline int q5k_mins(const void* sw, size_t g, int nb) {  // the m steps always (+-0 ones give the same bits)
    (void)sw, (void)g, (void)nb;
    return 1;
}

// Any dmin of row group g not +-0 (Q5_K); Q6_K has none, and its prefill then leaves the m terms out (q8_half0).
static inline int q8k_mins(const void* sw, size_t g, int nb) {
    const sc_q8k_scales* s = (const sc_q8k_scales*)sw + g * (size_t)(nb / 8);
    int mins = 0;
    for (int t = 0; t < nb / 8; t++)
        for (int r = 0; r < RG; r++) mins |= s[t].dmin[r] & 0x7FFF;
    return mins;
}

void sc_q4k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q4_row(&a->x, a->K, g0, g1, l->w, l->s, l->bias, l->y, q4k_scales, 8);
    else q4_rows(&a->x, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q4k_scales, 8);
}

void sc_q8k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, q8k_scales, 8);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, q8k_scales,
                 q8k_mins, 8);
}

void sc_q5k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, q5k_scales, 8);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, q5k_scales,
                 q5k_mins, 8);
}

// q6k: Q6_K's d and int8 scale of sub-block 2j + k of super-block t (span 8); no min, so mt is q8k's -(0*0) = -0
// and the prefill leaves the m terms out (q6k_mins), as q8k does for a Q6_K tensor: with q6k_bytes, q8k's bits.
static inline void q6k_scales(const void* sw, size_t t, int j, int k, __m512* ds, __m512* mt) {
    const sc_q6k_scales* s = (const sc_q6k_scales*)sw + t;
    *ds = _mm512_mul_ps(f16x16(s->d), i8x16(s->sc[2 * j + k]));
    *mt = _mm512_set1_ps(-0.0f);
}
static inline int q6k_mins(const void* sw, size_t g, int nb) {
    (void)sw, (void)g, (void)nb;
    return 0;
}

void sc_q6k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q6k_bytes, q6k_scales, 8);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q6k_bytes, q6k_scales,
                 q6k_mins, 8);
}
