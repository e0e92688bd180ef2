// One decode step of a Llama / Qwen2 shaped model in C, and the cache eviction: shared by both builds, over the
// pieces each variant implements (sc_q4_mm, sc_head_attend, sc_rot_row, ...: kernels.h).
#include "kernels.h"

enum { LQ, LK, LV, LO, LG, LU, LD };

// The step's activations, carved from the caller's work buffer (sizes: sc_step_work, which carves the same way).
typedef struct {
    float *x, *h, *t, *q, *k, *v, *att, *gu, *cs, *sn, *scores;
} StepBufs;

static int take_step(sc_arena* a, const Model* m, int n_slots, StepBufs* b) {
    size_t C = m->dim, D = m->head_dim, HD = (size_t)m->n_heads * D, KD = (size_t)m->n_kv * D;
    float** at[] = {&b->x, &b->h, &b->t, &b->q, &b->k, &b->v, &b->att, &b->gu, &b->cs, &b->sn, &b->scores};
    size_t n[] = {C, C, C, HD, KD, KD, HD, 2 * (size_t)m->inter, D, D, (size_t)m->n_heads * n_slots};
    for (size_t i = 0; i < sizeof n / sizeof n[0]; i++)
        if (!(*at[i] = sc_take(a, sizeof(float) * n[i]))) return SC_EWORK;
    return SC_OK;
}

// Bytes of work sc_step needs for a cache of `cap` slots: its activations, then one matmul's scratch at a time.
size_t sc_step_work(const Model* m, int cap) {
    sc_arena a = sc_measure();
    StepBufs b;
    take_step(&a, m, cap, &b);
    int k = m->dim > m->inter ? m->dim : m->inter;
    k = k > m->n_heads * m->head_dim ? k : m->n_heads * m->head_dim;
    size_t mm = sc_q4_work(1, k), head = m->table ? sc_q8_work(1, m->dim) : 0;
    return sc_measured(&a) + (mm > head ? mm : head);
}

static int lin(const Model* m, sc_arena scratch, int layer, int which, const float* x, int K, int N, float* y) {
    const void* const* p = m->lin + ((size_t)layer * 7 + which) * 3;
    return sc_q4_mm(&scratch, x, 1, K, N, (const sc_q4_block*)p[0], (const sc_q4_scales*)p[1], (const float*)p[2], y);
}

static void rms(const float* x, const float* w, int C, float eps, float* out) {
    float ss = 0;
    for (int i = 0; i < C; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / C + eps);
    for (int i = 0; i < C; i++) out[i] = w[i] * (x[i] * r);
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

// Attention of the H query heads over slots 0..pos of one layer's K/V [H_kv][cap][D]; writes out [H*D] and adds
// the gauge shares (first n_gauge slots, newest n_gauge slots, mean over heads) to gauge[2].
static void attend(const Model* m, const float* q, const void* K, const void* V, int cap, int pos, int n_gauge,
                   float* scores, float* out, float* gauge) {
    int H = m->n_heads, Hkv = m->n_kv, D = m->head_dim, G = H / Hkv, n = pos + 1;
    size_t esz = m->kv_bf16 ? 2 : 4;
    for (int hq = 0; hq < H; hq++) {
        size_t head = (size_t)(hq / G) * cap * D * esz;
        float* sc = scores + (size_t)hq * n;
        sc_head_attend(q + (size_t)hq * D, (const char*)K + head, (const char*)V + head, n, m->kv_bf16, m->scaling,
                       sc, out + (size_t)hq * D, D);
        float first = 0, last = 0;
        for (int t = 0; t < n_gauge && t < n; t++) first += sc[t];
        for (int t = n - 1; t >= 0 && t > pos - n_gauge; t--) last += sc[t];
        gauge[0] += first / H;
        gauge[1] += last / H;
    }
}

// One layer's attention alone, on queries already rotated (tests hold each variant's to the other's): scores
// [H][pos+1] is the caller's.
int sc_attend(const Model* m, const float* q, const void* K, const void* V, int cap, int pos, int n_gauge, float* out,
              float* gauge, float* scores) {
    gauge[0] = gauge[1] = 0;
    attend(m, q, K, V, cap, pos, n_gauge, scores, out, gauge);
    return SC_OK;
}

static void store_kv(void* buf, size_t at, const float* src, int D, int bf16) {
    if (bf16)
        sc_put_bf16((uint16_t*)buf + at, src, D);
    else
        memcpy((float*)buf + at, src, sizeof(float) * D);
}

// The attention half of layer l: x += o_proj(attention(rope(q), rope(k) and v written at slot pos)).
static int attention_block(const Model* m, const StepBufs* b, sc_arena rest, int l, int pos, int n_gauge,
                           void* const* keys, void* const* values, int cap, float* queries, float* gauge) {
    int C = m->dim, H = m->n_heads, Hkv = m->n_kv, D = m->head_dim, rc;
    rms(b->x, m->norm_in + (size_t)l * C, C, m->eps, b->h);
    if ((rc = lin(m, rest, l, LQ, b->h, C, H * D, b->q)) || (rc = lin(m, rest, l, LK, b->h, C, Hkv * D, b->k)) ||
        (rc = lin(m, rest, l, LV, b->h, C, Hkv * D, b->v)))
        return rc;
    memcpy(queries + (size_t)l * H * D, b->q, sizeof(float) * H * D);
    for (int i = 0; i < H; i++) sc_rot_row(b->q + i * D, b->q + i * D, b->cs, b->sn, D, D);
    for (int i = 0; i < Hkv; i++) {
        sc_rot_row(b->k + i * D, b->k + i * D, b->cs, b->sn, D, D);
        store_kv(keys[l], ((size_t)i * cap + pos) * D, b->k + i * D, D, m->kv_bf16);
        store_kv(values[l], ((size_t)i * cap + pos) * D, b->v + i * D, D, m->kv_bf16);
    }
    gauge[2 * l] = gauge[2 * l + 1] = 0;
    attend(m, b->q, keys[l], values[l], cap, pos, n_gauge, b->scores, b->att, gauge + 2 * l);
    if ((rc = lin(m, rest, l, LO, b->att, H * D, C, b->t))) return rc;
    for (int c = 0; c < C; c++) b->x[c] += b->t[c];
    return SC_OK;
}

// The MLP half of layer l: x += down(silu(gate(h)) * up(h)), h = rms(x).
static int mlp_block(const Model* m, const StepBufs* b, sc_arena rest, int l) {
    int C = m->dim, I = m->inter, rc;
    rms(b->x, m->norm_post + (size_t)l * C, C, m->eps, b->h);
    if ((rc = lin(m, rest, l, LG, b->h, C, I, b->gu)) || (rc = lin(m, rest, l, LU, b->h, C, I, b->gu + I))) return rc;
    for (int i = 0; i < I; i++) b->gu[i] = silu(b->gu[i]) * b->gu[I + i];
    if ((rc = lin(m, rest, l, LD, b->gu, I, C, b->t))) return rc;
    for (int c = 0; c < C; c++) b->x[c] += b->t[c];
    return SC_OK;
}

// One token whose embedding is x_in [C], at in-cache slot `pos`: writes its k/v into slot pos of keys[i] / values[i]
// ([H_kv][cap][D], float or bf16) and attends over slots <= pos. Outputs: out = logits [V padded to 16] when the
// model has a table, else the final normed hidden state [C]; the pre-RoPE queries [L][H*D]; gauge [L][2].
// work: sc_step_work(m, cap) bytes (or NULL: allocated here).
int sc_step(const Model* m, const float* x_in, int pos, int n_gauge, void* const* keys, void* const* values, int cap,
            float* out, float* queries, float* gauge, void* work, size_t work_size) {
    int C = m->dim, D = m->head_dim, rc;
    sc_arena a;
    void* own;
    StepBufs b;
    if ((rc = sc_work_open(work, work_size, sc_step_work(m, cap), &a, &own)) || (rc = take_step(&a, m, pos + 1, &b)))
        goto done;
    memcpy(b.x, x_in, sizeof(float) * C);
    for (int i = 0; i < D / 2; i++) {  // as transformers: fp32 angle = position x inv_freq
        float ang = (float)pos * m->inv_freq[i];
        b.cs[i] = b.cs[i + D / 2] = cosf(ang) * m->rope_scale;
        b.sn[i] = b.sn[i + D / 2] = sinf(ang) * m->rope_scale;
    }
    for (int l = 0; l < m->n_layers; l++)
        if ((rc = attention_block(m, &b, a, l, pos, n_gauge, keys, values, cap, queries, gauge)) ||
            (rc = mlp_block(m, &b, a, l)))
            goto done;
    rms(b.x, m->norm_final, C, m->eps, b.h);
    if (m->table)
        rc = sc_q8_mm(&a, b.h, 1, C, m->vocab, m->table, m->table_scale, out);
    else
        memcpy(out, b.h, sizeof(float) * C);
done:
    free(own);
    return rc;
}

// ---------------------------------------------------------------------------------------------------------------
// Eviction: drop slots [start, start+count) of one layer's K/V [H_kv][cap][D] and move the n slots after them down,
// re-rotating the moved keys by -count in fp32 (cos/sin [rot]: that angle, rotate-half layout; dims past rot copied).
// One pass over the cache instead of torch's five (copy out, two multiplies, two adds, copy back): the pause at an
// eviction is what p99 latency sees. No work buffer: one row on the stack.
int kv_evict(void* K, void* V, int n_heads, int cap, int D, int start, int count, int n, const float* cs,
             const float* sn, int rot, int bf16) {
    float kin[1024];
    if (D > 1024 || rot > D) return -1;
    size_t esz = bf16 ? 2 : 4;
    for (int h = 0; h < n_heads; h++) {
        for (int s = 0; s < n; s++) {
            size_t src = ((size_t)h * cap + start + count + s) * D, dst = ((size_t)h * cap + start + s) * D;
            if (!cs) {
                memmove((char*)K + dst * esz, (const char*)K + src * esz, esz * D);
            } else if (bf16) {
                sc_get_bf16(kin, (const uint16_t*)K + src, D);
                sc_rot_row(kin, kin, cs, sn, rot, D);
                sc_put_bf16((uint16_t*)K + dst, kin, D);
            } else {
                sc_rot_row((const float*)K + src, (float*)K + dst, cs, sn, rot, D);  // whole rows, never partly overlapping
            }
        }
        size_t src = ((size_t)h * cap + start + count) * D, dst = ((size_t)h * cap + start) * D;
        memmove((char*)V + dst * esz, (const char*)V + src * esz, esz * D * (size_t)n);  // overlapping: memmove
    }
    return 0;
}
