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
#define NR 3
/* x rows per register block: NR * MR accumulators + NR weights + one x fit in 32 registers. */
#define MR 8
/* Up to this many x rows (at most MR), weights are converted in registers, never stored (direct_dot). */
#define DIRECT_MAX_M 8
#define PARALLEL_MIN_MACS 65536 /* below this many multiply-adds a call runs single-threaded */
#define ERR_NOMEM 1

typedef int8_t bvec __attribute__((vector_size(CHUNK), aligned(1)));
typedef int16_t hvec __attribute__((vector_size(CHUNK * 2)));
typedef uint32_t uvec __attribute__((vector_size(CHUNK * 4)));

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* CHUNK bytes sign-extended to int32 lanes. GCC lowers a direct byte -> int convertvector to
 * 16 scalar loads (the kernel then ran at ~1 ns an element); AVX-512 has it in one instruction,
 * and elsewhere going through int16 keeps it in vector registers. */
INLINE ivec widen_bytes(const uint8_t *p) {
#ifdef __AVX512F__
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    ivec r;
    memcpy(&r, &v, sizeof r);
    return r;
#else
    return __builtin_convertvector(__builtin_convertvector(*(const bvec *)p, hvec), ivec);
#endif
}

#define MAG_SIGN 0x87f00000u /* sign (bit 31) and the 7 magnitude bits at 20..26 */
#define MAG 0x07f00000u
#define QNAN 0x7fc00000u

/* CHUNK codes -> their values times `factor` (= scale * 2^120). With nan = 0 (a constant where
 * inlined) the caller has checked there are no NaN codes: that check is 3 of 8 ops a chunk. */
INLINE vec e4m3_chunk(const uint8_t *p, float factor, int nan) {
    /* sign-extended: bit 7 copied into 8..31, so after << 20 the sign reaches bit 31 */
    uvec bits = ((uvec)widen_bytes(p) << 20) & MAG_SIGN;
    if (nan) bits |= (uvec)((bits & MAG) == MAG) & QNAN;
    return (vec)bits * factor;
}

/* Whether any of the n codes at p is a NaN (0x7f / 0xff): 64 codes a step, a few ops each. */
static int has_nan_code(const uint8_t *p, int64_t n) {
    typedef uint8_t b64 __attribute__((vector_size(64), aligned(1)));
    b64 hit = {0};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) hit |= (b64)((*(const b64 *)(p + i) & 0x7f) == 0x7f);
    uint64_t lanes[8], any = 0;
    memcpy(lanes, &hit, sizeof lanes);
    for (int l = 0; l < 8; l++) any |= lanes[l];
    for (; i < n; i++) any |= (p[i] & 0x7f) == 0x7f;
    return any != 0;
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
    for (; k + CHUNK <= len; k += CHUNK) STORE(out + k, e4m3_chunk(w + k, pre, 1) * post);
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

/* The call's arguments, as every group of NR weight rows reads them. */
typedef struct {
    const float *x;            /* [M, K], rows xs apart */
    int64_t xs;
    const uint8_t *w;          /* [N, K] */
    const float *scale;        /* [ceil(N / bn), scale_cols] */
    int64_t scale_cols, bn, bk;
    const float *bias;         /* [N] or NULL */
    float *y;                  /* [M, N] */
    int64_t M, N, K;
} fp8_args;

/* Calls FN(..., mr) with mr = min(M_LEFT, MR) as a constant, so the register loops unroll. */
#define BY_MR(M_LEFT, FN, ...)                                                                   \
    switch ((M_LEFT) < MR ? (int)(M_LEFT) : MR) {                                                \
    case 1: FN(__VA_ARGS__, 1); break;                                                           \
    case 2: FN(__VA_ARGS__, 2); break;                                                           \
    case 3: FN(__VA_ARGS__, 3); break;                                                           \
    case 4: FN(__VA_ARGS__, 4); break;                                                           \
    case 5: FN(__VA_ARGS__, 5); break;                                                           \
    case 6: FN(__VA_ARGS__, 6); break;                                                           \
    case 7: FN(__VA_ARGS__, 7); break;                                                           \
    default: FN(__VA_ARGS__, MR); break;                                                         \
    }

/* out[j][i] = dot(wbuf row j, x row i) for j < NR, i < mr. */
INLINE void buffer_dot(const float *wbuf, const float *x, int64_t xs, int64_t K, float out[NR][MR],
                       int mr) {
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

/* out[j][i] = dot(fp8 row n0 + j, x row i), converted in registers (M <= MR: one pass over x
 * rows, so nothing is converted twice). Rows past N repeat row N - 1 (their sums are dropped).
 * Needs every scale * 2^120 finite and no NaN codes (direct_ok). */
INLINE void direct_dot(const fp8_args *a, int64_t n0, float out[NR][MR], int mr) {
    const uint8_t *wr[NR];
    const float *sr[NR];
    vec acc[NR][MR];
    float tail[NR][MR];
    for (int j = 0; j < NR; j++) {
        const int64_t r = n0 + j < a->N ? n0 + j : a->N - 1;
        wr[j] = a->w + r * a->K;
        sr[j] = a->scale + (r / a->bn) * a->scale_cols;
        for (int i = 0; i < mr; i++) acc[j][i] = splat(0.0f), tail[j][i] = 0.0f;
    }
    for (int64_t k0 = 0, b = 0; k0 < a->K; k0 += a->bk, b++) { /* one scale per row per segment */
        const int64_t end = a->K - k0 < a->bk ? a->K : k0 + a->bk;
        float f[NR];
        for (int j = 0; j < NR; j++) f[j] = sr[j][b] * 0x1p120f;
        int64_t k = k0;
        for (; k + CHUNK <= end; k += CHUNK) {
            vec wv[NR];
            for (int j = 0; j < NR; j++) wv[j] = e4m3_chunk(wr[j] + k, f[j], 0);
            for (int i = 0; i < mr; i++) {
                const vec xv = LOAD(a->x + i * a->xs + k);
                for (int j = 0; j < NR; j++) acc[j][i] += xv * wv[j];
            }
        }
        for (; k < end; k++)
            for (int j = 0; j < NR; j++)
                for (int i = 0; i < mr; i++) tail[j][i] += a->x[i * a->xs + k] * e4m3_one(wr[j][k], f[j]);
    }
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < mr; i++) out[j][i] = hsum(acc[j][i]) + tail[j][i];
}

/* Whether direct_dot may take rows n0..n0+nr: no NaN code, every scale times 2^120 finite.
 * Otherwise (no real checkpoint) the rows go through dequant_row, which handles both. */
static int direct_ok(const fp8_args *a, int64_t n0, int nr) {
    if (has_nan_code(a->w + n0 * a->K, nr * a->K)) return 0;
    for (int j = 0; j < nr; j++) {
        const float *sr = a->scale + ((n0 + j) / a->bn) * a->scale_cols;
        for (int64_t b = 0; b < a->scale_cols; b++)
            if (!isfinite(sr[b] * 0x1p120f)) return 0;
    }
    return 1;
}

/* y[m0 + i, n0 + j] = out[j][i] (+ bias) for i < mr, j < nr. */
static void store_out(const fp8_args *a, float out[NR][MR], int64_t m0, int64_t n0, int nr) {
    const int64_t mr = a->M - m0 < MR ? a->M - m0 : MR;
    for (int64_t i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            a->y[(m0 + i) * a->N + n0 + j] = out[j][i] + (a->bias ? a->bias[n0 + j] : 0.0f);
}

/* The weight rows n0..n0+nr against every x row. Decode-sized M converts in registers; larger M
 * dequantizes the rows once into wbuf ([NR, K] fp32, in L1/L2) and reads them per block of x rows. */
static void row_group(const fp8_args *a, float *wbuf, int64_t n0) {
    const int nr = a->N - n0 < NR ? (int)(a->N - n0) : NR;
    float out[NR][MR];
    if (a->M <= DIRECT_MAX_M && direct_ok(a, n0, nr)) {
        BY_MR(a->M, direct_dot, a, n0, out);
        store_out(a, out, 0, n0, nr);
        return;
    }
    for (int j = 0; j < nr; j++)
        dequant_row(a->w + (n0 + j) * a->K, a->scale + ((n0 + j) / a->bn) * a->scale_cols, a->bk, a->K,
                    wbuf + j * a->K);
    memset(wbuf + nr * a->K, 0, (NR - nr) * a->K * sizeof(float)); /* the last group's missing rows */
    for (int64_t m0 = 0; m0 < a->M; m0 += MR) {
        BY_MR(a->M - m0, buffer_dot, wbuf, a->x + m0 * a->xs, a->xs, a->K, out);
        store_out(a, out, m0, n0, nr);
    }
}

/* y [M, N] = x @ (fp8(w) * scale).T (+ bias), parallel over groups of NR weight rows: w is read
 * from memory once whatever M is. Returns 0, or ERR_NOMEM when a thread's row buffer could not
 * be allocated (y is then incomplete). */
int rayllm_fp8_linear_f32(const float *x, int64_t x_stride, const uint8_t *w, const float *scale,
                          int64_t scale_cols, int64_t bn, int64_t bk, const float *bias, float *y,
                          int64_t M, int64_t N, int64_t K) {
    const fp8_args a = {x, x_stride, w, scale, scale_cols, bn, bk, bias, y, M, N, K};
    const int64_t groups = (N + NR - 1) / NR;
    int err = 0;
#pragma omp parallel if (M * N * K >= PARALLEL_MIN_MACS)
    {
        float *wbuf = malloc(NR * K * sizeof(float)); /* small: allocated even where unused */
        if (wbuf == NULL) {
#pragma omp atomic write
            err = ERR_NOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++)
            if (wbuf != NULL) row_group(&a, wbuf, g * NR);
        free(wbuf);
    }
    return err;
}

/* out[i] = fp8(codes[i]) (scale 1): the conversion alone, for the exhaustive test. */
void rayllm_fp8_e4m3_to_f32(const uint8_t *codes, float *out, int64_t n) {
    dequant_segment(codes, out, n, 1.0f);
}
