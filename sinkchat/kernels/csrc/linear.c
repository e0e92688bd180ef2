// The linears as jobs on the worker pool (shared by every build): quantize the input once, on the calling thread,
// then split the output row groups (and, for prefill, the row passes) across the threads, each group computed by
// one thread through sc_lin_run (the variant's kernel for its layout), which gives every output element the same
// instructions whatever the split: the result is bit-identical at any thread count (tests/test_threads.py).
//
// Why output row groups: a group is 16 rows in one 512-bit register, the unit every layout is stored in, so a
// thread streams whole contiguous blocks of weights and writes its own outputs; nothing is reduced across threads.
// Prefill passes (SC_MB / SC_MB8 rows) keep their L1 accumulators, one set per thread: the work buffer holds one
// SC_ACC piece per thread (sc_lin_work's `slots`).
#include "kernels.h"

void sc_act_fill(const float* x, sc_act* a, int what) {
    sc_quant_rows(x, a->M, a->K, a->x.xq, a->x.dx, a->x.sx);
    sc_q8_corr(a->x.sx, a->M, a->K / QB, a->x.corr);
    if (what & SC_ACT_16) sc_q8g_sums(&a->x, a->M, a->K, &a->h);
}

// Bytes of weights and scales in one row group of a linear of `type` over K inputs (the pool's job size measure).
static size_t group_bytes(int type, int K) {
    size_t nb = (size_t)K / QB, ns = (size_t)K / SC_QK;
    switch (type) {
        case SC_LIN_Q8G: return nb * (sizeof(sc_q8_block) + sizeof(sc_q8g_scales));
        case SC_LIN_Q4K: return nb * sizeof(sc_q4_block) + ns * sizeof(sc_q4k_scales);
        case SC_LIN_Q8K: return nb * sizeof(sc_q8_block) + ns * sizeof(sc_q8k_scales);
        case SC_LIN_Q40: return nb * (sizeof(sc_q4_block) + sizeof(sc_q40_scales));
        case SC_LIN_Q6K: return nb * sizeof(sc_q6k_block) + ns * sizeof(sc_q6k_scales);
        case SC_LIN_Q80: return nb * (sizeof(sc_q8_block) + sizeof(sc_q80_scales));
        case SC_LIN_Q50: return nb * (sizeof(sc_q5_block) + sizeof(sc_q80_scales));
        case SC_LIN_Q51: return nb * (sizeof(sc_q5_block) + sizeof(sc_q4_scales));
        case SC_LIN_Q5K: return nb * sizeof(sc_q5_block) + ns * sizeof(sc_q4k_scales);
        case SC_LIN_TABLE: return nb * sizeof(sc_q8_block) + RG * sizeof(float);
        default: return nb * (sizeof(sc_q4_block) + sizeof(sc_q4_scales));
    }
}

size_t sc_lin_work(int type, int M, int K, int slots) {
    sc_arena a = sc_measure();
    sc_act act;
    sc_take_act(&a, M, K, sc_lin_act(type), &act);
    if (M > 1 && type != SC_LIN_TABLE) sc_take(&a, sizeof(float) * SC_ACC * (size_t)(slots < 1 ? 1 : slots));
    return sc_measured(&a);
}

// One job over the row groups of nl linears that read one input, pass by pass: item p*G + r is group r (counted
// across the linears in order) of rows [p*pass, (p+1)*pass).
typedef struct {
    const sc_lin* l;
    const sc_act* a;
    float* acc;  // SC_ACC floats per slot (prefill), or NULL
    int nl, G, pass;
} LinsJob;

// The one dispatch of every build: each variant implements the eleven layouts' functions (kernels.h).
void sc_lin_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    switch (l->type) {
        case SC_LIN_TABLE: sc_table_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q8G: sc_q8g_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q4K: sc_q4k_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q8K: sc_q8k_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q40: sc_q40_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q6K: sc_q6k_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q80: sc_q80_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q50: sc_q50_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q51: sc_q51_run(l, a, m0, mn, g0, g1, acc); break;
        case SC_LIN_Q5K: sc_q5k_run(l, a, m0, mn, g0, g1, acc); break;
        default: sc_q4_run(l, a, m0, mn, g0, g1, acc);
    }
}

static void lins_task(void* ctx, int lo, int hi, int slot) {
    const LinsJob* j = ctx;
    float* acc = j->acc ? j->acc + (size_t)slot * SC_ACC : NULL;
    while (lo < hi) {
        int p = lo / j->G, r = lo % j->G, i = 0, off = 0;
        while (r >= off + j->l[i].N / RG) off += j->l[i++].N / RG;
        int stop = off + j->l[i].N / RG;  // this linear's groups end here, in this pass
        if (hi - p * j->G < stop) stop = hi - p * j->G;
        int m0 = p * j->pass, mn = j->a->M - m0 < j->pass ? j->a->M - m0 : j->pass;
        sc_lin_run(&j->l[i], j->a, m0, mn, r - off, stop - off, acc);
        lo = p * j->G + stop;
    }
}

void sc_lins_run(const sc_lin* l, int nl, const sc_act* a, float* acc, int slots) {
    LinsJob j = {l, a, acc, nl, 0, 1 << 30};
    size_t bytes = 0;
    for (int i = 0; i < nl; i++) {
        j.G += l[i].N / RG;
        j.pass = sc_lin_pass(l[i].type) < j.pass ? sc_lin_pass(l[i].type) : j.pass;
        bytes += (size_t)(l[i].N / RG) * group_bytes(l[i].type, a->K);
    }
    if (j.G <= 0 || a->M <= 0) return;
    int passes = (a->M + j.pass - 1) / j.pass;
    sc_parallel(lins_task, &j, passes * j.G, slots, bytes * (size_t)a->M);
}

// As many threads' prefill accumulators as the arena holds, up to the pool's size; 0: not even one.
static int take_accs(sc_arena* a, float** acc) {
    for (int t = sc_threads(); t >= 1; t--)
        if ((*acc = sc_take(a, sizeof(float) * SC_ACC * (size_t)t))) return t;
    return 0;
}

int sc_lin_mm(sc_arena* a, const sc_lin* l, const float* x, int M, int K) {
    sc_act act;
    float* acc = NULL;
    int slots = sc_threads(), what = sc_lin_act(l->type);
    if (M <= 0) return SC_OK;  // no rows: nothing to write
    if (sc_take_act(a, M, K, what, &act)) return SC_EWORK;
    if (M > 1 && l->type != SC_LIN_TABLE && !(slots = take_accs(a, &acc))) return SC_EWORK;
    sc_act_fill(x, &act, what);
    sc_lins_run(l, 1, &act, acc, slots);
    return SC_OK;
}

int sc_head_of(const Model* m, float* out, sc_lin* l) {
    if (m->table)
        *l = (sc_lin){SC_LIN_TABLE, m->vocab, m->table, m->table_scale, NULL, out};
    else if (m->head)
        *l = (sc_lin){m->head_type, m->vocab, m->head[0], m->head[1], m->head[2], out};
    return m->table || m->head;
}
