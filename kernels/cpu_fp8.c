/* FP8 (e4m3fn) weights on CPU: y = x @ (fp8(w) * scale).T (+ bias), the weight converted in
 * registers, never dense in memory. Built and loaded like cpu_ops.c (kernels/cpu_build.py);
 * the wrapper, its checks and its torch fallback are in kernels/cpu_fp8.py.
 *
 * Layouts: x [M, K] fp32, rows x_stride apart; w [N, K] uint8 (the fp8 bytes), contiguous;
 * y [M, N] contiguous. One scale per (bn x bk) block of w: scale[(n / bn) * scale_cols + k / bk].
 * Per tensor is bn = N, bk = K; per row is bn = 1, bk = K.
 *
 * Conversion: the magnitude bits b & 0x7f shifted to bit 20 land the 4 exponent bits in the
 * low bits of fp32's exponent and the 3 mantissa bits at its top, so read as an fp32 they are
 * the e4m3 value times 2^-120 (e4m3's bias is 7, fp32's 127), for normals and subnormals
 * alike (an e4m3 subnormal becomes an fp32 subnormal). The sign goes to bit 31. Multiplying
 * by scale * 2^120 then gives fp8 * scale rounded once, as torch's `w.float() * scale` does.
 * Codes 0x7f / 0xff (e4m3fn's NaNs) become NaN, as in torch. This relies on subnormals not
 * being flushed (no DAZ): torch leaves MXCSR alone and nothing here is built with -ffast-math.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

/* Weight rows dequantized together: each x chunk loaded serves NR of them. */
#define NR 4
/* x rows per register block: NR * MR accumulators + NR weights + one x fit in 32 registers. */
#define MR 6
#define PARALLEL_MIN_MACS 65536 /* below this many multiply-adds a call runs single-threaded */
#define ERR_NOMEM 1

typedef int8_t bvec __attribute__((vector_size(CHUNK)));
typedef uint32_t uvec __attribute__((vector_size(CHUNK * 4)));

#define MAG_SIGN 0x87f00000u /* sign (bit 31) and the 7 magnitude bits at 20..26 */
#define MAG 0x07f00000u
#define QNAN 0x7fc00000u

/* CHUNK codes -> their values times `factor` (= scale * 2^120). */
INLINE vec e4m3_chunk(const uint8_t *p, float factor) {
    bvec b;
    memcpy(&b, p, CHUNK);
    /* sign-extended: bit 7 copied into 8..31, so after << 20 the sign reaches bit 31 */
    uvec bits = ((uvec)__builtin_convertvector(b, ivec) << 20) & MAG_SIGN;
    bits |= (uvec)((bits & MAG) == MAG) & QNAN;
    return (vec)bits * factor;
}

INLINE float e4m3_one(uint8_t b, float factor) {
    uint32_t bits = ((uint32_t)(b & 0x7f) << 20) | ((uint32_t)(b & 0x80) << 24);
    if ((bits & MAG) == MAG) bits |= QNAN;
    float f;
    memcpy(&f, &bits, 4);
    return f * factor;
}

/* out[k] = fp8(w[k]) * s for k < len. s * 2^120 overflows for s >= 2^8 (no real checkpoint):
 * there the 2^120 goes first (exact) and s second, still one rounding. */
static void dequant_segment(const uint8_t *w, float *out, int64_t len, float s) {
    float pre = s * 0x1p120f, post = 1.0f;
    if (!isfinite(pre)) pre = 0x1p120f, post = s;
    int64_t k = 0;
    for (; k + CHUNK <= len; k += CHUNK) STORE(out + k, e4m3_chunk(w + k, pre) * post);
    for (; k < len; k++) out[k] = e4m3_one(w[k], pre) * post;
}

/* One weight row [K] dequantized into out; srow: its block row of scales. */
static void dequant_row(const uint8_t *w, const float *srow, int64_t bk, int64_t K, float *out) {
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += bk, b++)
        dequant_segment(w + k0, out + k0, (K - k0 < bk ? K - k0 : bk), srow[b]);
}

/* out [r1 - r0, K] = rows r0..r1 of w dequantized (the prefill path's tiles). */
void rayllm_fp8_dequant_rows_f32(const uint8_t *w, const float *scale, int64_t scale_cols, int64_t bn,
                                 int64_t bk, float *out, int64_t r0, int64_t r1, int64_t K) {
#pragma omp parallel for schedule(static) if ((r1 - r0) * K >= PARALLEL_MIN_MACS)
    for (int64_t r = r0; r < r1; r++)
        dequant_row(w + r * K, scale + (r / bn) * scale_cols, bk, K, out + (r - r0) * K);
}

/* acc[j][i] = dot(wbuf row j, x row i) for j < NR, i < mr (mr a constant where inlined). */
INLINE void block_dot(const float *wbuf, const float *x, int64_t xs, int64_t K, int mr,
                      float out[NR][MR]) {
    vec acc[NR][MR];
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < mr; i++) acc[j][i] = splat(0.0f);
    int64_t k = 0;
    for (; k + CHUNK <= K; k += CHUNK) {
        vec wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = LOAD(wbuf + j * K + k);
        for (int i = 0; i < mr; i++) {
            const vec xv = LOAD(x + i * xs + k);
            for (int j = 0; j < NR; j++) acc[j][i] += xv * wv[j];
        }
    }
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < mr; i++) {
            float s = hsum(acc[j][i]);
            for (int64_t t = k; t < K; t++) s += x[i * xs + t] * wbuf[j * K + t];
            out[j][i] = s;
        }
}

/* The NR rows in wbuf against every x row; y columns n0..n0+nr. */
static void rows_times_x(const float *wbuf, const float *x, int64_t xs, const float *bias, float *y,
                         int64_t M, int64_t N, int64_t K, int64_t n0, int nr) {
    float out[NR][MR];
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const float *xm = x + m0 * xs;
        switch (M - m0 < MR ? (int)(M - m0) : MR) { /* constant mr: the loops unroll */
        case 1: block_dot(wbuf, xm, xs, K, 1, out); break;
        case 2: block_dot(wbuf, xm, xs, K, 2, out); break;
        case 3: block_dot(wbuf, xm, xs, K, 3, out); break;
        case 4: block_dot(wbuf, xm, xs, K, 4, out); break;
        case 5: block_dot(wbuf, xm, xs, K, 5, out); break;
        default: block_dot(wbuf, xm, xs, K, MR, out); break;
        }
        const int64_t mr = M - m0 < MR ? M - m0 : MR;
        for (int64_t i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++)
                y[(m0 + i) * N + n0 + j] = out[j][i] + (bias ? bias[n0 + j] : 0.0f);
    }
}

/* y [M, N] = x @ (fp8(w) * scale).T (+ bias). Parallel over groups of NR weight rows: each
 * group is dequantized once into a per-thread buffer ([NR, K] fp32, in L1/L2) and dotted
 * with all M rows of x, so w is read from memory once whatever M is. Returns 0, or
 * ERR_NOMEM when a thread's buffer could not be allocated (y is then incomplete). */
int rayllm_fp8_linear_f32(const float *x, int64_t x_stride, const uint8_t *w, const float *scale,
                          int64_t scale_cols, int64_t bn, int64_t bk, const float *bias, float *y,
                          int64_t M, int64_t N, int64_t K) {
    const int64_t groups = (N + NR - 1) / NR;
    int err = 0;
#pragma omp parallel if (M * N * K >= PARALLEL_MIN_MACS)
    {
        float *wbuf = malloc(NR * K * sizeof(float));
        if (wbuf == NULL) {
#pragma omp atomic write
            err = ERR_NOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (wbuf == NULL) continue;
            const int64_t n0 = g * NR;
            const int nr = N - n0 < NR ? (int)(N - n0) : NR;
            for (int j = 0; j < nr; j++)
                dequant_row(w + (n0 + j) * K, scale + ((n0 + j) / bn) * scale_cols, bk, K, wbuf + j * K);
            memset(wbuf + nr * K, 0, (NR - nr) * K * sizeof(float)); /* the last group's missing rows */
            rows_times_x(wbuf, x, x_stride, bias, y, M, N, K, n0, nr);
        }
        free(wbuf);
    }
    return err;
}

/* out[i] = fp8(codes[i]) (scale 1): the conversion alone, for the exhaustive test. */
void rayllm_fp8_e4m3_to_f32(const uint8_t *codes, float *out, int64_t n) {
    dequant_segment(codes, out, n, 1.0f);
}
