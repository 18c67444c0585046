/* Fused elementwise ops for fp32 on CPU: one pass each where torch's eager ops take
 * two to five (and allocate in between). Built and loaded like cpu_paged_attention.c
 * (kernels/cpu_build.py); wrappers with torch fallbacks in kernels/cpu_ops.py.
 *
 * Rows are independent: large calls split rows across OpenMP threads, small ones
 * (a decode step's few dozen rows) stay on the calling thread, where waking the
 * pool would cost more than the work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define PARALLEL_MIN_ELEMS 65536 /* below this many floats a call runs single-threaded */
#define ERR_SLOT 1                /* a slot_mapping entry is past the cache */

/* out = rms_norm(x (+ residual)) * weight, row by row; with residual, residual = x + residual.
 * x, out: [n, h] rows x_stride / out_stride apart (out may be x); residual: [n, h]
 * contiguous or NULL; weight: [h]. The sum of squares accumulates in float lanes. */
void rayllm_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *weight,
                             float *out, int64_t out_stride, int64_t n, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (n * h >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * x_stride;
        float *o = out + i * out_stride, *r = residual ? residual + i * h : NULL;
        vec ss = splat(0.0f);
        float tail = 0.0f;
        int64_t d = 0;
        for (; d + CHUNK <= h; d += CHUNK) {
            vec s = LOAD(xr + d);
            if (r) {
                s += LOAD(r + d);
                STORE(r + d, s);
            }
            ss += s * s;
        }
        for (; d < h; d++) {
            const float s = r ? (r[d] = xr[d] + r[d]) : xr[d];
            tail += s * s;
        }
        const float inv = 1.0f / sqrtf((hsum(ss) + tail) / (float)h + eps);
        const float *src = r ? r : xr; /* the normalised input: x + residual, or x */
        for (d = 0; d + CHUNK <= h; d += CHUNK) STORE(o + d, LOAD(src + d) * inv * LOAD(weight + d));
        for (; d < h; d++) o[d] = src[d] * inv * weight[d];
    }
}

/* e^x for any float x, lane-wise: e^x = e^-|x| or its reciprocal (exp_nonpos covers x <= 0). */
INLINE vec exp_any(vec x) {
    const ivec neg = x < 0.0f;
    const vec ax = (vec)((ivec)x & 0x7fffffff); /* |x|: the sign bit cleared */
    const vec e = exp_nonpos(-ax);
    const vec inv = 1.0f / e;
    return (vec)(((ivec)e & neg) | ((ivec)inv & ~neg));
}

/* out = silu(gate) * up, x = [gate | up]: [n, 2 * d] rows x_stride apart; out: [n, d]. */
void rayllm_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t n, int64_t d) {
#pragma omp parallel for schedule(static) if (n * d >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const float *g = x + i * x_stride, *u = g + d;
        float *o = out + i * d;
        int64_t j = 0;
        for (; j + CHUNK <= d; j += CHUNK) {
            const vec gv = LOAD(g + j);
            STORE(o + j, gv / (1.0f + exp_any(-gv)) * LOAD(u + j));
        }
        for (; j < d; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* Neox rotary in place: each head [x1 | x2] (halves of D) at position p becomes
 * [x1 * cos - x2 * sin | x2 * cos + x1 * sin]. x: [n, heads, D], rows row_stride apart,
 * heads D apart; positions: [n]; cos_sin: [max_pos, D] = [cos (D/2) | sin (D/2)]. */
void rayllm_rotary_neox_f32(float *x, int64_t row_stride, const int64_t *positions,
                            const float *cos_sin, int64_t n, int64_t heads, int64_t D) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (n * heads * D >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos_sin + positions[i] * D, *s = c + half;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *restrict x1 = x + i * row_stride + hd * D, *restrict x2 = x1 + half;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                const float a = x1[j], b = x2[j];
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j] + a * s[j];
            }
        }
    }
}

/* k_cache/v_cache slot s <- key/value row t for s = slot_mapping[t] >= 0 (< 0: padding).
 * key, value: [n, row] rows k_stride / v_stride apart (row = kv_heads * D floats);
 * caches: [num_slots, row] contiguous. Returns ERR_SLOT (nothing written) for a slot
 * >= num_slots. */
int rayllm_store_kv_f32(const float *key, int64_t k_stride, const float *value, int64_t v_stride,
                        float *k_cache, float *v_cache, const int64_t *slot_mapping, int64_t n,
                        int64_t row, int64_t num_slots) {
    for (int64_t t = 0; t < n; t++)
        if (slot_mapping[t] >= num_slots) return ERR_SLOT;
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row, key + t * k_stride, row * sizeof(float));
        memcpy(v_cache + slot * row, value + t * v_stride, row * sizeof(float));
    }
    return 0;
}
