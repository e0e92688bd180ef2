// Prefill of a chunk of T tokens in C (shared by every build): the decode step's model (Model, the same weights and
// KV buffers as sc_step) run on T rows at once, over the pieces each variant implements (sc_lins_run for the
// linears, sc_heads_attend, sc_rot_row, sc_put_bf16: kernels.h). Per layer: RMSNorm of the T rows, q, k and v as one
// T-row job (the input quantized once), q/k norms where the model has them, RoPE at each row's in-cache slot, the T
// keys / values written into slots pos..pos+T-1 of the cache (fp32 or bf16, as sc_step writes them), causal attention
// of each query over the slots up to its own, o, the residual, then the SiLU MLP. The logits (or the final normed
// hidden state, where the head runs in torch) only for the last n_out rows.
//
// Why not transformers' forward on the same kernels: it re-quantizes the input of q, k and v once each, runs the
// mask, the cache API and ~20 torch ops per layer from Python, and (bf16 cache) converts the whole live cache to fp32
// for every layer. Measured in the README ("Decoding").
//
// Threads: each linear splits its row groups and passes (linear.c), the attention its (row, head) pairs, the SiLU its
// rows; every output is computed by one thread as it would be alone, so the result is bit-identical at any thread
// count (tests/test_native_prefill.py). The norms, RoPE, k/v stores and residual adds stay on the caller (~1% of a
// chunk's time on the bundled model).
#include "kernels.h"

enum { LQ, LK, LV, LO, LG, LU, LD };  // Model.lin's order (step.c)

// The chunk's activations, carved from the caller's work buffer (sizes: sc_prefill_work, which carves the same way):
// rows [T][...] each; cs / sn [T][rot] (each row's angles); scores [slots][tile_queries][cap], the attention tiles'
// scratch [slots][sc_tile_floats] and the linears' accumulators [slots][SC_ACC] (one piece per thread of the pool);
// `in` the quantized input of the next linears.
typedef struct {
    float *x, *h, *t, *q, *k, *v, *att, *g, *u, *cs, *sn, *scores, *kv, *acc;
    sc_act in;
    int slots;
} PrefillBufs;

static inline int rot_dims(const Model* m) { return m->rot > 0 ? m->rot : m->head_dim; }

// Chunk rows per attention tile: a tile is one kv head's query heads for this many rows (SC_TILE queries or so).
static inline int tile_rows(const Model* m) {
    int G = m->n_heads / m->n_kv;
    return G >= SC_TILE ? 1 : SC_TILE / G;
}

static int take_prefill(sc_arena* a, const Model* m, int T, int cap, PrefillBufs* b) {
    size_t C = m->dim, HD = (size_t)m->n_heads * m->head_dim, KD = (size_t)m->n_kv * m->head_dim, I = m->inter;
    b->slots = sc_threads();
    int nq = (tile_rows(m) < T ? tile_rows(m) : T) * (m->n_heads / m->n_kv);  // att_task's rows <= both
    float** at[] = {&b->x, &b->h, &b->t, &b->q, &b->k, &b->v, &b->att, &b->g, &b->u, &b->cs, &b->sn, &b->scores,
                    &b->kv, &b->acc};
    size_t n[] = {C * T, C * T, C * T, HD * T, KD * T, KD * T, HD * T, I * T, I * T, (size_t)rot_dims(m) * T,
                  (size_t)rot_dims(m) * T, (size_t)b->slots * nq * cap, b->slots * sc_tile_floats(m->head_dim, nq),
                  (size_t)b->slots * SC_ACC};
    for (size_t i = 0; i < sizeof n / sizeof n[0]; i++)
        if (!(*at[i] = sc_take(a, sizeof(float) * n[i]))) return SC_EWORK;
    int k = m->dim > m->inter ? m->dim : m->inter;
    k = k > (int)HD ? k : (int)HD;
    return sc_take_act(a, T, k, SC_ACT_16, &b->in);
}

// Bytes of work sc_prefill needs for T rows over a cache of `cap` slots, on the pool's thread count.
size_t sc_prefill_work(const Model* m, int T, int cap) {
    sc_arena a = sc_measure();
    PrefillBufs b;
    take_prefill(&a, m, T < 1 ? 1 : T, cap, &b);
    return sc_measured(&a);
}

static sc_lin lin_at(const Model* m, int layer, int which, int N, float* y) {
    size_t at = (size_t)layer * 7 + which;
    const void* const* p = m->lin + at * 3;
    return (sc_lin){m->lin_type ? m->lin_type[at] : SC_LIN_Q4, N, p[0], p[1], p[2], y};
}

// Quantize x [M][K] as the input of the next linears (with the per-16 sums: any of them may be q8g / q8k).
static const sc_act* quant_rows(PrefillBufs* b, const float* x, int M, int K) {
    b->in.M = M, b->in.K = K;
    sc_act_fill(x, &b->in, SC_ACT_16);
    return &b->in;
}

// The linears that read one input, on the pool (a one-row chunk takes the decode path, which keeps no accumulators).
static void run_lins(PrefillBufs* b, const sc_lin* l, int nl, const float* x, int M, int K) {
    sc_lins_run(l, nl, quant_rows(b, x, M, K), M > 1 ? b->acc : NULL, b->slots);
}

// RMSNorm of n rows of width C (as step.c's: one fp32 sum in order, w * (x * r)).
static void rms_rows(const float* x, const float* w, int n, int C, float eps, float* out) {
    for (int r = 0; r < n; r++) {
        const float* xr = x + (size_t)r * C;
        float* o = out + (size_t)r * C;
        float ss = 0;
        for (int i = 0; i < C; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / C + eps);
        for (int i = 0; i < C; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

static void add_rows(float* x, const float* t, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += t[i];
}

static void store_kv(void* buf, size_t at, const float* src, int D, int bf16) {
    if (bf16)
        sc_put_bf16((uint16_t*)buf + at, src, D);
    else
        memcpy((float*)buf + at, src, sizeof(float) * D);
}

// The causal attention as a job: item i is kv head i % H_kv of the `rows` rows of chunk row block order(i / H_kv),
// one sc_heads_attend tile (every query as sc_head_attend computes it alone: the decode step's bits), its softmaxes
// in this thread's scores rows. Row blocks are taken alternately from both ends (0, last, 1, last - 1, ...) so that
// each contiguous chunk of items the pool hands out costs about the same (row t attends over pos + t + 1 slots).
typedef struct {
    const Model* m;
    const float* q;
    const void *K, *V;
    int cap, pos, T, rows;
    float *scores, *kv, *out;
} AttJob;

static void att_task(void* ctx, int lo, int hi, int slot) {
    const AttJob* j = ctx;
    const Model* m = j->m;
    int D = m->head_dim, H = m->n_heads, Hkv = m->n_kv, G = H / Hkv, nb = (j->T + j->rows - 1) / j->rows;
    size_t esz = m->kv_bf16 ? 2 : 4, nq_max = (size_t)j->rows * G;
    float* sc = j->scores + (size_t)slot * nq_max * j->cap;
    float* kv = j->kv + (size_t)slot * sc_tile_floats(D, (int)nq_max);
    const float* qs[nq_max];
    float* outs[nq_max];
    int ns[nq_max];
    for (int i = lo; i < hi; i++) {
        int r = i / Hkv, h = i % Hkv, rb = r % 2 ? nb - 1 - r / 2 : r / 2, nq = 0;
        for (int t = rb * j->rows; t < j->T && t < (rb + 1) * j->rows; t++)
            for (int g = 0; g < G; g++, nq++) {
                size_t at = ((size_t)t * H + h * G + g) * D;
                qs[nq] = j->q + at, outs[nq] = j->out + at, ns[nq] = j->pos + t + 1;
            }
        size_t head = (size_t)h * j->cap * D * esz;
        sc_heads_attend(qs, ns, nq, (const char*)j->K + head, (const char*)j->V + head, m->kv_bf16, m->scaling, 0,
                        sc, j->cap, outs, D, kv);
    }
}

// The attention half of layer l over T rows at slots pos..pos+T-1: x += o(attention(rope(q), rope(k) and v written
// into the cache)). q/k norms (Qwen3) act on each head after its projection and before RoPE, as in sc_step.
static void attention_block(const Model* m, PrefillBufs* b, int l, int T, int pos, int off, void* const* keys,
                            void* const* values, int cap, float* queries) {
    int C = m->dim, H = m->n_heads, Hkv = m->n_kv, D = m->head_dim, R = rot_dims(m);
    rms_rows(b->x, m->norm_in + (size_t)l * C, T, C, m->eps, b->h);
    sc_lin qkv[3] = {lin_at(m, l, LQ, H * D, b->q), lin_at(m, l, LK, Hkv * D, b->k), lin_at(m, l, LV, Hkv * D, b->v)};
    run_lins(b, qkv, 3, b->h, T, C);
    if (m->q_norm) rms_rows(b->q, m->q_norm + (size_t)l * D, T * H, D, m->eps, b->q);
    if (m->k_norm) rms_rows(b->k, m->k_norm + (size_t)l * D, T * Hkv, D, m->eps, b->k);
    if (queries) memcpy(queries + (size_t)l * H * D, b->q + (size_t)(T - 1) * H * D, sizeof(float) * H * D);
    for (int t = 0; t < T; t++) {
        const float *cs = b->cs + (size_t)t * R, *sn = b->sn + (size_t)t * R;
        for (int i = 0; i < H; i++) sc_rot_row(b->q + ((size_t)t * H + i) * D, b->q + ((size_t)t * H + i) * D, cs, sn, R, D);
        for (int i = 0; i < Hkv; i++) {
            float *k = b->k + ((size_t)t * Hkv + i) * D, *v = b->v + ((size_t)t * Hkv + i) * D;
            sc_rot_row(k, k, cs, sn, R, D);
            store_kv(keys[l], ((size_t)i * cap + off + pos + t) * D, k, D, m->kv_bf16);
            store_kv(values[l], ((size_t)i * cap + off + pos + t) * D, v, D, m->kv_bf16);
        }
    }
    int blocks = (T + tile_rows(m) - 1) / tile_rows(m), busy = (2 * b->slots + Hkv - 1) / Hkv;
    blocks = blocks < busy ? (busy < T ? busy : T) : blocks;  // two tiles a thread at least, where the rows allow
    // row blocks of even size (36 rows, 10 a tile: 4 of 9)
    AttJob j = {m, b->q, keys[l], values[l], cap, off + pos, T, (T + blocks - 1) / blocks, b->scores, b->kv, b->att};
    size_t bytes = (size_t)H * T * (off + pos + T) * D * (m->kv_bf16 ? 2 : 4);  // about the K/V rows read
    sc_parallel(att_task, &j, (T + j.rows - 1) / j.rows * Hkv, b->slots, bytes);
    sc_lin o = lin_at(m, l, LO, C, b->t);
    run_lins(b, &o, 1, b->att, T, H * D);
    add_rows(b->x, b->t, (size_t)T * C);
}

// silu(gate) * up of rows [lo, hi), into gate (the same operations per element as sc_step's).
typedef struct {
    float *g;
    const float* u;
    int I;
} SiluJob;

static void silu_task(void* ctx, int lo, int hi, int slot) {
    const SiluJob* j = ctx;
    (void)slot;
    sc_silu_mul(j->g + (size_t)lo * j->I, j->u + (size_t)lo * j->I, (size_t)(hi - lo) * j->I);
}

// The MLP half of layer l: x += down(silu(gate(h)) * up(h)), h = rms(x).
static void mlp_block(const Model* m, PrefillBufs* b, int l, int T) {
    int C = m->dim, I = m->inter;
    rms_rows(b->x, m->norm_post + (size_t)l * C, T, C, m->eps, b->h);
    sc_lin gu[2] = {lin_at(m, l, LG, I, b->g), lin_at(m, l, LU, I, b->u)};
    run_lins(b, gu, 2, b->h, T, C);
    SiluJob j = {b->g, b->u, I};
    sc_parallel(silu_task, &j, T, b->slots, (size_t)T * I * 16);  // ~1 ns an element: weigh it as bytes
    sc_lin down = lin_at(m, l, LD, C, b->t);
    run_lins(b, &down, 1, b->g, T, I);
    add_rows(b->x, b->t, (size_t)T * C);
}

// T tokens whose embeddings are x_in [T][C], at in-cache positions pos..pos+T-1 (off + pos + T <= cap): writes their
// k/v into slots off+pos.. of keys[i] / values[i] ([H_kv][cap][D], fp32 or bf16 as Model.kv_bf16 says) and attends
// causally over slots <= each row's own: the `off` slots in front (recalled memory, rotated by the caller) and the
// stream's. Output for the last n_out rows (1 <= n_out <= T): out [n_out][vocab padded to 16] logits when the model
// has a head (a table or Model.head), else the final normed hidden states [n_out][C]; queries (or NULL) [L][H*D] the
// last row's pre-RoPE queries, as sc_step returns them.
// work: sc_prefill_work(m, T, cap) bytes (or NULL: allocated here).
int sc_prefill(const Model* m, const float* x_in, int T, int pos, int off, int n_out, void* const* keys,
               void* const* values, int cap, float* out, float* queries, void* work, size_t work_size) {
    int C = m->dim, half = rot_dims(m) / 2, R = rot_dims(m), rc;
    sc_arena a;
    void* own;
    PrefillBufs b;
    if (T < 1 || n_out < 1 || n_out > T || pos < 0 || off < 0 || off + pos + T > cap || sc_head_bad(m)) return SC_EARG;
    if ((rc = sc_work_open(work, work_size, sc_prefill_work(m, T, cap), &a, &own)) ||
        (rc = take_prefill(&a, m, T, cap, &b)))
        goto done;
    memcpy(b.x, x_in, sizeof(float) * C * T);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {  // as sc_step: fp32 angle = position x inv_freq
            float ang = (float)(pos + t) * m->inv_freq[i];
            b.cs[t * R + i] = b.cs[t * R + i + half] = cosf(ang) * m->rope_scale;
            b.sn[t * R + i] = b.sn[t * R + i + half] = sinf(ang) * m->rope_scale;
        }
    for (int l = 0; l < m->n_layers; l++) {
        attention_block(m, &b, l, T, pos, off, keys, values, cap, queries);
        mlp_block(m, &b, l, T);
    }
    const float* last = b.x + (size_t)(T - n_out) * C;
    rms_rows(last, m->norm_final, n_out, C, m->eps, b.h);
    sc_lin head;
    if (sc_head_of(m, out, &head))
        sc_lins_run(&head, 1, quant_rows(&b, b.h, n_out, C), b.acc, b.slots);
    else
        memcpy(out, b.h, sizeof(float) * C * n_out);
done:
    free(own);
    return rc;
}
