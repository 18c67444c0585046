/* y = x @ W.T on CPU with W kept in GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K),
 * fp32 x and y.
 * Built and loaded like cpu_ops.c (kernels/cpu_build.py); the wrapper, its torch fallback and
 * the block layouts are in kernels/cpu_gguf.py and kernels/torch_gguf.py.
 *
 * W is uint8 [out, row_bytes]: row o is the blocks of W[o, :]. The matmul walks W in tiles of
 * CHUNK (16) output rows by KTILE (256) input features:
 *
 *     for each 16-row tile of W (OpenMP splits these):
 *         for each 256-wide k tile:   buf[16][256] = dequantize(the tile's blocks)   (16 KB: L1)
 *             for each row i of x:    y[i, tile] += x[i, k tile] . buf[j]  for j < 16 (dot_chunk)
 *
 * so W is read once, as bytes, and never exists dequantized beyond one tile. Decode (a few rows
 * of x) is bound by how fast blocks turn into floats; `rayllm_gguf_dequant_f32` serves the
 * wrapper's prefill path instead (tile dequantized here, multiplied by the BLAS).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define KTILE 256 /* features dequantized per tile: one K-quant block, 8 of the 32-element ones */
#define PARALLEL_MIN_WORK 262144 /* below this many multiply-adds a call stays on one thread */
#define Q4_0 2
#define Q4_1 3
#define Q5_0 6
#define Q5_1 7
#define Q8_0 8
#define Q4_K 12
#define Q5_K 13
#define Q6_K 14
#define ERR_TYPE 1 /* a type id without a dequantizer here */

INLINE float f16_to_f32(const uint8_t *p) { /* little-endian IEEE half -> float, subnormals too */
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    float f;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        f = (float)mant * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    bits = sign | (exp == 0x1f ? 0x7f800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
    memcpy(&f, &bits, 4);
    return f;
}

static void dq_q8_0(const uint8_t *b, float *out) { /* d | int8 q[32] */
    const float d = f16_to_f32(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int l = 0; l < 32; l++) out[l] = d * (float)q[l];
}

/* Q4_0 / Q4_1 / Q5_0 / Q5_1: d | (m, has_min) | (qh[4], five_bit) | qs[16]. Element l < 16 is
 * qs[l]'s low nibble, l + 16 its high one; the 5th bit of element l is bit l of qh as a
 * little-endian uint32. w = d * q + m, or d * (q - 8) / d * (q - 16) without m. Inlined with
 * constant flags, so each type gets its own loop. */
INLINE void dq_legacy(const uint8_t *b, float *out, int has_min, int five_bit) {
    const float d = f16_to_f32(b), m = has_min ? f16_to_f32(b + 2) : 0.0f;
    const uint8_t *qh = b + (has_min ? 4 : 2), *qs = qh + (five_bit ? 4 : 0);
    uint32_t hi = 0;
    if (five_bit) memcpy(&hi, qh, 4); /* little-endian, as the file (and x86 / arm64) */
    const int offset = has_min ? 0 : (five_bit ? 16 : 8);
    for (int l = 0; l < 16; l++) {
        const int q0 = (qs[l] & 15) | (int)((hi >> l) & 1) << 4;
        const int q1 = (qs[l] >> 4) | (int)((hi >> (l + 16)) & 1) << 4;
        out[l] = has_min ? d * (float)q0 + m : d * (float)(q0 - offset);
        out[l + 16] = has_min ? d * (float)q1 + m : d * (float)(q1 - offset);
    }
}

/* Q4_K / Q5_K's 12 scale bytes -> 8 six-bit scales and mins (see torch_gguf._k_scales). */
INLINE void k_scales(const uint8_t *s, float *sc, float *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = (float)(s[j] & 63);
        mn[j] = (float)(s[j + 4] & 63);
        sc[j + 4] = (float)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = (float)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* d | dmin | scales[12] | (qh[32] for Q5_K) | qs[128]; sub-block s reads qs[32*(s/2) + l]'s
 * low (even s) or high (odd s) nibble, and for Q5_K bit s of qh[l] as the 5th bit. */
static void dq_qk(const uint8_t *b, float *out, int five_bit) {
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    float sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + (five_bit ? 48 : 16);
    for (int s = 0; s < 8; s++) {
        const float scale = d * sc[s], shift = dmin * mn[s];
        const uint8_t *q = qs + 32 * (s / 2);
        const int nib = 4 * (s % 2);
        float *o = out + 32 * s;
        if (five_bit)
            for (int l = 0; l < 32; l++)
                o[l] = scale * (float)(((q[l] >> nib) & 15) | (((qh[l] >> s) & 1) << 4)) - shift;
        else
            for (int l = 0; l < 32; l++) o[l] = scale * (float)((q[l] >> nib) & 15) - shift;
    }
}

/* ql[128] | qh[64] | int8 scales[16] | d; element 128h + 32t + l: 4 low bits from
 * ql[64h + 32(t%2) + l] >> 4(t/2), 2 high bits from qh[32h + l] >> 2t, scale (128h + 32t + l) / 16. */
static void dq_q6_k(const uint8_t *b, float *out) {
    const float d = f16_to_f32(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++) {
            const uint8_t *ql = b + 64 * h + 32 * (t % 2), *qh = b + 128 + 32 * h;
            const int base = 128 * h + 32 * t;
            const float s0 = d * (float)sc[base / 16], s1 = d * (float)sc[base / 16 + 1];
            for (int l = 0; l < 32; l++) {
                const int q = ((ql[l] >> (4 * (t / 2))) & 15) | (((qh[l] >> (2 * t)) & 3) << 4);
                out[base + l] = (l < 16 ? s0 : s1) * (float)(q - 32);
            }
        }
}

/* (elements, bytes) of one block of `qtype`; 0 elements for an unknown type. */
static void block_layout(int qtype, int64_t *elems, int64_t *bytes) {
    switch (qtype) {
    case Q8_0: *elems = 32; *bytes = 34; return;
    case Q4_0: *elems = 32; *bytes = 18; return;
    case Q4_1: *elems = 32; *bytes = 20; return;
    case Q5_0: *elems = 32; *bytes = 22; return;
    case Q5_1: *elems = 32; *bytes = 24; return;
    case Q4_K: *elems = 256; *bytes = 144; return;
    case Q5_K: *elems = 256; *bytes = 176; return;
    case Q6_K: *elems = 256; *bytes = 210; return;
    default: *elems = 0; *bytes = 0;
    }
}

/* Features [k0, k0 + len) of one W row (len a multiple of the block) into out[len]. */
static void dequant_span(const uint8_t *row, int qtype, int64_t k0, int64_t len, float *out) {
    int64_t elems, bytes;
    block_layout(qtype, &elems, &bytes);
    for (int64_t k = 0; k < len; k += elems) {
        const uint8_t *b = row + (k0 + k) / elems * bytes;
        switch (qtype) {
        case Q8_0: dq_q8_0(b, out + k); break;
        case Q4_0: dq_legacy(b, out + k, 0, 0); break;
        case Q4_1: dq_legacy(b, out + k, 1, 0); break;
        case Q5_0: dq_legacy(b, out + k, 0, 1); break;
        case Q5_1: dq_legacy(b, out + k, 1, 1); break;
        case Q4_K: dq_qk(b, out + k, 0); break;
        case Q5_K: dq_qk(b, out + k, 1); break;
        default: dq_q6_k(b, out + k); break;
        }
    }
}

/* y[i, o0 : o0 + rows] (+)= x[i, k0 : k0 + len] . buf[j] for every row i < n; rows <= CHUNK,
 * buf [CHUNK][len] with the unused rows zero. first: store instead of accumulate. */
static void tile_dots(const float *x, int64_t x_stride, const float *buf, int64_t len, int64_t k0,
                      float *y, int64_t y_stride, int64_t n, int64_t o0, int64_t rows, int first) {
    for (int64_t i = 0; i < n; i++) {
        const vec s = dot_chunk(x + i * x_stride + k0, buf, len, len);
        float *yr = y + i * y_stride + o0;
        if (rows == CHUNK) {
            STORE(yr, first ? s : LOAD(yr) + s);
            continue;
        }
        for (int64_t j = 0; j < rows; j++) yr[j] = first ? s[j] : yr[j] + s[j];
    }
}

/* y [n, out] (rows y_stride apart) = x [n, in] (rows x_stride apart) @ W.T, W = w's rows of
 * `qtype` blocks, row_bytes apart. in must be a multiple of the block (and so of 32).
 * Returns 0, or ERR_TYPE for a type this file cannot dequantize. */
int rayllm_gguf_linear_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes, int qtype,
                           float *y, int64_t y_stride, int64_t n, int64_t out, int64_t in) {
    int64_t elems, bytes;
    block_layout(qtype, &elems, &bytes);
    if (elems == 0) return ERR_TYPE;
    const int64_t num_tiles = (out + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (n * out * in >= PARALLEL_MIN_WORK)
    for (int64_t tile = 0; tile < num_tiles; tile++) {
        float buf[CHUNK * KTILE] __attribute__((aligned(64)));
        const int64_t o0 = tile * CHUNK, rows = out - o0 < CHUNK ? out - o0 : CHUNK;
        for (int64_t k0 = 0; k0 < in; k0 += KTILE) {
            const int64_t len = in - k0 < KTILE ? in - k0 : KTILE;
            for (int64_t j = 0; j < CHUNK; j++) {
                if (j < rows) dequant_span(w + (o0 + j) * row_bytes, qtype, k0, len, buf + j * len);
                else memset(buf + j * len, 0, (size_t)len * sizeof(float));
            }
            tile_dots(x, x_stride, buf, len, k0, y, y_stride, n, o0, rows, k0 == 0);
        }
    }
    return 0;
}

/* out [rows, in] = W's rows dequantized (the wrapper's many-row path multiplies these with the BLAS). */
int rayllm_gguf_dequant_f32(const uint8_t *w, int64_t row_bytes, int qtype, float *out, int64_t rows, int64_t in) {
    int64_t elems, bytes;
    block_layout(qtype, &elems, &bytes);
    if (elems == 0) return ERR_TYPE;
#pragma omp parallel for schedule(static) if (rows * in >= PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) dequant_span(w + r * row_bytes, qtype, 0, in, out + r * in);
    return 0;
}
