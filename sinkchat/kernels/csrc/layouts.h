// The weight layouts the kernels read (kernels.h includes this; sinkchat/kernels/layouts.py and model/int5.py pack
// them, the binding checks every size): one struct per 32 weights x 16 rows (or per 256 for the K-quants' scales),
// each typed, with static asserts on its size and, where it holds a GGUF type at its own bits, on that type's bytes.
// No intrinsics: the reference build includes it on any architecture.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define QB 32  // weights per quant block
#define RG 16  // rows per group: one 512-bit lane per row

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

// The q8g layout's fp16 scales (llama.cpp's Q8_0, Q5_0, Q5_1, Q5_K, Q6_K held exactly): the block's bytes are an
// sc_q8_block (q + 128), and every 16 weights along K of a row have their own d and m: w = d*q + m, index 0 for
// columns 32b..32b+15 (sub-blocks s = 0..3), 1 for 32b+16..32b+31 (s = 4..7). sw [N/16][K/32], parallel to hw.
typedef struct {
    uint16_t d[2][RG], m[2][RG];
} sc_q8g_scales;

// q40 (llama.cpp's Q4_0 at its own 18 bytes per 32 weights): the nibbles are sc_q4_blocks (qw [N/16][K/32], as q4)
// and each block of 32 of a row has one fp16 d, w = d*(q - 8): no m is stored; the kernels form m = -8*d in fp32
// (exact: a power-of-two multiple of an fp16), the very value q4 held for a Q4_0 tensor, so the two give the same
// bits. sw [N/16][K/32], parallel to qw: 16 + 2 bytes per row and 32 weights, Q4_0's 0.5625 bytes a weight.
typedef struct {
    uint16_t d[RG];
} sc_q40_scales;

// q80 (llama.cpp's Q8_0 at its own 34 bytes per 32 weights): the bytes are sc_q8_blocks (hw [N/16][K/32], q + 128,
// as q8g) and each block of 32 of a row has one fp16 d, w = d*q: no m. The kernels run q8g's loop with ds = d for both
// half blocks and mt = +0, the values q8g held for a Q8_0 tensor (d per half, m = +0), so the same bits from 34 bytes
// of 40 (the prefill leaves the +0 m terms out, as q8k does for Q6_K: rows512.h, q8_half0). sw [N/16][K/32].
typedef struct {
    uint16_t d[RG];
} sc_q80_scales;

_Static_assert(sizeof(sc_q4_block) == QB * RG / 2, "q4 block: 16 rows x 32 nibbles, no padding");
_Static_assert(sizeof(sc_q4_scales) == 2 * RG * sizeof(uint16_t), "q4 scales: 16 fp16 d then 16 fp16 m");
_Static_assert(sizeof(sc_q40_scales) == RG * sizeof(uint16_t), "q40 scales: 16 fp16 d, no m");
_Static_assert(sizeof(sc_q8_block) + sizeof(sc_q80_scales) == RG * 34, "q80: Q8_0's 34 bytes a row and 32");
_Static_assert(sizeof(sc_q8_block) == QB * RG, "q8 block: 16 rows x 32 bytes, no padding");
_Static_assert(sizeof(sc_q8g_scales) == 4 * RG * sizeof(uint16_t), "q8g scales: 2x16 fp16 d then 2x16 fp16 m");
_Static_assert(offsetof(sc_q8g_scales, m) == 2 * RG * sizeof(uint16_t), "q8g scales: m follows d, no padding");
_Static_assert(sizeof(sc_q4_block) % 64 == 0 && sizeof(sc_q8_block) % 64 == 0, "blocks are whole 512-bit loads");

// ---- K-quant layouts: llama.cpp's Q4_K / Q5_K / Q6_K with the file's own scales -----------------------------------
// A K-quant super-block is 256 weights along K with fp16 d (and dmin) and small integer scales per sub-block:
// w = (d*sc_j)*q - (dmin*mn_j). Stored as the file stores them (not as fp16 products, which round: d has an 11-bit
// mantissa, sc up to 8 bits) and multiplied in fp32 in the kernel, where d*sc and dmin*mn are exact. K % 256 == 0.
#define SC_QK 256  // weights per super-block

// q4k: the nibbles are sc_q4_blocks (qw [N/16][K/32], as q4); per 16 rows x 256 columns one of these (sw
// [N/16][K/256]): sub-block j (32 weights, columns 32j..32j+31 of the super-block) of row r has a 6-bit unsigned
// scale sc_j = v_j and min mn_j = v_{8+j}, held at Q4_K's 6 bits in three 32-bit words a row: v_k (k < 15) at bits
// 6(k % 5) of w[k / 5][r], and v_15's bits 2i..2i+1 at bits 30..31 of w[i][r] (sc_q4k_v). A row's word in a 32-bit
// lane, so the kernels form v_k of 16 rows with one shift and one and (v_15: three), where bytes would take a widening
// too. 256 bytes per 4096 weights: with the nibbles Q4_K's own 144 bytes per 256 (0.5625 bytes a weight; ABI 11 held
// sc, mn a byte each: 148, 0.578).
typedef struct {
    uint16_t d[RG], dmin[RG];
    uint32_t w[3][RG];
} sc_q4k_scales;
static inline int sc_q4k_v(const sc_q4k_scales* s, int k, int r) {
    if (k < 15) return (int)(s->w[k / 5][r] >> (6 * (k % 5))) & 63;
    return (int)((s->w[0][r] >> 30) | (s->w[1][r] >> 30) << 2 | (s->w[2][r] >> 30) << 4);
}

// q8k: the bytes are sc_q8_blocks (hw [N/16][K/32], q + 128, as q8g); per 16 rows x 256 columns one of these (sw
// [N/16][K/256]) with a signed scale and unsigned min per 16 weights (j = 0..15: columns 16j..16j+15). Q6_K: its own
// int8 scales, dmin = 0, mn = 0; Q5_K: each 32-weight scale / min on both of its 16-halves.
typedef struct {
    uint16_t d[RG], dmin[RG];
    int8_t sc[16][RG];
    uint8_t mn[16][RG];
} sc_q8k_scales;

_Static_assert(sizeof(sc_q4k_scales) == 4 * RG + 12 * RG, "q4k scales: 2x16 fp16, then 3x16 words, no padding");
_Static_assert(offsetof(sc_q4k_scales, w) == 2 * RG * sizeof(uint16_t), "q4k scales: the words follow d, dmin");
_Static_assert(8 * sizeof(sc_q4_block) + sizeof(sc_q4k_scales) == RG * 144, "q4k: Q4_K's 144 bytes a row and 256");
_Static_assert(sizeof(sc_q8k_scales) == 4 * RG + 32 * RG, "q8k scales: 2x16 fp16, then 2x16x16 bytes, no padding");
_Static_assert(offsetof(sc_q8k_scales, sc) == 2 * RG * sizeof(uint16_t), "q8k scales: sc follows d, dmin");
_Static_assert(offsetof(sc_q8k_scales, mn) == 2 * RG * sizeof(uint16_t) + 16 * RG, "q8k scales: mn follows sc");
_Static_assert(sizeof(sc_q4k_scales) % 64 == 0 && sizeof(sc_q8k_scales) % 64 == 0, "scales keep 64-byte strides");

// q6k (llama.cpp's Q6_K at its own 210 bytes per 256 weights, where q8k takes 292): per 16 rows x 32 columns the
// low 4 bits of u = q + 32 (0..63) as an sc_q4_block's nibbles (q), then the high 2 bits as two bit-planes laid over
// the same [row][byte] tiles: bits 2i..2i+1 of h[p][r][t] are those of w[r, 32b + 4(4p + i) + t], i.e. of the q8
// layout's sub-block s = 4p + i (byte t), so plane p is half block p. The kernels rebuild q8k's bytes q + 128 = u + 96
// in registers (rows512.h: the weight-unpack step; avx2 dots u itself and takes 32, not 128, x the sum of x off: the
// same exact integer) and run q8k's loop and float steps: every output has q8k's bits.
typedef struct {
    uint8_t q[4][RG][4];  // sc_q4_block's nibbles: low bits of w[r, 32b+8s+t] (low nibble), w[r, 32b+8s+4+t] (high)
    uint8_t h[2][RG][4];  // the high 2 bits, four sub-blocks a byte
} sc_q6k_block;
// Per 16 rows x 256 columns (sw [N/16][K/256]): fp16 d and the file's int8 scale per 16 weights (j: columns
// 16j..16j+15). No dmin / mn (Q6_K has none): 288 bytes, so blocks + scales are the file's 210 bytes a row and 256.
typedef struct {
    uint16_t d[RG];
    int8_t sc[16][RG];
} sc_q6k_scales;
_Static_assert(offsetof(sc_q6k_block, h) == sizeof(sc_q4_block), "q6k block: the q4 nibble tile, then the planes");
_Static_assert(sizeof(sc_q6k_block) == 6 * 64, "q6k block: 16 rows x 32 x 6 bits, whole 512-bit loads");
_Static_assert(sizeof(sc_q6k_scales) == 2 * RG + 16 * RG, "q6k scales: 16 fp16 d, then 16x16 int8 sc, no padding");
_Static_assert(8 * sizeof(sc_q6k_block) + sizeof(sc_q6k_scales) == RG * 210, "q6k: Q6_K's 210 bytes a row and 256");

// q5 blocks (llama.cpp's Q5_0 / Q5_1 / Q5_K at their own 5 bits, where q8g / q8k held a byte a weight): per 16 rows
// x 32 columns the low 4 bits of u (0..31) as an sc_q4_block's nibbles (q), then one bit-plane over the q8 layout's
// [row][byte] tile: bit s of h[r][t] is bit 4 of u of w[r, 32b + 4s + t] (sub-block s). The kernels rebuild q8g's /
// q8k's bytes in the 8-bit loops' weight-unpack step (rows512.h: q5_bytes) and run those loops: their bits. Scales:
// q50 (Q5_0, q = u - 16, w = d*q): sc_q80_scales, d per block, m +0; q51 (Q5_1, q = u, w = d*q + m): sc_q4_scales,
// d and m per block for both half blocks; q5k (Q5_K, q = u): sc_q4k_scales (its 6-bit sc, mn per 32 for both halves).
// 22 / 24 bytes a row and 32, 176 a row and 256: the files'.
typedef struct {
    uint8_t q[4][RG][4];
    uint8_t h[RG][4];
} sc_q5_block;
_Static_assert(offsetof(sc_q5_block, h) == sizeof(sc_q4_block), "q5 block: the q4 nibble tile, then the plane");
_Static_assert(sizeof(sc_q5_block) == 5 * 64, "q5 block: 16 rows x 32 x 5 bits, whole 512-bit loads");
_Static_assert(sizeof(sc_q5_block) + sizeof(sc_q80_scales) == RG * 22, "q50: Q5_0's 22 bytes a row and 32");
_Static_assert(sizeof(sc_q5_block) + sizeof(sc_q4_scales) == RG * 24, "q51: Q5_1's 24 bytes a row and 32");
_Static_assert(8 * sizeof(sc_q5_block) + sizeof(sc_q4k_scales) == RG * 176, "q5k: Q5_K's 176 bytes a row and 256");
