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

/* The G dots of one row a [W] with the fp32 queries qf [G][W] into out [G]. */
static void row_avx2(const uint16_t *a, const float *qf, int g, int w, float *out) {
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
        out[c] = hsum(_mm256_add_ps(s[0], s[1]));
    }
}
#endif

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
        for (int j = 0; j < n; j++) {
            const uint16_t *a = ri + (int64_t)j * w;
#if MK_AVX2
            if (!ref)
                row_avx2(a, qf, g, w, tmp);
            else
#endif
                for (int c = 0; c < g; c++) tmp[c] = dot_ref(a, qf + (int64_t)c * w, w);
            if (!r) {
                for (int c = 0; c < g; c++) out[((int64_t)i * n + j) * g + c] = f32_bf16(tmp[c]);
                continue;
            }
            float *m = best + ((int64_t)i * (n / r) + j / r) * g;
            for (int c = 0; c < g; c++) {
                float v = bf16_f32(f32_bf16(tmp[c]));
                if (j % r == 0)
                    m[c] = v;
                else if (m[c] == m[c] && (v != v || v > m[c]))
                    m[c] = v;
            }
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
