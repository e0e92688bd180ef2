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

// Every function below computes the outputs of row groups [g0, g1) for activation rows [m0, m0 + mn) (kernels.h:
// sc_lin_run), each element by itself, so any split of the rows or groups gives the same bits.
static void q4_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1) {
    const sc_q4_block* qw = l->w;
    const sc_q4_scales* sw = l->s;
    int K = a->K, nb = K / QB;
    for (int m = m0; m < m0 + mn; m++)
        for (int n = g0 * RG; n < g1 * RG; n++) {
            int g = n / RG, r = n % RG;
            float acc = 0;
            for (int b = 0; b < nb; b++) {
                size_t at = (size_t)m * nb + b;
                const sc_q4_scales* sb = sw + (size_t)g * nb + b;
                float isum = (float)q4_dot(qw + (size_t)g * nb + b, r, a->x.xq + (size_t)m * K + b * QB);
                acc = fmaf(isum, h2f(sb->d[r]) * a->x.dx[at], acc);  // d*q*x: one product, one fused add
                acc = fmaf(h2f(sb->m[r]), a->x.sx[at], acc);          // m*sum(x)
            }
            l->y[(size_t)m * l->N + n] = l->bias ? acc + l->bias[n] : acc;
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

// Row r of half h (sub-blocks 4h..4h+3) of a q8 block times the 16 int8 values they meet: sum of (q + 128) * x.
static int32_t q8_half_dot(const sc_q8_block* wb, int r, int h, const int8_t* xb) {
    int32_t isum = 0;
    for (int s = 4 * h; s < 4 * h + 4; s++)
        for (int t = 0; t < 4; t++) isum += wb->q[s][r][t] * xb[4 * s + t];
    return isum;
}

// q8g, by lanes as matmul.c's q8g_half: per half block, the exact integer dot (the +128 taken off with c16), then
// acc_h = fmaf(isum, d*dx, acc_h) and acc_h = fmaf(m, sx16, acc_h); the two halves' accumulators are added last.
static void q8g_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1) {
    const sc_q8_block* hw = l->w;
    const sc_q8g_scales* sw = l->s;
    int K = a->K, nb = K / QB, nh = K / 16;
    for (int m = m0; m < m0 + mn; m++)
        for (int n = g0 * RG; n < g1 * RG; n++) {
            int g = n / RG, r = n % RG;
            float acc[2] = {0, 0};
            for (int b = 0; b < nb; b++) {
                const sc_q8g_scales* sb = sw + (size_t)g * nb + b;
                float dx = a->x.dx[(size_t)m * nb + b];
                for (int h = 0; h < 2; h++) {
                    size_t at = (size_t)m * nh + 2 * b + h;
                    int32_t isum = q8_half_dot(hw + (size_t)g * nb + b, r, h, a->x.xq + (size_t)m * K + b * QB);
                    acc[h] = fmaf((float)(isum - a->h.c16[at]), h2f(sb->d[h][r]) * dx, acc[h]);
                    acc[h] = fmaf(h2f(sb->m[h][r]), a->h.sx16[at], acc[h]);
                }
            }
            float v = acc[0] + acc[1];
            l->y[(size_t)m * l->N + n] = l->bias ? v + l->bias[n] : v;
        }
}

// ---- K-quants (matmul_k.c's twins) ----------------------------------------------------------------------------------
// ds = d*sc and dm = dmin*mn of sub-block j, row r: fp32 products of an fp16 and a small integer, exact.
static inline float k_prod(uint16_t d, int v) { return h2f(d) * (float)v; }

// q4k per lane: per 32-block b (sub-block b % 8 of super-block b / 8), acc = fmaf(isum, ds*dx, acc), then
// acc = fmaf(-dm, sx, acc) (as the vector fnmadd: one rounding of acc - dm*sx).
static void q4k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1) {
    const sc_q4_block* qw = l->w;
    const sc_q4k_scales* sw = l->s;
    int K = a->K, nb = K / QB, ns = K / SC_QK;
    for (int m = m0; m < m0 + mn; m++)
        for (int n = g0 * RG; n < g1 * RG; n++) {
            int g = n / RG, r = n % RG;
            float acc = 0;
            for (int b = 0; b < nb; b++) {
                size_t at = (size_t)m * nb + b;
                const sc_q4k_scales* ss = sw + (size_t)g * ns + b / 8;
                float ds = k_prod(ss->d[r], ss->sc[b % 8][r]), dm = k_prod(ss->dmin[r], ss->mn[b % 8][r]);
                float isum = (float)q4_dot(qw + (size_t)g * nb + b, r, a->x.xq + (size_t)m * K + b * QB);
                acc = fmaf(isum, ds * a->x.dx[at], acc);
                acc = fmaf(-dm, a->x.sx[at], acc);
            }
            l->y[(size_t)m * l->N + n] = l->bias ? acc + l->bias[n] : acc;
        }
}

// q8k per lane: as q8g_run, with half h of block b scaled by sub-block j = 2*(b % 8) + h of super-block b / 8.
static void q8k_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1) {
    const sc_q8_block* hw = l->w;
    const sc_q8k_scales* sw = l->s;
    int K = a->K, nb = K / QB, nh = K / 16, ns = K / SC_QK;
    for (int m = m0; m < m0 + mn; m++)
        for (int n = g0 * RG; n < g1 * RG; n++) {
            int g = n / RG, r = n % RG;
            float acc[2] = {0, 0};
            for (int b = 0; b < nb; b++) {
                const sc_q8k_scales* ss = sw + (size_t)g * ns + b / 8;
                float dx = a->x.dx[(size_t)m * nb + b];
                for (int h = 0; h < 2; h++) {
                    int j = 2 * (b % 8) + h;
                    size_t at = (size_t)m * nh + 2 * b + h;
                    float ds = k_prod(ss->d[r], ss->sc[j][r]), dm = k_prod(ss->dmin[r], ss->mn[j][r]);
                    int32_t isum = q8_half_dot(hw + (size_t)g * nb + b, r, h, a->x.xq + (size_t)m * K + b * QB);
                    acc[h] = fmaf((float)(isum - a->h.c16[at]), ds * dx, acc[h]);
                    acc[h] = fmaf(-dm, a->h.sx16[at], acc[h]);
                }
            }
            float v = acc[0] + acc[1];
            l->y[(size_t)m * l->N + n] = l->bias ? v + l->bias[n] : v;
        }
}

void sc_lin_run(const sc_lin* l, const sc_act* a, int m0, int mn, int g0, int g1, float* acc) {
    (void)acc;  // every output's accumulator is a local here
    switch (l->type) {
        case SC_LIN_TABLE: q8_table_run(l, a, m0, mn, g0, g1); break;
        case SC_LIN_Q8G: q8g_run(l, a, m0, mn, g0, g1); break;
        case SC_LIN_Q4K: q4k_run(l, a, m0, mn, g0, g1); break;
        case SC_LIN_Q8K: q8k_run(l, a, m0, mn, g0, g1); break;
        default: q4_run(l, a, m0, mn, g0, g1);
    }
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
