// The scalar reference of every variant function in kernels.h, in plain C: built with no -march flag (so on any
// CPU, and the only variant where AVX-512 VNNI is missing), selected at run time by loading its library
// (native.py: SINKCHAT_KERNELS=ref, native.use("ref")).
//
// The SIMD variant (matmul.c, attend.c) is held to it by the tests. Where the arithmetic is the same it is the
// same operations in the same order, so the results agree bit for bit: integer dot products are exact in any
// order, and each float step below is one the vector code does per lane (fmaf where it fuses, one rounded product
// where it multiplies first; both builds use -ffp-contract=off, so the compiler fuses nothing on its own). The
// attention sums in plain order instead of the SIMD one (and expf for its polynomial), so it agrees to float
// rounding only.
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

int sc_q4_mm(sc_arena* a, const float* x, int M, int K, int N, const sc_q4_block* qw, const sc_q4_scales* sw,
             const float* bias, float* y) {
    int nb = K / QB;
    sc_xq xa;
    float* unused;
    if (sc_take_q4(a, M, K, &xa, &unused)) return SC_EWORK;
    sc_quant_rows(x, M, K, xa.xq, xa.dx, xa.sx);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int g = n / RG, r = n % RG;
            float acc = 0;
            for (int b = 0; b < nb; b++) {
                size_t at = (size_t)m * nb + b;
                const sc_q4_scales* sb = sw + (size_t)g * nb + b;
                float isum = (float)q4_dot(qw + (size_t)g * nb + b, r, xa.xq + (size_t)m * K + b * QB);
                acc = fmaf(isum, h2f(sb->d[r]) * xa.dx[at], acc);  // d*q*x: one product, one fused add
                acc = fmaf(h2f(sb->m[r]), xa.sx[at], acc);          // m*sum(x)
            }
            y[(size_t)m * N + n] = bias ? acc + bias[n] : acc;
        }
    return SC_OK;
}

int sc_q8_mm(sc_arena* a, const float* x, int M, int K, int N, const sc_q8_block* hw, const float* ws, float* y) {
    int nb = K / QB;
    sc_xq xa;
    if (sc_take_xq(a, M, K, &xa)) return SC_EWORK;
    sc_quant_rows(x, M, K, xa.xq, xa.dx, xa.sx);
    sc_q8_corr(xa.sx, M, nb, xa.corr);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int g = n / RG, r = n % RG;
            float acc = 0;
            for (int b = 0; b < nb; b++) {
                const sc_q8_block* wb = hw + (size_t)g * nb + b;
                const int8_t* xb = xa.xq + (size_t)m * K + b * QB;
                int32_t isum = 0;  // (w + 128) * x; the +128 comes off with corr
                for (int s = 0; s < QB / 4; s++)
                    for (int t = 0; t < 4; t++) isum += wb->q[s][r][t] * xb[4 * s + t];
                acc = fmaf((float)isum, xa.dx[(size_t)m * nb + b], acc);
            }
            y[(size_t)m * N + n] = (acc - xa.corr[m]) * ws[n];
        }
    return SC_OK;
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

// Softmax attention of one head, by the definition: scores q.k * scale, p = exp(s - max) / sum, o = sum p * v.
void sc_head_attend(const float* qh, const void* Kh, const void* Vh, int n, int bf, float scale, float* sc, float* o,
                    int D) {
    float mx = -INFINITY, sum = 0;
    for (int s = 0; s < n; s++) {
        float acc = 0;
        for (int d = 0; d < D; d++) acc += qh[d] * kv_at(Kh, (size_t)s * D + d, bf);
        sc[s] = acc * scale;
        mx = sc[s] > mx ? sc[s] : mx;
    }
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
