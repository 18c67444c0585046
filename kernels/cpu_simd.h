/* Vector helpers for the CPU kernels: GCC/Clang vector extensions, no intrinsics.
 *
 * `vec` is CHUNK = 16 floats; the compiler lowers it to one AVX-512 register, two
 * AVX2 registers or four NEON registers, whatever -march=native offers.
 */
#ifndef RAYLLM_CPU_SIMD_H
#define RAYLLM_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

#define CHUNK 16
typedef float vec __attribute__((vector_size(CHUNK * 4), aligned(4))); /* unaligned loads ok */
typedef int32_t ivec __attribute__((vector_size(CHUNK * 4), aligned(4)));
#define INLINE static inline __attribute__((always_inline))
#define LOAD(p) (*(const vec *)(p))
#define STORE(p, v) (*(vec *)(p) = (v))

INLINE vec splat(float f) { /* a broadcast (not zero + f, which turns -0.0f into +0.0f) */
    vec v;
    for (int l = 0; l < CHUNK; l++) v[l] = f;
    return v;
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

/* r[j] = sum of the lanes of p[j], j < CHUNK: CHUNK horizontal sums at once. Each
 * level adds the two halves of every lane group of a pair of vectors (16 -> 8 -> 4 ->
 * 2 -> 1 lanes per input), 15 shuffle pairs instead of 16 separate reductions. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define HALVES(a, b, LO, HI) (SHUF(a, b, LO) + SHUF(a, b, HI))
#define L1_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define L1_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define L2_LO 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define L2_HI 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define L3_LO 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define L3_HI 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define L4_LO 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define L4_HI 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
INLINE vec transpose_sum(const vec *p) {
    vec a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = HALVES(p[2 * i], p[2 * i + 1], L1_LO, L1_HI);
    for (int i = 0; i < 4; i++) b[i] = HALVES(a[2 * i], a[2 * i + 1], L2_LO, L2_HI);
    for (int i = 0; i < 2; i++) c[i] = HALVES(b[2 * i], b[2 * i + 1], L3_LO, L3_HI);
    return HALVES(c[0], c[1], L4_LO, L4_HI);
}
#else
INLINE vec transpose_sum(const vec *p) {
    vec r;
    for (int j = 0; j < CHUNK; j++) r[j] = hsum(p[j]);
    return r;
}
#endif

/* s[j] = q . k_j for the CHUNK rows k_j = kb + j * stride ([D] each), D % CHUNK == 0. */
INLINE vec dot_chunk(const float *restrict q, const float *restrict kb, int64_t stride, int64_t D) {
    vec p[CHUNK];
    for (int j = 0; j < CHUNK; j++) {
        vec acc = LOAD(q) * LOAD(kb + j * stride);
        for (int64_t d = CHUNK; d < D; d += CHUNK) acc += LOAD(q + d) * LOAD(kb + j * stride + d);
        p[j] = acc;
    }
    return transpose_sum(p);
}

/* q . k over any D (the slow path). */
INLINE float dot(const float *restrict q, const float *restrict k, int64_t D) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; d++) s += q[d] * k[d];
    return s;
}

#endif
