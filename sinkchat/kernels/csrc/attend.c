// The decode step's attention pieces, SIMD variant (AVX-512): RoPE rotation, one head's softmax attention, bf16
// rows. ref.c holds the scalar reference of each; the rotation and the bf16 conversions match it bit for bit, the
// attention to float rounding (its sums run in another order: see tests/test_kernels.py).
#include "simd512.h"

// Rotate-half RoPE of one row k [D] by the angles cos/sin [rot] into o (o may be k: in place); dims past rot are
// copied. The decode step rotates q and k with it, the eviction re-rotates moved keys. The scalar tail rounds as
// the vector loop does (fmaf over one rounded product), so every lane gives the reference's bits.
void sc_rot_row(const float* k, float* o, const float* cs, const float* sn, int rot, int D) {
    int h = rot / 2, i = 0;
    if (h % 16 == 0) {
        for (; i < h; i += 16) {
            __m512 a = _mm512_loadu_ps(k + i), b = _mm512_loadu_ps(k + i + h);
            _mm512_storeu_ps(o + i, _mm512_fmsub_ps(a, _mm512_loadu_ps(cs + i), _mm512_mul_ps(b, _mm512_loadu_ps(sn + i))));
            _mm512_storeu_ps(o + i + h, _mm512_fmadd_ps(b, _mm512_loadu_ps(cs + i + h), _mm512_mul_ps(a, _mm512_loadu_ps(sn + i + h))));
        }
    }
    sc_rot_lanes(k, o, cs, sn, i, rot, D);
}

void sc_put_bf16(uint16_t* p, const float* src, int D) {
    int d = 0;
    for (; d + 16 <= D; d += 16) _mm256_storeu_si256((__m256i*)(p + d), bf16_16(_mm512_loadu_ps(src + d)));
    for (; d < D; d++) p[d] = sc_to_bf16(src[d]);
}

void sc_get_bf16(float* dst, const uint16_t* p, int D) {
    int d = 0;
    for (; d + 16 <= D; d += 16) _mm512_storeu_ps(dst + d, bf16x16(p + d));
    for (; d < D; d++) dst[d] = sc_from_bf16(p[d]);
}

// r[j] = the sum of v[j]'s 16 lanes, for j < 16: a transposing add tree (15 adds, 30 shuffles) instead of 16
// horizontal reductions (~8 dependent ops each): attention's q.k scores over long caches are dominated by these.
static inline __m512 hsum16(const __m512* v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: v[2i] and v[2i+1], two partial sums each
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // per 128-bit lane: slots 4i..4i+3, one partial sum each
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// In place over sc [n]: softmax, vectorized, the tail masked.
static void softmax(float* sc, int n) {
    __m512 vm = _mm512_set1_ps(-INFINITY), vs = _mm512_setzero_ps();
    int s = 0;
    for (; s + 16 <= n; s += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sc + s));
    __mmask16 tail = (__mmask16)((1u << (n - s)) - 1);
    vm = _mm512_mask_max_ps(vm, tail, vm, _mm512_maskz_loadu_ps(tail, sc + s));
    vm = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
    for (s = 0; s + 16 <= n; s += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + s), vm));
        _mm512_storeu_ps(sc + s, e);
        vs = _mm512_add_ps(vs, e);
    }
    if (s < n) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sc + s), vm));
        _mm512_mask_storeu_ps(sc + s, tail, e);
        vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(tail, e));
    }
    __m512 inv = _mm512_set1_ps(1.0f / hsum512(vs));
    for (s = 0; s + 16 <= n; s += 16) _mm512_storeu_ps(sc + s, _mm512_mul_ps(_mm512_loadu_ps(sc + s), inv));
    if (s < n) _mm512_mask_storeu_ps(sc + s, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, sc + s), inv));
}

// attend_v16.h's head attention on one __m512 per v16: the very operations the 256-bit and NEON builds mirror on
// register pairs / quads, so all three share one source of the scores, the softmax's callers and P.V.
typedef __m512 v16;
static inline v16 v16_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float* p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v16_kv(const void* base, size_t i, int bf) { return kv16(base, i, bf); }
static inline v16 v16_set1(float f) { return _mm512_set1_ps(f); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline float v16_sum(v16 v) { return hsum512(v); }
#define V16_PAIRS  // 32 zmm registers: a tile scores its queries two at a time (attend_v16.h: block_scores2)
#include "attend_v16.h"  // head_scores, head_pv and sc_head_attend_cap, over this file's hsum16 and softmax
