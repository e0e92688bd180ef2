// One decode step of a Llama / Qwen2 shaped model in C, and the cache eviction, over sinkchat's matmuls.
#include "simd.h"

// ---------------------------------------------------------------------------------------------------------------
// One decode step of a Llama / Qwen2 shaped model, all layers, straight over the sink cache's K/V buffers.

typedef struct {
    int n_layers, dim, n_heads, n_kv, head_dim, inter, vocab, kv_bf16;  // vocab: padded to 16
    float eps, scaling, rope_scale;
    const float* inv_freq;    // [D/2]
    const float* norm_in;     // [L][C]
    const float* norm_post;   // [L][C]
    const float* norm_final;  // [C]
    const void* const* lin;   // [L][7][3]: (weights, scales, bias or NULL) for q, k, v, o, gate, up, down
    const uint8_t* table;     // the tied token table, head layout (q8_matmul's hw), or NULL: no head here
    const float* table_scale; // [V]
} Model;

enum { LQ, LK, LV, LO, LG, LU, LD };

static int lin(const Model* m, int layer, int which, const float* x, int K, int N, float* y) {
    const void* const* p = m->lin + ((size_t)layer * 7 + which) * 3;
    return q4_matmul(x, 1, K, N, (const uint8_t*)p[0], (const uint16_t*)p[1], (const float*)p[2], y);
}

static void rms(const float* x, const float* w, int C, float eps, float* out) {
    float ss = 0;
    for (int i = 0; i < C; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / C + eps);
    for (int i = 0; i < C; i++) out[i] = w[i] * (x[i] * r);
}

// Rotate-half RoPE of one row k [D] by the angles cos/sin [rot] into o (o may be k: in place); dims past rot are
// copied. The decode step rotates q and k with it, the eviction re-rotates moved keys.
static void rot_row(const float* k, float* o, const float* cs, const float* sn, int rot, int D) {
    int h = rot / 2, i = 0;
    if (h % 16 == 0) {
        for (; i < h; i += 16) {
            __m512 a = _mm512_loadu_ps(k + i), b = _mm512_loadu_ps(k + i + h);
            _mm512_storeu_ps(o + i, _mm512_fmsub_ps(a, _mm512_loadu_ps(cs + i), _mm512_mul_ps(b, _mm512_loadu_ps(sn + i))));
            _mm512_storeu_ps(o + i + h, _mm512_fmadd_ps(b, _mm512_loadu_ps(cs + i + h), _mm512_mul_ps(a, _mm512_loadu_ps(sn + i + h))));
        }
    }
    for (; i < h; i++) {
        float a = k[i], b = k[i + h];
        o[i] = a * cs[i] - b * sn[i];
        o[i + h] = b * cs[i + h] + a * sn[i + h];
    }
    for (int i = rot; i < D; i++) o[i] = k[i];
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
        sc[s] = _mm512_reduce_add_ps(acc) * scale;
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

static void head_attend(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float* sc,
                        float* o, int D) {
    switch (D) {  // constant chunk counts: the chunk loops unroll and the accumulators stay in registers
        case 64: head_scores(qh, Kh, n, bf, scale, sc, 4); break;
        case 128: head_scores(qh, Kh, n, bf, scale, sc, 8); break;
        default:
            for (int s = 0; s < n; s++) {
                __m512 acc = _mm512_setzero_ps();
                for (int d = 0; d < D; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), kv16(Kh, (size_t)s * D + d, bf), acc);
                sc[s] = _mm512_reduce_add_ps(acc) * scale;
            }
    }
    // softmax over the n scores (vectorized; the tail masked)
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
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vs));
    for (s = 0; s + 16 <= n; s += 16) _mm512_storeu_ps(sc + s, _mm512_mul_ps(_mm512_loadu_ps(sc + s), inv));
    if (s < n) _mm512_mask_storeu_ps(sc + s, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, sc + s), inv));
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

// Attention of the H query heads over slots 0..pos of one layer's K/V [H_kv][cap][D]; writes out [H*D] and adds
// the gauge shares (first n_gauge slots, newest n_gauge slots, mean over heads) to gauge[2].
static void attend(const Model* m, const float* q, const void* K, const void* V, int cap, int pos, int n_gauge,
                   float* scores, float* out, float* gauge) {
    int H = m->n_heads, Hkv = m->n_kv, D = m->head_dim, G = H / Hkv, n = pos + 1;
    size_t esz = m->kv_bf16 ? 2 : 4;
    for (int hq = 0; hq < H; hq++) {
        size_t head = (size_t)(hq / G) * cap * D * esz;
        float* sc = scores + (size_t)hq * n;
        head_attend(q + (size_t)hq * D, (const char*)K + head, (const char*)V + head, n, m->kv_bf16, m->scaling, sc,
                    out + (size_t)hq * D, D);
        float first = 0, last = 0;
        for (int t = 0; t < n_gauge && t < n; t++) first += sc[t];
        for (int t = n - 1; t >= 0 && t > pos - n_gauge; t--) last += sc[t];
        gauge[0] += first / H;
        gauge[1] += last / H;
    }
}

static void store_kv(void* buf, size_t at, const float* src, int D, int bf16) {
    if (bf16) {
        put_bf16((uint16_t*)buf + at, src, D);
    } else {
        memcpy((float*)buf + at, src, sizeof(float) * D);
    }
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

// One token whose embedding is x_in [C], at in-cache slot `pos`: writes its k/v into slot pos of keys[i] / values[i]
// ([H_kv][cap][D], float or bf16) and attends over slots <= pos. Outputs: out = logits [V padded to 16] when the
// model has a table, else the final normed hidden state [C]; the pre-RoPE queries [L][H*D]; gauge [L][2].
int sc_step(const Model* m, const float* x_in, int pos, int n_gauge, void* const* keys, void* const* values, int cap,
            float* out, float* queries, float* gauge) {
    int C = m->dim, H = m->n_heads, Hkv = m->n_kv, D = m->head_dim, I = m->inter, err = 0;
    float* x = malloc(sizeof(float) * (3 * C + (H + 2 * Hkv) * D + H * D + 2 * I + 2 * D + (size_t)H * (pos + 1)));
    if (!x) return -1;
    float *h = x + C, *t = h + C, *q = t + C, *k = q + H * D, *v = k + Hkv * D, *att = v + Hkv * D;
    float *gu = att + H * D, *cs = gu + 2 * I, *sn = cs + D, *scores = sn + D;
    memcpy(x, x_in, sizeof(float) * C);
    for (int i = 0; i < D / 2; i++) {  // as transformers: fp32 angle = position x inv_freq
        float a = (float)pos * m->inv_freq[i];
        cs[i] = cs[i + D / 2] = cosf(a) * m->rope_scale;
        sn[i] = sn[i + D / 2] = sinf(a) * m->rope_scale;
    }
    for (int l = 0; l < m->n_layers; l++) {
        rms(x, m->norm_in + (size_t)l * C, C, m->eps, h);
        err |= lin(m, l, LQ, h, C, H * D, q);
        err |= lin(m, l, LK, h, C, Hkv * D, k);
        err |= lin(m, l, LV, h, C, Hkv * D, v);
        memcpy(queries + (size_t)l * H * D, q, sizeof(float) * H * D);
        for (int i = 0; i < H; i++) rot_row(q + i * D, q + i * D, cs, sn, D, D);
        for (int i = 0; i < Hkv; i++) {
            rot_row(k + i * D, k + i * D, cs, sn, D, D);
            store_kv(keys[l], ((size_t)i * cap + pos) * D, k + i * D, D, m->kv_bf16);
            store_kv(values[l], ((size_t)i * cap + pos) * D, v + i * D, D, m->kv_bf16);
        }
        gauge[2 * l] = gauge[2 * l + 1] = 0;
        attend(m, q, keys[l], values[l], cap, pos, n_gauge, scores, att, gauge + 2 * l);
        err |= lin(m, l, LO, att, H * D, C, t);
        for (int c = 0; c < C; c++) x[c] += t[c];
        rms(x, m->norm_post + (size_t)l * C, C, m->eps, h);
        err |= lin(m, l, LG, h, C, I, gu);
        err |= lin(m, l, LU, h, C, I, gu + I);
        for (int i = 0; i < I; i++) gu[i] = silu(gu[i]) * gu[I + i];
        err |= lin(m, l, LD, gu, I, C, t);
        for (int c = 0; c < C; c++) x[c] += t[c];
    }
    rms(x, m->norm_final, C, m->eps, h);
    if (m->table)
        err |= q8_matmul(h, 1, C, m->vocab, m->table, m->table_scale, out);
    else
        memcpy(out, h, sizeof(float) * C);
    free(x);
    return err;
}

// ---------------------------------------------------------------------------------------------------------------
// Eviction: drop slots [start, start+count) of one layer's K/V [H_kv][cap][D] and move the n slots after them down,
// re-rotating the moved keys by -count in fp32 (cos/sin [rot]: that angle, rotate-half layout; dims past rot copied).
// One pass over the cache instead of torch's five (copy out, two multiplies, two adds, copy back): the pause at an
// eviction is what p99 latency sees.

int kv_evict(void* K, void* V, int n_heads, int cap, int D, int start, int count, int n, const float* cs,
             const float* sn, int rot, int bf16) {
    float kin[1024];
    if (D > 1024 || rot > D) return -1;
    size_t esz = bf16 ? 2 : 4;
    for (int h = 0; h < n_heads; h++) {
        for (int s = 0; s < n; s++) {
            size_t src = ((size_t)h * cap + start + count + s) * D, dst = ((size_t)h * cap + start + s) * D;
            if (bf16) {
                if (!cs) {
                    memmove((uint16_t*)K + dst, (const uint16_t*)K + src, 2 * (size_t)D);
                    continue;
                }
                get_bf16(kin, (const uint16_t*)K + src, D);
                rot_row(kin, kin, cs, sn, rot, D);
                put_bf16((uint16_t*)K + dst, kin, D);
            } else if (cs) {
                rot_row((const float*)K + src, (float*)K + dst, cs, sn, rot, D);  // whole rows, never partly overlapping
            } else {
                memmove((float*)K + dst, (const float*)K + src, sizeof(float) * D);
            }
        }
        size_t src = ((size_t)h * cap + start + count) * D, dst = ((size_t)h * cap + start) * D;
        memmove((char*)V + dst * esz, (const char*)V + src * esz, esz * D * (size_t)n);  // overlapping: memmove
    }
    return 0;
}
