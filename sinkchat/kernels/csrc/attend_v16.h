// The 16-lane head attention every SIMD build shares, written over its `v16` type (one __m512 in attend.c, two
// 256-bit registers in attend256.c, four 128-bit ones in attend_neon.c) and its ops (v16_load, v16_store, v16_kv,
// v16_set1, v16_mul, v16_fma, v16_add, v16_sum, hsum16) and `softmax`, which each file defines before including
// this, last (it defines sc_head_attend_cap, the decode step's, and sc_heads_attend, the prefill's tiles over it).
// The narrower builds do the 512-bit lanes and add tree on their registers, so one source gives all three
// bit-identical attention. A build that defines V16_PAIRS (attend.c: 32 registers) scores a tile's queries two at a
// time at D = 64 (block_scores2); the others, one (their 16 registers of 256 bits spill it: 4.55 -> 4.76 ns a
// slot-query).
#pragma once

// q . k of one slot over D = 16*DC dims: an unrolled chain (a product, then FMAs).
static inline __attribute__((always_inline)) v16 dot_row(const float* qh, const void* Kh, size_t base, int bf,
                                                         const int DC) {
    v16 acc = v16_mul(v16_load(qh), v16_kv(Kh, base, bf));
    for (int c = 1; c < DC; c++) acc = v16_fma(v16_load(qh + 16 * c), v16_kv(Kh, base + 16 * c, bf), acc);
    return acc;
}

// Scores of slots [s0, e) of one query (D = 64, 128), the rows at Kb from slot s0 on (fp32, or bf16 when bf): 16
// slots a round through hsum16, times scale; the rest one by one, which only the query's last block has (e == n: a
// tile's block of SC_KVB slots ends on a multiple of 16 otherwise). The decode step's scores are one block of n slots.
static inline __attribute__((always_inline)) void block_scores(const float* qh, const void* Kb, int bf, int s0, int e,
                                                               int n, float scale, float* sc, const int DC) {
    const size_t D = (size_t)DC * 16;
    int s = s0;
    for (; s + 16 <= e; s += 16) {
        v16 v[16];
        for (int j = 0; j < 16; j++) v[j] = dot_row(qh, Kb, (s - s0 + j) * D, bf, DC);
        v16_store(sc + s, v16_mul(hsum16(v), v16_set1(scale)));
    }
    for (; s < e && e == n; s++) sc[s] = v16_sum(dot_row(qh, Kb, (s - s0) * D, bf, DC)) * scale;
}

// block_scores of two queries q0, q1 over the 16-slot groups of a tile block [s0, e) of fp32 rows Kb (e - s0 a
// multiple of 16, both queries covering all of it): each K vector loaded once for both, every score summed as
// block_scores sums it (the same chain and add tree: bit-identical). The scores' K loads were one per FMA: 135M
// (D 64), 30 queries over 1,203 bf16 slots, 1 thread, 136 -> 123 us (3 or 4 queries a load: 133 / 132, spilled).
static inline __attribute__((always_inline)) void block_scores2(const float* q0, const float* q1, const float* Kb,
                                                                int s0, int e, float scale, float* sc0, float* sc1,
                                                                const int DC) {
    const size_t D = (size_t)DC * 16;
    for (int s = s0; s + 16 <= e; s += 16) {
        v16 v[16], w[16];
        for (int j = 0; j < 16; j++) {
            const float* k = Kb + (s - s0 + j) * D;
            v16 kk = v16_load(k);
            v[j] = v16_mul(v16_load(q0), kk), w[j] = v16_mul(v16_load(q1), kk);
            for (int c = 1; c < DC; c++) {
                kk = v16_load(k + 16 * c);
                v[j] = v16_fma(v16_load(q0 + 16 * c), kk, v[j]), w[j] = v16_fma(v16_load(q1 + 16 * c), kk, w[j]);
            }
        }
        v16_store(sc0 + s, v16_mul(hsum16(v), v16_set1(scale)));
        v16_store(sc1 + s, v16_mul(hsum16(w), v16_set1(scale)));
    }
}

// o += p[s] * V[s] over slots [s0, e) (D = 64, 128), the rows at Vb from slot s0 on: even slots into a [DC], odd ones
// into b (the FMA chains overlap); a last unpaired slot (into a) only in the query's last block (e == n).
static inline __attribute__((always_inline)) void block_pv(const float* p, const void* Vb, int bf, int s0, int e, int n,
                                                           v16* a, v16* b, const int DC) {
    const size_t D = (size_t)DC * 16;
    int s = s0;
    for (; s + 2 <= e; s += 2) {
        v16 p0 = v16_set1(p[s]), p1 = v16_set1(p[s + 1]);
        for (int c = 0; c < DC; c++) {
            a[c] = v16_fma(p0, v16_kv(Vb, (s - s0) * D + 16 * c, bf), a[c]);
            b[c] = v16_fma(p1, v16_kv(Vb, (s + 1 - s0) * D + 16 * c, bf), b[c]);
        }
    }
    for (int c = 0; s < e && e == n && c < DC; c++)
        a[c] = v16_fma(v16_set1(p[s]), v16_kv(Vb, (s - s0) * D + 16 * c, bf), a[c]);
}

// One query's o = sum of p[s] * V[s] over all n slots: one block_pv from zeroed accumulators, a + b last.
static inline __attribute__((always_inline)) void head_pv(const float* p, const void* Vh, int n, int bf, float* o,
                                                          const int DC) {
    v16 a[8], b[8];
    for (int c = 0; c < DC; c++) a[c] = b[c] = v16_set1(0.0f);
    block_pv(p, Vh, bf, 0, n, n, a, b, DC);
    for (int c = 0; c < DC; c++) v16_store(o + 16 * c, v16_add(a[c], b[c]));
}

// The exported head attention (kernels.h) of every SIMD build: scores, soft-cap, softmax, P.V.
void sc_head_attend_cap(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float softcap,
                        float* sc, float* o, int D) {
    switch (D) {  // constant chunk counts unroll the loops (accumulators in registers); other D: a chain a slot
        case 64: block_scores(qh, Kh, bf, 0, n, n, scale, sc, 4); break;
        case 128: block_scores(qh, Kh, bf, 0, n, n, scale, sc, 8); break;
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

// ---- tiles: many queries over one K/V head (the prefill), each as sc_head_attend_cap computes it alone ----------
// Per block of SC_KVB slots the K rows (then the V rows) are read once from the cache (converted to fp32 when bf16)
// and every query of the tile runs over them in L1: one query at a time read the whole head from L2 (a 1024-slot
// bf16 head, K and V: 256 KB) and widened every bf16 row again. The blocks split nothing a query sums: its 16-slot
// score groups and its P.V pairs start at multiples of 16 and 2, and its P.V accumulators wait in `st` between blocks.
// Measured (135M, 2048 tokens into 2048 bf16 slots, 1 thread, tok/s): a query at a time 411-431; tiles of 8 queries
// 457-459, 16: 480-490, 32: 500-503 (SC_TILE); 64-slot blocks 497-505 (SC_KVB 32: a bf16 block of D 128 is 16 KB).

// Slots [s0, s0 + n) of a head from the cache into fp32 rows kv [n][D], or the cache itself when it is fp32.
static inline const float* kv_block(const void* base, int s0, int n, int bf, int D, float* kv) {
    if (!bf) return (const float*)base + (size_t)s0 * D;
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D; d += 16) v16_store(kv + (size_t)i * D + d, v16_kv(base, (size_t)(s0 + i) * D + d, 1));
    return kv;
}

// block_pv of one query of a tile, its accumulators a | b waiting in st [2][D] between blocks.
static inline __attribute__((always_inline)) void tile_pv(const float* p, const float* Vb, int s0, int e, int n,
                                                          float* st, const int DC) {
    const size_t D = (size_t)DC * 16;
    v16 a[8], b[8];
    for (int c = 0; c < DC; c++) a[c] = v16_load(st + 16 * c), b[c] = v16_load(st + D + 16 * c);
    block_pv(p, Vb, 0, s0, e, n, a, b, DC);
    for (int c = 0; c < DC; c++) v16_store(st + 16 * c, a[c]), v16_store(st + D + 16 * c, b[c]);
}

// The scores of a tile's queries over its block [s0, e) of fp32 rows Kb: two at a time where both cover the whole
// block (V16_PAIRS, D = 64: at D = 128 the pairs' 16 query registers spill, 6.7 -> 7.1 ns a slot-query), else one.
static inline __attribute__((always_inline)) void tile_scores(const float* const* qs, const int* ns, int nq,
                                                              const float* Kb, int s0, int e, float scale, float* sc,
                                                              size_t stride, const int DC) {
    for (int i = 0; i < nq; i++) {
#ifdef V16_PAIRS
        if (DC == 4 && i + 1 < nq && ns[i] >= e && ns[i + 1] >= e && (e - s0) % 16 == 0) {
            block_scores2(qs[i], qs[i + 1], Kb, s0, e, scale, sc + i * stride, sc + (i + 1) * stride, DC);
            i++;
            continue;
        }
#endif
        if (ns[i] > s0) block_scores(qs[i], Kb, 0, s0, e < ns[i] ? e : ns[i], ns[i], scale, sc + i * stride, DC);
    }
}

static inline __attribute__((always_inline)) void tile_attend(const float* const* qs, const int* ns, int nq,
                                                              const void* Kh, const void* Vh, int bf, float scale,
                                                              float softcap, float* sc, size_t stride,
                                                              float* const* outs, float* kv, const int DC) {
    const int D = DC * 16;
    int top = 0;
    for (int i = 0; i < nq; i++) top = ns[i] > top ? ns[i] : top;
    float* st = kv + (size_t)SC_KVB * D;  // [nq][2][D]: each query's P.V accumulators between blocks
    for (int s0 = 0; s0 < top; s0 += SC_KVB) {
        int e = s0 + SC_KVB < top ? s0 + SC_KVB : top;
        tile_scores(qs, ns, nq, kv_block(Kh, s0, e - s0, bf, D, kv), s0, e, scale, sc, stride, DC);
    }
    for (int i = 0; i < nq; i++) {
        if (softcap > 0) sc_softcap(sc + i * stride, ns[i], softcap);
        softmax(sc + i * stride, ns[i]);
        for (int d = 0; d < 2 * D; d += 16) v16_store(st + (size_t)i * 2 * D + d, v16_set1(0.0f));
    }
    for (int s0 = 0; s0 < top; s0 += SC_KVB) {
        int e = s0 + SC_KVB < top ? s0 + SC_KVB : top;
        const float* Vb = kv_block(Vh, s0, e - s0, bf, D, kv);
        for (int i = 0; i < nq; i++)
            if (ns[i] > s0) tile_pv(sc + i * stride, Vb, s0, e < ns[i] ? e : ns[i], ns[i], st + (size_t)i * 2 * D, DC);
    }
    for (int i = 0; i < nq; i++)
        for (int d = 0; d < D; d += 16) {
            const float* a = st + (size_t)i * 2 * D;
            v16_store(outs[i] + d, v16_add(v16_load(a + d), v16_load(a + D + d)));
        }
}

// kernels.h: sc_heads_attend. D = 64 / 128 in tiles; any other D one query at a time (as sc_head_attend_cap).
void sc_heads_attend(const float* const* qs, const int* ns, int nq, const void* Kh, const void* Vh, int bf, float scale,
                     float softcap, float* sc, size_t stride, float* const* outs, int D, float* kv) {
    if (D == 64)
        tile_attend(qs, ns, nq, Kh, Vh, bf, scale, softcap, sc, stride, outs, kv, 4);
    else if (D == 128)
        tile_attend(qs, ns, nq, Kh, Vh, bf, scale, softcap, sc, stride, outs, kv, 8);
    else
        for (int i = 0; i < nq; i++)
            sc_head_attend_cap(qs[i], Kh, Vh, ns[i], bf, scale, softcap, sc + i * stride, outs[i], D);
}
