/* Vector helpers for the CPU kernels: GCC/Clang vector extensions, no intrinsics.
 *
 * `vec` is CHUNK = 16 floats; the compiler lowers it to one AVX-512 register, two
 * AVX2 registers or four NEON registers, whatever -march=native offers.
 */
#ifndef RAYLLM_CPU_SIMD_H
#define RAYLLM_CPU_SIMD_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define CHUNK 16
typedef float vec __attribute__((vector_size(CHUNK * 4), aligned(4))); /* unaligned loads ok */
typedef int32_t ivec __attribute__((vector_size(CHUNK * 4), aligned(4)));
#define INLINE static inline __attribute__((always_inline))
#define LOAD(p) (*(const vec *)(p))
#define STORE(p, v) (*(vec *)(p) = (v))

/* A broadcast. Not zero + f, which turns -0.0f into +0.0f; and not a loop over the lanes,
 * which GCC 12 turns into 16 masked broadcasts when f comes from memory. f - (+0) is f for
 * every f, -0.0f and NaN included, and compiles to one vbroadcastss. */
INLINE vec splat(float f) {
    return f - (vec){0};
}

INLINE vec vmax(vec a, vec b) {
    const ivec a_wins = a > b;
    return (vec)(((ivec)a & a_wins) | ((ivec)b & ~a_wins));
}

INLINE float hsum(vec v) {
    float s = 0.0f;
    for (int l = 0; l < CHUNK; l++) s += v[l];
    return s;
}

INLINE float hmax(vec v) {
    float m = v[0];
    for (int l = 1; l < CHUNK; l++) m = v[l] > m ? v[l] : m;
    return m;
}

/* e^x lane-wise for x <= 0: Cephes expf's range reduction and polynomial (~2 ulp).
 * x below -87 (incl. -inf) gives ~1e-38 instead of 0: callers never use such lanes. */
INLINE vec exp_nonpos(vec x) {
    x = vmax(x, splat(-87.0f));
    const vec magic = splat(12582912.0f);                      /* + 1.5 * 2^23 rounds to int */
    const vec n = (x * 1.44269504088896341f + magic) - magic; /* round(x / ln 2), in [-126, 0] */
    const vec r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec two_n = (__builtin_convertvector(n, ivec) + 127) << 23; /* 2^n as float bits */
    return p * (vec)two_n;
}

INLINE float exp1(float x) { /* scalar e^x, x <= 0 */
    return exp_nonpos(splat(x))[0];
}

/* x * sigmoid(x) lane-wise with one exp and one division: with e = e^-|x| (never overflows),
 * sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) below. Shared by cpu_ops.c's SiLU-and-mul
 * and cpu_int8.c's gated epilogue, which must agree to the bit. */
INLINE vec silu(vec x) {
    const ivec neg = x < 0.0f;
    const vec e = exp_nonpos((vec)((ivec)x | (int32_t)0x80000000)); /* e^-|x|: the sign bit set */
    const vec num = (vec)(((ivec)e & neg) | ((ivec)splat(1.0f) & ~neg));
    return x * num / (1.0f + e);
}

/* r[j] = sum (or, with use_max, a constant once inlined: max) of the lanes of p[j], j < CHUNK:
 * CHUNK horizontal reductions at once. Each level combines the two halves of every lane group of
 * a pair of vectors (16 -> 8 -> 4 -> 2 -> 1 lanes per input), 15 shuffle pairs instead of 16
 * separate reductions. */
INLINE vec combine(vec a, vec b, const int use_max) { return use_max ? vmax(a, b) : a + b; }
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define HALVES(a, b, LO, HI, M) combine(SHUF(a, b, LO), SHUF(a, b, HI), M)
#define L1_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define L1_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define L2_LO 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define L2_HI 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define L3_LO 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define L3_HI 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define L4_LO 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define L4_HI 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
INLINE vec transpose_reduce(const vec *p, const int use_max) {
    vec a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = HALVES(p[2 * i], p[2 * i + 1], L1_LO, L1_HI, use_max);
    for (int i = 0; i < 4; i++) b[i] = HALVES(a[2 * i], a[2 * i + 1], L2_LO, L2_HI, use_max);
    for (int i = 0; i < 2; i++) c[i] = HALVES(b[2 * i], b[2 * i + 1], L3_LO, L3_HI, use_max);
    return HALVES(c[0], c[1], L4_LO, L4_HI, use_max);
}
#else
INLINE vec transpose_reduce(const vec *p, const int use_max) {
    vec r;
    for (int j = 0; j < CHUNK; j++) r[j] = use_max ? hmax(p[j]) : hsum(p[j]);
    return r;
}
#endif
INLINE vec transpose_sum(const vec *p) { return transpose_reduce(p, 0); }
INLINE vec transpose_max(const vec *p) { return transpose_reduce(p, 1); }

/* Element types a kernel reads and writes as floats; the codes are shared with the Python
 * wrappers. Call sites pass the type as a compile-time constant through these always-inlined
 * helpers, so a kernel specialised per type has no branch in its loops. */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
typedef uint32_t u32vec __attribute__((vector_size(CHUNK * 4), aligned(4)));
typedef uint16_t u16vec __attribute__((vector_size(CHUNK * 2), aligned(2)));

INLINE int64_t dt_size(int64_t dt) { return dt == DT_F32 ? 4 : 2; } /* bytes per element */

INLINE const void *elem_at(const void *p, int64_t i, int dt) { /* &p[i] for elements of type dt */
    return (const char *)p + i * dt_size(dt);
}

/* IEEE half bits (in the low 16 of each lane) -> float, with integer ops only (no F16C): the
 * exponent and mantissa move to float position and a multiply by 2^112 rebiases the exponent
 * (15 -> 127), subnormal halves included; an all-ones exponent (inf, NaN) is restored after. */
INLINE vec f16_widen(u32vec h) {
    const vec f = (vec)((h & 0x7fff) << 13) * 0x1p112f;
    const u32vec special = (u32vec)((h & 0x7c00) == 0x7c00) & 0x7f800000;
    return (vec)((u32vec)f | special | (h & 0x8000) << 16);
}

/* CHUNK elements of type dt from p[i] on, as floats. A bf16 is the top half of a float.
 * With AVX-512 the widening is one vpmovzxwd (or vcvtph2ps) per CHUNK: GCC 12 lowers the
 * generic __builtin_convertvector to two 256-bit halves and an insert. */
INLINE vec load_as_f32(const void *p, int64_t i, int dt) {
    if (dt == DT_F32) return LOAD((const float *)p + i);
#if defined(__AVX512F__)
    const __m256i h16 = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (dt == DT_BF16) return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h16), 16);
    return (vec)_mm512_cvtph_ps(h16);
#endif
    const u32vec h = __builtin_convertvector(*(const u16vec *)((const uint16_t *)p + i), u32vec);
    return dt == DT_BF16 ? (vec)(h << 16) : f16_widen(h);
}

INLINE float load1_as_f32(const void *p, int64_t i, int dt) { /* p[i] as a float */
    if (dt == DT_F32) return ((const float *)p)[i];
    u32vec h = {0};
    h[0] = ((const uint16_t *)p)[i];
    return dt == DT_BF16 ? ((vec)(h << 16))[0] : f16_widen(h)[0];
}

/* float -> bf16 bits, round to nearest even (as torch casts); a NaN stays a quiet NaN. */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)(x >> 16 | 0x40);
    return (uint16_t)((x + 0x7fff + (x >> 16 & 1)) >> 16);
}

/* float -> IEEE half bits, round to nearest even (F. Giesen's float_to_half_fast3_rtne):
 * overflow gives inf, a NaN a quiet NaN, and below 2^-14 the float add of a magic number
 * rounds the mantissa into half-subnormal position. */
INLINE uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = x & 0x80000000u, magic_bits = (127 - 15 + 23 - 10 + 1) << 23;
    x ^= sign;
    uint32_t o;
    if (x >= (127 + 16) << 23) { /* >= 2^16, inf or NaN (65520 .. 2^16 round up to inf below) */
        o = x > 0x7f800000u ? 0x7e00 : 0x7c00;
    } else if (x < 113u << 23) { /* below half's smallest normal */
        float v, magic;
        memcpy(&v, &x, 4);
        memcpy(&magic, &magic_bits, 4);
        v += magic;
        memcpy(&o, &v, 4);
        o -= magic_bits;
    } else {
        const uint32_t mant_odd = x >> 13 & 1;
        x += ((uint32_t)(15 - 127) << 23) + 0xfff + mant_odd;
        o = x >> 13;
    }
    return (uint16_t)(o | sign >> 16);
}

INLINE void store1_from_f32(void *p, int64_t i, float x, int dt) { /* p[i] = x, rounded to dt */
    if (dt == DT_F32) ((float *)p)[i] = x;
    else ((uint16_t *)p)[i] = dt == DT_BF16 ? f32_to_bf16(x) : f32_to_f16(x);
}

INLINE float round1_to(float x, int dt) { /* x rounded to type dt, as a float */
    if (dt == DT_F32) return x;
    const uint16_t h = dt == DT_BF16 ? f32_to_bf16(x) : f32_to_f16(x);
    return load1_as_f32(&h, 0, dt);
}

/* Each lane rounded to nearest even bf16, as float bits (low 16 zero); a NaN stays a NaN. */
INLINE u32vec bf16_round_bits(vec v) {
    const u32vec x = (u32vec)v;
    const u32vec nan = (u32vec)((x & 0x7fffffff) > 0x7f800000);
    return (((x + 0x7fff + (x >> 16 & 1)) & ~nan) | ((x | 0x400000) & nan)) & 0xffff0000u;
}

/* Each lane rounded to nearest even bf16 (as torch casts), as bf16 bits. With AVX512-BF16 one
 * vcvtneps2bf16 does it, but that instruction flushes denormals and quiets NaNs its own way: a
 * vector holding either takes the bit arithmetic instead. */
INLINE u16vec bf16_bits(vec v) {
#if defined(__AVX512BF16__)
    __m512 f;
    memcpy(&f, &v, sizeof f);
    if (!_mm512_fpclass_ps_mask(f, 0xa1)) { /* 0x01 QNaN | 0x20 denormal | 0x80 SNaN */
        const __m256bh h = _mm512_cvtneps_pbh(f);
        u16vec r;
        memcpy(&r, &h, sizeof r);
        return r;
    }
#endif
    return __builtin_convertvector(bf16_round_bits(v) >> 16, u16vec);
}

/* p[i .. i + CHUNK) = v rounded to type dt. */
INLINE void store_as(void *p, int64_t i, vec v, int dt) {
    if (dt == DT_F32) {
        STORE((float *)p + i, v);
    } else if (dt == DT_BF16) {
        *(u16vec *)((uint16_t *)p + i) = bf16_bits(v);
    } else {
        for (int l = 0; l < CHUNK; l++) ((uint16_t *)p)[i + l] = f32_to_f16(v[l]);
    }
}

/* v rounded to type dt, still as floats: what a torch op in that type would have stored. */
INLINE vec round_to(vec v, int dt) {
    if (dt == DT_F32) return v;
    if (dt == DT_BF16) {
        const u16vec h = bf16_bits(v);
        return load_as_f32(&h, 0, DT_BF16);
    }
    u32vec h = {0};
    for (int l = 0; l < CHUNK; l++) h[l] = f32_to_f16(v[l]);
    return f16_widen(h);
}

/* dst[d] = src[i0 + d] * scale for d < n, src of type dt; CHUNK at a time, then the tail. */
INLINE void widen_row_as(float *dst, const void *src, int64_t i0, int64_t n, float scale, int dt) {
    int64_t d = 0;
    for (; d + CHUNK <= n; d += CHUNK) STORE(dst + d, load_as_f32(src, i0 + d, dt) * scale);
    for (; d < n; d++) dst[d] = load1_as_f32(src, i0 + d, dt) * scale;
}

/* dst[i0 + d] = src[d] * mul rounded to type dt, for d < n; CHUNK at a time, then the tail. */
INLINE void narrow_row_as(void *dst, int64_t i0, const float *src, int64_t n, float mul, int dt) {
    int64_t d = 0;
    for (; d + CHUNK <= n; d += CHUNK) store_as(dst, i0 + d, LOAD(src + d) * mul, dt);
    for (; d < n; d++) store1_from_f32(dst, i0 + d, src[d] * mul, dt);
}

/* widen_row_as and narrow_row_as for a run-time dt: one loop per type, no branch per element. */
static inline void widen_row(float *dst, const void *src, int64_t i0, int64_t n, float scale, int64_t dt) {
    switch (dt) {
    case DT_BF16: widen_row_as(dst, src, i0, n, scale, DT_BF16); break;
    case DT_F16: widen_row_as(dst, src, i0, n, scale, DT_F16); break;
    default: widen_row_as(dst, src, i0, n, scale, DT_F32);
    }
}

static inline void narrow_row(void *dst, int64_t i0, const float *src, int64_t n, float mul, int64_t dt) {
    switch (dt) {
    case DT_BF16: narrow_row_as(dst, i0, src, n, mul, DT_BF16); break;
    case DT_F16: narrow_row_as(dst, i0, src, n, mul, DT_F16); break;
    default: narrow_row_as(dst, i0, src, n, mul, DT_F32);
    }
}

/* s[j] = q . k_j for the CHUNK rows k_j = kb + j * stride ([D] each, type dt), D % CHUNK == 0. */
INLINE vec dot_chunk(const float *restrict q, const void *restrict kb, int64_t stride, int64_t D, int dt) {
    vec p[CHUNK];
    for (int j = 0; j < CHUNK; j++) {
        vec acc = LOAD(q) * load_as_f32(kb, j * stride, dt);
        for (int64_t d = CHUNK; d < D; d += CHUNK) acc += LOAD(q + d) * load_as_f32(kb, j * stride + d, dt);
        p[j] = acc;
    }
    return transpose_sum(p);
}

/* q . k over any D, k of type dt (the slow path). */
INLINE float dot(const float *restrict q, const void *restrict k, int64_t D, int dt) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; d++) s += q[d] * load1_as_f32(k, d, dt);
    return s;
}

#endif
