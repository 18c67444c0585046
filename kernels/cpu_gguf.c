/* y = x @ W.T on CPU with W kept in GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K),
 * fp32 x and y. Built and loaded like cpu_ops.c (kernels/cpu_build.py); the wrapper and its torch
 * fallback are in kernels/cpu_gguf.py, the block layouts in kernels/torch_gguf.py and the
 * vectorized dequantizers in cpu_gguf_blocks.h.
 *
 * W is uint8 [N, row_bytes]: row n is the blocks of W[n, :]. Threads split W into groups of NR
 * rows:
 *
 *     for each group of NR (4) rows of W (OpenMP splits these):
 *         wbuf[NR][K] = dequantize(the rows)                  (L1 / L2: 9 KB for K = 576)
 *         for each block of MR (4) rows of x:                 NR x MR accumulators in registers
 *             y[block, group] = x[block] . wbuf               (k in the lanes, one transpose_sum)
 *
 * so W is read once as bytes whatever M is, dequantized once, and never dense beyond NR rows a
 * thread; x (M x K floats) is re-read from L2 by each group. The same loop serves decode (few
 * rows, bound by the dequantizer and memory) and batches or prefill (bound by the multiply-adds).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gguf_blocks.h"

#define PARALLEL_MIN_WORK 262144 /* below this many multiply-adds a call stays on one thread */
#define ERR_TYPE 1 /* a type id without a dequantizer here */
#define ERR_NOMEM 2 /* a thread's row buffer could not be allocated (y is then incomplete) */
#define NR 4 /* W rows dequantized together: each x chunk loaded serves NR of them */
#define X_BLOCK_BYTES (256 * 1024) /* x rows multiplied per pass over W: a quarter of a 1 MiB L2 */
#define MR 4 /* x rows per register block: NR * MR = CHUNK accumulators, summed by one transpose_sum */

/* Keeps v in a register: otherwise GCC folds a loaded vector into each multiply-add that uses
 * it (NR or MR loads where one does), and the loop becomes load-bound. */
#if defined(__AVX512F__) || defined(__AVX__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

/* The many-row call's arguments, as every group of NR W rows reads them. */
typedef struct {
    const float *x; /* [M, K], rows xs apart */
    int64_t xs;
    const uint8_t *w; /* [N, row_bytes] blocks of qtype */
    int64_t row_bytes;
    int qtype;
    float *y; /* [M, N], rows ys apart */
    int64_t ys, M, N, K;
} gguf_args;

/* y[i * ys + j] = x row i . wbuf row j for i < mr, j < nr; wbuf [NR][K] fp32, K % CHUNK == 0.
 * acc[j * MR + i] keeps k in its lanes; one transpose_sum turns the CHUNK of them into sums. */
INLINE void block_dot(const float *wbuf, const float *x, int64_t xs, int64_t K, float *y, int64_t ys, int nr,
                      const int mr) {
    vec acc[NR * MR];
    for (int p = 0; p < NR * MR; p++) acc[p] = splat(0.0f);
    for (int64_t k = 0; k < K; k += CHUNK) {
        vec wv[NR];
        for (int j = 0; j < NR; j++) {
            wv[j] = LOAD(wbuf + j * K + k);
            IN_REGISTER(wv[j]);
        }
        for (int i = 0; i < mr; i++) {
            vec xv = LOAD(x + i * xs + k);
            IN_REGISTER(xv);
            for (int j = 0; j < NR; j++) acc[j * MR + i] += xv * wv[j];
        }
    }
    const vec s = transpose_sum(acc);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ys + j] = s[j * MR + i];
}

/* W rows n0..n0+NR dequantized into wbuf once (NR * K floats: L1 / L2), then multiplied with
 * every x row, MR at a time. Rows past N are zero in wbuf and their sums dropped. */
static void row_group(const gguf_args *a, float *wbuf, int64_t n0) {
    int64_t elems, bytes;
    block_layout(a->qtype, &elems, &bytes);
    const int nr = a->N - n0 < NR ? (int)(a->N - n0) : NR;
    for (int j = 0; j < nr; j++) dequant_blocks(a->w + (n0 + j) * a->row_bytes, a->qtype, 0, a->K / elems, wbuf + j * a->K);
    memset(wbuf + nr * a->K, 0, (size_t)(NR - nr) * a->K * sizeof(float));
    int64_t m0 = 0;
    for (; m0 + MR <= a->M; m0 += MR) block_dot(wbuf, a->x + m0 * a->xs, a->xs, a->K, a->y + m0 * a->ys + n0, a->ys, nr, MR);
    switch (a->M - m0) { /* mr a constant in each, so the register loops unroll */
    case 1: block_dot(wbuf, a->x + m0 * a->xs, a->xs, a->K, a->y + m0 * a->ys + n0, a->ys, nr, 1); break;
    case 2: block_dot(wbuf, a->x + m0 * a->xs, a->xs, a->K, a->y + m0 * a->ys + n0, a->ys, nr, 2); break;
    case 3: block_dot(wbuf, a->x + m0 * a->xs, a->xs, a->K, a->y + m0 * a->ys + n0, a->ys, nr, 3); break;
    default: break;
    }
}

/* Rows of x per pass over W: a block of x that stays in L2 while every group of W rows reads it.
 * A prefill of thousands of rows would otherwise stream all of x from memory once per group;
 * the price is dequantizing W once per block, small beside the block's multiply-adds. */
static int64_t x_block_rows(int64_t K) {
    const int64_t rows = X_BLOCK_BYTES / ((int64_t)sizeof(float) * K) / MR * MR;
    return rows > MR ? rows : MR;
}

/* y [M, N] (rows y_stride apart) = x [M, K] (rows x_stride apart) @ W.T, W = w's N rows of
 * `qtype` blocks, row_bytes apart; K a multiple of the block (and so of 32).
 * Returns 0, ERR_TYPE for a type this file cannot dequantize, or ERR_NOMEM. */
int rayllm_gguf_linear_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes, int qtype,
                           float *y, int64_t y_stride, int64_t M, int64_t N, int64_t K) {
    int64_t elems, bytes;
    block_layout(qtype, &elems, &bytes);
    if (elems == 0) return ERR_TYPE;
    const int64_t groups = (N + NR - 1) / NR, mb = x_block_rows(K);
    int err = 0;
#pragma omp parallel if (M * N * K >= PARALLEL_MIN_WORK)
    {
        float *wbuf = malloc((size_t)NR * K * sizeof(float));
        if (wbuf == NULL) {
#pragma omp atomic write
            err = ERR_NOMEM;
        }
        for (int64_t m0 = 0; m0 < M; m0 += mb) { /* every thread, in step: the omp for's barrier */
            const gguf_args a = {x + m0 * x_stride, x_stride, w, row_bytes, qtype, y + m0 * y_stride, y_stride,
                                 M - m0 < mb ? M - m0 : mb, N, K};
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++)
                if (wbuf != NULL) row_group(&a, wbuf, g * NR);
        }
        free(wbuf);
    }
    return err;
}
