// The C side of sinkchat's kernels as the binding (sinkchat/kernels/native.py) sees it: the ABI version, the typed
// weight layouts (layouts.h), the decode step's Model, the caller-owned work buffers, the exported functions (with
// their signatures spelled once, here, so the binding can check its ctypes declarations against them at load), and
// the internal interface that each variant implements.
//
// One build per variant links the same shared code (linear.c, step.c, pool.c, api.c) to that variant's kernels:
// avx512 (matmul.c, matmul_k.c, attend.c: AVX-512 VNNI, -march=native), avx2 and avxvnni (matmul256.c,
// matmul256_k.c, attend256.c: 256-bit, -mavx2 -mfma -mf16c [-mavxvnni]), neon (matmul_neon.c, matmul_neon_k.c,
// attend_neon.c: -march=armv8.2-a+dotprod) and the scalar reference (ref.c: plain C, no -march flag, any CPU). No
// intrinsics in this header: the reference build includes it on any architecture.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Bump on any change to an exported signature, the Model struct or a layout: the binding refuses another number.
#define SC_ABI_VERSION 12  // 12: sc_q4k_scales at 6 bits (Q4_K's 144 bytes per 256), the q80 layout

#define SC_API __attribute__((visibility("default")))  // everything else is hidden (-fvisibility=hidden)

// Return codes of the exported kernels.
#define SC_OK 0
#define SC_ENOMEM (-1)  // no work buffer was given and allocating one failed
#define SC_EWORK (-2)   // the work buffer given is smaller than the sc_*_work function says
#define SC_EARG (-3)    // arguments out of range (sc_prefill: rows or slots outside the cache)

#include "layouts.h"  // the typed weight layouts

// ---- the decode step's model (native.StepModel mirrors it; the binding checks its size and every offset) -----
// Kinds of a linear (Model.lin_type).
#define SC_LIN_Q4 0   // lin triple: (sc_q4_block*, sc_q4_scales*, bias)
#define SC_LIN_Q8G 1  // lin triple: (sc_q8_block*, sc_q8g_scales*, bias)
#define SC_LIN_Q4K 2  // lin triple: (sc_q4_block*, sc_q4k_scales*, bias)
#define SC_LIN_Q8K 3  // lin triple: (sc_q8_block*, sc_q8k_scales*, bias)
#define SC_LIN_Q40 5  // lin triple: (sc_q4_block*, sc_q40_scales*, bias) (4 is SC_LIN_TABLE, linear.c's own)
#define SC_LIN_Q6K 6  // lin triple: (sc_q6k_block*, sc_q6k_scales*, bias)
#define SC_LIN_Q80 7  // lin triple: (sc_q8_block*, sc_q80_scales*, bias)
#define SC_LIN_Q50 8  // lin triple: (sc_q5_block*, sc_q80_scales*, bias)
#define SC_LIN_Q51 9  // lin triple: (sc_q5_block*, sc_q4_scales*, bias)
#define SC_LIN_Q5K 10 // lin triple: (sc_q5_block*, sc_q4k_scales*, bias)

typedef struct {
    int n_layers, dim, n_heads, n_kv, head_dim, inter, vocab, kv_bf16;  // vocab: padded to 16
    float eps, scaling, rope_scale;
    const float* inv_freq;     // [rot/2]
    const float* norm_in;      // [L][C]
    const float* norm_post;    // [L][C]
    const float* norm_final;   // [C]
    const void* const* lin;    // [L][7][3]: (weights, scales, bias or NULL) for q, k, v, o, gate, up, down
    const sc_q8_block* table;  // the int8 token table as the head (q8_matmul's hw), or NULL: Model.head
    const float* table_scale;  // [V]
    const float* q_norm;       // [L][D]: RMSNorm of each query head before RoPE (Qwen3), or NULL: none
    const float* k_norm;       // [L][D]: the same for each key head, or NULL
    const int* lin_type;       // [L][7]: SC_LIN_Q4, _Q8G, _Q4K, _Q8K or _Q40 per linear, or NULL: all q4
    int rot;                   // rotary dims (even, <= head_dim; dims past it pass through); <= 0: head_dim
    // The head as a linear of layout head_type (SC_LIN_*), vocab rows, where there is no table; NULL: neither, and
    // the final normed hidden state is the output.
    int head_type;
    const void* const* head;  // [3]: (weights, scales, bias or NULL)
} Model;

// What sc_step_layers adds to a Model (native.StepLayers mirrors it; checked as Model is): what differs per layer,
// and Gemma 2 / 3's extras. NULL pointers: as Model says for every layer / no such norm.
#define SC_ACT_SILU 0       // the MLP's act(gate) * up: SiLU (Llama, Qwen, Phi-3)
#define SC_ACT_GELU_TANH 1  // transformers' gelu_pytorch_tanh (Gemma)
typedef struct {
    const float* inv_freq;       // [L][rot/2]: each layer's RoPE (Gemma 3: local base 10k, global its own + scaling)
    const float* rope_scale;     // [L]: each layer's cos/sin multiplier
    const float* scaling;        // [L]: each layer's softmax scale of q.k (Gemma: query_pre_attn_scalar^-0.5)
    const float* norm_attn_out;  // [L][C]: RMSNorm of the attention output before its residual add (Gemma)
    const float* norm_mlp_out;   // [L][C]: the same for the MLP's output (Model.norm_post: the MLP's input norm)
    float softcap;               // attention scores s -> softcap * tanh(s / softcap) before the softmax; 0: none
    int act;                     // SC_ACT_*
} sc_layers;

// ---- caller-owned work buffers --------------------------------------------------------------------------------
// An arena over the caller's buffer: takes 64-byte-aligned pieces, never frees. `sc_measure()` starts one that
// only counts (at an address that is 1 mod 64, the worst case for the first alignment), so each work-size
// function runs the very carving code its kernel runs and the two cannot disagree.
typedef struct {
    uintptr_t at, end;
} sc_arena;

static inline sc_arena sc_arena_of(void* p, size_t n) { return (sc_arena){(uintptr_t)p, (uintptr_t)p + n}; }
static inline sc_arena sc_measure(void) { return (sc_arena){1, UINTPTR_MAX}; }
static inline size_t sc_measured(const sc_arena* a) { return (size_t)(a->at - 1); }

static inline void* sc_take(sc_arena* a, size_t n) {
    uintptr_t p = (a->at + 63) & ~(uintptr_t)63;
    if (p < a->at || p > a->end || n > a->end - p) return NULL;
    a->at = p + n;
    return (void*)p;
}

// The arena an exported kernel works in: over the caller's buffer (SC_EWORK when it is under `need`), or, with
// work NULL (C callers that keep no buffer), over one allocated here (SC_ENOMEM if that fails): free *own after.
static inline int sc_work_open(void* work, size_t size, size_t need, sc_arena* a, void** own) {
    *own = NULL;
    if (!work) {
        work = *own = malloc(need);
        size = need;
        if (!work) return SC_ENOMEM;
    }
    if (size < need) return SC_EWORK;
    *a = sc_arena_of(work, size);
    return SC_OK;
}

// The int8 activations every matmul makes first (every variant): xq [M][K], per 32 values the scale dx and
// sx = dx * sum(xq) ([M][K/32] each), and q8_matmul's per-row correction corr [M].
typedef struct {
    int8_t* xq;
    float *dx, *sx, *corr;
} sc_xq;

// q8g / q8k also read, per 16 of them (c16, sx16 [M][K/16]), 128 x their integer sum (the +128 storage offset's
// correction) and dx x their sum (the m term).
typedef struct {
    int32_t* c16;
    float* sx16;
} sc_x16;

// One input's activations, quantized once (by one thread, before a job splits) for every linear that reads it.
typedef struct {
    int M, K;
    sc_xq x;
    sc_x16 h;  // NULLs unless made (SC_ACT_16)
} sc_act;

#define SC_ACT_16 1  // make the per-16 sums too (a q8g or q8k linear reads this input)

static inline int sc_take_act(sc_arena* a, int M, int K, int what, sc_act* x) {
    size_t nb = (size_t)M * (K / QB), nh = (size_t)M * (K / 16);
    x->M = M, x->K = K;
    x->x.xq = sc_take(a, (size_t)M * K);
    x->x.dx = sc_take(a, sizeof(float) * nb);
    x->x.sx = sc_take(a, sizeof(float) * nb);
    x->x.corr = sc_take(a, sizeof(float) * (size_t)M);
    x->h.c16 = what & SC_ACT_16 ? sc_take(a, sizeof(int32_t) * nh) : NULL;
    x->h.sx16 = what & SC_ACT_16 ? sc_take(a, sizeof(float) * nh) : NULL;
    int ok = x->x.xq && x->x.dx && x->x.sx && x->x.corr && (!(what & SC_ACT_16) || (x->h.c16 && x->h.sx16));
    return ok ? SC_OK : SC_EWORK;
}

// The per-16 sums from the quantized rows (shared, so every variant rounds sx16 alike: one product).
static inline void sc_q8g_sums(const sc_xq* x, int M, int K, sc_x16* h) {
    int nh = K / 16;
    for (int m = 0; m < M; m++)
        for (int j = 0; j < nh; j++) {
            const int8_t* p = x->xq + (size_t)m * K + 16 * j;
            int32_t s = 0;
            for (int i = 0; i < 16; i++) s += p[i];
            h->c16[(size_t)m * nh + j] = 128 * s;
            h->sx16[(size_t)m * nh + j] = x->dx[(size_t)m * (K / QB) + j / 2] * (float)s;
        }
}

// ---- the worker pool (pool.c) and the linears on it (linear.c) ------------------------------------------------
// A task computes items [lo, hi) of a job as thread `slot` (0: the caller; < the job's slots): per-thread scratch is
// the slot's piece of the caller's work buffer.
typedef void (*sc_task)(void* ctx, int lo, int hi, int slot);
// Run fn over [0, n) on up to `slots` threads of the pool, in contiguous chunks, and return when all are done.
// `bytes` is the memory the job touches: a job under the pool's grain runs on the caller alone (a wake-up costs
// more than it saves).
void sc_parallel(sc_task fn, void* ctx, int n, int slots, size_t bytes);
// The break-even, measured (q4, one row, the other core idle, workers polling): 80 KB of weights 2.3 us alone against
// 2.4 on two threads; 207 KB 4.0 against 3.6; 640 KB 10.7 / 7.4; 1.3 MB 39.8 / 24.4; 5.1 MB 160 / 82.
#define SC_GRAIN (128 * 1024)

#define SC_LIN_TABLE 4  // the int8 token table (q8_matmul): w sc_q8_block*, s the fp32 per-row scale, no bias
// One linear: y [M][N] = x @ W^T (+ bias), W in layout `type` (SC_LIN_*): w its blocks, s its scales.
typedef struct {
    int type, N;
    const void *w, *s;
    const float* bias;
    float* y;
} sc_lin;

#define SC_MB 256  // q4 / q4k prefill: rows per pass (their accumulators, 16 KB, stay in L1)
#define SC_MB8 128 // q8g / q8k prefill: rows per pass (2 x 16 floats each: 16 KB, in L1)
#define SC_ACC (RG * SC_MB)  // floats of one thread's prefill accumulators, any layout
_Static_assert(SC_ACC == 2 * RG * SC_MB8 && SC_ACC * sizeof(float) % 64 == 0, "one accumulator size, 64-byte pieces");

static inline int sc_lin_8bit(int type) {  // the layouts on the 8-bit loops (q6k, q5k: q8k's; q80, q50, q51: q8g's)
    return type == SC_LIN_Q8G || type == SC_LIN_Q8K || type == SC_LIN_Q6K || type == SC_LIN_Q80 || type == SC_LIN_Q50 ||
           type == SC_LIN_Q51 || type == SC_LIN_Q5K;
}
static inline int sc_lin_pass(int type) {  // rows per prefill pass (the table keeps no accumulators: all rows)
    return sc_lin_8bit(type) ? SC_MB8 : type == SC_LIN_TABLE ? 1 << 30 : SC_MB;
}
static inline int sc_lin_act(int type) {  // the 8-bit loops read the per-16 sums too
    return sc_lin_8bit(type) ? SC_ACT_16 : 0;
}

// Quantize x [M][K] into a (and the sums `what` asks for).
void sc_act_fill(const float* x, sc_act* a, int what);
// Work bytes of one linear of `type` over M rows of K, on up to `slots` threads (linear.c; the sc_*_work exports).
size_t sc_lin_work(int type, int M, int K, int slots);
// y of one linear on x [M][K]: quantize, then the job over its row groups (and prefill passes); scratch from `a`,
// which also says how many threads' accumulators fit (SC_EWORK if not one).
int sc_lin_mm(sc_arena* a, const sc_lin* l, const float* x, int M, int K);
// The nl linears that read one input (the decode step's q, k, v), one job over all their row groups.
void sc_lins_run(const sc_lin* l, int nl, const sc_act* a, float* acc, int slots);
// The output head as a linear writing logits to out (Model.table, else Model.head): 0 where the model has none;
// sc_head_bad: a head whose vocab is no whole number of row groups (sc_step / sc_prefill refuse it: SC_EARG).
int sc_head_of(const Model* m, float* out, sc_lin* l);
static inline int sc_head_bad(const Model* m) { return (m->table || m->head) && (m->vocab < RG || m->vocab % RG); }

// ---- the exported functions, each signature once: prototypes below, sc_signature's table in api.c ------------
// X(return type, name, argument types...). native.py's declarations must give the same codes (sc_signature).
#define SC_EXPORTS(X)                                                                                                  \
    X(size_t, sc_q4_work, int, int, int)                                                                               \
    X(size_t, sc_q8_work, int, int, int)                                                                               \
    X(size_t, sc_q8g_work, int, int, int)                                                                              \
    X(size_t, sc_q4k_work, int, int, int)                                                                              \
    X(size_t, sc_q8k_work, int, int, int)                                                                              \
    X(size_t, sc_q40_work, int, int, int)                                                                              \
    X(size_t, sc_q6k_work, int, int, int)                                                                              \
    X(size_t, sc_q80_work, int, int, int)                                                                              \
    X(size_t, sc_q50_work, int, int, int)                                                                              \
    X(size_t, sc_q51_work, int, int, int)                                                                              \
    X(size_t, sc_q5k_work, int, int, int)                                                                              \
    X(int, sc_set_threads, int)                                                                                        \
    X(long, sc_set_grain, long)                                                                                        \
    X(int, sc_set_deal, int)                                                                                           \
    X(size_t, sc_step_work, const Model*, int)                                                                         \
    X(int, sc_quant, const float*, int, int, int8_t*, float*, float*)                                                  \
    X(int, q4_matmul, const float*, int, int, int, const sc_q4_block*, const sc_q4_scales*, const float*, float*,      \
      void*, size_t)                                                                                                   \
    X(int, q8_matmul, const float*, int, int, int, const sc_q8_block*, const float*, float*, void*, size_t)            \
    X(int, q8g_matmul, const float*, int, int, int, const sc_q8_block*, const sc_q8g_scales*, const float*, float*,    \
      void*, size_t)                                                                                                   \
    X(int, q4k_matmul, const float*, int, int, int, const sc_q4_block*, const sc_q4k_scales*, const float*, float*,    \
      void*, size_t)                                                                                                   \
    X(int, q8k_matmul, const float*, int, int, int, const sc_q8_block*, const sc_q8k_scales*, const float*, float*,    \
      void*, size_t)                                                                                                   \
    X(int, q40_matmul, const float*, int, int, int, const sc_q4_block*, const sc_q40_scales*, const float*, float*,    \
      void*, size_t)                                                                                                   \
    X(int, q6k_matmul, const float*, int, int, int, const sc_q6k_block*, const sc_q6k_scales*, const float*, float*,  \
      void*, size_t)                                                                                                   \
    X(int, q80_matmul, const float*, int, int, int, const sc_q8_block*, const sc_q80_scales*, const float*, float*,    \
      void*, size_t)                                                                                                   \
    X(int, q50_matmul, const float*, int, int, int, const sc_q5_block*, const sc_q80_scales*, const float*, float*,    \
      void*, size_t)                                                                                                   \
    X(int, q51_matmul, const float*, int, int, int, const sc_q5_block*, const sc_q4_scales*, const float*, float*,     \
      void*, size_t)                                                                                                   \
    X(int, q5k_matmul, const float*, int, int, int, const sc_q5_block*, const sc_q4k_scales*, const float*, float*,    \
      void*, size_t)                                                                                                   \
    X(int, sc_attend, const Model*, const float*, const void*, const void*, int, int, int, float*, float*, float*)     \
    X(int, sc_step, const Model*, const float*, int, int, void* const*, void* const*, int, float*, float*, float*,     \
      void*, size_t)                                                                                                   \
    X(int, kv_evict, void*, void*, int, int, int, int, int, int, const float*, const float*, int, int)            \
    X(int, sc_step_layers, const Model*, const sc_layers*, const float*, int, int, void* const*, void* const*,        \
      const int*, const int*, float*, float*, float*, void*, size_t)                                                 \
    X(int, sc_silu, float*, const float*, size_t)                                                                      \
    X(size_t, sc_prefill_work, const Model*, int, int)                                                                 \
    X(int, sc_prefill, const Model*, const float*, int, int, int, int, void* const*, void* const*, int, float*,       \
      float*, void*, size_t)

#define SC_PROTO(ret, name, ...) SC_API ret name(__VA_ARGS__);
SC_EXPORTS(SC_PROTO)
// The handshake, outside the table (its own shape is what SC_ABI_VERSION promises).
SC_API int sc_abi(void);
SC_API int sc_variant(void);                     // SC_VARIANT_*
SC_API long sc_sizeof(const char* type);         // "Model", "sc_q4_block", ...; -1: unknown
SC_API long sc_offsetof(const char* field);      // a Model field, or "sc_layers." + one of its; -1: unknown
SC_API const char* sc_signature(const char* fn);  // e.g. "i(piiipppppz)"; NULL: not exported
// The pool's size (threads with the caller; 1: none): no arguments, so outside the table as the handshake is.
SC_API int sc_threads(void);

#define SC_VARIANT_REF 0
#define SC_VARIANT_AVX512 1  // matmul.c, matmul_k.c, attend.c (-march=native)
#define SC_VARIANT_AVX2 2    // matmul256.c, matmul256_k.c, attend256.c (-mavx2 -mfma -mf16c)
#define SC_VARIANT_AVXVNNI 3 // the same sources with -mavxvnni: vpdpbusd on 256 bits
#define SC_VARIANT_NEON 4    // matmul_neon.c, matmul_neon_k.c, attend_neon.c (-march=armv8.2-a+dotprod)

// ---- what each variant implements (matmul.c + attend.c, or ref.c); hidden, called by step.c and api.c -------
extern const int sc_variant_id;
// x [M][K] -> int8 per 32 values into q (see matmul.c: quant_row for the rounding).
void sc_quant_rows(const float* x, int M, int K, int8_t* xq, float* dx, float* sx);
// Output row groups [g0, g1) of one linear for activation rows [m0, m0 + mn): when a->M == 1 the one-row (decode)
// path, else one prefill pass (mn <= sc_lin_pass(type)) with acc this thread's SC_ACC floats. Every output element
// is computed by the same operations whatever the range, so a split of the groups or passes changes no bit.
// sc_lin_run (linear.c, every build) calls the variant's function for l->type, one per layout. Their arithmetic per
// lane, one step for all four: per 32-block b (q4, q4k), or per half block h of it (q8g, q8k: an accumulator per half,
// summed last), acc = fmaf(isum, ds*dx, acc), then acc = fmaf(mt, sx, acc), isum the exact integer dot (q8: less
// 128 * the block's sum, the +128 storage) and sx the half's sum (sx16). q4, q8g: ds = d, mt = m (fp16). K-quants
// (sub-block j of super-block b / 8): ds = d*sc_j, mt = -(dmin*mn_j), in fp32 and exact, so the second step is one
// rounding of acc - dmin*mn_j*sx (the AVX-512 prefill leaves it out where dmin is 0 throughout a row group: the same
// bits). The table: acc = fmaf(isum, dx, acc), y = (acc - corr) * scale.
typedef void sc_run_fn(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc);
sc_run_fn sc_lin_run, sc_q4_run, sc_q8g_run, sc_q4k_run, sc_q8k_run, sc_q40_run, sc_table_run;
sc_run_fn sc_q6k_run;  // q6k: q8k's 8-bit loop over bytes rebuilt from the nibbles and bit-planes
sc_run_fn sc_q80_run;  // q80: q8g's 8-bit loop with one d per block and no m
sc_run_fn sc_q50_run, sc_q51_run, sc_q5k_run;  // q5 blocks rebuilt into q8g's (q50, q51) and q8k's (q5k) loops
// Rotate-half RoPE of one row k [D] by cos/sin [rot] into o (o may be k); dims past rot are copied.
void sc_rot_row(const float* k, float* o, const float* cs, const float* sn, int rot, int D);
// Softmax attention of one query head qh [D] over n rows of Kh / Vh [n][D] (fp32, or bf16 when bf): the
// probabilities into sc [n], the output into o [D].
void sc_head_attend(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float* sc, float* o,
                    int D);
// The same with the scores soft-capped before the softmax (softcap > 0: s -> softcap * tanh(s / softcap), by
// sc_softcap, so every variant rounds it alike; 0: sc_head_attend, which step.c defines over it for every build).
void sc_head_attend_cap(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float softcap,
                        float* sc, float* o, int D);
// Softmax attention of nq queries over one K/V head (the prefill's tiles: a kv head's query heads of a few rows):
// query i is qs[i] [D] over slots 0..ns[i]-1 of Kh / Vh [cap][D], its probabilities into sc + i * stride, its output
// into outs[i] [D]; each bit-identical to sc_head_attend_cap on that query alone. The SIMD builds convert the K (then
// V) rows once per SC_KVB slots into `kv` (sc_tile_floats(D, nq) floats) and run every query of the tile over them
// in L1 (an fp32 cache is read in place); other head dims than 64 / 128 go a query at a time.
void sc_heads_attend(const float* const* qs, const int* ns, int nq, const void* Kh, const void* Vh, int bf, float scale,
                     float softcap, float* sc, size_t stride, float* const* outs, int D, float* kv);
#define SC_KVB 32   // slots per block of sc_heads_attend (a bf16 block of D = 128 converted: 16 KB, in L1)
#define SC_TILE 32  // queries per prefill attention tile (more when one kv head has more query heads)
_Static_assert(SC_KVB % 16 == 0, "no query's 16-slot score group or P.V pair spans two blocks");
static inline size_t sc_tile_floats(int D, int nq) { return (size_t)SC_KVB * D + 2 * (size_t)nq * D; }
static inline void sc_softcap(float* sc, int n, float cap) {  // as transformers: tanh(s / cap) * cap
    for (int s = 0; s < n; s++) sc[s] = tanhf(sc[s] / cap) * cap;
}
// e^x in plain float operations, rounded alike in every build (the reference at -O2, the SIMD ones vectorizing it):
// Cephes' expf (x = n ln2 + r, |r| <= ln2/2, degree-7 polynomial, 2^n from exponent bits), the SiLU within 1.8e-7 of
// fp64 (tests/test_silu.py). libm's expf is a call per element, and its overflow path alone took 1.6% of a 1B prefill
// whose gates reach -100 (silu + expf: 5.4% -> 0.7%). SiLU use only: below -86 it returns e^-86 (1 + e^x is 1
// there), above 88 infinity (g / inf is the -0 torch gives).
static inline float sc_exp(float x) {
    float c = x < -86.0f ? -86.0f : x > 88.0f ? 88.0f : x;
    float t = c * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23 + round(c / ln 2): n in the low mantissa bits
    float n = t - 12582912.0f;
    float r = c - n * 0.693359375f;  // ln 2 in two parts: n * 0.693359375 is exact for |n| < 2^14
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * (r * r) + r + 1.0f;
    uint32_t tb, k;
    memcpy(&tb, &t, 4);
    k = (tb - 0x4B400000u + 126u) << 23;  // 2^(n-1): n = 128 would not fit the exponent (unsigned: no UB, NaN too)
    float s;
    memcpy(&s, &k, 4);
    e = e * s * 2.0f;
    return x > 88.0f ? INFINITY : e;
}
// g[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u for n elements: the decode step's and the prefill's one code.
static inline void sc_silu_mul(float* g, const float* u, size_t n) {
    for (size_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + sc_exp(-g[i])) * u[i];
}
void sc_put_bf16(uint16_t* p, const float* src, int D);  // round to nearest even, as torch; NaN stays NaN
void sc_get_bf16(float* dst, const uint16_t* p, int D);

// The scalar rotate-half of lanes [from, rot/2) of one row, then the copy of dims past rot (o may be k): the whole of
// the reference's sc_rot_row, and the SIMD one's tail, so both round the same way (fmaf over one rounded product).
static inline void sc_rot_lanes(const float* k, float* o, const float* cs, const float* sn, int from, int rot, int D) {
    int h = rot / 2;
    for (int i = from; i < h; i++) {
        float a = k[i], b = k[i + h];
        o[i] = fmaf(a, cs[i], -(b * sn[i]));
        o[i + h] = fmaf(b, cs[i + h], a * sn[i + h]);
    }
    if (o != k)
        for (int j = rot; j < D; j++) o[j] = k[j];
}

static inline uint16_t sc_to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float sc_from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// The q8 table's +128 offset per row, 128 * sum of sx (= dx * sum(xq)): shared, so every variant rounds it alike.
static inline void sc_q8_corr(const float* sx, int M, int nb, float* corr) {
    for (int m = 0; m < M; m++) {
        float c = 0;
        for (int b = 0; b < nb; b++) c += sx[(size_t)m * nb + b];
        corr[m] = 128.0f * c;
    }
}
