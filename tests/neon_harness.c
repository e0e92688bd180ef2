// tests/test_neon.py's runner on another architecture: load a kernels library (argv[1]), make the calls a file
// describes (argv[2]) and write back each call's result and buffers (argv[3]). Built for aarch64 and run under
// qemu-aarch64, so the neon variant's kernels are checked against the x86 ones from Python.
//
// A call: u32 name length, the name, u32 argument count, then per argument a kind byte: 'i' an int64 value, 'b' a
// buffer (u64 length, the bytes: passed as a pointer, written back after the call), 'n' NULL. Every argument goes
// as a 64-bit integer: on AArch64 an int or size_t parameter reads its register (or 8-byte stack slot) the same way,
// and no exported kernel takes a float by value. Output per call: int64 result, then every buffer's bytes in order.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef int64_t (*fn14)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t);

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
        fn14 fn = (fn14)dlsym(lib, name);
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
