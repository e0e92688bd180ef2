// AVX-512 helpers of the avx512 variant (matmul.c, matmul_k.c, rows512.h, attend.c); built with -march=native only.
#pragma once
#include <immintrin.h>

#include "kernels.h"

static inline __m512 f16x16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

static inline __m512 u8x16(const uint8_t* p) {  // 16 unsigned bytes to floats (exact)
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

static inline __m512 i8x16(const int8_t* p) {  // 16 signed bytes to floats (exact)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// The integer chain sub-block s (of a q8 block's 8) adds into (q8g, q8k): half 0 (s = 0..3) into chains 0, 1
// alternately, half 1 into 2, 3 (two chains a half, so the dependent dpbusd latencies overlap).
static inline int q8g_chain(int s) { return (s / 4) * 2 + s % 2; }

static inline __m512 bf16x16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline __m256i bf16_16(__m512 f) {  // 16 floats to bf16, round to nearest even; NaN stays NaN
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static inline __m512 kv16(const void* base, size_t i, int bf16) {  // 16 floats of a K or V row
    return bf16 ? bf16x16((const uint16_t*)base + i) : _mm512_loadu_ps((const float*)base + i);
}

// The sum of v's 16 lanes in one fixed order, gcc's _mm512_reduce_add_ps's spelled out (so another compiler's order
// cannot change the bits): halves 8-15 + 0-7, then 4-7 + 0-3, then 2, 3 + 0, 1, then the two. The 256-bit variants
// repeat it on their register pairs (simd256.h: v16_sum), so their attention has these bits too.
static inline float hsum512(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));  // AVX512F (no DQ needed)
    __m256 t = _mm256_add_ps(hi, _mm512_castps512_ps256(v));
    __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    u = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, 1));
}

static inline __m512 exp512(__m512 x) {  // e^x, ~1 ulp on [-87, 0] (what softmax feeds it)
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
