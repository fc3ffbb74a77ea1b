/* llama.cpp's own CPU dot kernels timed on the shapes and in the units of
 * `crates/tessera-engine/examples/kernel_bench.rs` (1 thread, 1 token: ms per matrix-vector
 * product), so a kernel of this engine can be compared with ggml's in the same run.
 * Weights are random floats quantized by ggml (an importance matrix of ones where the type needs
 * one); the activation is quantized to the type's vec_dot_type as ggml's mul_mat does.
 *
 *   B=/tmp/llama.cpp-build/llama_cpp_python-0.3.36/vendor/llama.cpp   # tools/llama-cpp.sh build
 *   cc -O2 -o /tmp/ggml_vec_dot_bench tools/ggml_vec_dot_bench.c -I$B/ggml/include \
 *      -L$B/build/bin -lggml-cpu -lggml-base -lm
 *   LD_LIBRARY_PATH=$B/build/bin /tmp/ggml_vec_dot_bench IQ2_XXS IQ3_XXS Q2_K ...
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static enum ggml_type type_named(const char *name) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char *n = ggml_type_name((enum ggml_type)t);
        if (n && strcasecmp(n, name) == 0) return (enum ggml_type)t;
    }
    fprintf(stderr, "unknown type %s\n", name);
    exit(2);
}

int main(int argc, char **argv) {
    static const int shapes[4][2] = {{1024, 1024}, {3072, 1024}, {1024, 3072}, {32000, 1024}};
    ggml_cpu_init();
    printf("%-8s %11s %10s %9s\n", "dtype", "rows x cols", "ms/call", "GFLOP/s");
    for (int a = 1; a < argc; a++) {
        enum ggml_type type = type_named(argv[a]);
        const struct ggml_type_traits_cpu *tr = ggml_get_type_traits_cpu(type);
        for (int s = 0; s < 4; s++) {
            int rows = shapes[s][0], cols = shapes[s][1];
            float *wf = malloc(sizeof(float) * (size_t)rows * cols);
            float *imat = malloc(sizeof(float) * cols);
            float *x = malloc(sizeof(float) * cols);
            srand(7);
            for (size_t i = 0; i < (size_t)rows * cols; i++) wf[i] = (float)rand() / RAND_MAX - 0.5f;
            for (int i = 0; i < cols; i++) { imat[i] = 1.0f; x[i] = (float)rand() / RAND_MAX - 0.5f; }
            size_t row_bytes = ggml_row_size(type, cols);
            char *w = malloc(row_bytes * rows);
            ggml_quantize_chunk(type, wf, w, 0, rows, cols, ggml_quantize_requires_imatrix(type) ? imat : NULL);
            char *xq = malloc(ggml_row_size(tr->vec_dot_type, cols));
            const ggml_from_float_t from_float = ggml_get_type_traits_cpu(tr->vec_dot_type)->from_float;
            from_float(x, xq, cols);
            float *out = malloc(sizeof(float) * rows);
            double best = 1e9, start = now();
            for (int n = 0; n < 3 || now() - start < 0.2; n++) {
                double t = now();
                for (int r = 0; r < rows; r++) tr->vec_dot(cols, out + r, 0, w + r * row_bytes, 0, xq, 0, 1);
                t = now() - t;
                if (t < best) best = t;
            }
            printf("%-8s %5dx%-5d %10.3f %9.1f\n", argv[a], rows, cols, best * 1e3, 2.0 * rows * cols / best / 1e9);
            free(wf); free(imat); free(x); free(w); free(xq); free(out);
        }
    }
    return 0;
}
