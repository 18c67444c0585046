/* GGUF blocks -> fp32, CHUNK (16) lanes at a time, for kernels/cpu_gguf.c. The block layouts
 * are documented in kernels/torch_gguf.py; each dequantizer writes one block's elements.
 *
 * Bytes become int32 lanes through AVX-512's byte -> dword widening where the build has it
 * (GCC lowers a generic byte -> int convertvector to 16 scalar inserts), else through int16.
 */
#ifndef RAYLLM_CPU_GGUF_BLOCKS_H
#define RAYLLM_CPU_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define Q4_0 2
#define Q4_1 3
#define Q5_0 6
#define Q5_1 7
#define Q8_0 8
#define Q4_K 12
#define Q5_K 13
#define Q6_K 14

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));
typedef int16_t i16x16 __attribute__((vector_size(32)));

static const ivec LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

INLINE ivec widen_u8(u8x16 v) { /* 16 bytes 0..255 -> int32 lanes */
#ifdef __AVX512F__
    __m128i b;
    memcpy(&b, &v, 16);
    const __m512i w = _mm512_cvtepu8_epi32(b);
    ivec r;
    memcpy(&r, &w, sizeof r);
    return r;
#else
    return __builtin_convertvector(__builtin_convertvector((i8x16)v, i16x16) & 0xff, ivec);
#endif
}

INLINE ivec widen_i8(i8x16 v) { /* 16 signed bytes -> int32 lanes */
#ifdef __AVX512F__
    __m128i b;
    memcpy(&b, &v, 16);
    const __m512i w = _mm512_cvtepi8_epi32(b);
    ivec r;
    memcpy(&r, &w, sizeof r);
    return r;
#else
    return __builtin_convertvector(__builtin_convertvector(v, i16x16), ivec);
#endif
}

INLINE vec to_f32(ivec v) { return __builtin_convertvector(v, vec); }

INLINE ivec splat_i(int32_t s) { return (ivec){} + s; }

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
    const vec d = splat(f16_to_f32(b));
    STORE(out, to_f32(widen_i8(*(const i8x16 *)(b + 2))) * d);
    STORE(out + 16, to_f32(widen_i8(*(const i8x16 *)(b + 18))) * d);
}

/* Q4_0 / Q4_1 / Q5_0 / Q5_1: d | (m, has_min) | (qh[4], five_bit) | qs[16]. Element l < 16 is
 * qs[l]'s low nibble, l + 16 its high one; the 5th bit of element l is bit l of qh as a
 * little-endian uint32. w = d * q + m, or d * (q - 8) / d * (q - 16) without m. Inlined with
 * constant flags, so each type gets its own straight-line code. */
INLINE void dq_legacy(const uint8_t *b, float *out, int has_min, int five_bit) {
    const float d = f16_to_f32(b), m = has_min ? f16_to_f32(b + 2) : 0.0f;
    const uint8_t *qh = b + (has_min ? 4 : 2), *qs = qh + (five_bit ? 4 : 0);
    const u8x16 bytes = *(const u8x16 *)qs;
    ivec lo = widen_u8(bytes & 15), hi = widen_u8(bytes >> 4);
    if (five_bit) {
        uint32_t h;
        memcpy(&h, qh, 4); /* little-endian, as the file (and x86 / arm64) */
        lo |= ((splat_i((int32_t)(h & 0xffff)) >> LANE) & 1) << 4;
        hi |= ((splat_i((int32_t)(h >> 16)) >> LANE) & 1) << 4;
    }
    if (has_min) {
        STORE(out, to_f32(lo) * d + m);
        STORE(out + 16, to_f32(hi) * d + m);
    } else {
        const int offset = five_bit ? 16 : 8;
        STORE(out, to_f32(lo - offset) * d);
        STORE(out + 16, to_f32(hi - offset) * d);
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
INLINE void dq_qk(const uint8_t *b, float *out, int five_bit) {
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    float sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + (five_bit ? 48 : 16);
    for (int s = 0; s < 8; s++) {
        const vec scale = splat(d * sc[s]), shift = splat(dmin * mn[s]);
        for (int half = 0; half < 2; half++) {
            u8x16 q = (*(const u8x16 *)(qs + 32 * (s / 2) + 16 * half) >> (4 * (s % 2))) & 15;
            if (five_bit) q |= ((*(const u8x16 *)(qh + 16 * half) >> s) & 1) << 4;
            STORE(out + 32 * s + 16 * half, scale * to_f32(widen_u8(q)) - shift);
        }
    }
}

/* ql[128] | qh[64] | int8 scales[16] | d; element 128h + 32t + l: 4 low bits from
 * ql[64h + 32(t%2) + l] >> 4(t/2), 2 high bits from qh[32h + l] >> 2t, scale (128h + 32t + l) / 16. */
static void dq_q6_k(const uint8_t *b, float *out) {
    const float d = f16_to_f32(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int half = 0; half < 2; half++) { /* 16 elements, one scale */
                const int base = 128 * h + 32 * t + 16 * half;
                const u8x16 ql = *(const u8x16 *)(b + 64 * h + 32 * (t % 2) + 16 * half);
                const u8x16 qh = *(const u8x16 *)(b + 128 + 32 * h + 16 * half);
                const u8x16 q = ((ql >> (4 * (t / 2))) & 15) | (((qh >> (2 * t)) & 3) << 4);
                STORE(out + base, to_f32(widen_u8(q) - 32) * (d * (float)sc[base / 16]));
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

/* Blocks [first, first + count) of one W row of `qtype` into out[count * elems]. The switch sits
 * outside the loops, so each loop calls one inlined dequantizer. */
static void dequant_blocks(const uint8_t *row, int qtype, int64_t first, int64_t count, float *out) {
    int64_t elems, bytes;
    block_layout(qtype, &elems, &bytes);
    const uint8_t *b = row + first * bytes;
#define DQ_LOOP(CALL)                                                                            \
    for (int64_t i = 0; i < count; i++, b += bytes, out += elems) CALL;                          \
    return
    switch (qtype) {
    case Q8_0: DQ_LOOP(dq_q8_0(b, out));
    case Q4_0: DQ_LOOP(dq_legacy(b, out, 0, 0));
    case Q4_1: DQ_LOOP(dq_legacy(b, out, 1, 0));
    case Q5_0: DQ_LOOP(dq_legacy(b, out, 0, 1));
    case Q5_1: DQ_LOOP(dq_legacy(b, out, 1, 1));
    case Q4_K: DQ_LOOP(dq_qk(b, out, 0));
    case Q5_K: DQ_LOOP(dq_qk(b, out, 1));
    default: DQ_LOOP(dq_q6_k(b, out));
    }
#undef DQ_LOOP
}

#endif
