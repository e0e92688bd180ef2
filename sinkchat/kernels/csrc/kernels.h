// The C side of sinkchat's kernels as the binding (sinkchat/kernels/native.py) sees it: the ABI version, the typed
// weight layouts, the decode step's Model, the caller-owned work buffers, the exported functions (with their
// signatures spelled once, here, so the binding can check its ctypes declarations against them at load), and the
// internal interface that each variant implements.
//
// Two builds link the same shared code (step.c, api.c) to one variant each: the SIMD one (matmul.c, attend.c:
// AVX-512 VNNI, built with -march=native) and the scalar reference (ref.c: plain C, built with no -march flag, so
// it runs on any CPU). No intrinsics in this header: the reference build includes it on any architecture.
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Bump on any change to an exported signature, the Model struct or a layout: the binding refuses another number.
#define SC_ABI_VERSION 2

#define QB 32  // weights per quant block
#define RG 16  // rows per group: one 512-bit lane per row

#define SC_API __attribute__((visibility("default")))  // everything else is hidden (-fvisibility=hidden)

// Return codes of the exported kernels.
#define SC_OK 0
#define SC_ENOMEM (-1)  // no work buffer was given and allocating one failed
#define SC_EWORK (-2)   // the work buffer given is smaller than the sc_*_work function says

// ---- typed layouts (ggml style): what native.pack_q4 / pack_q8 write, one struct per 32 weights x 16 rows ------

// 4-bit weights of rows 16g..16g+15, columns 32b..32b+31: q[s][r][t] holds w[r, 32b+8s+t] in its low nibble and
// w[r, 32b+8s+4+t] in its high one. A row group is [K/32] of these (qw [N/16][K/32]).
typedef struct {
    uint8_t q[4][RG][4];
} sc_q4_block;
// Their fp16 scales: w = d[r]*q + m[r] (sw [N/16][K/32], parallel to qw).
typedef struct {
    uint16_t d[RG], m[RG];
} sc_q4_scales;
// 8-bit table rows 16g..16g+15, columns 32b..32b+31, stored q+128: q[s][r][t] is w[r, 32b+4s+t] (hw [N/16][K/32]).
typedef struct {
    uint8_t q[QB / 4][RG][4];
} sc_q8_block;

_Static_assert(sizeof(sc_q4_block) == QB * RG / 2, "q4 block: 16 rows x 32 nibbles, no padding");
_Static_assert(sizeof(sc_q4_scales) == 2 * RG * sizeof(uint16_t), "q4 scales: 16 fp16 d then 16 fp16 m");
_Static_assert(sizeof(sc_q8_block) == QB * RG, "q8 block: 16 rows x 32 bytes, no padding");
_Static_assert(sizeof(sc_q4_block) % 64 == 0 && sizeof(sc_q8_block) % 64 == 0, "blocks are whole 512-bit loads");

// ---- the decode step's model (native.StepModel mirrors it; the binding checks its size and every offset) -----
typedef struct {
    int n_layers, dim, n_heads, n_kv, head_dim, inter, vocab, kv_bf16;  // vocab: padded to 16
    float eps, scaling, rope_scale;
    const float* inv_freq;     // [D/2]
    const float* norm_in;      // [L][C]
    const float* norm_post;    // [L][C]
    const float* norm_final;   // [C]
    const void* const* lin;    // [L][7][3]: (sc_q4_block*, sc_q4_scales*, bias or NULL) for q, k, v, o, gate, up, down
    const sc_q8_block* table;  // the tied token table (q8_matmul's hw), or NULL: no head here
    const float* table_scale;  // [V]
} Model;

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

// The int8 activations every matmul makes first (both variants): xq [M][K], per 32 values the scale dx and
// sx = dx * sum(xq) ([M][K/32] each), and q8_matmul's per-row correction corr [M].
typedef struct {
    int8_t* xq;
    float *dx, *sx, *corr;
} sc_xq;

static inline int sc_take_xq(sc_arena* a, int M, int K, sc_xq* x) {
    size_t nb = (size_t)M * (K / QB);
    x->xq = sc_take(a, (size_t)M * K);
    x->dx = sc_take(a, sizeof(float) * nb);
    x->sx = sc_take(a, sizeof(float) * nb);
    x->corr = sc_take(a, sizeof(float) * (size_t)M);
    return x->xq && x->dx && x->sx && x->corr ? SC_OK : SC_EWORK;
}

#define SC_MB 256  // q4 prefill: rows per pass (their accumulators, 16 KB, stay in L1)

// q4_matmul's scratch: the int8 activations, and for M > 1 (prefill) SC_MB accumulators of 16 floats.
static inline int sc_take_q4(sc_arena* a, int M, int K, sc_xq* x, float** acc) {
    if (sc_take_xq(a, M, K, x)) return SC_EWORK;
    *acc = M > 1 ? sc_take(a, sizeof(float) * RG * SC_MB) : NULL;
    return M > 1 && !*acc ? SC_EWORK : SC_OK;
}

// ---- the exported functions, each signature once: prototypes below, sc_signature's table in api.c ------------
// X(return type, name, argument types...). native.py's declarations must give the same codes (sc_signature).
#define SC_EXPORTS(X)                                                                                                  \
    X(size_t, sc_q4_work, int, int)                                                                                    \
    X(size_t, sc_q8_work, int, int)                                                                                    \
    X(size_t, sc_step_work, const Model*, int)                                                                         \
    X(int, sc_quant, const float*, int, int, int8_t*, float*, float*)                                                  \
    X(int, q4_matmul, const float*, int, int, int, const sc_q4_block*, const sc_q4_scales*, const float*, float*,      \
      void*, size_t)                                                                                                   \
    X(int, q8_matmul, const float*, int, int, int, const sc_q8_block*, const float*, float*, void*, size_t)            \
    X(int, sc_attend, const Model*, const float*, const void*, const void*, int, int, int, float*, float*, float*)     \
    X(int, sc_step, const Model*, const float*, int, int, void* const*, void* const*, int, float*, float*, float*,     \
      void*, size_t)                                                                                                   \
    X(int, kv_evict, void*, void*, int, int, int, int, int, int, const float*, const float*, int, int)

#define SC_PROTO(ret, name, ...) SC_API ret name(__VA_ARGS__);
SC_EXPORTS(SC_PROTO)
// The handshake, outside the table (its own shape is what SC_ABI_VERSION promises).
SC_API int sc_abi(void);
SC_API int sc_variant(void);                     // SC_VARIANT_SIMD or SC_VARIANT_REF
SC_API long sc_sizeof(const char* type);         // "Model", "sc_q4_block", ...; -1: unknown
SC_API long sc_offsetof(const char* field);      // a Model field; -1: unknown
SC_API const char* sc_signature(const char* fn);  // e.g. "i(piiipppppz)"; NULL: not exported

#define SC_VARIANT_REF 0
#define SC_VARIANT_SIMD 1

// ---- what each variant implements (matmul.c + attend.c, or ref.c); hidden, called by step.c and api.c -------
extern const int sc_variant_id;
// x [M][K] -> int8 per 32 values into q (see matmul.c: quant_row for the rounding).
void sc_quant_rows(const float* x, int M, int K, int8_t* xq, float* dx, float* sx);
// y [M][N] = x [M][K] @ W^T (+ bias); scratch from `a` (SC_EWORK if it is short).
int sc_q4_mm(sc_arena* a, const float* x, int M, int K, int N, const sc_q4_block* qw, const sc_q4_scales* sw,
             const float* bias, float* y);
int sc_q8_mm(sc_arena* a, const float* x, int M, int K, int N, const sc_q8_block* hw, const float* ws, float* y);
// Rotate-half RoPE of one row k [D] by cos/sin [rot] into o (o may be k); dims past rot are copied.
void sc_rot_row(const float* k, float* o, const float* cs, const float* sn, int rot, int D);
// Softmax attention of one query head qh [D] over n rows of Kh / Vh [n][D] (fp32, or bf16 when bf): the
// probabilities into sc [n], the output into o [D].
void sc_head_attend(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float* sc, float* o,
                    int D);
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

// The q8 table's +128 offset, per row: 128 * sum over blocks of sx (= dx * sum(xq)). Shared so both variants
// round it alike.
static inline void sc_q8_corr(const float* sx, int M, int nb, float* corr) {
    for (int m = 0; m < M; m++) {
        float c = 0;
        for (int b = 0; b < nb; b++) c += sx[(size_t)m * nb + b];
        corr[m] = 128.0f * c;
    }
}
