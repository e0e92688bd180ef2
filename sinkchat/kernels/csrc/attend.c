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

// Scores of one query head qh [DC*16] against n key rows of Kh [n][DC*16], times scale, into sc [n].
static inline __attribute__((always_inline)) void head_scores(const float* qh, const void* Kh, int n, int bf,
                                                              float scale, float* sc, const int DC) {
    const int D = DC * 16;
    __m512 qv[8], v[16];
    for (int c = 0; c < DC; c++) qv[c] = _mm512_loadu_ps(qh + 16 * c);
    int s = 0;
    for (; s + 16 <= n; s += 16) {
        for (int j = 0; j < 16; j++) {
            size_t base = (size_t)(s + j) * D;
            __m512 acc = _mm512_mul_ps(qv[0], kv16(Kh, base, bf));
            for (int c = 1; c < DC; c++) acc = _mm512_fmadd_ps(qv[c], kv16(Kh, base + 16 * c, bf), acc);
            v[j] = acc;
        }
        _mm512_storeu_ps(sc + s, _mm512_mul_ps(hsum16(v), _mm512_set1_ps(scale)));
    }
    for (; s < n; s++) {
        size_t base = (size_t)s * D;
        __m512 acc = _mm512_mul_ps(qv[0], kv16(Kh, base, bf));
        for (int c = 1; c < DC; c++) acc = _mm512_fmadd_ps(qv[c], kv16(Kh, base + 16 * c, bf), acc);
        sc[s] = hsum512(acc) * scale;
    }
}

// o [DC*16] = sum over s < n of p[s] * Vh[s]; two accumulator sets so the FMA chains overlap.
static inline __attribute__((always_inline)) void head_pv(const float* p, const void* Vh, int n, int bf, float* o,
                                                          const int DC) {
    const int D = DC * 16;
    __m512 a[8], b[8];
    for (int c = 0; c < DC; c++) a[c] = b[c] = _mm512_setzero_ps();
    int s = 0;
    for (; s + 2 <= n; s += 2) {
        __m512 p0 = _mm512_set1_ps(p[s]), p1 = _mm512_set1_ps(p[s + 1]);
        size_t b0 = (size_t)s * D, b1 = b0 + D;
        for (int c = 0; c < DC; c++) {
            a[c] = _mm512_fmadd_ps(p0, kv16(Vh, b0 + 16 * c, bf), a[c]);
            b[c] = _mm512_fmadd_ps(p1, kv16(Vh, b1 + 16 * c, bf), b[c]);
        }
    }
    if (s < n) {
        __m512 p0 = _mm512_set1_ps(p[s]);
        for (int c = 0; c < DC; c++) a[c] = _mm512_fmadd_ps(p0, kv16(Vh, (size_t)s * D + 16 * c, bf), a[c]);
    }
    for (int c = 0; c < DC; c++) _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(a[c], b[c]));
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

void sc_head_attend_cap(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float softcap,
                        float* sc, float* o, int D) {
    switch (D) {  // constant chunk counts: the chunk loops unroll and the accumulators stay in registers
        case 64: head_scores(qh, Kh, n, bf, scale, sc, 4); break;
        case 128: head_scores(qh, Kh, n, bf, scale, sc, 8); break;
        default:
            for (int s = 0; s < n; s++) {
                __m512 acc = _mm512_setzero_ps();
                for (int d = 0; d < D; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), kv16(Kh, (size_t)s * D + d, bf), acc);
                sc[s] = hsum512(acc) * scale;
            }
    }
    if (softcap > 0) sc_softcap(sc, n, softcap);
    softmax(sc, n);
    switch (D) {
        case 64: head_pv(sc, Vh, n, bf, o, 4); break;
        case 128: head_pv(sc, Vh, n, bf, o, 8); break;
        default:
            for (int d = 0; d < D; d += 16) {
                __m512 acc = _mm512_setzero_ps();
                for (int t = 0; t < n; t++) acc = _mm512_fmadd_ps(_mm512_set1_ps(sc[t]), kv16(Vh, (size_t)t * D + d, bf), acc);
                _mm512_storeu_ps(o + d, acc);
            }
    }
}
