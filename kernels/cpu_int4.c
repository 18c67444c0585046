/* Group-wise int4 weights times fp32 activations on CPU: y = x @ W^T (+ bias), the codes
 * unpacked in registers. Built and loaded like cpu_ops.c (kernels/cpu_build.py); the
 * wrapper, the repacking into this layout and the torch fallback are in kernels/cpu_int4.py.
 *
 * Layout, for W [N out, K in] with its input rows sorted by group (the wrapper permutes x's
 * columns to match when act-order scattered them):
 *
 *   codes  [N * K / 2] uint8  4 outputs (NR) at a time, their codes along K interleaved by
 *                             blocks of 32 inputs: block b of the outputs 4i..4i+3 is 4 runs
 *                             of 16 bytes, one per output, so a thread reads one stream.
 *                             Byte j of a run holds k = 32b + j in its low nibble and
 *                             k = 32b + j + 16 in its high one: one 16-byte load gives two runs
 *                             of 16 consecutive k without shuffles. A last block of w < 32
 *                             inputs (K % 32, a multiple of 8) pairs j with j + w / 2, and a
 *                             last group of fewer than 4 outputs interleaves just those.
 *   scales [N, S] fp16        per output and segment (a run of sorted k in one group)
 *   zeros  [N, S] uint8       the true zero point, 0..16
 *   bounds [S + 1] int32      segment s covers k in [bounds[s], bounds[s + 1])
 *
 *   W[n, k] = (q[n, k] - zeros[n, s(k)]) * scales[n, s(k)], exact in fp32.
 *
 * Threads split the outputs NR at a time. For a few rows of x (decode) the codes go straight
 * from bytes to fp32 registers and meet each MR-row tile of x (k in vector lanes, one
 * accumulator per row and output); for more rows, KC inputs of the NR outputs are dequantized
 * into an fp32 buffer (in L1) once and every MR-row tile multiplies it. The wrapper sends
 * still larger calls to torch's dense matmul on tiles from rayllm_int4_dequant_f32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define MR 4     /* rows of x per register tile */
#define NR 4     /* outputs per register tile (and per dequantized buffer) */
#define KC 512   /* inputs per dequantized chunk: NR * KC floats stay in L1 */
#define BLOCK 32 /* inputs per packed block: 16 bytes */
#define PARALLEL_MIN_MACS 65536 /* below this M * N * K a call stays on the calling thread */

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

/* 16 int8 -> 16 floats, through int32 (GCC scalarizes the direct int8 -> float conversion). */
INLINE vec widen(i8x16 v) { return __builtin_convertvector(__builtin_convertvector(v, ivec), vec); }

/* IEEE half -> float (a scale is converted once per output and segment, so no F16C needed). */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in float */
        const float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
    const uint8_t *zeros;
    const int32_t *bounds;
    int64_t num_segments, K, N;
} Weights;

/* The bytes of output n's block of inputs starting at b (a multiple of BLOCK). */
INLINE const uint8_t *block_at(const Weights *wt, int64_t n, int64_t b) {
    const int64_t n0 = n - n % NR, nr = wt->N - n0 < NR ? wt->N - n0 : NR;
    const int64_t w = wt->K - b < BLOCK ? wt->K - b : BLOCK;
    return wt->codes + n0 * (wt->K / 2) + (b / 2) * nr + (n - n0) * (w / 2);
}

/* The input k of the code in byte `byte` (relative to the block at b, width w), nibble hi. */
static inline uint8_t code_at(const Weights *wt, int64_t n, int64_t k) {
    const int64_t b = k - k % BLOCK, w = wt->K - b < BLOCK ? wt->K - b : BLOCK, j = k - b;
    const uint8_t byte = block_at(wt, n, b)[j < w / 2 ? j : j - w / 2];
    return j < w / 2 ? byte & 0xf : byte >> 4;
}

/* out[k - k0] = W[n, k] for k in [k0, k1) (k0 a multiple of BLOCK), segment by segment: one
 * scale conversion per segment, whole blocks inside it unpacked 32 codes at a time. */
static void dequant_row(const Weights *wt, int64_t n, int64_t k0, int64_t k1, float *out) {
    int64_t s = 0;
    while (wt->bounds[s + 1] <= k0) s++;
    for (int64_t k = k0; k < k1; s++) {
        const int64_t end = wt->bounds[s + 1] < k1 ? wt->bounds[s + 1] : k1;
        const float scale = half_to_float(wt->scales[n * wt->num_segments + s]);
        const uint8_t zero = wt->zeros[n * wt->num_segments + s];
        const vec vscale = splat(scale);
        const i8x16 z = (i8x16){} + (int8_t)zero;
        for (; k < end && (k % BLOCK || k + BLOCK > end); k++) /* up to a whole block inside the segment */
            out[k - k0] = (float)((int)code_at(wt, n, k) - (int)zero) * scale;
        for (; k + BLOCK <= end; k += BLOCK) {
            const u8x16 bytes = *(const u8x16 *)block_at(wt, n, k);
            STORE(out + (k - k0), widen((i8x16)(bytes & 0xf) - z) * vscale);
            STORE(out + (k - k0) + 16, widen((i8x16)(bytes >> 4) - z) * vscale);
        }
        for (; k < end; k++) /* the segment ends inside a block */
            out[k - k0] = (float)((int)code_at(wt, n, k) - (int)zero) * scale;
    }
}

/* acc[i * NR + r] += x[i, 0:kc] * w[r, 0:kc] lane-wise, for the `rows` (<= MR, a constant
 * once inlined) rows xr[i] (k offset already applied) and the NR dequantized rows w[r] (KC
 * apart). kc % 8 == 0. */
INLINE void tile_rows(const float *const *xr, const float *w, int64_t kc, vec *acc, const int rows) {
    vec c[MR][NR];
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < NR; r++) c[i][r] = acc[i * NR + r];
    int64_t k = 0;
    for (; k + CHUNK <= kc; k += CHUNK) {
        vec wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = LOAD(w + r * KC + k);
        for (int i = 0; i < rows; i++) {
            const vec xv = LOAD(xr[i] + k);
            for (int r = 0; r < NR; r++) c[i][r] += xv * wv[r];
        }
    }
    for (; k < kc; k++) /* K % 16 == 8: one half chunk */
        for (int i = 0; i < rows; i++)
            for (int r = 0; r < NR; r++) c[i][r][k % CHUNK] += xr[i][k] * w[r * KC + k];
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < NR; r++) acc[i * NR + r] = c[i][r];
}

/* tile_rows with `rows` made a constant: decode's 1 to 3 rows do no work for absent ones. */
static void tile(const float *const *xr, const float *w, int64_t kc, vec *acc, int rows) {
    switch (rows) {
    case 1: tile_rows(xr, w, kc, acc, 1); break;
    case 2: tile_rows(xr, w, kc, acc, 2); break;
    case 3: tile_rows(xr, w, kc, acc, 3); break;
    default: tile_rows(xr, w, kc, acc, MR); break;
    }
}

/* t[i][r] += x[i, k] * W[n0 + r, k]: the ends of segments that do not fall on whole blocks
 * (kept apart from the vector accumulators, which then never leave registers). */
INLINE void scalar_step(const Weights *wt, const float *const *xr, const int64_t *n, const uint8_t *zero,
                        const float *scale, int64_t k, float t[MR][NR], const int rows) {
    for (int r = 0; r < NR; r++) {
        const float w = (float)((int)code_at(wt, n[r], k) - (int)zero[r]) * scale[r];
        for (int i = 0; i < rows; i++) t[i][r] += xr[i][k] * w;
    }
}

/* acc[i * NR + r] = x[i, :] * W[n0 + r, :] lane-wise, the codes unpacked straight into
 * registers (no buffer): the decode path, where each weight meets only a few rows. */
INLINE void direct_rows(const Weights *wt, const float *const *xr, int64_t n0, int64_t N, vec *acc,
                        const int rows) {
    const int64_t nr = N - n0 < NR ? N - n0 : NR;
    const uint8_t *base = wt->codes + n0 * (wt->K / 2); /* the NR outputs' blocks, interleaved */
    int64_t n[NR];
    vec c[MR][NR];
    float t[MR][NR] = {{0.0f}};
    for (int r = 0; r < NR; r++) {
        n[r] = n0 + (r < nr ? r : nr - 1);
        for (int i = 0; i < rows; i++) c[i][r] = splat(0.0f);
    }
    for (int64_t s = 0, k = 0; s < wt->num_segments; s++) {
        const int64_t end = wt->bounds[s + 1];
        float scale[NR];
        uint8_t zero[NR];
        vec vscale[NR];
        i8x16 z[NR];
        for (int r = 0; r < NR; r++) {
            const int64_t gs = n[r] * wt->num_segments + s;
            scale[r] = half_to_float(wt->scales[gs]), zero[r] = wt->zeros[gs];
            vscale[r] = splat(scale[r]), z[r] = (i8x16){} + (int8_t)zero[r];
        }
        for (; k < end && (k % BLOCK || k + BLOCK > end); k++) scalar_step(wt, xr, n, zero, scale, k, t, rows);
        for (; k + BLOCK <= end; k += BLOCK)
            for (int r = 0; r < NR; r++) {
                const u8x16 bytes = *(const u8x16 *)(base + (k / 2) * nr + (n[r] - n0) * 16);
                const vec lo = widen((i8x16)(bytes & 0xf) - z[r]) * vscale[r];
                const vec hi = widen((i8x16)(bytes >> 4) - z[r]) * vscale[r];
                for (int i = 0; i < rows; i++) {
                    c[i][r] += LOAD(xr[i] + k) * lo;
                    c[i][r] += LOAD(xr[i] + k + 16) * hi;
                }
            }
        for (; k < end; k++) scalar_step(wt, xr, n, zero, scale, k, t, rows);
    }
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < NR; r++) {
            c[i][r][0] += t[i][r];
            acc[i * NR + r] = c[i][r];
        }
}

static void direct(const Weights *wt, const float *const *xr, int64_t n0, int64_t N, vec *acc, int rows) {
    switch (rows) {
    case 1: direct_rows(wt, xr, n0, N, acc, 1); break;
    case 2: direct_rows(wt, xr, n0, N, acc, 2); break;
    case 3: direct_rows(wt, xr, n0, N, acc, 3); break;
    default: direct_rows(wt, xr, n0, N, acc, MR); break;
    }
}

/* acc[m * NR + r] = x[m, :] * W[n0 + r, :] lane-wise for every row m, KC inputs of the NR
 * outputs dequantized into wbuf at a time and multiplied with each MR-row tile of x. */
static void buffered(const Weights *wt, const float *x, int64_t M, int64_t x_stride, int64_t N, int64_t n0,
                     float *wbuf, vec *acc) {
    memset(acc, 0, (size_t)(M * NR) * sizeof(vec));
    for (int64_t k0 = 0; k0 < wt->K; k0 += KC) {
        const int64_t kc = wt->K - k0 < KC ? wt->K - k0 : KC;
        for (int r = 0; r < NR; r++) dequant_row(wt, n0 + r < N ? n0 + r : N - 1, k0, k0 + kc, wbuf + r * KC);
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int rows = M - m0 < MR ? (int)(M - m0) : MR;
            const float *xr[MR];
            for (int i = 0; i < rows; i++) xr[i] = x + (m0 + i) * x_stride + k0;
            tile(xr, wbuf, kc, acc + m0 * NR, rows);
        }
    }
}

/* y[:, n0:n0 + NR] for every row of x; outputs past N repeat the last one (computed, never
 * stored). wbuf: NR * KC floats; acc: M * NR vectors. Up to direct_max_rows rows the codes
 * go straight into registers, once per MR rows; above, through wbuf, once per call. */
static void output_block(const Weights *wt, const float *x, int64_t M, int64_t x_stride, const float *bias,
                         float *y, int64_t N, int64_t n0, float *wbuf, vec *acc, int64_t direct_max_rows) {
    const float *xr[MR];
    for (int64_t m0 = 0; m0 < M && M <= direct_max_rows; m0 += MR) {
        const int rows = M - m0 < MR ? (int)(M - m0) : MR;
        for (int i = 0; i < rows; i++) xr[i] = x + (m0 + i) * x_stride;
        direct(wt, xr, n0, N, acc + m0 * NR, rows);
    }
    if (M > direct_max_rows) buffered(wt, x, M, x_stride, N, n0, wbuf, acc);
    for (int64_t m = 0; m < M; m++)
        for (int r = 0; r < NR && n0 + r < N; r++)
            y[m * N + n0 + r] = hsum(acc[m * NR + r]) + (bias ? bias[n0 + r] : 0.0f);
}

/* y [M, N] (contiguous) = x [M, K] (rows x_stride apart, columns in the sorted order) @ W^T
 * (+ bias [N] or NULL). Returns 0, or 1 when a thread's scratch could not be allocated. */
int rayllm_int4_gemm_f32(const float *x, int64_t M, int64_t x_stride, const uint8_t *codes,
                         const uint16_t *scales, const uint8_t *zeros, const int32_t *bounds,
                         int64_t num_segments, int64_t K, int64_t N, const float *bias, float *y,
                         int64_t direct_max_rows) {
    const Weights wt = {codes, scales, zeros, bounds, num_segments, K, N};
    const int64_t n_blocks = (N + NR - 1) / NR;
    int failed = 0;
#pragma omp parallel if (M * N * K >= PARALLEL_MIN_MACS)
    {
        float *wbuf = aligned_alloc(64, NR * KC * sizeof(float));
        vec *acc = aligned_alloc(64, (size_t)(M * NR) * sizeof(vec));
        if (!wbuf || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < n_blocks; nb++)
            if (wbuf && acc) output_block(&wt, x, M, x_stride, bias, y, N, nb * NR, wbuf, acc, direct_max_rows);
        free(wbuf);
        free(acc);
    }
    return failed;
}

/* w [n1 - n0, K] fp32 = W[n0:n1, :] (sorted input order): the dense tiles of the prefill path. */
void rayllm_int4_dequant_f32(const uint8_t *codes, const uint16_t *scales, const uint8_t *zeros,
                             const int32_t *bounds, int64_t num_segments, int64_t K, int64_t N, int64_t n0,
                             int64_t n1, float *w) {
    const Weights wt = {codes, scales, zeros, bounds, num_segments, K, N};
#pragma omp parallel for schedule(static) if ((n1 - n0) * K >= PARALLEL_MIN_MACS)
    for (int64_t n = n0; n < n1; n++)
        dequant_row(&wt, n, 0, K, w + (n - n0) * K);
}
