// The decode step's attention pieces on NEON (the neon variant). RoPE and the bf16 rows are ref.c's scalar code
// (the same bits as every variant; a few hundred values a token). One head's softmax attention is attend.c's lane
// for lane, each 16-lane register four 128-bit ones and its add tree step for step (attend256.c does the same on
// register pairs), so every variant's attention, and so its decode step, has the avx512 variant's bits.
#include "simd_neon.h"

void sc_rot_row(const float* k, float* o, const float* cs, const float* sn, int rot, int D) {
    sc_rot_lanes(k, o, cs, sn, 0, rot, D);
}

void sc_put_bf16(uint16_t* p, const float* src, int D) {
    for (int d = 0; d < D; d++) p[d] = sc_to_bf16(src[d]);
}

void sc_get_bf16(float* dst, const uint16_t* p, int D) {
    for (int d = 0; d < D; d++) dst[d] = sc_from_bf16(p[d]);
}

typedef float32x4x4_t v16;  // lanes 0-3, 4-7, 8-11, 12-15 of one avx512 register

static inline v16 v16_set1(float f) { return (v16){{vdupq_n_f32(f), vdupq_n_f32(f), vdupq_n_f32(f), vdupq_n_f32(f)}}; }
static inline v16 v16_load(const float* p) { return vld1q_f32_x4(p); }
static inline v16 v16_kv(const void* base, size_t i, int bf) {
    return (v16){{kv4(base, i, bf), kv4(base, i + 4, bf), kv4(base, i + 8, bf), kv4(base, i + 12, bf)}};
}
static inline void v16_store(float* p, v16 v) { vst1q_f32_x4(p, v); }
static inline v16 v16_add(v16 a, v16 b) {
    for (int i = 0; i < 4; i++) a.val[i] = vaddq_f32(a.val[i], b.val[i]);
    return a;
}
static inline v16 v16_mul(v16 a, v16 b) {
    for (int i = 0; i < 4; i++) a.val[i] = vmulq_f32(a.val[i], b.val[i]);
    return a;
}
static inline v16 v16_fma(v16 a, v16 b, v16 c) {  // a*b + c, fused
    for (int i = 0; i < 4; i++) c.val[i] = vfmaq_f32(c.val[i], a.val[i], b.val[i]);
    return c;
}

// simd512.h: hsum512.
static inline float v16_sum(v16 v) {
    float32x4_t u = vaddq_f32(vaddq_f32(v.val[3], v.val[1]), vaddq_f32(v.val[2], v.val[0]));
    u = vaddq_f32(u, vextq_f32(u, u, 2));
    return vgetq_lane_f32(u, 0) + vgetq_lane_f32(u, 1);
}

static inline float32x4_t zip_lo_pd(float32x4_t x, float32x4_t y) {
    return vreinterpretq_f32_f64(vzip1q_f64(vreinterpretq_f64_f32(x), vreinterpretq_f64_f32(y)));
}
static inline float32x4_t zip_hi_pd(float32x4_t x, float32x4_t y) {
    return vreinterpretq_f32_f64(vzip2q_f64(vreinterpretq_f64_f32(x), vreinterpretq_f64_f32(y)));
}

// attend.c: hsum16 (r[j] = the sum of v[j]'s 16 lanes): unpack{lo,hi}_ps are zip{1,2} per 128-bit lane,
// unpack{lo,hi}_pd zip{1,2} on doubles, and the f32x4 shuffles pick whole 128-bit lanes.
static inline v16 hsum16(const v16* v) {
    v16 a[8], b[4], d[2], r;
    for (int i = 0; i < 8; i++)
        for (int L = 0; L < 4; L++) {
            float32x4_t x = v[2 * i].val[L], y = v[2 * i + 1].val[L];
            a[i].val[L] = vaddq_f32(vzip1q_f32(x, y), vzip2q_f32(x, y));
        }
    for (int i = 0; i < 4; i++)
        for (int L = 0; L < 4; L++) {
            float32x4_t x = a[2 * i].val[L], y = a[2 * i + 1].val[L];
            b[i].val[L] = vaddq_f32(zip_lo_pd(x, y), zip_hi_pd(x, y));
        }
    for (int i = 0; i < 2; i++)  // shuffle_f32x4 0x88 + 0xDD: lanes (0 + 1, 2 + 3) of the first, then of the second
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 2; j++) {
                const v16 x = b[2 * i + h];
                d[i].val[2 * h + j] = vaddq_f32(x.val[2 * j], x.val[2 * j + 1]);
            }
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 2; j++) r.val[2 * h + j] = vaddq_f32(d[h].val[2 * j], d[h].val[2 * j + 1]);
    return r;
}

static inline v16 v16_exp_minus(v16 x, float m) {
    for (int i = 0; i < 4; i++) x.val[i] = exp4(vsubq_f32(x.val[i], vdupq_n_f32(m)));
    return x;
}

// attend.c: softmax, in place over sc [n]: the 16-lane sum, the tail through a padded copy (masked lanes add 0).
static void softmax(float* sc, int n) {
    float mx = -INFINITY, tail[16];
    int t = n % 16, full = n - t;
    for (int s = 0; s < n; s++) mx = sc[s] > mx ? sc[s] : mx;  // a max: any order gives the same value
    v16 vs = v16_set1(0.0f);
    for (int s = 0; s < full; s += 16) {
        v16 e = v16_exp_minus(v16_load(sc + s), mx);
        v16_store(sc + s, e);
        vs = v16_add(vs, e);
    }
    if (t) {
        for (int i = 0; i < 16; i++) tail[i] = i < t ? sc[full + i] : mx;
        v16_store(tail, v16_exp_minus(v16_load(tail), mx));
        for (int i = 0; i < 16; i++) tail[i] = i < t ? tail[i] : 0.0f;
        memcpy(sc + full, tail, sizeof(float) * t);
        vs = v16_add(vs, v16_load(tail));
    }
    float inv = 1.0f / v16_sum(vs);
    for (int s = 0; s < n; s++) sc[s] *= inv;
}

#include "attend_v16.h"  // the shared pieces and sc_head_attend_cap, over this file's softmax
