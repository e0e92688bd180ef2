// 256-bit helpers of the avx2 and avxvnni variants (matmul256.c, matmul256_k.c, rows256.h, attend256.c), built
// with explicit -mavx2 -mfma -mf16c (and -mavxvnni for avxvnni), never -march=native: the library then runs on any
// CPU with those flags, and this CPU (which has AVX-512 too) can build and test both without the compiler slipping
// an AVX-512 instruction in.
//
// The layouts keep 16 rows in 64 bytes (one 512-bit register). Here a row group is two halves, rows 0-7 and 8-15
// (bytes 0..31 and 32..63 of each sub-block), each one 256-bit register with a 32-bit lane per row: every lane does
// the avx512 variant's per-lane operations in the same order, so the matmuls stay bit-exact to ref.c.
#pragma once
#include <immintrin.h>

#include "kernels.h"

static inline __m256 f16x8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

static inline __m256 u8x8(const uint8_t* p) {  // 8 unsigned bytes to floats (exact)
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static inline __m256 i8x8(const int8_t* p) {  // 8 signed bytes to floats (exact)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static inline __m256i bcast32(const int32_t* p) { return _mm256_set1_epi32(*p); }

// ---- the integer dot products: int8 activations times unsigned weight bytes, exact in every variant ---------------
// avxvnni: vpdpbusd, as the avx512 variant (4 byte products a lane, no saturation).
// avx2: vpmaddubsw (unsigned x signed byte pairs to int16, saturating) then vpmaddwd by 1 (int16 pairs to int32).
// A pair of 4-bit weights times int8 is at most 15 * 128 * 2 = 3840 in magnitude, so the int16 sums of a whole
// q4 block (8 such registers: 30720) cannot saturate and one vpmaddwd a block suffices. 8-bit weights (stored
// q + 128, 0..255) would saturate (255 * 128 * 2 = 65280), so they go through the same path as two nibbles:
// dot(u, x) = dot(u & 15, x) + 16 * dot(u >> 4, x), each half 4-bit and exact, the high one weighted 16 by its
// vpmaddwd. (The sign trick llama.cpp uses, |x| times sign(q, x), is wrong for q = -128, which the layouts allow.)
// avxvnni_evex (tests only, abi.TEST_VARIANTS): the avxvnni code with vpdpbusd in its AVX-512 VL encoding (the same
// operation), so a CPU with AVX-512 VNNI but no AVX-VNNI (this Zen 5) still runs and checks every avxvnni line.
#if defined(__AVXVNNI__)
#define SC_DP(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#elif defined(SC_VNNI_EVEX)
#define SC_DP(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#endif

static inline __m256i lo_nib(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline __m256i hi_nib(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }

// Half h (rows 8h..8h+7) of a q4 block as 8 registers of nibbles: w[2s] the low ones of sub-block s (columns
// 8s..8s+3), w[2s+1] the high ones (8s+4..8s+7).
static inline void q4_unpack(const sc_q4_block* wb, int h, __m256i w[8]) {
    for (int s = 0; s < 4; s++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)wb->q[s][8 * h]);
        w[2 * s] = lo_nib(v);
        w[2 * s + 1] = hi_nib(v);
    }
}

// The exact dot of q4_unpack's registers with the block's 32 int8 values at xm (8 int32 words), per row lane.
static inline __m256i q4_dot(const __m256i w[8], const int32_t* xm) {
#ifdef SC_DP
    __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();  // two chains, as the avx512 variant
    for (int s = 0; s < 4; s++) {
        i0 = SC_DP(i0, w[2 * s], bcast32(xm + 2 * s));
        i1 = SC_DP(i1, w[2 * s + 1], bcast32(xm + 2 * s + 1));
    }
    return _mm256_add_epi32(i0, i1);
#else
    __m256i s16 = _mm256_setzero_si256();  // <= 8 x 3840 in magnitude: no saturation (above)
    for (int i = 0; i < 8; i++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[i], bcast32(xm + i)));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
}

// Half h (rows 8h..8h+7) of four sub-blocks s0..s0+3 of a q8 block (one q8g half block when s0 is 0 or 4), ready
// for q8_dot: the bytes (avxvnni) or their nibbles (avx2).
typedef struct {
#ifdef SC_DP
    __m256i v[4];
#else
    __m256i lo[4], hi[4];
#endif
} q8w;

static inline void q8_load(const sc_q8_block* wb, int s0, int h, q8w* w) {
    for (int s = 0; s < 4; s++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)wb->q[s0 + s][8 * h]);
#ifdef SC_DP
        w->v[s] = v;
#else
        w->lo[s] = lo_nib(v);
        w->hi[s] = hi_nib(v);
#endif
    }
}

// The exact dot of the four sub-blocks' (q + 128) bytes with their 16 int8 values at xm (4 int32 words).
static inline __m256i q8_dot(const q8w* w, const int32_t* xm) {
#ifdef SC_DP
    __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
    for (int s = 0; s < 4; s += 2) {
        i0 = SC_DP(i0, w->v[s], bcast32(xm + s));
        i1 = SC_DP(i1, w->v[s + 1], bcast32(xm + s + 1));
    }
    return _mm256_add_epi32(i0, i1);
#else
    __m256i l16 = _mm256_setzero_si256(), h16 = _mm256_setzero_si256();  // <= 4 x 3840 each
    for (int s = 0; s < 4; s++) {
        __m256i x = bcast32(xm + s);
        l16 = _mm256_add_epi16(l16, _mm256_maddubs_epi16(w->lo[s], x));
        h16 = _mm256_add_epi16(h16, _mm256_maddubs_epi16(w->hi[s], x));
    }
    __m256i lo = _mm256_madd_epi16(l16, _mm256_set1_epi16(1)), hi = _mm256_madd_epi16(h16, _mm256_set1_epi16(16));
    return _mm256_add_epi32(lo, hi);
#endif
}

// ---- floats ---------------------------------------------------------------------------------------------------------
static inline __m256 bf16x8(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline __m128i bf16_8(__m256 f) {  // 8 floats to bf16, round to nearest even; NaN stays NaN (sc_to_bf16)
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    r = _mm256_srli_epi32(r, 16);  // <= 0xffff: the unsigned pack below keeps it
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline __m256 kv8(const void* base, size_t i, int bf16) {  // 8 floats of a K or V row
    return bf16 ? bf16x8((const uint16_t*)base + i) : _mm256_loadu_ps((const float*)base + i);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline int32_t hsum8i(__m256i v) {  // wrapping, as the avx512 variant's reduction
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(m, _mm_shuffle_epi32(m, 0xb1)));
}

// e^x, ~1 ulp on [-87, 0]: the avx512 variant's exp512 (the same polynomial), with 2^n built from its exponent
// bits instead of vscalefps (n is in [-126, 0] here, so 2^n is a normal float and the product is the same).
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    n = _mm256_round_ps(n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
