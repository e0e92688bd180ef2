// The scalar reference of every variant function in kernels.h, in plain C: built with no -march flag (so on any
// CPU), selected at run time by loading its library (native.py: SINKCHAT_KERNELS=ref, native.use("ref")).
//
// Every SIMD variant (avx512, avxvnni, avx2, neon) is held to it by the tests. Where the arithmetic is the same it is the
// same operations in the same order, so the results agree bit for bit: integer dot products are exact in any
// order, and each float step below is one the vector code does per lane (fmaf where it fuses, one rounded product
// where it multiplies first; every build uses -ffp-contract=off, so the compiler fuses nothing on its own). The
// attention sums in plain order instead of the SIMD one (and expf for its polynomial), so it agrees to float
// rounding only (the SIMD variants' attention is one order, the avx512 one's, bit for bit).
#include "kernels.h"

const int sc_variant_id = SC_VARIANT_REF;

static float h2f(uint16_t h) {  // fp16 -> fp32, exact (as vcvtph2ps)
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, f = h & 0x3ff, u;
    if (e == 0x1f) {
        u = sign | 0x7f800000 | (f << 13);
    } else if (e) {
        u = sign | ((e + 112) << 23) | (f << 13);
    } else {
        float v = (float)f * 0x1p-24f;  // zero or subnormal: exact in fp32
        return sign ? -v : v;
    }
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static int32_t cvt_rne(float p) {  // as vcvtps2dq: round to nearest even, NaN / out of range -> INT32_MIN
    if (!(fabsf(p) < 2147483648.0f)) return INT32_MIN;
    return (int32_t)nearbyintf(p);
}

// One row to int8 per 32 values; see matmul.c: quant_row for why sx sums the rounded values.
static void quant_row(const float* x, int K, int8_t* xq, float* dx, float* sx) {
    for (int b = 0; b < K / QB; b++) {
        const float* xb = x + b * QB;
        float amax = 0;
        for (int i = 0; i < QB; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        float d = amax / 127.0f;
        float id = d > 0 ? 1.0f / d : 0.0f;
        uint32_t sum = 0;  // of the unsaturated values, wrapping, as the vector reduction
        for (int i = 0; i < QB; i++) {
            int32_t q = cvt_rne(xb[i] * id);
            sum += (uint32_t)q;
            xq[b * QB + i] = (int8_t)(q > 127 ? 127 : q < -128 ? -128 : q);
        }
        dx[b] = d;
        sx[b] = d * (float)(int32_t)sum;
    }
}

void sc_quant_rows(const float* x, int M, int K, int8_t* xq, float* dx, float* sx) {
    int nb = K / QB;
    for (int m = 0; m < M; m++)
        quant_row(x + (size_t)m * K, K, xq + (size_t)m * K, dx + (size_t)m * nb, sx + (size_t)m * nb);
}

// Row r of a q4 block times the 32 int8 values xb: w[r, 8s+t] is the low nibble of q[s][r][t], w[r, 8s+4+t] the
// high one.
static int32_t q4_dot(const sc_q4_block* wb, int r, const int8_t* xb) {
    int32_t isum = 0;
    for (int s = 0; s < 4; s++)
        for (int t = 0; t < 4; t++) {
            uint8_t v = wb->q[s][r][t];
            isum += (v & 15) * xb[8 * s + t] + (v >> 4) * xb[8 * s + 4 + t];
        }
    return isum;
}

// Every loop below computes the outputs of row groups [g0, g1) for activation rows [m0, m0 + mn) (kernels.h:
// sc_lin_run), each element by itself, so any split of the rows or groups gives the same bits. A layout is its
// family's loop (4-bit nibbles: q4, q4k; 8-bit bytes: q8g, q8k, q6k) plus its scale-forming step, as in the SIMD builds
// (rows512.h): ds and mt of row r for block b (q8: its half h), whose per-lane step is acc = fmaf(isum, ds*dx, acc),
// then acc = fmaf(mt, sx, acc).
typedef void (*q4_scales_fn)(const void* sw, int nb, int g, int b, int r, float* ds, float* mt);
typedef void (*q8_scales_fn)(const void* sw, int nb, int g, int b, int h, int r, float* ds, float* mt);

static inline __attribute__((always_inline)) void q4_family(const sc_lin* l, const sc_act* a, int m0, int mn, int g0,
                                                            int g1, q4_scales_fn scales) {
    const sc_q4_block* qw = l->w;
    int K = a->K, nb = K / QB;
    for (int m = m0; m < m0 + mn; m++)
        for (int n = g0 * RG; n < g1 * RG; n++) {
            int g = n / RG, r = n % RG;
            float acc = 0;
            for (int b = 0; b < nb; b++) {
                size_t at = (size_t)m * nb + b;
                float ds, mt, isum = (float)q4_dot(qw + (size_t)g * nb + b, r, a->x.xq + (size_t)m * K + b * QB);
                scales(l->s, nb, g, b, r, &ds, &mt);
                acc = fmaf(isum, ds * a->x.dx[at], acc);  // d*q*x: one product, one fused add
                acc = fmaf(mt, a->x.sx[at], acc);          // m*sum(x)
            }
            l->y[(size_t)m * l->N + n] = l->bias ? acc + l->bias[n] : acc;
        }
}

// The 8-bit family's weight-unpack step (rows512.h: q8_load_fn): q + 128 of w[r, 32b + 4s + t] of block blk (g*K/32
// + b). q8g / q8k store that byte; q6k rebuilds it from its nibble (sub-block s is nibble tile s / 2, low half for
// even s) and its 2 high bits (bits 2(s % 4) of plane s / 4): u = q + 32, and q + 128 = u + 96 (the SIMD builds dot
// u itself and take 32, not 128, x the sum of x off: the same exact isum).
typedef int (*q8_byte_fn)(const void* hw, size_t blk, int s, int r, int t);
static inline int q8_byte(const void* hw, size_t blk, int s, int r, int t) {
    return ((const sc_q8_block*)hw)[blk].q[s][r][t];
}
static inline int q6k_byte(const void* hw, size_t blk, int s, int r, int t) {
    const sc_q6k_block* wb = (const sc_q6k_block*)hw + blk;
    int v = wb->q[s / 2][r][t], lo = s % 2 ? v >> 4 : v & 15;
    int hi = (wb->h[s / 4][r][t] >> (2 * (s % 4))) & 3;
    return (lo | hi << 4) + 96;
}

// q5 blocks: u = nibble (tile s / 2, low half for even s) | bit s of the plane << 4; q50's q + 128 is u + 112 (q =
// u - 16), q51's and q5k's u + 128 (q = u).
static inline int q5_u(const void* hw, size_t blk, int s, int r, int t) {
    const sc_q5_block* wb = (const sc_q5_block*)hw + blk;
    int v = wb->q[s / 2][r][t], lo = s % 2 ? v >> 4 : v & 15;
    return lo | ((wb->h[r][t] >> s) & 1) << 4;
}
static inline int q50_byte(const void* hw, size_t blk, int s, int r, int t) { return q5_u(hw, blk, s, r, t) + 112; }
static inline int q51_byte(const void* hw, size_t blk, int s, int r, int t) { return q5_u(hw, blk, s, r, t) + 128; }

// Row r of half h (sub-blocks 4h..4h+3) of block blk times the 16 int8 values they meet: sum of (q + 128) * x.
static inline int32_t q8_half_dot(q8_byte_fn byte, const void* hw, size_t blk, int r, int h, const int8_t* xb) {
    int32_t isum = 0;
    for (int s = 4 * h; s < 4 * h + 4; s++)
        for (int t = 0; t < 4; t++) isum += byte(hw, blk, s, r, t) * xb[4 * s + t];
    return isum;
}

// The 8-bit bytes by lanes as rows512.h's q8_half: per half block, the exact integer dot (the +128 taken off with
// c16), then the step into that half's accumulator; the two halves' accumulators are added last.
static inline __attribute__((always_inline)) void q8_family(const sc_lin* l, const sc_act* a, int m0, int mn, int g0,
                                                            int g1, q8_byte_fn byte, q8_scales_fn scales) {
    const void* hw = l->w;
    int K = a->K, nb = K / QB, nh = K / 16;
    for (int m = m0; m < m0 + mn; m++)
        for (int n = g0 * RG; n < g1 * RG; n++) {
            int g = n / RG, r = n % RG;
            float acc[2] = {0, 0};
            for (int b = 0; b < nb; b++) {
                float dx = a->x.dx[(size_t)m * nb + b];
                for (int h = 0; h < 2; h++) {
                    size_t at = (size_t)m * nh + 2 * b + h;
                    int32_t isum = q8_half_dot(byte, hw, (size_t)g * nb + b, r, h, a->x.xq + (size_t)m * K + b * QB);
                    float ds, mt;
                    scales(l->s, nb, g, b, h, r, &ds, &mt);
                    acc[h] = fmaf((float)(isum - a->h.c16[at]), ds * dx, acc[h]);
                    acc[h] = fmaf(mt, a->h.sx16[at], acc[h]);
                }
            }
            float v = acc[0] + acc[1];
            l->y[(size_t)m * l->N + n] = l->bias ? v + l->bias[n] : v;
        }
}

static void q8_table_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1) {
    const sc_q8_block* hw = l->w;
    const float* ws = l->s;
    int K = a->K, nb = K / QB;
    for (int m = m0; m < m0 + mn; m++)
        for (int n = g0 * RG; n < g1 * RG; n++) {
            int g = n / RG, r = n % RG;
            float acc = 0;
            for (int b = 0; b < nb; b++) {
                const sc_q8_block* wb = hw + (size_t)g * nb + b;
                const int8_t* xb = a->x.xq + (size_t)m * K + b * QB;
                int32_t isum = 0;  // (w + 128) * x; the +128 comes off with corr
                for (int s = 0; s < QB / 4; s++)
                    for (int t = 0; t < 4; t++) isum += wb->q[s][r][t] * xb[4 * s + t];
                acc = fmaf((float)isum, a->x.dx[(size_t)m * nb + b], acc);
            }
            l->y[(size_t)m * l->N + n] = (acc - a->x.corr[m]) * ws[n];
        }
}

// ---- the scale-forming steps ----------------------------------------------------------------------------------------
// q4: fp16 d and m per block of 32; q8g: per half block of 16.
static inline void q4_scales(const void* sw, int nb, int g, int b, int r, float* ds, float* mt) {
    const sc_q4_scales* s = (const sc_q4_scales*)sw + (size_t)g * nb + b;
    *ds = h2f(s->d[r]), *mt = h2f(s->m[r]);
}

// q40: Q4_0's one fp16 d per block of 32; its m, -8*d, formed in fp32: exact (a power-of-two multiple), the value q4
// held as an fp16 m for the same tensor, so the same bits as q4 there.
static inline void q40_scales(const void* sw, int nb, int g, int b, int r, float* ds, float* mt) {
    const sc_q40_scales* s = (const sc_q40_scales*)sw + (size_t)g * nb + b;
    *ds = h2f(s->d[r]), *mt = -8.0f * *ds;
}

static inline void q8g_scales(const void* sw, int nb, int g, int b, int h, int r, float* ds, float* mt) {
    const sc_q8g_scales* s = (const sc_q8g_scales*)sw + (size_t)g * nb + b;
    *ds = h2f(s->d[h][r]), *mt = h2f(s->m[h][r]);
}

// q80: Q8_0's one fp16 d per block of 32 for both halves, m +0: q8g's values for a Q8_0 tensor, so its bits.
static inline void q80_scales(const void* sw, int nb, int g, int b, int h, int r, float* ds, float* mt) {
    const sc_q80_scales* s = (const sc_q80_scales*)sw + (size_t)g * nb + b;
    (void)h, *ds = h2f(s->d[r]), *mt = 0.0f;
}

// q51: Q5_1's fp16 d and m per block of 32 for both halves (sc_q4_scales): q8g's values for a Q5_1 tensor.
static inline void q51_scales(const void* sw, int nb, int g, int b, int h, int r, float* ds, float* mt) {
    const sc_q4_scales* s = (const sc_q4_scales*)sw + (size_t)g * nb + b;
    (void)h, *ds = h2f(s->d[r]), *mt = h2f(s->m[r]);
}

// The K-quants (matmul_k.c's twins): ds = d*sc and mt = -(dmin*mn) of sub-block j of super-block b / 8, products of an
// fp16 and a small integer, exact; the m step is then one rounding of acc - dmin*mn*sx (as the vector fnmadd was).
static inline float k_prod(uint16_t d, int v) { return h2f(d) * (float)v; }

static inline void q4k_scales(const void* sw, int nb, int g, int b, int r, float* ds, float* mt) {
    const sc_q4k_scales* s = (const sc_q4k_scales*)sw + (size_t)g * (nb / 8) + b / 8;
    *ds = k_prod(s->d[r], sc_q4k_v(s, b % 8, r)), *mt = -k_prod(s->dmin[r], sc_q4k_v(s, 8 + b % 8, r));
}

// q8k: half h of block b is sub-block j = 2*(b % 8) + h.
static inline void q8k_scales(const void* sw, int nb, int g, int b, int h, int r, float* ds, float* mt) {
    const sc_q8k_scales* s = (const sc_q8k_scales*)sw + (size_t)g * (nb / 8) + b / 8;
    int j = 2 * (b % 8) + h;
    *ds = k_prod(s->d[r], s->sc[j][r]), *mt = -k_prod(s->dmin[r], s->mn[j][r]);
}

// q6k: Q6_K's d and int8 scale of sub-block j = 2*(b % 8) + h; no min: mt is q8k's -(0*0) for it, -0.
static inline void q6k_scales(const void* sw, int nb, int g, int b, int h, int r, float* ds, float* mt) {
    const sc_q6k_scales* s = (const sc_q6k_scales*)sw + (size_t)g * (nb / 8) + b / 8;
    *ds = k_prod(s->d[r], s->sc[2 * (b % 8) + h][r]), *mt = -0.0f;
}

// q5k: Q5_K's sc_j, mn_j per 32 (sc_q4k_scales) for both halves of block b: q8k's values for a Q5_K tensor.
static inline void q5k_scales(const void* sw, int nb, int g, int b, int h, int r, float* ds, float* mt) {
    q4k_scales(sw, nb, g, b, r, ds, mt);
    (void)h;
}

// kernels.h: the layouts' run functions (every output's accumulator is a local here: acc unused).
void sc_q4_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q4_family(l, a, m0, mn, g0, g1, q4_scales);
}
void sc_q4k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q4_family(l, a, m0, mn, g0, g1, q4k_scales);
}
void sc_q40_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q4_family(l, a, m0, mn, g0, g1, q40_scales);
}
void sc_q8g_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q8_family(l, a, m0, mn, g0, g1, q8_byte, q8g_scales);
}
void sc_q8k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q8_family(l, a, m0, mn, g0, g1, q8_byte, q8k_scales);
}
void sc_q6k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q8_family(l, a, m0, mn, g0, g1, q6k_byte, q6k_scales);
}
void sc_q80_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q8_family(l, a, m0, mn, g0, g1, q8_byte, q80_scales);
}
void sc_q50_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q8_family(l, a, m0, mn, g0, g1, q50_byte, q80_scales);
}
void sc_q51_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q8_family(l, a, m0, mn, g0, g1, q51_byte, q51_scales);
}
void sc_q5k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q8_family(l, a, m0, mn, g0, g1, q51_byte, q5k_scales);
}
void sc_table_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc, q8_table_run(l, a, m0, mn, g0, g1);
}

void sc_rot_row(const float* k, float* o, const float* cs, const float* sn, int rot, int D) {
    sc_rot_lanes(k, o, cs, sn, 0, rot, D);
}

void sc_put_bf16(uint16_t* p, const float* src, int D) {
    for (int d = 0; d < D; d++) p[d] = sc_to_bf16(src[d]);
}

void sc_get_bf16(float* dst, const uint16_t* p, int D) {
    for (int d = 0; d < D; d++) dst[d] = sc_from_bf16(p[d]);
}

static inline float kv_at(const void* base, size_t i, int bf) {
    return bf ? sc_from_bf16(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

// Softmax attention of one head, by the definition: scores q.k * scale (soft-capped: softcap > 0), p = exp(s - max)
// / sum, o = sum p * v.
void sc_head_attend_cap(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float softcap,
                        float* sc, float* o, int D) {
    float mx = -INFINITY, sum = 0;
    for (int s = 0; s < n; s++) {
        float acc = 0;
        for (int d = 0; d < D; d++) acc += qh[d] * kv_at(Kh, (size_t)s * D + d, bf);
        sc[s] = acc * scale;
    }
    if (softcap > 0) sc_softcap(sc, n, softcap);
    for (int s = 0; s < n; s++) mx = sc[s] > mx ? sc[s] : mx;
    for (int s = 0; s < n; s++) {
        sc[s] = expf(sc[s] - mx);
        sum += sc[s];
    }
    float inv = 1.0f / sum;
    for (int s = 0; s < n; s++) sc[s] *= inv;
    for (int d = 0; d < D; d++) {
        float acc = 0;
        for (int s = 0; s < n; s++) acc += sc[s] * kv_at(Vh, (size_t)s * D + d, bf);
        o[d] = acc;
    }
}

// The reference of a tile: each query on its own.
void sc_heads_attend(const float* const* qs, const int* ns, int nq, const void* Kh, const void* Vh, int bf, float scale,
                     float softcap, float* sc, size_t stride, float* const* outs, int D, float* kv) {
    (void)kv;
    for (int i = 0; i < nq; i++)
        sc_head_attend_cap(qs[i], Kh, Vh, ns[i], bf, scale, softcap, sc + i * stride, outs[i], D);
}
