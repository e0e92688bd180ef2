// The 16-lane head attention every SIMD build shares, written over its `v16` type (one __m512 in attend.c, two
// 256-bit registers in attend256.c, four 128-bit ones in attend_neon.c) and its ops (v16_load, v16_store, v16_kv,
// v16_set1, v16_mul, v16_fma, v16_add, v16_sum, hsum16) and `softmax`, which each file defines before including
// this, last (it defines the exported sc_head_attend_cap). The narrower builds do the 512-bit lanes and add tree on
// their registers, so one source gives all three bit-identical attention.
#pragma once

// q . k of one slot over D = 16*DC dims: an unrolled chain (a product, then FMAs).
static inline __attribute__((always_inline)) v16 dot_row(const float* qh, const void* Kh, size_t base, int bf,
                                                         const int DC) {
    v16 acc = v16_mul(v16_load(qh), v16_kv(Kh, base, bf));
    for (int c = 1; c < DC; c++) acc = v16_fma(v16_load(qh + 16 * c), v16_kv(Kh, base + 16 * c, bf), acc);
    return acc;
}

// Scores (D = 64, 128): 16 slots a round through hsum16, times scale; the rest one by one.
static inline __attribute__((always_inline)) void head_scores(const float* qh, const void* Kh, int n, int bf,
                                                              float scale, float* sc, const int DC) {
    const size_t D = (size_t)DC * 16;
    int s = 0;
    for (; s + 16 <= n; s += 16) {
        v16 v[16];
        for (int j = 0; j < 16; j++) v[j] = dot_row(qh, Kh, (s + j) * D, bf, DC);
        v16_store(sc + s, v16_mul(hsum16(v), v16_set1(scale)));
    }
    for (; s < n; s++) sc[s] = v16_sum(dot_row(qh, Kh, s * D, bf, DC)) * scale;
}

// o = sum of p[s] * V[s] (D = 64, 128): even slots into a, odd ones into b (the FMA chains overlap), summed last.
static inline __attribute__((always_inline)) void head_pv(const float* p, const void* Vh, int n, int bf, float* o,
                                                          const int DC) {
    const size_t D = (size_t)DC * 16;
    v16 a[8], b[8];
    for (int c = 0; c < DC; c++) a[c] = b[c] = v16_set1(0.0f);
    int s = 0;
    for (; s + 2 <= n; s += 2) {
        v16 p0 = v16_set1(p[s]), p1 = v16_set1(p[s + 1]);
        for (int c = 0; c < DC; c++) {
            a[c] = v16_fma(p0, v16_kv(Vh, s * D + 16 * c, bf), a[c]);
            b[c] = v16_fma(p1, v16_kv(Vh, (s + 1) * D + 16 * c, bf), b[c]);
        }
    }
    for (int c = 0; s < n && c < DC; c++) a[c] = v16_fma(v16_set1(p[s]), v16_kv(Vh, s * D + 16 * c, bf), a[c]);
    for (int c = 0; c < DC; c++) v16_store(o + 16 * c, v16_add(a[c], b[c]));
}

// The exported head attention (kernels.h) of every SIMD build: scores, soft-cap, softmax, P.V.
void sc_head_attend_cap(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float softcap,
                        float* sc, float* o, int D) {
    switch (D) {  // constant chunk counts unroll the loops (accumulators in registers); other D: a chain a slot
        case 64: head_scores(qh, Kh, n, bf, scale, sc, 4); break;
        case 128: head_scores(qh, Kh, n, bf, scale, sc, 8); break;
        default:
            for (int s = 0; s < n; s++) {
                v16 acc = v16_set1(0.0f);
                for (int d = 0; d < D; d += 16) acc = v16_fma(v16_load(qh + d), v16_kv(Kh, (size_t)s * D + d, bf), acc);
                sc[s] = v16_sum(acc) * scale;
            }
    }
    if (softcap > 0) sc_softcap(sc, n, softcap);
    softmax(sc, n);
    switch (D) {
        case 64: head_pv(sc, Vh, n, bf, o, 4); break;
        case 128: head_pv(sc, Vh, n, bf, o, 8); break;
        default:
            for (int d = 0; d < D; d += 16) {
                v16 acc = v16_set1(0.0f);
                for (int t = 0; t < n; t++) acc = v16_fma(v16_set1(sc[t]), v16_kv(Vh, (size_t)t * D + d, bf), acc);
                v16_store(o + d, acc);
            }
    }
}
