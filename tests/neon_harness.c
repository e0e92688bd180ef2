// tests/test_neon.py's runner on another architecture: load a kernels library (argv[1]), make the calls a file
// describes (argv[2]) and write back each call's result and buffers (argv[3]). Built for aarch64 and run under
// qemu-aarch64, so the neon variant's kernels are checked against the x86 ones from Python.
//
// A call: u32 name length, the name, u32 argument count, then per argument a kind byte: 'i' an int64 value, 'b' a
// buffer (u64 length, the bytes: passed as a pointer, written back after the call), 'n' NULL. Every argument goes
// as a 64-bit integer: on AArch64 an int or size_t parameter reads its register (or 8-byte stack slot) the same way,
// and no exported kernel takes a float by value. Output per call: int64 result, then every buffer's bytes in order.
//
// Two names are this program's own, not the library's: the prefill's attention tiles are hidden in it (no export
// reaches them but sc_prefill, whose Model holds pointers), so attend_neon.c is compiled into this program too, with
// the library's flags, and "tiles" / "head" call its sc_heads_attend / sc_head_attend_cap (floats as their bits).
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef int64_t (*fn14)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t);

#define PTR(x) ((void*)(intptr_t)(x))

static float f32(int64_t bits) {
    uint32_t u = (uint32_t)bits;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// tiles(q [nq][D], ns int32 [nq], nq, K, V, bf, scale, softcap, sc, stride, out [nq][D], D, kv): sc_heads_attend.
static int64_t tiles(int64_t q, int64_t ns, int64_t nq, int64_t K, int64_t V, int64_t bf, int64_t scale,
                     int64_t softcap, int64_t sc, int64_t stride, int64_t out, int64_t D, int64_t kv, int64_t unused) {
    const float* qs[256];
    float* outs[256];
    (void)unused;
    if (nq > 256) return -1;
    for (int i = 0; i < nq; i++) qs[i] = (const float*)PTR(q) + i * D, outs[i] = (float*)PTR(out) + i * D;
    sc_heads_attend(qs, PTR(ns), (int)nq, PTR(K), PTR(V), (int)bf, f32(scale), f32(softcap), PTR(sc), (size_t)stride,
                    outs, (int)D, PTR(kv));
    return 0;
}

// head(q [D], K, V, n, bf, scale, softcap, sc [n], o [D], D): sc_head_attend_cap, one query alone.
static int64_t head(int64_t q, int64_t K, int64_t V, int64_t n, int64_t bf, int64_t scale, int64_t softcap, int64_t sc,
                    int64_t o, int64_t D, int64_t a, int64_t b, int64_t c, int64_t d) {
    (void)a, (void)b, (void)c, (void)d;
    sc_head_attend_cap(PTR(q), PTR(K), PTR(V), (int)n, (int)bf, f32(scale), f32(softcap), PTR(sc), PTR(o), (int)D);
    return 0;
}

static int get(FILE* f, void* p, size_t n) { return fread(p, 1, n, f) == n; }

int main(int argc, char** argv) {
    if (argc != 4) return 2;
    void* lib = dlopen(argv[1], RTLD_NOW);
    FILE *in = fopen(argv[2], "rb"), *out = fopen(argv[3], "wb");
    if (!lib || !in || !out) return fprintf(stderr, "open: %s\n", dlerror()), 3;
    uint32_t len, nargs;
    while (get(in, &len, 4)) {
        char name[64] = {0};
        int64_t args[14] = {0};
        void* bufs[14] = {0};
        uint64_t sizes[14] = {0};
        if (len >= sizeof name || !get(in, name, len) || !get(in, &nargs, 4) || nargs > 14) return 4;
        for (uint32_t i = 0; i < nargs; i++) {
            char kind;
            if (!get(in, &kind, 1)) return 5;
            if (kind == 'i' && !get(in, &args[i], 8)) return 5;
            if (kind == 'b') {
                if (!get(in, &sizes[i], 8) || !(bufs[i] = malloc(sizes[i] + 1))) return 5;
                if (!get(in, bufs[i], sizes[i])) return 5;
                args[i] = (int64_t)(intptr_t)bufs[i];
            }
        }
        fn14 fn = !strcmp(name, "tiles") ? tiles : !strcmp(name, "head") ? head : (fn14)dlsym(lib, name);
        if (!fn) return fprintf(stderr, "no %s\n", name), 6;
        int64_t rc = fn(args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7], args[8], args[9],
                        args[10], args[11], args[12], args[13]);
        fwrite(&rc, 8, 1, out);
        for (uint32_t i = 0; i < nargs; i++)
            if (bufs[i]) {
                fwrite(bufs[i], 1, sizes[i], out);
                free(bufs[i]);
            }
    }
    fclose(out);
    return 0;
}
