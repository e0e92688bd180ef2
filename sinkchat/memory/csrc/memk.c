/* The recall memory's own kernels (sinkchat/memory/native.py): the bf16 index's dots and the rotation of a block's
 * keys, each giving the bits of the torch code it replaces (tests/test_memory_native.py holds them to it).
 *
 * mk_dots: what torch 2.x computes for one bf16 dot of the index's per-batch matmul [G, W] x [W, N] (its
 * reduced-precision dot, ATen's dot_with_fp32_arith): 64 fp32 partial sums (8 registers of 8 lanes) of the exact
 * bf16 x bf16 products, k = 8 * register + lane, accumulated 64 elements at a time, then a halving tree (+32, +16,
 * +8 across registers, +4, +2, +1 across lanes), rounded to bf16 to nearest even. A bf16 product has 16 significant
 * bits, so it is exact in fp32 and a fused multiply-add rounds as mul-then-add does.
 *
 * mk_rotate: rotate-half RoPE of keys [rows, n, D] by per-token cos / sin [n, R] in fp32, each half rounded as
 * (a * c) - (b * s) and (b * c) + (a * s), two products then the sum (-ffp-contract=off: no fused multiply-add),
 * as blocks.rotate's torch ops do; dims past R copied.
 *
 * Built with -mavx2 -mfma where the CPU has them, else plain C of the same order (both tested against torch). */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MK_AVX2 1
#else
#define MK_AVX2 0
#endif

#define MK_API __attribute__((visibility("default")))

static inline float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* c10::BFloat16's round_to_nearest_even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

MK_API int mk_avx2(void) { return MK_AVX2; }

/* One dot of W (a multiple of 64) bf16 values in the order above, scalar. */
static float dot_ref(const uint16_t *a, const float *q, int w) {
    float p[64];
    for (int k = 0; k < 64; k++) p[k] = bf16_f32(a[k]) * q[k];
    for (int j = 64; j < w; j += 64)
        for (int k = 0; k < 64; k++) p[k] = p[k] + bf16_f32(a[j + k]) * q[j + k];
    for (int h = 32; h >= 1; h >>= 1)
        for (int k = 0; k < h; k++) p[k] = p[k] + p[k + h];
    return p[0];
}

#if MK_AVX2
static inline __m256 load8(const uint16_t *a) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)a));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

static inline float hsum(__m256 v) { /* lanes i + i+4, then + i+2, then + i+1 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The G dots of one row a [W] with the fp32 queries qf [G][W], each left as 8 lanes v[c] whose hsum is the dot. */
static inline void row_lanes(const uint16_t *a, const float *qf, int g, int w, __m256 *v) {
    __m256 x[8];
    for (int r = 0; r < 8; r++) x[r] = load8(a + 8 * r);
    for (int c = 0; c < g; c++) {
        const float *q = qf + (int64_t)c * w;
        __m256 s[8];
        for (int r = 0; r < 8; r++) s[r] = _mm256_mul_ps(x[r], _mm256_loadu_ps(q + 8 * r));
        for (int j = 64; j < w; j += 64)
            for (int r = 0; r < 8; r++)
                s[r] = _mm256_fmadd_ps(load8(a + j + 8 * r), _mm256_loadu_ps(q + j + 8 * r), s[r]);
        for (int r = 0; r < 4; r++) s[r] = _mm256_add_ps(s[r], s[r + 4]);
        s[0] = _mm256_add_ps(s[0], s[2]);
        s[1] = _mm256_add_ps(s[1], s[3]);
        v[c] = _mm256_add_ps(s[0], s[1]);
    }
}

/* The G dots of one row a [W] with the fp32 queries qf [G][W] into out [G]. */
static void row_avx2(const uint16_t *a, const float *qf, int g, int w, float *out) {
    __m256 v[16];
    row_lanes(a, qf, g, w, v);
    for (int c = 0; c < g; c++) out[c] = hsum(v[c]);
}

/* hsum of eight vectors at once, the same additions in the same order (lanes l + l+4, then + l+2, then + l+1):
 * lane t holds v[t]'s sum. */
static inline __m256 hsum8(const __m256 *v) {
    __m256 t[4];
    for (int k = 0; k < 4; k++)
        t[k] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x31));  /* [v0 l+l4 | v1 l+l4] */
    __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
    __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
    __m256 s = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x88), _mm256_shuffle_ps(u0, u1, 0xDD));  /* 0 2 4 6 | 1 3 5 7 */
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* x rounded to bf16 to nearest even (f32_bf16), as fp32 bits: the low 16 bits zero, a NaN 0x7fc00000. */
static inline __m256i round8_bf16(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
}

/* The max of each r consecutive lanes of x (r 1, 2, 4 or 8), in the group's first lane: the first of equal values
 * (+0 / -0) and a NaN winning, as keep() does one value at a time (a NaN here is 0x7fc00000, the rounding's). */
static inline __m256 block_max8(__m256 x, int r) {
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (r >= 2) { /* lane 2k: max(later 2k+1, earlier 2k); maxps returns its second operand on a tie */
        x = _mm256_max_ps(_mm256_permute_ps(x, 0xB1), x);
        nan = _mm256_or_ps(nan, _mm256_permute_ps(nan, 0xB1));
    }
    if (r >= 4) {
        x = _mm256_max_ps(_mm256_permute_ps(x, 0x4E), x);
        nan = _mm256_or_ps(nan, _mm256_permute_ps(nan, 0x4E));
    }
    if (r >= 8) {
        x = _mm256_max_ps(_mm256_permute2f128_ps(x, x, 0x01), x);
        nan = _mm256_or_ps(nan, _mm256_permute2f128_ps(nan, nan, 0x01));
    }
    return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

/* Eight rows a [8][W] at once: per query c the eight dots rounded to bf16, as fp32 bits, into bits [G][8]. */
static void rows8_avx2(const uint16_t *a, const float *qf, int g, int w, uint32_t *bits) {
    __m256 v[16][8];
    for (int t = 0; t < 8; t++) {
        __m256 lanes[16];
        row_lanes(a + (int64_t)t * w, qf, g, w, lanes);
        for (int c = 0; c < g; c++) v[c][t] = lanes[c];
    }
    for (int c = 0; c < g; c++) _mm256_storeu_si256((__m256i *)(bits + 8 * c), round8_bf16(hsum8(v[c])));
}
#endif

/* Dot c of row j of batch i, already rounded to bf16 (v): into out as bf16 (r 0), or into its block's max in best,
 * the first of equal values kept and a NaN winning, as torch's amax (branch-free: which row wins is data). */
static inline void keep(uint16_t *out, float *best, int i, int n, int j, int g, int r, int c, float v) {
    if (!r) {
        uint32_t u;
        memcpy(&u, &v, 4);
        out[((int64_t)i * n + j) * g + c] = (uint16_t)(u >> 16);
        return;
    }
    float *m = best + ((int64_t)i * (n / r) + j / r) * g + c;
    if (j % r == 0) {
        *m = v;
        return;
    }
    float o = *m;
    *m = ((o == o) & ((v != v) | (v > o))) ? v : o;
}

/* Per batch b the dots of rows[b] [N, W] (bf16; batch b at rows + b * stride) with q[b] [G, W] (bf16), each in the
 * order above and rounded to bf16: into out [B, N, G] (bf16) when r is 0, else their max over each r consecutive
 * rows (a block's) into best [B, N / r, G] as fp32 (a NaN wins, as torch's amax). W a multiple of 64, G <= 16 and
 * G * W <= 4096, else -1 (the caller keeps torch). ref: 1 forces the scalar code. */
MK_API int mk_dots(const uint16_t *rows, int64_t stride, int b, int n, int w, const uint16_t *q, int g, int r,
                   uint16_t *out, float *best, int ref) {
    float qf[4096], tmp[16];
    if (w <= 0 || w % 64 || g <= 0 || g > 16 || g * w > 4096 || r < 0 || (r && n % r)) return -1;
    (void)ref;
    for (int i = 0; i < b; i++) {
        for (int k = 0; k < g * w; k++) qf[k] = bf16_f32(q[(int64_t)i * g * w + k]);
        const uint16_t *ri = rows + (int64_t)i * stride;
        int j = 0;
#if MK_AVX2
        for (; !ref && j + 8 <= n; j += 8) {  /* eight rows at once: the same sums, hsums and roundings */
            uint32_t bits[16 * 8];
            rows8_avx2(ri + (int64_t)j * w, qf, g, w, bits);
            if (r && 8 % r == 0) { /* whole blocks: their maxima in lanes 0, r, 2r, ... */
                for (int c = 0; c < g; c++) {
                    float m[8];
                    _mm256_storeu_ps(m, block_max8(_mm256_loadu_ps((const float *)(bits + 8 * c)), r));
                    for (int t = 0; t < 8; t += r) best[((int64_t)i * (n / r) + (j + t) / r) * g + c] = m[t];
                }
                continue;
            }
            for (int t = 0; t < 8; t++)
                for (int c = 0; c < g; c++) {
                    float v;
                    memcpy(&v, &bits[8 * c + t], 4);
                    keep(out, best, i, n, j + t, g, r, c, v);
                }
        }
#endif
        for (; j < n; j++) {
            const uint16_t *a = ri + (int64_t)j * w;
#if MK_AVX2
            if (!ref)
                row_avx2(a, qf, g, w, tmp);
            else
#endif
                for (int c = 0; c < g; c++) tmp[c] = dot_ref(a, qf + (int64_t)c * w, w);
            for (int c = 0; c < g; c++) keep(out, best, i, n, j, g, r, c, bf16_f32(f32_bf16(tmp[c])));
        }
    }
    return 0;
}

/* Keys k [rows, n, D] (bf16 when bf16_in, else fp32) rotated by cos / sin [n, R] (fp32, R even, R <= D <= 1024)
 * into out [rows, n, D]: fp32, or bf16 rounded to nearest even when bf16_out. -1 for a shape it does not take. */
MK_API int mk_rotate(const void *k, int bf16_in, int64_t rows, int n, int d, int r, const float *cos,
                     const float *sin, void *out, int bf16_out) {
    const int half = r / 2;
    float x[1024], y[1024];
    if (d <= 0 || d > 1024 || r < 0 || r > d || r % 2) return -1;
    for (int64_t i = 0; i < rows; i++) {
        for (int t = 0; t < n; t++) {
            const int64_t at = (i * n + t) * d;
            const float *c = cos + (int64_t)t * r, *s = sin + (int64_t)t * r;
            if (bf16_in)
                for (int e = 0; e < d; e++) x[e] = bf16_f32(((const uint16_t *)k)[at + e]);
            else
                memcpy(x, (const float *)k + at, sizeof(float) * d);
            for (int e = 0; e < half; e++) {
                float p = x[e] * c[e], q = x[half + e] * s[e];
                float u = x[half + e] * c[half + e], v = x[e] * s[half + e];
                y[e] = p - q;
                y[half + e] = u + v;
            }
            for (int e = r; e < d; e++) y[e] = x[e];
            if (bf16_out)
                for (int e = 0; e < d; e++) ((uint16_t *)out)[at + e] = f32_bf16(y[e]);
            else
                memcpy((float *)out + at, y, sizeof(float) * d);
        }
    }
    return 0;
}
