/* INT8 W8A8 linear on CPU with AVX-512 VNNI or AMX: y = (qx * x_scale) @ (w * w_scale)^T, the
 * activations quantized to int8 inside the call. Built and loaded like cpu_ops.c
 * (kernels/cpu_build.py); the wrapper, the repacking into this layout and the checks are in
 * kernels/cpu_int8.py. Built for a CPU without AVX-512 VNNI this file holds only
 * rayllm_int8_vnni_available(), which says 0, and the engine keeps its torch path.
 *
 * Activations: x [M, K] fp32 or bf16, rows x_stride apart. Each row is quantized as torch does
 * it (engine/layers/quantization/int8.py's quantize_per_token): scale = max(absmax / 127, 1e-10),
 * q = round_half_even(x / scale) clamped to +-127; or by one static scale for every row. The
 * quotient is rounded as a true fp32 division rounds it (torch's), so q is the same bytes.
 *
 * u8 x s8: vpdpbusd multiplies unsigned bytes by signed ones, so the kernel feeds it
 * qx + 128 (1..255) and takes back 128 * sum_k w[n, k] per output:
 *
 *   sum_k (qx[k] + 128) * w[n, k] = sum_k qx[k] * w[n, k] + comp[n],   comp[n] = 128 * sum_k w[n, k]
 *
 * with comp computed once, at load. Every int32 sum is exact (K <= MAX_K: the wrapper checks).
 *
 * Weight layout, once at load: w [N, K] int8 padded with zeros to [Np, Kp] (Np a multiple of 16,
 * Kp of 64), then
 *
 *   packed [Np / 16][Kp / 4][16][4] int8: block b of 16 outputs, inputs k..k+3 of output
 *   b * 16 + l at bytes (k / 4) * 64 + l * 4 .. + 3
 *
 * so one 64-byte load is the 4 inputs of 16 outputs that one vpdpbusd takes against 4 inputs
 * of one activation row broadcast to every lane; a block's bytes are one stream along K.
 *
 * Register tile: MR rows x NR blocks (64 outputs) of int32 accumulators over the whole K, then
 *   y[m, n] = float(acc - comp[n]) * x_scale[m] * w_scale[n]     (in that order, as torch's
 *   `acc.float() * x_scale * w_scale`), stored in x's dtype (bf16: round to nearest even),
 * or acc - comp itself as int32. Threads split (chunk of MC rows) x (panel of NR blocks).
 *
 * With AMX (a CPU with AMX-INT8, Linux's permission granted: cpu_amx.h) calls of AMX_MIN_M rows
 * or more multiply whole tiles instead, on the same packed bytes (below, amx_tile).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#include <immintrin.h>
#else
#define HAVE_VNNI 0
#endif

enum { OUT_F32 = DT_F32, OUT_BF16 = DT_BF16, OUT_I32 = 3 }; /* shared with kernels/cpu_int8.py */
enum { OK = 0, ERR_NO_VNNI = 1, ERR_NOMEM = 2, ERR_DTYPE = 3, ERR_NO_AMX = 4, ERR_SHAPE = 5 };
enum { ISA_AUTO = 0, ISA_VNNI = 1, ISA_AMX = 2 }; /* which instructions multiply: kernels/cpu_int8.py */

int rayllm_int8_vnni_available(void) { return HAVE_VNNI; }

int rayllm_int8_amx_available(void) { return HAVE_VNNI && HAVE_AMX && amx_ready(); }

#if HAVE_VNNI
#define LANES 16    /* outputs per weight vector: int32 lanes */
#define MR 4        /* activation rows per register tile */
#define NR 4        /* blocks of LANES outputs per register tile: MR * NR accumulators + NR weights */
#define MC 256      /* activation rows per task: MC * Kp bytes stay in L2 across a thread's panels */
#define PARALLEL_MIN_MACS 65536 /* below this many multiply-adds a call runs on the calling thread */
#define K_ALIGN 64  /* Kp: K padded with zeros to whole AMX tiles (kernels/cpu_int8.py packs it so) */
#define AMX_MIN_M 8  /* fewer rows leave most of an AMX tile empty: VNNI is faster there */
#define AMX_NR 8     /* blocks per task with AMX: the 32 rows' tiles are read from L1 again per pair */

typedef struct {
    const uint8_t *xq;     /* [M, Kp] qx + 128 */
    const float *x_scale;  /* [M] */
    const int8_t *packed;  /* [Np / 16][Kp / 4][16][4] */
    const int32_t *comp;   /* [N] */
    const float *w_scale;  /* [N] */
    void *y;               /* [M, N], type out_dt; gated: [M, N / 2] */
    int64_t M, N, Kp, out_dt;
    int64_t gated;         /* 1: y = silu(gate) * up of the outputs' halves [gate | up] (AMX only) */
} Gemm;

/* Blocks of LANES outputs the tasks split: the gate half's when gated (each carries its up block). */
INLINE int64_t out_blocks(const Gemm *g) { return ((g->gated ? g->N / 2 : g->N) + LANES - 1) / LANES; }

INLINE __mmask16 tail_mask(int64_t n) { return n >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* 16 elements of x (fp32 or bf16) from p on, the lanes past `mask` zero. */
INLINE __m512 load_x(const void *p, __mmask16 mask, int dt) {
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(mask, p);
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)); /* a bf16 is the top half of a float */
}

/* x / s correctly rounded, as _mm512_div_ps gives it, from r = 1 / s (correctly rounded) with one
 * multiply and two FMAs: q = x * r is within an ulp of x / s, the FMA remainder x - q * s is exact,
 * and q + remainder * r rounds to the correctly rounded quotient (Markstein's theorem), as long as
 * s, r and the quotients near the rounding boundaries that matter here (|x / s| >= 0.5) are
 * normal floats: the caller keeps the division for scales outside [1e-30, 1e30]. A division's
 * throughput is a fifth of these three. Where the remainder is NaN but q is not (x infinite), q
 * is already the quotient. */
INLINE __m512 divide_by_scale(__m512 x, __m512 s, __m512 r) {
    const __m512 q = _mm512_mul_ps(x, r);
    const __m512 q2 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, s, x), r, q);
    const __mmask16 lost = _mm512_cmp_ps_mask(q2, q2, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(q, q, _CMP_ORD_Q);
    return _mm512_mask_mov_ps(q2, lost, q);
}

/* 16 elements of x quantized by s (r = 1 / s) as int32, plus 128. */
INLINE __m512i quantize_vec(__m512 xv, __m512 s, __m512 r, int exact_by_fma) {
    __m512 v = exact_by_fma ? divide_by_scale(xv, s, r) : _mm512_div_ps(xv, s);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f)); /* clamped first: cvtps2dq of a huge float is INT_MIN */
    return _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128)); /* rounds half to even (MXCSR) */
}

/* xq[0:Kp] = the row quantized, plus 128; inputs K..Kp get 128 (q = 0). Returns the row's scale:
 * `*static_scale`, or the row's absmax / 127 (at least 1e-10) when static_scale is NULL. Whole
 * groups of 64 inputs are stored 64 bytes at a time: a masked 16-byte store per vector was the
 * loop's bottleneck. */
INLINE float quantize_row(const void *x, int64_t K, int64_t Kp, const float *static_scale, uint8_t *xq,
                          const int dt) {
    const int64_t esize = dt == DT_F32 ? 4 : 2;
    float scale;
    if (static_scale) {
        scale = *static_scale;
    } else {
        __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 2 * LANES <= K; k += 2 * LANES) {
            m0 = _mm512_max_ps(m0, _mm512_abs_ps(load_x((const char *)x + k * esize, 0xffff, dt)));
            m1 = _mm512_max_ps(m1, _mm512_abs_ps(load_x((const char *)x + (k + LANES) * esize, 0xffff, dt)));
        }
        for (; k < K; k += LANES)
            m0 = _mm512_max_ps(m0, _mm512_abs_ps(load_x((const char *)x + k * esize, tail_mask(K - k), dt)));
        scale = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1)) / 127.0f;
        scale = scale < 1e-10f ? 1e-10f : scale; /* torch's clamp_(min=1e-10): an all-zero row */
    }
    const __m512 vs = _mm512_set1_ps(scale), vr = _mm512_set1_ps(1.0f / scale);
    const int exact_by_fma = scale > 1e-30f && scale < 1e30f; /* else 1 / scale or the remainder leaves the normal range */
    int64_t k = 0;
    for (; k + 4 * LANES <= K; k += 4 * LANES) {
        __m128i b[4];
        for (int i = 0; i < 4; i++)
            b[i] = _mm512_cvtepi32_epi8(quantize_vec(load_x((const char *)x + (k + i * LANES) * esize, 0xffff, dt),
                                                     vs, vr, exact_by_fma));
        const __m512i all = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(b[1], b[0])),
                                               _mm256_set_m128i(b[3], b[2]), 1);
        _mm512_storeu_si512(xq + k, all);
    }
    for (; k < K; k += LANES) {
        const __mmask16 mask = tail_mask(K - k);
        const __m512i q = quantize_vec(load_x((const char *)x + k * esize, mask, dt), vs, vr, exact_by_fma);
        _mm512_mask_cvtepi32_storeu_epi8(xq + k, mask, q);
    }
    memset(xq + K, 128, (size_t)(Kp - K));
    return scale;
}

static float quantize_row_any(const void *x, int64_t K, int64_t Kp, const float *static_scale, uint8_t *xq,
                              int64_t dt) {
    return dt == DT_F32 ? quantize_row(x, K, Kp, static_scale, xq, DT_F32)
                        : quantize_row(x, K, Kp, static_scale, xq, DT_BF16);
}

/* f rounded to bf16 as torch's .to(bfloat16) rounds it (cpu_simd.h's bf16_bits), the lanes of
 * mask stored at dst. */
INLINE void store_bf16(uint16_t *dst, __m512 f, __mmask16 mask) {
    vec fv;
    memcpy(&fv, &f, sizeof fv);
    const u16vec r = bf16_bits(fv);
    __m256i ri;
    memcpy(&ri, &r, sizeof ri);
    _mm256_mask_storeu_epi16(dst, mask, ri);
}

/* float(acc - comp) * x_scale * w_scale, in that order (as torch's `acc.float() * x_scale * w_scale`):
 * every output of this kernel, plain or gated, is this value before its rounding. */
INLINE __m512 dequantize(__m512i acc, __m512i comp, float x_scale, __m512 ws) {
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, comp)), _mm512_set1_ps(x_scale)), ws);
}

/* Output y[m, n..n+16) from its sums acc: acc - comp, scaled by x_scale[m] and ws (w_scale[n..]),
 * stored in out_dt (a constant once inlined). */
INLINE void store_row(const Gemm *g, __m512i acc, __m512i comp, __m512 ws, __mmask16 mask, int64_t m, int64_t n,
                      const int out_dt) {
    if (out_dt == OUT_I32) {
        _mm512_mask_storeu_epi32((int32_t *)g->y + m * g->N + n, mask, _mm512_sub_epi32(acc, comp));
        return;
    }
    const __m512 f = dequantize(acc, comp, g->x_scale[m], ws);
    if (out_dt == OUT_F32)
        _mm512_mask_storeu_ps((float *)g->y + m * g->N + n, mask, f);
    else
        store_bf16((uint16_t *)g->y + m * g->N + n, f, mask);
}

/* Output block (m, n..n+16) from its accumulator: acc - comp, scaled and stored in g->out_dt. */
INLINE void store_block(const Gemm *g, __m512i acc, int64_t m, int64_t n) {
    const __mmask16 mask = tail_mask(g->N - n);
    const __m512i comp = _mm512_maskz_loadu_epi32(mask, g->comp + n);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, g->w_scale + n);
    switch (g->out_dt) {
    case OUT_I32: store_row(g, acc, comp, ws, mask, m, n, OUT_I32); break;
    case OUT_F32: store_row(g, acc, comp, ws, mask, m, n, OUT_F32); break;
    default: store_row(g, acc, comp, ws, mask, m, n, OUT_BF16);
    }
}

/* The rows m0..m0+rows against the blocks b0..b0+cols over all of Kp, then stored: rows and
 * cols are constants once inlined, so the MR x NR accumulators live in registers. */
INLINE void tile(const Gemm *g, int64_t m0, int64_t b0, const int rows, const int cols) {
    const int64_t Kp = g->Kp, block_bytes = Kp * LANES;
    const uint8_t *xr = g->xq + m0 * Kp;
    const int8_t *wb = g->packed + b0 * block_bytes;
    __m512i acc[MR][NR];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < Kp; k += 4) {
        __m512i w[NR];
        for (int j = 0; j < cols; j++) w[j] = _mm512_loadu_si512(wb + j * block_bytes + k * LANES);
        for (int i = 0; i < rows; i++) {
            int32_t four;
            memcpy(&four, xr + i * Kp + k, 4);
            const __m512i a = _mm512_set1_epi32(four);
            for (int j = 0; j < cols; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], a, w[j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) store_block(g, acc[i][j], m0 + i, (b0 + j) * LANES);
}

#define TILE_CASE(R, C) case (R) * 8 + (C): tile(g, m0, b0, R, C); break;
#define TILE_ROW(R) TILE_CASE(R, 1) TILE_CASE(R, 2) TILE_CASE(R, 3) TILE_CASE(R, 4)

/* tile() with rows (<= MR) and cols (<= NR) made constants. */
static void tile_any(const Gemm *g, int64_t m0, int64_t b0, int rows, int cols) {
    switch (rows * 8 + cols) {
        TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4)
    }
}

#if HAVE_AMX
/* AMX: tiles 0-3 hold C (16 rows x 16 int32 outputs), 4-5 A (16 rows of qx + 128, 64 inputs each),
 * 6-7 B (16 groups of 4 inputs x 16 outputs: 16 of the packed layout's 64-byte rows, a block's
 * inputs k..k+63). tdpbusd is vpdpbusd over a whole tile, u8 x s8 into int32, so comp corrects the
 * sums as before. Kp is a multiple of AMX_K and the quantized rows are padded to a multiple of 16
 * (q = 0); padded rows are never stored. */
#define AMX_K 64

/* The 16 x 16 sums of a C tile, rows m0.. (those below M) and outputs n..n+16, stored as y. */
INLINE void amx_store_rows(const Gemm *g, const int32_t c[16][LANES], int64_t m0, int64_t n, const int out_dt) {
    const __mmask16 mask = tail_mask(g->N - n);
    const __m512i comp = _mm512_maskz_loadu_epi32(mask, g->comp + n);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, g->w_scale + n);
    const int rows = g->M - m0 < 16 ? (int)(g->M - m0) : 16;
    for (int r = 0; r < rows; r++) store_row(g, _mm512_load_si512(c[r]), comp, ws, mask, m0 + r, n, out_dt);
}

static void amx_store_tile(const Gemm *g, const int32_t c[16][LANES], int64_t m0, int64_t n) {
    switch (g->out_dt) {
    case OUT_I32: amx_store_rows(g, c, m0, n, OUT_I32); break;
    case OUT_F32: amx_store_rows(g, c, m0, n, OUT_F32); break;
    default: amx_store_rows(g, c, m0, n, OUT_BF16);
    }
}

/* Gated: y[m, n..n+16) = silu(gate) * up from the gate tile cg (outputs n..) and the up tile cu
 * (outputs N / 2 + n..): each rounded to out_dt first, as this GEMM stores its outputs, then as
 * cpu_ops.c's rayllm_silu_and_mul computes on them, so the result is the two calls' to the bit. */
static void amx_store_gated(const Gemm *g, const int32_t cg[16][LANES], const int32_t cu[16][LANES], int64_t m0,
                            int64_t n) {
    const int64_t half = g->N / 2;
    const __m512i comp_g = _mm512_loadu_si512(g->comp + n), comp_u = _mm512_loadu_si512(g->comp + half + n);
    const __m512 ws_g = _mm512_loadu_ps(g->w_scale + n), ws_u = _mm512_loadu_ps(g->w_scale + half + n);
    const int rows = g->M - m0 < 16 ? (int)(g->M - m0) : 16;
    for (int r = 0; r < rows; r++) {
        const float xs = g->x_scale[m0 + r];
        const __m512 fg = dequantize(_mm512_load_si512(cg[r]), comp_g, xs, ws_g);
        const __m512 fu = dequantize(_mm512_load_si512(cu[r]), comp_u, xs, ws_u);
        vec gv, uv;
        memcpy(&gv, &fg, sizeof gv);
        memcpy(&uv, &fu, sizeof uv);
        if (g->out_dt == OUT_BF16)
            store_as(g->y, (m0 + r) * half + n, round_to(silu(round_to(gv, DT_BF16)), DT_BF16) * round_to(uv, DT_BF16),
                     DT_BF16);
        else
            store_as(g->y, (m0 + r) * half + n, silu(gv) * uv, DT_F32);
    }
}

/* Rows m0..m0 + 16 * ra against the blocks b0 and b0 + second (cb: 1 or 2; ra: 1 or 2) over all
 * of Kp, stored: second is 1 (a pair of neighbours), or N / 32 when gated (a gate block and its up). */
INLINE void amx_tile(const Gemm *g, int64_t m0, int64_t b0, int64_t second, const int ra, const int cb) {
    const int64_t Kp = g->Kp, block_bytes = Kp * LANES;
    const uint8_t *a = g->xq + m0 * Kp;
    const int8_t *b = g->packed + b0 * block_bytes;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < Kp; k += AMX_K) {
        _tile_loadd(4, a + k, Kp);
        _tile_loadd(6, b + k * LANES, 64);
        if (ra > 1) _tile_loadd(5, a + 16 * Kp + k, Kp);
        if (cb > 1) _tile_loadd(7, b + second * block_bytes + k * LANES, 64);
        _tile_dpbusd(0, 4, 6);
        if (cb > 1) _tile_dpbusd(1, 4, 7);
        if (ra > 1) _tile_dpbusd(2, 5, 6);
        if (ra > 1 && cb > 1) _tile_dpbusd(3, 5, 7);
    }
    int32_t c[4][16][LANES] __attribute__((aligned(64)));
    _tile_stored(0, c[0], LANES * 4);
    _tile_stored(1, c[1], LANES * 4);
    _tile_stored(2, c[2], LANES * 4);
    _tile_stored(3, c[3], LANES * 4);
    if (g->gated) {
        for (int i = 0; i < ra; i++) amx_store_gated(g, c[i * 2], c[i * 2 + 1], m0 + i * 16, b0 * LANES);
        return;
    }
    for (int j = 0; j < cb; j++)
        for (int i = 0; i < ra; i++) amx_store_tile(g, c[i * 2 + j], m0 + i * 16, (b0 + j) * LANES);
}

static void amx_tile_any(const Gemm *g, int64_t m0, int64_t b0, int64_t second, int ra, int cb) {
    if (ra == 2 && cb == 2) amx_tile(g, m0, b0, second, 2, 2);
    else if (ra == 2) amx_tile(g, m0, b0, second, 2, 1);
    else if (cb == 2) amx_tile(g, m0, b0, second, 1, 2);
    else amx_tile(g, m0, b0, second, 1, 1);
}

/* Rows [m0, m1) against the panel of up to AMX_NR blocks from b0, 32 rows x 32 outputs at a time:
 * a wide panel, so the 32 rows' tiles are read from L1 again for each pair of blocks. */
static void amx_task(const Gemm *g, int64_t m0, int64_t m1, int64_t b0) {
    const int64_t num_blocks = out_blocks(g);
    const int64_t b1 = b0 + AMX_NR < num_blocks ? b0 + AMX_NR : num_blocks;
    for (int64_t m = m0; m < m1; m += 32) {
        const int ra = m1 - m > 16 ? 2 : 1;
        if (g->gated) /* gate block b with its up block, num_blocks further */
            for (int64_t b = b0; b < b1; b++) amx_tile_any(g, m, b, num_blocks, ra, 2);
        else
            for (int64_t b = b0; b < b1; b += 2) amx_tile_any(g, m, b, 1, ra, b1 - b > 1 ? 2 : 1);
    }
}
#endif

/* Rows [m0, m1) against the panel of blocks from b0 (NR of them, AMX_NR with AMX): a thread's task. */
static void task(const Gemm *g, int64_t m0, int64_t m1, int64_t b0, int use_amx) {
#if HAVE_AMX
    if (use_amx) {
        amx_task(g, m0, m1, b0);
        return;
    }
#endif
    (void)use_amx;
    const int64_t num_blocks = (g->N + LANES - 1) / LANES;
    const int cols = num_blocks - b0 < NR ? (int)(num_blocks - b0) : NR;
    for (int64_t m = m0; m < m1; m += MR) tile_any(g, m, b0, m1 - m < MR ? (int)(m1 - m) : MR, cols);
}

/* y from x [M, K] (type x_dt, rows x_stride elements apart); the entry points below say which y. */
static int gemm(const void *x, int64_t M, int64_t x_stride, int64_t x_dt, const float *static_scale,
                const int8_t *packed, const int32_t *comp, const float *w_scale, int64_t K, int64_t N, void *y,
                int64_t out_dt, float *x_scale_out, int use_amx, int64_t gated) {
    const int64_t Kp = (K + K_ALIGN - 1) / K_ALIGN * K_ALIGN, esize = x_dt == DT_F32 ? 4 : 2;
    const int64_t Mp = use_amx ? (M + 15) / 16 * 16 : M; /* AMX reads whole tiles of 16 rows */
    uint8_t *xq = aligned_alloc(64, (size_t)((Mp * Kp + 63) / 64 * 64));
    if (!xq) return ERR_NOMEM;
    memset(xq + M * Kp, 128, (size_t)((Mp - M) * Kp));
    const Gemm g = {xq, x_scale_out, packed, comp, w_scale, y, M, N, Kp, out_dt, gated};
    const int64_t panel = use_amx ? AMX_NR : NR, num_chunks = (M + MC - 1) / MC;
    const int64_t num_panels = (out_blocks(&g) + panel - 1) / panel;
#pragma omp parallel if (M * N * K >= PARALLEL_MIN_MACS)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            x_scale_out[m] = quantize_row_any((const char *)x + m * x_stride * esize, K, Kp, static_scale,
                                              xq + m * Kp, x_dt);
        /* the implicit barrier: every row is quantized before any tile reads it */
#if HAVE_AMX
        if (use_amx) amx_load_full_tiles();
#endif
#pragma omp for collapse(2) schedule(static)
        for (int64_t c = 0; c < num_chunks; c++)
            for (int64_t p = 0; p < num_panels; p++)
                task(&g, c * MC, (c + 1) * MC < M ? (c + 1) * MC : M, p * panel, use_amx);
#if HAVE_AMX
        if (use_amx) _tile_release();
#endif
    }
    free(xq);
    return OK;
}

/* y [M, N] (type out_dt, contiguous). static_scale: one input scale, or NULL for per-token
 * scales; x_scale_out: [M], the scales used (for the int32 output's caller); isa: ISA_AUTO, or
 * ISA_VNNI / ISA_AMX to pick. Returns OK, or ERR_NOMEM / ERR_DTYPE / ERR_NO_AMX (y untouched). */
int rayllm_int8_w8a8_gemm(const void *x, int64_t M, int64_t x_stride, int64_t x_dt, const float *static_scale,
                          const int8_t *packed, const int32_t *comp, const float *w_scale, int64_t K, int64_t N,
                          void *y, int64_t out_dt, float *x_scale_out, int64_t isa) {
    if ((x_dt != DT_F32 && x_dt != DT_BF16) || (out_dt != OUT_F32 && out_dt != OUT_BF16 && out_dt != OUT_I32))
        return ERR_DTYPE;
    const int amx = rayllm_int8_amx_available();
    if (isa == ISA_AMX && !amx) return ERR_NO_AMX;
    /* AMX when asked for, or on auto where it runs and M has enough rows to fill its tiles */
    const int use_amx = isa == ISA_AMX || (isa == ISA_AUTO && amx && M >= AMX_MIN_M);
    return gemm(x, M, x_stride, x_dt, static_scale, packed, comp, w_scale, K, N, y, out_dt, x_scale_out, use_amx, 0);
}

/* The gate_up projection and SiLU-and-mul in one pass, on AMX: the weight's N outputs are
 * [gate | up] (N / 2 a multiple of 16), y [M, N / 2] = silu(gate) * up in out_dt (fp32 or bf16),
 * the same bits as rayllm_int8_w8a8_gemm then cpu_ops.c's rayllm_silu_and_mul. Returns OK, or
 * ERR_NOMEM / ERR_DTYPE / ERR_NO_AMX / ERR_SHAPE (y untouched). */
int rayllm_int8_w8a8_gemm_silu(const void *x, int64_t M, int64_t x_stride, int64_t x_dt, const float *static_scale,
                               const int8_t *packed, const int32_t *comp, const float *w_scale, int64_t K, int64_t N,
                               void *y, int64_t out_dt, float *x_scale_out) {
    if ((x_dt != DT_F32 && x_dt != DT_BF16) || (out_dt != OUT_F32 && out_dt != OUT_BF16)) return ERR_DTYPE;
    if (!rayllm_int8_amx_available()) return ERR_NO_AMX;
    if (N % (2 * LANES)) return ERR_SHAPE;
    return gemm(x, M, x_stride, x_dt, static_scale, packed, comp, w_scale, K, N, y, out_dt, x_scale_out, 1, 1);
}
#else
int rayllm_int8_w8a8_gemm(const void *x, int64_t M, int64_t x_stride, int64_t x_dt, const float *static_scale,
                          const int8_t *packed, const int32_t *comp, const float *w_scale, int64_t K, int64_t N,
                          void *y, int64_t out_dt, float *x_scale_out, int64_t isa) {
    (void)x, (void)M, (void)x_stride, (void)x_dt, (void)static_scale, (void)packed, (void)comp, (void)w_scale;
    (void)K, (void)N, (void)y, (void)out_dt, (void)x_scale_out, (void)isa;
    return ERR_NO_VNNI;
}

int rayllm_int8_w8a8_gemm_silu(const void *x, int64_t M, int64_t x_stride, int64_t x_dt, const float *static_scale,
                               const int8_t *packed, const int32_t *comp, const float *w_scale, int64_t K, int64_t N,
                               void *y, int64_t out_dt, float *x_scale_out) {
    (void)x, (void)M, (void)x_stride, (void)x_dt, (void)static_scale, (void)packed, (void)comp, (void)w_scale;
    (void)K, (void)N, (void)y, (void)out_dt, (void)x_scale_out;
    return ERR_NO_VNNI;
}
#endif
