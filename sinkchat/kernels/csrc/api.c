// The exported kernels' entry points and the handshake the binding checks at load (shared by every build).
#include <stddef.h>

#include "kernels.h"

// ---- work sizes: each runs its kernel's own carving (linear.c: sc_lin_work) over a counting arena -------------
// `threads`: how many threads' scratch to hold (prefill accumulators, 16 KB each); <= 0: the pool's size. A kernel
// given less runs on as many threads as its buffer holds scratch for (never fewer than one).
static int slots_of(int threads) { return threads > 0 ? threads : sc_threads(); }

size_t sc_q4_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q4, M, K, slots_of(threads)); }
size_t sc_q8_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_TABLE, M, K, slots_of(threads)); }
size_t sc_q8g_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q8G, M, K, slots_of(threads)); }
size_t sc_q4k_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q4K, M, K, slots_of(threads)); }
size_t sc_q8k_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q8K, M, K, slots_of(threads)); }
size_t sc_q40_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q40, M, K, slots_of(threads)); }
size_t sc_q6k_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q6K, M, K, slots_of(threads)); }
size_t sc_q80_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q80, M, K, slots_of(threads)); }
size_t sc_q50_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q50, M, K, slots_of(threads)); }
size_t sc_q51_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q51, M, K, slots_of(threads)); }
size_t sc_q5k_work(int M, int K, int threads) { return sc_lin_work(SC_LIN_Q5K, M, K, slots_of(threads)); }

// ---- kernels ---------------------------------------------------------------------------------------------------
// Each takes the caller's work buffer of at least its sc_*_work bytes for one thread (or NULL: allocated and freed
// here, for the pool's size).
static int run_lin(const sc_lin* l, const float* x, int M, int K, void* work, size_t work_size) {
    sc_arena a;
    void* own;
    int rc = sc_work_open(work, work_size, sc_lin_work(l->type, M, K, work ? 1 : sc_threads()), &a, &own);
    if (!rc) rc = sc_lin_mm(&a, l, x, M, K);
    free(own);
    return rc;
}

int q4_matmul(const float* x, int M, int K, int N, const sc_q4_block* qw, const sc_q4_scales* sw, const float* bias,
              float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q4, N, qw, sw, bias, y}, x, M, K, work, work_size);
}

int q8_matmul(const float* x, int M, int K, int N, const sc_q8_block* hw, const float* ws, float* y, void* work,
              size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_TABLE, N, hw, ws, NULL, y}, x, M, K, work, work_size);
}

int q8g_matmul(const float* x, int M, int K, int N, const sc_q8_block* hw, const sc_q8g_scales* sw, const float* bias,
               float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q8G, N, hw, sw, bias, y}, x, M, K, work, work_size);
}

int q4k_matmul(const float* x, int M, int K, int N, const sc_q4_block* qw, const sc_q4k_scales* sw, const float* bias,
               float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q4K, N, qw, sw, bias, y}, x, M, K, work, work_size);
}

int q8k_matmul(const float* x, int M, int K, int N, const sc_q8_block* hw, const sc_q8k_scales* sw, const float* bias,
               float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q8K, N, hw, sw, bias, y}, x, M, K, work, work_size);
}

int q40_matmul(const float* x, int M, int K, int N, const sc_q4_block* qw, const sc_q40_scales* sw, const float* bias,
               float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q40, N, qw, sw, bias, y}, x, M, K, work, work_size);
}

int q6k_matmul(const float* x, int M, int K, int N, const sc_q6k_block* qw, const sc_q6k_scales* sw, const float* bias,
               float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q6K, N, qw, sw, bias, y}, x, M, K, work, work_size);
}

int q80_matmul(const float* x, int M, int K, int N, const sc_q8_block* hw, const sc_q80_scales* sw, const float* bias,
               float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q80, N, hw, sw, bias, y}, x, M, K, work, work_size);
}

int q50_matmul(const float* x, int M, int K, int N, const sc_q5_block* qw, const sc_q80_scales* sw, const float* bias,
               float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q50, N, qw, sw, bias, y}, x, M, K, work, work_size);
}

int q51_matmul(const float* x, int M, int K, int N, const sc_q5_block* qw, const sc_q4_scales* sw, const float* bias,
               float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q51, N, qw, sw, bias, y}, x, M, K, work, work_size);
}

int q5k_matmul(const float* x, int M, int K, int N, const sc_q5_block* qw, const sc_q4k_scales* sw, const float* bias,
               float* y, void* work, size_t work_size) {
    return run_lin(&(sc_lin){SC_LIN_Q5K, N, qw, sw, bias, y}, x, M, K, work, work_size);
}

// g = silu(g) * u over n elements (the MLP's activation, as the step and the prefill run it).
int sc_silu(float* g, const float* u, size_t n) {
    sc_silu_mul(g, u, n);
    return 0;
}

// The activation quantizer alone: xq [M][K], dx and sx [M][K/32] are the caller's.
int sc_quant(const float* x, int M, int K, int8_t* xq, float* dx, float* sx) {
    sc_quant_rows(x, M, K, xq, dx, sx);
    return SC_OK;
}

// ---- handshake ---------------------------------------------------------------------------------------------------
int sc_abi(void) { return SC_ABI_VERSION; }

int sc_variant(void) { return sc_variant_id; }

long sc_sizeof(const char* type) {
    static const struct {
        const char* name;
        size_t size;
    } t[] = {{"Model", sizeof(Model)},
             {"sc_q4_block", sizeof(sc_q4_block)},
             {"sc_q4_scales", sizeof(sc_q4_scales)},
             {"sc_q8_block", sizeof(sc_q8_block)},
             {"sc_q8g_scales", sizeof(sc_q8g_scales)},
             {"sc_q4k_scales", sizeof(sc_q4k_scales)},
             {"sc_q8k_scales", sizeof(sc_q8k_scales)},
             {"sc_q40_scales", sizeof(sc_q40_scales)},
             {"sc_q6k_block", sizeof(sc_q6k_block)},
             {"sc_q6k_scales", sizeof(sc_q6k_scales)},
             {"sc_q80_scales", sizeof(sc_q80_scales)},
             {"sc_q5_block", sizeof(sc_q5_block)},
             {"sc_layers", sizeof(sc_layers)}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(type, t[i].name)) return (long)t[i].size;
    return -1;
}

long sc_offsetof(const char* field) {
#define F(f) {#f, offsetof(Model, f)}
    static const struct {
        const char* name;
        size_t at;
    } t[] = {F(n_layers), F(dim),        F(n_heads),  F(n_kv),      F(head_dim),   F(inter),     F(vocab),
             F(kv_bf16),  F(eps),        F(scaling),  F(rope_scale), F(inv_freq),  F(norm_in),   F(norm_post),
             F(norm_final), F(lin),      F(table),    F(table_scale), F(q_norm),  F(k_norm),    F(lin_type),
             F(rot),      F(head_type),  F(head)};
#undef F
#define F(f) {"sc_layers." #f, offsetof(sc_layers, f)}
    static const struct {
        const char* name;
        size_t at;
    } x[] = {F(inv_freq), F(rope_scale), F(scaling), F(norm_attn_out), F(norm_mlp_out), F(softcap), F(act)};
#undef F
    for (size_t i = 0; i < sizeof x / sizeof x[0]; i++)
        if (!strcmp(field, x[i].name)) return (long)x[i].at;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(field, t[i].name)) return (long)t[i].at;
    return -1;
}

// Signature codes, from the types in SC_EXPORTS by _Generic (so they cannot drift from the prototypes): i int,
// l long, z size_t, f float, p any pointer; "r(args)".
#define SC_T(T) _Generic(*(T*)0, int: 'i', long: 'l', size_t: 'z', float: 'f', default: 'p')
#define SC_N(...) SC_N_(__VA_ARGS__, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define SC_N_(a, b, c, d, e, f, g, h, i, j, k, l, m, n, N, ...) N
#define SC_CAT(a, b) SC_CAT_(a, b)
#define SC_CAT_(a, b) a##b
#define SC_C1(a) SC_T(a)
#define SC_C2(a, ...) SC_T(a), SC_C1(__VA_ARGS__)
#define SC_C3(a, ...) SC_T(a), SC_C2(__VA_ARGS__)
#define SC_C4(a, ...) SC_T(a), SC_C3(__VA_ARGS__)
#define SC_C5(a, ...) SC_T(a), SC_C4(__VA_ARGS__)
#define SC_C6(a, ...) SC_T(a), SC_C5(__VA_ARGS__)
#define SC_C7(a, ...) SC_T(a), SC_C6(__VA_ARGS__)
#define SC_C8(a, ...) SC_T(a), SC_C7(__VA_ARGS__)
#define SC_C9(a, ...) SC_T(a), SC_C8(__VA_ARGS__)
#define SC_C10(a, ...) SC_T(a), SC_C9(__VA_ARGS__)
#define SC_C11(a, ...) SC_T(a), SC_C10(__VA_ARGS__)
#define SC_C12(a, ...) SC_T(a), SC_C11(__VA_ARGS__)
#define SC_C13(a, ...) SC_T(a), SC_C12(__VA_ARGS__)
#define SC_C14(a, ...) SC_T(a), SC_C13(__VA_ARGS__)
#define SC_CODES(...) SC_CAT(SC_C, SC_N(__VA_ARGS__))(__VA_ARGS__)
#define SC_SIG(ret, name, ...) {#name, {SC_T(ret), '(', SC_CODES(__VA_ARGS__), ')', 0}},

#define SC_NAME(ret, name, ...) #name " "

// The signature of `fn`; with fn NULL, the names of all exported kernels (space-separated).
const char* sc_signature(const char* fn) {
    if (!fn) return SC_EXPORTS(SC_NAME);
    static const struct {
        const char* name;
        char sig[20];
    } t[] = {SC_EXPORTS(SC_SIG)};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(fn, t[i].name)) return t[i].sig;
    return NULL;
}
