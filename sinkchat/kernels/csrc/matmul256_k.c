// The K-quant matmuls on 256-bit registers (avx2 / avxvnni): matmul_k.c's q4k, q8k and q6k (see there for why these
// layouts), their scale-forming steps on rows256.h's loops, every lane ref.c's operations in its order (bit-exact).
#include "rows256.h"

// -(dmin*mn), exactly (matmul_k.c: k_neg): q_step's acc + mt*sx is then the fused acc - (dmin*mn)*sx.
static inline __m256 k_neg(__m256 dmin, __m256 mn) { return _mm256_fnmadd_ps(dmin, mn, _mm256_set1_ps(-0.0f)); }

// q4k's v_k of rows 8h..8h+7 as floats (layouts.h: sc_q4k_v; matmul_k.c: q4k_v, why words).
static inline __m256 q4k_v(const sc_q4k_scales* s, int k, int h) {
    if (k < 15) {
        __m256i w = _mm256_loadu_si256((const __m256i*)(s->w[k / 5] + 8 * h));
        w = _mm256_and_si256(_mm256_srl_epi32(w, _mm_cvtsi32_si128(6 * (k % 5))), _mm256_set1_epi32(63));
        return _mm256_cvtepi32_ps(w);
    }
    __m256i a = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i*)(s->w[0] + 8 * h)), 30);
    __m256i b = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i*)(s->w[1] + 8 * h)), 30);
    __m256i c = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i*)(s->w[2] + 8 * h)), 30);
    return _mm256_cvtepi32_ps(_mm256_or_si256(a, _mm256_or_si256(_mm256_slli_epi32(b, 2), _mm256_slli_epi32(c, 4))));
}

// q4k: block j of super-block t, rows 8h..8h+7 (span 8).
static inline void q4k_scales(const void* sw, size_t t, int j, int h, __m256* ds, __m256* mt) {
    const sc_q4k_scales* s = (const sc_q4k_scales*)sw + t;
    *ds = _mm256_mul_ps(f16x8(s->d + 8 * h), q4k_v(s, j, h));
    *mt = k_neg(f16x8(s->dmin + 8 * h), q4k_v(s, 8 + j, h));
}

// q8k: half k of block j is 16-weight sub-block 2j + k of super-block t, rows 8h..8h+7 (signed scales, unsigned
// mins; span 8).
static inline void q8k_scales(const void* sw, size_t t, int j, int k, int h, __m256* ds, __m256* mt) {
    const sc_q8k_scales* s = (const sc_q8k_scales*)sw + t;
    *ds = _mm256_mul_ps(f16x8(s->d + 8 * h), i8x8(s->sc[2 * j + k] + 8 * h));
    *mt = k_neg(f16x8(s->dmin + 8 * h), u8x8(s->mn[2 * j + k] + 8 * h));
}

void sc_q4k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q4_row(&a->x, a->K, g0, g1, l->w, l->s, l->bias, l->y, q4k_scales, 8);
    else q4_rows(&a->x, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q4k_scales, 8);
}

void sc_q8k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, 0, q8k_scales, 8);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q8_bytes, 0, q8k_scales, 8);
}

// q5k: Q5_K's sc_j, mn_j per 32 for both halves k of block j, rows 8h..8h+7 (matmul_k.c's q5k_scales; span 8).
static inline void q5k_scales(const void* sw, size_t t, int j, int k, int h, __m256* ds, __m256* mt) {
    (void)k, q4k_scales(sw, t, j, h, ds, mt);
}

void sc_q5k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, 0, q5k_scales, 8);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q51_bytes, 0, q5k_scales, 8);
}

// q6k: Q6_K's d and int8 scale of sub-block 2j + k of super-block t, rows 8h..8h+7; mt q8k's -(0*0) = -0 (span 8).
static inline void q6k_scales(const void* sw, size_t t, int j, int k, int h, __m256* ds, __m256* mt) {
    const sc_q6k_scales* s = (const sc_q6k_scales*)sw + t;
    *ds = _mm256_mul_ps(f16x8(s->d + 8 * h), i8x8(s->sc[2 * j + k] + 8 * h));
    *mt = _mm256_set1_ps(-0.0f);
}

void sc_q6k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    if (a->M == 1) q8_row(&a->x, &a->h, a->K, g0, g1, l->w, l->s, l->bias, l->y, q6k_bytes, 2, q6k_scales, 8);
    else q8_rows(&a->x, &a->h, acc, m0, mn, a->K, l->N, g0, g1, l->w, l->s, l->bias, l->y, q6k_bytes, 2, q6k_scales, 8);
}
