/*
 * c-mlp: a tpubox guest in C (wasi-libc).
 *
 * Reads a small CSV table (a header and 1 to 64 rows of three numbers), normalises each column
 * to zero mean and unit variance in C, then runs a two-layer perceptron on the host's device:
 *
 *     y = relu(x . W1 + b1) . W2 + b2      x: f32[N,3], W1: f32[3,8], W2: f32[8,2]
 *
 * as a StableHLO program (MLIR text) written for the row count it read. It reads the result
 * back, recomputes it in plain C and fails if the two differ by more than 1e-4.
 *
 * Input: the CSV text after `--csv`, or stdin when there is no argument.
 * Output (stdout): `rows: N`, `normalized: [[...]]`, `result: [[y0,y1],...]` (JSON rows) and
 * `max abs diff: D`. On any error: one line `c-mlp: error: ...` on stderr, exit status 1.
 *
 * `guest.h` is generated from ../../wit by `wit-bindgen c`; see docs/guests/c.md.
 */
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "guest.h"

#define NAME "c-mlp"
#define IN 3
#define HIDDEN 8
#define OUT 2
#define MAX_ROWS 64
#define MAX_INPUT (1 << 20)
#define TOLERANCE 1e-4

/* Prints `c-mlp: error: ...` as one line on stderr and exits with status 1. */
__attribute__((format(printf, 1, 2))) static _Noreturn void fail(const char *fmt, ...) {
    va_list ap;
    fflush(stdout);
    fputs(NAME ": error: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

/* Fails with a tpubox `error` record, naming the step that failed. */
static const char *const KIND_NAMES[] = {
    "invalid-argument", "not-found",       "failed-precondition",
    "permission-denied", "resource-exhausted", "unsupported",
    "compile-failed",   "execution-failed", "internal",
};

static _Noreturn void fail_device(const char *what, tpubox_device_types_error_t *err) {
    const char *kind = err->kind < sizeof KIND_NAMES / sizeof KIND_NAMES[0] ? KIND_NAMES[err->kind] : "?";
    fail("%s: %s: %.*s", what, kind, (int)err->message.len, (const char *)err->message.ptr);
}

/* Accepts `[+-]digits[.digits][e[+-]digits]` (a leading or trailing dot is fine) and nothing
 * else: no `nan`, `inf` or hex, which strtod would take, so every guest language reads the
 * same numbers. */
static int is_number(const char *s) {
    int digits = 0;
    if (*s == '+' || *s == '-') s++;
    while (isdigit((unsigned char)*s)) s++, digits++;
    if (*s == '.') {
        s++;
        while (isdigit((unsigned char)*s)) s++, digits++;
    }
    if (digits == 0) return 0;
    if (*s == 'e' || *s == 'E') {
        int exp = 0;
        s++;
        if (*s == '+' || *s == '-') s++;
        while (isdigit((unsigned char)*s)) s++, exp++;
        if (exp == 0) return 0;
    }
    return *s == '\0';
}

/* Trims spaces and tabs at both ends, in place. */
static char *trim(char *s) {
    char *end;
    while (*s == ' ' || *s == '\t' || *s == '\r') s++;
    end = s + strlen(s);
    while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r')) *--end = '\0';
    return s;
}

static int is_blank(const char *s) {
    while (*s == ' ' || *s == '\t' || *s == '\r') s++;
    return *s == '\0';
}

/* Splits `line` at commas into at most `max` trimmed fields; returns how many there were
 * (which may exceed `max`: the extra ones are counted, not stored). */
static int split(char *line, char **fields, int max) {
    int n = 0;
    for (;;) {
        char *comma = strchr(line, ',');
        if (comma) *comma = '\0';
        if (n < max) fields[n] = trim(line);
        n++;
        if (!comma) return n;
        line = comma + 1;
    }
}

/* Parses the CSV in `text` (modified in place) into `rows`; returns the number of rows. */
static int parse_csv(char *text, double rows[MAX_ROWS][IN]) {
    int line_no = 0, n = 0, seen_header = 0;
    char *line = text;
    while (line) {
        char *fields[IN];
        char *next = strchr(line, '\n');
        int count;
        if (next) *next++ = '\0';
        line_no++;
        if (is_blank(line)) {
            line = next;
            continue;
        }
        count = split(line, fields, IN);
        if (!seen_header) {
            if (count != IN) fail("line %d: header has %d columns, expected %d", line_no, count, IN);
            seen_header = 1;
        } else {
            if (count != IN) fail("line %d: expected %d fields, got %d", line_no, IN, count);
            for (int c = 0; c < IN; c++) {
                double v;
                if (!is_number(fields[c])) fail("line %d, column %d: not a number: '%s'", line_no, c + 1, fields[c]);
                v = strtod(fields[c], NULL);
                if (!isfinite(v)) fail("line %d, column %d: out of range: '%s'", line_no, c + 1, fields[c]);
                if (n < MAX_ROWS) rows[n][c] = v; /* rows past the limit are checked, then refused */
            }
            n++;
        }
        line = next;
    }
    if (!seen_header) fail("empty input: expected a header line and at least one row");
    if (n == 0) fail("no data rows after the header");
    if (n > MAX_ROWS) fail("%d data rows, at most %d allowed", n, MAX_ROWS);
    return n;
}

/* Each column to zero mean and unit (population) variance, in double precision, then rounded
 * to float; a constant column becomes all zeros. */
static void normalise(double rows[MAX_ROWS][IN], int n, float *x) {
    for (int c = 0; c < IN; c++) {
        double total = 0.0, sq = 0.0, mean, std;
        for (int i = 0; i < n; i++) total += rows[i][c];
        mean = total / n;
        for (int i = 0; i < n; i++) sq += (rows[i][c] - mean) * (rows[i][c] - mean);
        std = sqrt(sq / n);
        for (int i = 0; i < n; i++) x[i * IN + c] = (float)(std > 0.0 ? (rows[i][c] - mean) / std : 0.0);
    }
}

/* Deterministic weights, row-major. */
static float W1[IN * HIDDEN], B1[HIDDEN], W2[HIDDEN * OUT], B2[OUT];

static void make_weights(void) {
    for (int k = 0; k < IN; k++)
        for (int j = 0; j < HIDDEN; j++) W1[k * HIDDEN + j] = (float)(((3 * k + 5 * j) % 11 - 5) / 8.0);
    for (int j = 0; j < HIDDEN; j++) B1[j] = (float)(((j % 3) - 1) / 10.0);
    for (int j = 0; j < HIDDEN; j++)
        for (int m = 0; m < OUT; m++) W2[j * OUT + m] = (float)(((7 * j + 3 * m) % 13 - 6) / 10.0);
    for (int m = 0; m < OUT; m++) B2[m] = (float)(0.25 - 0.5 * m);
}

/* The MLP in StableHLO for `n` rows, written into `buf`. HIGHEST precision keeps f32 matmuls in
 * full f32 on backends that would otherwise use bf16 or TF32 passes. */
static int program(char *buf, size_t size, int n) {
    char x[32], h[32], y[32];
    snprintf(x, sizeof x, "tensor<%dx%dxf32>", n, IN);
    snprintf(h, sizeof h, "tensor<%dx%dxf32>", n, HIDDEN);
    snprintf(y, sizeof y, "tensor<%dx%dxf32>", n, OUT);
    return snprintf(buf, size,
        "module @c_mlp {\n"
        "  func.func public @main(%%x: %s, %%w1: tensor<%dx%dxf32>, %%b1: tensor<%dxf32>,\n"
        "                         %%w2: tensor<%dx%dxf32>, %%b2: tensor<%dxf32>) -> %s {\n"
        "    %%xw = stablehlo.dot_general %%x, %%w1, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (%s, tensor<%dx%dxf32>) -> %s\n"
        "    %%bb1 = stablehlo.broadcast_in_dim %%b1, dims = [1] : (tensor<%dxf32>) -> %s\n"
        "    %%z = stablehlo.add %%xw, %%bb1 : %s\n"
        "    %%zero = stablehlo.constant dense<0.0> : %s\n"
        "    %%a = stablehlo.maximum %%z, %%zero : %s\n"
        "    %%aw = stablehlo.dot_general %%a, %%w2, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (%s, tensor<%dx%dxf32>) -> %s\n"
        "    %%bb2 = stablehlo.broadcast_in_dim %%b2, dims = [1] : (tensor<%dxf32>) -> %s\n"
        "    %%out = stablehlo.add %%aw, %%bb2 : %s\n"
        "    func.return %%out : %s\n"
        "  }\n"
        "}\n",
        x, IN, HIDDEN, HIDDEN, HIDDEN, OUT, OUT, y,
        x, IN, HIDDEN, h,
        HIDDEN, h, h, h, h,
        h, HIDDEN, OUT, y,
        OUT, y, y, y);
}

/* The same MLP in plain C (double precision). */
static void reference(const float *x, int n, double *out) {
    for (int i = 0; i < n; i++) {
        double hidden[HIDDEN];
        for (int j = 0; j < HIDDEN; j++) {
            double z = B1[j];
            for (int k = 0; k < IN; k++) z += (double)x[i * IN + k] * W1[k * HIDDEN + j];
            hidden[j] = z > 0.0 ? z : 0.0;
        }
        for (int m = 0; m < OUT; m++) {
            double v = B2[m];
            for (int j = 0; j < HIDDEN; j++) v += hidden[j] * W2[j * OUT + m];
            out[i * OUT + m] = v;
        }
    }
}

/* Creates an f32 tensor on device 0 from `count` floats. */
static tpubox_device_types_own_tensor_t upload(const float *values, size_t count, const uint64_t *dims, size_t rank) {
    tpubox_device_types_own_tensor_t t;
    tpubox_device_types_error_t err;
    guest_list_u64_t d = {(uint64_t *)dims, rank};
    guest_list_u8_t data = {(uint8_t *)values, count * sizeof(float)};
    if (!tpubox_device_types_static_tensor_from_bytes(TPUBOX_DEVICE_TYPES_DTYPE_F32, &d, &data, NULL, &t, &err))
        fail_device("upload", &err);
    return t;
}

static void print_rows(const char *label, const float *v, int n, int cols) {
    printf("%s: [", label);
    for (int i = 0; i < n; i++) {
        printf(i ? ",[" : "[");
        for (int c = 0; c < cols; c++) printf(c ? ",%.9g" : "%.9g", v[i * cols + c]);
        printf("]");
    }
    printf("]\n");
}

/* Reads all of stdin (at most MAX_INPUT bytes) into a NUL-terminated buffer. */
static char *read_stdin(void) {
    char *buf = malloc(MAX_INPUT + 1);
    size_t len;
    if (!buf) fail("out of memory");
    len = fread(buf, 1, MAX_INPUT + 1, stdin);
    if (ferror(stdin)) fail("reading stdin failed");
    if (len > MAX_INPUT) fail("input is larger than %d bytes", MAX_INPUT);
    if (memchr(buf, 0, len)) fail("input contains a NUL byte");
    buf[len] = '\0';
    return buf;
}

int main(int argc, char **argv) {
    static double rows[MAX_ROWS][IN];
    static float x[MAX_ROWS * IN], got[MAX_ROWS * OUT];
    static double want[MAX_ROWS * OUT];
    static char code[4096];
    char *text;
    int n, code_len;
    double diff = 0.0;

    if (argc == 1) {
        text = read_stdin();
    } else if (argc == 3 && strcmp(argv[1], "--csv") == 0) {
        text = strdup(argv[2]);
        if (!text) fail("out of memory");
    } else {
        fail("usage: c-mlp [--csv TEXT]  (without --csv the CSV is read from stdin)");
    }

    n = parse_csv(text, rows);
    free(text);
    normalise(rows, n, x);
    make_weights();

    code_len = program(code, sizeof code, n);
    if (code_len < 0 || (size_t)code_len >= sizeof code) fail("program text does not fit");

    {
        tpubox_device_types_error_t err;
        tpubox_device_client_own_executable_t exe;
        tpubox_device_client_compile_options_t opts = {.device = {.is_some = false}};
        guest_list_u8_t src = {(uint8_t *)code, (size_t)code_len};
        const uint64_t xd[] = {(uint64_t)n, IN}, w1d[] = {IN, HIDDEN}, b1d[] = {HIDDEN};
        const uint64_t w2d[] = {HIDDEN, OUT}, b2d[] = {OUT};
        tpubox_device_types_own_tensor_t args[5];
        tpubox_device_types_borrow_tensor_t borrowed[5];
        tpubox_device_client_list_borrow_tensor_t arg_list = {borrowed, 5};
        guest_list_u32_t donate = {NULL, 0};
        tpubox_device_client_list_own_tensor_t outs;
        tpubox_device_types_tensor_spec_t spec;
        guest_list_u8_t bytes;

        if (!tpubox_device_client_compile(TPUBOX_DEVICE_CLIENT_PROGRAM_FORMAT_MLIR_TEXT, &src, &opts, &exe, &err))
            fail_device("compile", &err);
        args[0] = upload(x, (size_t)n * IN, xd, 2);
        args[1] = upload(W1, IN * HIDDEN, w1d, 2);
        args[2] = upload(B1, HIDDEN, b1d, 1);
        args[3] = upload(W2, HIDDEN * OUT, w2d, 2);
        args[4] = upload(B2, OUT, b2d, 1);
        for (int i = 0; i < 5; i++) borrowed[i] = tpubox_device_types_borrow_tensor(args[i]);

        if (!tpubox_device_client_execute(tpubox_device_types_borrow_executable(exe), &arg_list, &donate, &outs, &err))
            fail_device("execute", &err);
        /* Handles own device memory: drop each one as soon as it is no longer needed. */
        for (int i = 0; i < 5; i++) tpubox_device_types_tensor_drop_own(args[i]);
        tpubox_device_types_executable_drop_own(exe);

        if (outs.len != 1) fail("expected 1 result, got %zu", outs.len);
        tpubox_device_types_method_tensor_spec(tpubox_device_types_borrow_tensor(outs.ptr[0]), &spec);
        if (spec.dtype != TPUBOX_DEVICE_TYPES_DTYPE_F32 || spec.dims.len != 2 || spec.dims.ptr[0] != (uint64_t)n ||
            spec.dims.ptr[1] != OUT)
            fail("result has the wrong spec, expected f32[%d,%d]", n, OUT);
        tpubox_device_types_tensor_spec_free(&spec);
        if (!tpubox_device_types_method_tensor_read(tpubox_device_types_borrow_tensor(outs.ptr[0]), &bytes, &err))
            fail_device("read", &err);
        if (bytes.len != (size_t)n * OUT * sizeof(float)) fail("result has %zu bytes", bytes.len);
        memcpy(got, bytes.ptr, bytes.len);
        guest_list_u8_free(&bytes);
        /* Freeing the list only frees its memory: drop the handles in it first. */
        for (size_t i = 0; i < outs.len; i++) tpubox_device_types_tensor_drop_own(outs.ptr[i]);
        tpubox_device_client_list_own_tensor_free(&outs);
    }

    reference(x, n, want);
    for (int i = 0; i < n * OUT; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (!isfinite(got[i]) || !(d <= TOLERANCE)) {
            fail("device result [%d][%d] = %.9g differs from the C reference %.9g (> %g)", i / OUT, i % OUT,
                 got[i], want[i], TOLERANCE);
        }
        if (d > diff) diff = d;
    }
    printf("rows: %d\n", n);
    print_rows("normalized", x, n, IN);
    print_rows("result", got, n, OUT);
    printf("max abs diff: %.9g\n", diff);
    return 0;
}
