// The decode step's attention pieces on 256-bit registers (avx2 / avxvnni: no integer dot here, so the two builds
// are the same code): attend.c's RoPE rotation, bf16 rows and one head's softmax attention. The rotation and the
// bf16 conversions match ref.c bit for bit; the attention matches the avx512 variant's bit for bit (below), and so
// ref.c to float rounding only, as that one does (tests/test_kernels.py: 4e-6).
#include "simd256.h"

// Rotate-half RoPE of one row k [D] by cos/sin [rot] into o (o may be k); dims past rot copied. The scalar tail
// rounds as the vector loop does (attend.c: sc_rot_row).
void sc_rot_row(const float* k, float* o, const float* cs, const float* sn, int rot, int D) {
    int h = rot / 2, i = 0;
    if (h % 8 == 0) {
        for (; i < h; i += 8) {
            __m256 a = _mm256_loadu_ps(k + i), b = _mm256_loadu_ps(k + i + h);
            __m256 lo = _mm256_fmsub_ps(a, _mm256_loadu_ps(cs + i), _mm256_mul_ps(b, _mm256_loadu_ps(sn + i)));
            __m256 hi = _mm256_fmadd_ps(b, _mm256_loadu_ps(cs + i + h), _mm256_mul_ps(a, _mm256_loadu_ps(sn + i + h)));
            _mm256_storeu_ps(o + i, lo);
            _mm256_storeu_ps(o + i + h, hi);
        }
    }
    sc_rot_lanes(k, o, cs, sn, i, rot, D);
}

void sc_put_bf16(uint16_t* p, const float* src, int D) {
    int d = 0;
    for (; d + 8 <= D; d += 8) _mm_storeu_si128((__m128i*)(p + d), bf16_8(_mm256_loadu_ps(src + d)));
    for (; d < D; d++) p[d] = sc_to_bf16(src[d]);
}

void sc_get_bf16(float* dst, const uint16_t* p, int D) {
    int d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, bf16x8(p + d));
    for (; d < D; d++) dst[d] = sc_from_bf16(p[d]);
}

// ---- attention: the avx512 variant's lanes, in pairs of registers --------------------------------------------------
// attend.c works on 16-lane registers and sums in a fixed tree; here each of its registers is a pair (lanes 0-7,
// 8-15) and every add, multiply and FMA is the one it does on that lane, the tree included (its shuffles stay within
// 128-bit lanes or move whole ones). So this attention gives the avx512 variant's bits, and the whole decode step
// of every variant is bit-identical (tests/test_kernels.py): a different order would flip an int8 rounding in a
// later layer now and then (seen: one flip of 2.8e-2 in 40 Qwen3 steps with an 8-lane order).
typedef struct {
    __m256 lo, hi;
} v16;

static inline v16 v16_load(const float* p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline v16 v16_kv(const void* base, size_t i, int bf) { return (v16){kv8(base, i, bf), kv8(base, i + 8, bf)}; }
static inline v16 v16_set1(float f) { return (v16){_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline v16 v16_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline v16 v16_mul(v16 a, v16 b) { return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline void v16_store(float* p, v16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}

// simd512.h: hsum512, on a pair.
static inline float v16_sum(v16 v) {
    __m256 t = _mm256_add_ps(v.hi, v.lo);
    __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    u = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, 1));
}

// [x.L_i, x.L_j] of a pair's 128-bit lanes L0..L3 (lo = L0, L1; hi = L2, L3): _mm512_shuffle_f32x4's 0x88 (i, j = 0,
// 2) and 0xDD (1, 3) halves.
static inline __m256 lanes02(v16 x) { return _mm256_permute2f128_ps(x.lo, x.hi, 0x20); }
static inline __m256 lanes13(v16 x) { return _mm256_permute2f128_ps(x.lo, x.hi, 0x31); }

// attend.c: hsum16 (r[j] = the sum of v[j]'s 16 lanes), step for step on pairs.
static inline v16 hsum16(const v16* v) {
    v16 a[8], b[4], d[2];
    for (int i = 0; i < 8; i++) {
        const v16 x = v[2 * i], y = v[2 * i + 1];
        a[i].lo = _mm256_add_ps(_mm256_unpacklo_ps(x.lo, y.lo), _mm256_unpackhi_ps(x.lo, y.lo));
        a[i].hi = _mm256_add_ps(_mm256_unpacklo_ps(x.hi, y.hi), _mm256_unpackhi_ps(x.hi, y.hi));
    }
    for (int i = 0; i < 4; i++) {
        const v16 x = a[2 * i], y = a[2 * i + 1];
        b[i].lo = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x.lo), _mm256_castps_pd(y.lo))),
                                _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x.lo), _mm256_castps_pd(y.lo))));
        b[i].hi = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x.hi), _mm256_castps_pd(y.hi))),
                                _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x.hi), _mm256_castps_pd(y.hi))));
    }
    for (int i = 0; i < 2; i++)
        d[i] = (v16){_mm256_add_ps(lanes02(b[2 * i]), lanes13(b[2 * i])),
                     _mm256_add_ps(lanes02(b[2 * i + 1]), lanes13(b[2 * i + 1]))};
    return (v16){_mm256_add_ps(lanes02(d[0]), lanes13(d[0])), _mm256_add_ps(lanes02(d[1]), lanes13(d[1]))};
}

// attend.c: softmax, in place over sc [n]: a 16-lane max and sum, the tail through a padded copy (pad lanes -inf
// for the max, not added to the sum: the masked lanes there).
static void softmax(float* sc, int n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    v16 vs = v16_set1(0.0f);
    int s = 0, t = n % 16, full = n - t;
    for (; s < full; s += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sc + s));
    float tail[16];
    for (int i = 0; i < 16; i++) tail[i] = i < t ? sc[full + i] : -INFINITY;
    m8 = _mm256_max_ps(m8, _mm256_max_ps(_mm256_loadu_ps(tail), _mm256_loadu_ps(tail + 8)));
    v16 vm = v16_set1(hmax8(m8));  // a max: any order gives the same value
    for (s = 0; s < full; s += 16) {
        v16 x = v16_load(sc + s), e = {exp256(_mm256_sub_ps(x.lo, vm.lo)), exp256(_mm256_sub_ps(x.hi, vm.hi))};
        v16_store(sc + s, e);
        vs = v16_add(vs, e);
    }
    if (t) {
        v16 x = v16_load(tail), e = {exp256(_mm256_sub_ps(x.lo, vm.lo)), exp256(_mm256_sub_ps(x.hi, vm.hi))};
        v16_store(tail, e);
        for (int i = 0; i < 16; i++) tail[i] = i < t ? tail[i] : 0.0f;  // masked: + 0 leaves a lane's sum as it is
        memcpy(sc + full, tail, sizeof(float) * t);
        vs = v16_add(vs, v16_load(tail));
    }
    float inv = 1.0f / v16_sum(vs);
    for (s = 0; s < n; s++) sc[s] *= inv;
}

#include "attend_v16.h"  // the shared pieces and sc_head_attend_cap, over this file's softmax
