// One decode step of a Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / Gemma 2 / Gemma 3 shaped model in C, and the cache
// eviction: shared by every build, over the pieces each variant implements (sc_lin_run, sc_head_attend_cap,
// sc_rot_row, ...: kernels.h). Each linear is q4, q8g, q4k, q8k or q40 (Model.lin_type); q/k norms and partial
// rotary are optional. sc_step_layers adds what differs per layer or is Gemma's (sc_layers): a RoPE and a query scale
// per layer, each layer's own slice of the cache (a local layer's ring), norms of the attention and MLP outputs before
// each residual add, GELU (tanh) instead of SiLU, soft-capped attention scores.
//
// Threads (pool.c): per layer five jobs, each split so every output is computed by one thread as it is alone (the
// step's results are bit-identical at any thread count): q, k and v together (one input, quantized once), the heads'
// attention, o, gate and up together with the SiLU product of each finished row group, and down; then the head.
// Fewer, larger jobs: each costs a wake-up of the workers. The norms, RoPE and residual adds stay on the caller.
#include "kernels.h"

enum { LQ, LK, LV, LO, LG, LU, LD };

// The step's activations, carved from the caller's work buffer (sizes: sc_step_work, which carves the same way), and
// the quantized input of the linears (one at a time, K up to the widest).
typedef struct {
    float *x, *h, *t, *q, *k, *v, *att, *gu, *cs, *sn, *scores;
    sc_act in;
    const float* rope;  // the inv_freq row cs / sn hold now (sc_step_layers: layers of one RoPE share them)
    float rope_scale;
} StepBufs;

// One call's cache: layer l's keys / values at keys[l] / values[l] hold [H_kv][cap_l][D]; the token attends to
// slots 0..n_l-1 and writes its own k/v into slot n_l - 1. caps / ns NULL: every layer cap, n = pos + 1.
typedef struct {
    void* const *keys, *const *values;
    const int *caps, *ns;
    int cap, pos;
} KvView;

static inline int kv_cap(const KvView* kv, int l) { return kv->caps ? kv->caps[l] : kv->cap; }
static inline int kv_n(const KvView* kv, int l) { return kv->ns ? kv->ns[l] : kv->pos + 1; }

static int take_step(sc_arena* a, const Model* m, int n_slots, StepBufs* b) {
    size_t C = m->dim, D = m->head_dim, HD = (size_t)m->n_heads * D, KD = (size_t)m->n_kv * D;
    float** at[] = {&b->x, &b->h, &b->t, &b->q, &b->k, &b->v, &b->att, &b->gu, &b->cs, &b->sn, &b->scores};
    size_t n[] = {C, C, C, HD, KD, KD, HD, 2 * (size_t)m->inter, D, D, (size_t)m->n_heads * n_slots};
    for (size_t i = 0; i < sizeof n / sizeof n[0]; i++)
        if (!(*at[i] = sc_take(a, sizeof(float) * n[i]))) return SC_EWORK;
    int k = m->dim > m->inter ? m->dim : m->inter;
    k = k > (int)HD ? k : (int)HD;
    b->rope = NULL;
    return sc_take_act(a, 1, k, SC_ACT_16, &b->in);
}

// Bytes of work sc_step needs for a cache of `cap` slots (any thread count: at one row no thread keeps scratch);
// sc_step_layers: cap = the most slots any layer attends to.
size_t sc_step_work(const Model* m, int cap) {
    sc_arena a = sc_measure();
    StepBufs b;
    take_step(&a, m, cap, &b);
    return sc_measured(&a);
}

// Linear `which` of `layer` (Model.lin_type; NULL: every linear q4), writing y.
static sc_lin lin_of(const Model* m, int layer, int which, int N, float* y) {
    size_t at = (size_t)layer * 7 + which;
    const void* const* p = m->lin + at * 3;
    return (sc_lin){m->lin_type ? m->lin_type[at] : SC_LIN_Q4, N, p[0], p[1], p[2], y};
}

// Quantize x [K] as the input of the next linears (with the per-16 sums: any of them may be q8g / q8k).
static const sc_act* quant_in(StepBufs* b, const float* x, int K) {
    b->in.K = K;
    sc_act_fill(x, &b->in, SC_ACT_16);
    return &b->in;
}

// The rotary dims: Model.rot, or the whole head where it is unset.
static inline int rot_dims(const Model* m) { return m->rot > 0 ? m->rot : m->head_dim; }

// cos / sin of position pos for the RoPE inv_freq [rot/2], times scale (yarn / longrope), into b->cs / b->sn; kept
// while the next layer's RoPE is the same (Gemma 3: 5 local layers of base 10k, then a global one of its own).
static void rope_at(const Model* m, StepBufs* b, const float* inv_freq, float scale, int pos) {
    int half = rot_dims(m) / 2;
    if (b->rope && b->rope_scale == scale && !memcmp(b->rope, inv_freq, sizeof(float) * half)) return;
    for (int i = 0; i < half; i++) {  // as transformers: fp32 angle = position x inv_freq
        float ang = (float)pos * inv_freq[i];
        b->cs[i] = b->cs[i + half] = cosf(ang) * scale;
        b->sn[i] = b->sn[i + half] = sinf(ang) * scale;
    }
    b->rope = inv_freq, b->rope_scale = scale;
}

static void rms(const float* x, const float* w, int C, float eps, float* out) {
    float ss = 0;
    for (int i = 0; i < C; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / C + eps);
    for (int i = 0; i < C; i++) out[i] = w[i] * (x[i] * r);
}

// transformers' gelu_pytorch_tanh (Gemma): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
static inline float gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
}

// Every build's sc_head_attend: its sc_head_attend_cap without a cap.
void sc_head_attend(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float* sc, float* o,
                    int D) {
    sc_head_attend_cap(qh, Kh, Vh, n, bf, scale, 0, sc, o, D);
}

// The heads' attention as a job: item hq is query head hq (its softmax and output computed by one thread).
typedef struct {
    const Model* m;
    const float* q;
    const void *K, *V;
    int cap, n;
    float scale, softcap;
    float *scores, *out;
} AttJob;

static void att_task(void* ctx, int lo, int hi, int slot) {
    const AttJob* j = ctx;
    const Model* m = j->m;
    int D = m->head_dim, G = m->n_heads / m->n_kv;
    size_t esz = m->kv_bf16 ? 2 : 4;
    (void)slot;
    for (int hq = lo; hq < hi; hq++) {
        size_t head = (size_t)(hq / G) * j->cap * D * esz;
        sc_head_attend_cap(j->q + (size_t)hq * D, (const char*)j->K + head, (const char*)j->V + head, j->n,
                           m->kv_bf16, j->scale, j->softcap, j->scores + (size_t)hq * j->n, j->out + (size_t)hq * D, D);
    }
}

// Attention of the H query heads over slots 0..n-1 of one layer's K/V [H_kv][cap][D], scores times `scale` (and
// soft-capped: softcap > 0); writes out [H*D] and adds the gauge shares (mean over heads) to gauge[3]: [0] the n_gauge
// slots from g0 on (the stream's first, after any recalled memory slots), [1] the newest n_gauge slots (never the
// recalled ones), [2] the recalled memory slots 0..g0-1 (0 without them). On the caller, after the heads' job, in
// head order (so the float sums do not depend on which thread did which head); with g0 = 0, [0] and [1] are the sums
// they were before [2] existed, operation for operation.
static void attend(const Model* m, const float* q, const void* K, const void* V, int cap, int n, float scale,
                   float softcap, int n_gauge, int g0, float* scores, float* out, float* gauge) {
    int H = m->n_heads;
    AttJob j = {m, q, K, V, cap, n, scale, softcap, scores, out};
    sc_parallel(att_task, &j, H, sc_threads(), (size_t)H * n * m->head_dim * (m->kv_bf16 ? 4 : 8));
    for (int hq = 0; hq < H; hq++) {
        const float* sc = scores + (size_t)hq * n;
        float first = 0, last = 0, mem = 0;
        for (int t = g0; t < g0 + n_gauge && t < n; t++) first += sc[t];
        for (int t = n - 1; t >= g0 && t >= n - n_gauge; t--) last += sc[t];
        for (int t = 0; t < g0 && t < n; t++) mem += sc[t];
        gauge[0] += first / H;
        gauge[1] += last / H;
        gauge[2] += mem / H;
    }
}

// One layer's attention alone, on queries already rotated (tests hold each variant's to the other's): scores
// [H][pos+1] is the caller's; gauge [2]: the first / newest shares (no recalled slots here, so no third).
int sc_attend(const Model* m, const float* q, const void* K, const void* V, int cap, int pos, int n_gauge, float* out,
              float* gauge, float* scores) {
    float g[3] = {0, 0, 0};
    attend(m, q, K, V, cap, pos + 1, m->scaling, 0, n_gauge, 0, scores, out, g);
    gauge[0] = g[0], gauge[1] = g[1];
    return SC_OK;
}

static void store_kv(void* buf, size_t at, const float* src, int D, int bf16) {
    if (bf16)
        sc_put_bf16((uint16_t*)buf + at, src, D);
    else
        memcpy((float*)buf + at, src, sizeof(float) * D);
}

// x += t, t first normed by w where the model norms a block's output (Gemma's post-attention / post-feedforward).
static void residual(const Model* m, float* x, float* t, const float* w) {
    if (w) rms(t, w, m->dim, m->eps, t);
    for (int c = 0; c < m->dim; c++) x[c] += t[c];
}

// The attention half of layer l: x += o_proj(attention(rope(q), rope(k) and v written at the layer's slot)). With
// q/k norms (Qwen3, Gemma 3) each head is RMS-normed after its projection and before RoPE, as transformers'
// attention does; the queries handed back are those normed, unrotated ones (what the gauge's hook on q_norm sees).
static void attention_block(const Model* m, const sc_layers* X, StepBufs* b, int l, const KvView* kv, int n_gauge,
                            float* queries, float* gauge) {
    int C = m->dim, H = m->n_heads, Hkv = m->n_kv, D = m->head_dim, R = rot_dims(m), T = sc_threads();
    int cap = kv_cap(kv, l), n = kv_n(kv, l);
    rms(b->x, m->norm_in + (size_t)l * C, C, m->eps, b->h);
    sc_lin qkv[3] = {lin_of(m, l, LQ, H * D, b->q), lin_of(m, l, LK, Hkv * D, b->k), lin_of(m, l, LV, Hkv * D, b->v)};
    sc_lins_run(qkv, 3, quant_in(b, b->h, C), NULL, T);
    for (int i = 0; m->q_norm && i < H; i++) rms(b->q + i * D, m->q_norm + (size_t)l * D, D, m->eps, b->q + i * D);
    for (int i = 0; m->k_norm && i < Hkv; i++) rms(b->k + i * D, m->k_norm + (size_t)l * D, D, m->eps, b->k + i * D);
    memcpy(queries + (size_t)l * H * D, b->q, sizeof(float) * H * D);
    if (X && X->inv_freq)
        rope_at(m, b, X->inv_freq + (size_t)l * (R / 2), X->rope_scale ? X->rope_scale[l] : m->rope_scale, kv->pos);
    for (int i = 0; i < H; i++) sc_rot_row(b->q + i * D, b->q + i * D, b->cs, b->sn, R, D);
    for (int i = 0; i < Hkv; i++) {
        sc_rot_row(b->k + i * D, b->k + i * D, b->cs, b->sn, R, D);
        store_kv(kv->keys[l], ((size_t)i * cap + n - 1) * D, b->k + i * D, D, m->kv_bf16);
        store_kv(kv->values[l], ((size_t)i * cap + n - 1) * D, b->v + i * D, D, m->kv_bf16);
    }
    float* g = gauge + 3 * l;  // this layer's [first, newest, recalled] shares
    g[0] = g[1] = g[2] = 0;
    float scale = X && X->scaling ? X->scaling[l] : m->scaling, softcap = X ? X->softcap : 0;
    int g0 = n > kv->pos + 1 ? n - (kv->pos + 1) : 0;  // slots before the stream's first: recalled memory
    attend(m, b->q, kv->keys[l], kv->values[l], cap, n, scale, softcap, n_gauge, g0, b->scores, b->att, g);
    sc_lin o = lin_of(m, l, LO, C, b->t);
    sc_lins_run(&o, 1, quant_in(b, b->att, H * D), NULL, T);
    residual(m, b->x, b->t, X && X->norm_attn_out ? X->norm_attn_out + (size_t)l * C : NULL);
}

// gate and up as one job: item g is row group g of both, then the activation's product of its 16 values (the same
// operations per element as a separate loop: act(gate) * up).
typedef struct {
    sc_lin gate, up;
    const sc_act* in;
    float* gu;
    int I, act;
} MlpJob;

static void gate_up_task(void* ctx, int lo, int hi, int slot) {
    const MlpJob* j = ctx;
    (void)slot;
    sc_lin_run(&j->gate, j->in, 0, 1, lo, hi, NULL);
    sc_lin_run(&j->up, j->in, 0, 1, lo, hi, NULL);
    if (j->act == SC_ACT_GELU_TANH)
        for (int i = lo * RG; i < hi * RG; i++) j->gu[i] = gelu_tanh(j->gu[i]) * j->gu[j->I + i];
    else
        sc_silu_mul(j->gu + lo * RG, j->gu + j->I + lo * RG, (size_t)(hi - lo) * RG);
}

// The MLP half of layer l: x += down(act(gate(h)) * up(h)), h = rms(x) (Gemma: pre_feedforward_layernorm, held in
// norm_post; the output normed again by X->norm_mlp_out before the add).
static void mlp_block(const Model* m, const sc_layers* X, StepBufs* b, int l) {
    int C = m->dim, I = m->inter, T = sc_threads();
    rms(b->x, m->norm_post + (size_t)l * C, C, m->eps, b->h);
    MlpJob j = {lin_of(m, l, LG, I, b->gu), lin_of(m, l, LU, I, b->gu + I), quant_in(b, b->h, C), b->gu, I,
                X ? X->act : SC_ACT_SILU};
    size_t bytes = (size_t)I * C;  // about the weights' bytes (2 x I x C at 4 bits)
    sc_parallel(gate_up_task, &j, I / RG, T, bytes);
    sc_lin down = lin_of(m, l, LD, C, b->t);
    sc_lins_run(&down, 1, quant_in(b, b->gu, I), NULL, T);
    residual(m, b->x, b->t, X && X->norm_mlp_out ? X->norm_mlp_out + (size_t)l * C : NULL);
}

// The whole token through every layer and the head (sc_step, sc_step_layers).
static int run_step(const Model* m, const sc_layers* X, const float* x_in, const KvView* kv, int n_gauge, float* out,
                    float* queries, float* gauge, void* work, size_t work_size) {
    int C = m->dim, most = kv->pos + 1, rc;
    if (sc_head_bad(m)) return SC_EARG;
    for (int l = 0; kv->ns && l < m->n_layers; l++) most = kv->ns[l] > most ? kv->ns[l] : most;
    sc_arena a;
    void* own;
    StepBufs b;
    if ((rc = sc_work_open(work, work_size, sc_step_work(m, most), &a, &own)) || (rc = take_step(&a, m, most, &b)))
        goto done;
    memcpy(b.x, x_in, sizeof(float) * C);
    rope_at(m, &b, m->inv_freq, m->rope_scale, kv->pos);
    for (int l = 0; l < m->n_layers; l++) {
        attention_block(m, X, &b, l, kv, n_gauge, queries, gauge);
        mlp_block(m, X, &b, l);
    }
    rms(b.x, m->norm_final, C, m->eps, b.h);
    sc_lin head;
    if (sc_head_of(m, out, &head))
        sc_lins_run(&head, 1, quant_in(&b, b.h, C), NULL, sc_threads());
    else
        memcpy(out, b.h, sizeof(float) * C);
done:
    free(own);
    return rc;
}

// One token whose embedding is x_in [C], at in-cache slot `pos`: writes its k/v into slot pos of keys[i] / values[i]
// ([H_kv][cap][D], float or bf16) and attends over slots <= pos. Outputs: out = logits [V padded to 16] when the
// model has a head (table or Model.head), else the final normed hidden state [C]; the pre-RoPE queries [L][H*D];
// gauge [L][3] (per layer the shares on the first / newest n_gauge slots and on the recalled ones: `attend`).
// work: sc_step_work(m, cap) bytes (or NULL: allocated here).
int sc_step(const Model* m, const float* x_in, int pos, int n_gauge, void* const* keys, void* const* values, int cap,
            float* out, float* queries, float* gauge, void* work, size_t work_size) {
    KvView kv = {keys, values, NULL, NULL, cap, pos};
    return run_step(m, NULL, x_in, &kv, n_gauge, out, queries, gauge, work, work_size);
}

// sc_step with the per-layer extras X (or NULL) and each layer's own cache slice: layer l's keys[l] / values[l] are
// [H_kv][caps[l]][D] and the token, at RoPE position pos, writes slot ns[l] - 1 and attends over slots 0..ns[l]-1
// (a global layer: the sink cache, ns = pos + 1; a local ring: its window, the new token last). work:
// sc_step_work(m, max ns) bytes.
int sc_step_layers(const Model* m, const sc_layers* X, const float* x_in, int pos, int n_gauge, void* const* keys,
                   void* const* values, const int* caps, const int* ns, float* out, float* queries, float* gauge,
                   void* work, size_t work_size) {
    for (int l = 0; l < m->n_layers; l++)
        if (ns[l] < 1 || ns[l] > caps[l]) return SC_EARG;
    KvView kv = {keys, values, caps, ns, 0, pos};
    return run_step(m, X, x_in, &kv, n_gauge, out, queries, gauge, work, work_size);
}

// ---------------------------------------------------------------------------------------------------------------
// Eviction: drop slots [start, start+count) of one layer's K/V [H_kv][cap][D] and move the n slots after them down,
// re-rotating the moved keys by -count in fp32 (cos/sin [rot]: that angle, rotate-half layout; dims past rot copied).
// One pass over the cache instead of torch's five (copy out, two multiplies, two adds, copy back): the pause at an
// eviction is what p99 latency sees. A job over the KV heads (each head's rows moved by one thread); no work buffer:
// one row on each thread's stack.
typedef struct {
    void *K, *V;
    int cap, D, start, count, n, rot, bf16;
    const float *cs, *sn;
} EvictJob;

static void evict_task(void* ctx, int lo, int hi, int slot) {
    const EvictJob* j = ctx;
    float kin[1024];
    int D = j->D;
    size_t esz = j->bf16 ? 2 : 4;
    (void)slot;
    for (int h = lo; h < hi; h++) {
        for (int s = 0; s < j->n; s++) {
            size_t src = ((size_t)h * j->cap + j->start + j->count + s) * D, dst = ((size_t)h * j->cap + j->start + s) * D;
            if (!j->cs) {
                memmove((char*)j->K + dst * esz, (const char*)j->K + src * esz, esz * D);
            } else if (j->bf16) {
                sc_get_bf16(kin, (const uint16_t*)j->K + src, D);
                sc_rot_row(kin, kin, j->cs, j->sn, j->rot, D);
                sc_put_bf16((uint16_t*)j->K + dst, kin, D);
            } else {  // whole rows, never partly overlapping
                sc_rot_row((const float*)j->K + src, (float*)j->K + dst, j->cs, j->sn, j->rot, D);
            }
        }
        size_t src = ((size_t)h * j->cap + j->start + j->count) * D, dst = ((size_t)h * j->cap + j->start) * D;
        memmove((char*)j->V + dst * esz, (const char*)j->V + src * esz, esz * D * (size_t)j->n);  // overlapping
    }
}

int kv_evict(void* K, void* V, int n_heads, int cap, int D, int start, int count, int n, const float* cs,
             const float* sn, int rot, int bf16) {
    if (D > 1024 || rot > D) return -1;
    EvictJob j = {K, V, cap, D, start, count, n, rot, bf16, cs, sn};
    sc_parallel(evict_task, &j, n_heads, sc_threads(), (size_t)n_heads * n * D * (bf16 ? 4 : 8));
    return 0;
}
