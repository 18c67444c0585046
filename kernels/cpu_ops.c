/* Fused elementwise ops on CPU: one pass each where torch's eager ops take two to five (and
 * allocate in between). Norm and activation take fp32, bf16 and fp16 (computing in fp32 and
 * rounding where torch's ops in that type would), rotary too (its cos/sin table fp32); the KV
 * store any type. Built
 * and loaded like cpu_paged_attention.c (kernels/cpu_build.py); wrappers with torch fallbacks
 * in kernels/cpu_ops.py.
 *
 * Rows are independent: large calls split rows across OpenMP threads, small ones
 * (a decode step's few dozen rows) stay on the calling thread, where waking the
 * pool would cost more than the work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define PARALLEL_MIN_ELEMS 65536 /* below this many elements a call runs single-threaded */
#define ERR_SLOT 1                /* a slot_mapping entry is past the cache */

/* One row of rayllm_add_rms_norm, elements of type dt, the weight of type wdt. In a half type
 * the sum x + r is rounded before it is stored and normalised (as torch's add_ then rms_norm),
 * and each output once from fp32 (as F.rms_norm). */
INLINE void rms_norm_row(const void *x, void *r, const void *w, void *o, int64_t h, float eps, int dt, int wdt) {
    vec ss = splat(0.0f);
    float tail = 0.0f;
    int64_t d = 0;
    for (; d + CHUNK <= h; d += CHUNK) {
        vec s = load_as_f32(x, d, dt);
        if (r) {
            s = round_to(s + load_as_f32(r, d, dt), dt);
            store_as(r, d, s, dt);
        }
        ss += s * s;
    }
    for (; d < h; d++) {
        float s = load1_as_f32(x, d, dt);
        if (r) {
            s = round1_to(s + load1_as_f32(r, d, dt), dt);
            store1_from_f32(r, d, s, dt);
        }
        tail += s * s;
    }
    const float inv = 1.0f / sqrtf((hsum(ss) + tail) / (float)h + eps);
    const void *src = r ? r : x; /* the normalised input: x + residual, or x */
    for (d = 0; d + CHUNK <= h; d += CHUNK)
        store_as(o, d, load_as_f32(src, d, dt) * inv * load_as_f32(w, d, wdt), dt);
    for (; d < h; d++) store1_from_f32(o, d, load1_as_f32(src, d, dt) * inv * load1_as_f32(w, d, wdt), dt);
}

/* out = rms_norm(x (+ residual)) * weight, row by row; with residual, residual = x + residual.
 * x, out: [n, h] rows x_stride / out_stride elements apart (out may be x); residual: [n, h]
 * contiguous or NULL; weight: [h]. x, residual and out are of type dt (DT_*, cpu_simd.h), the
 * weight of dt or DT_F32 (wdt); the sum of squares accumulates in float lanes. */
void rayllm_add_rms_norm(const void *x, int64_t x_stride, void *residual, const void *weight, void *out,
                         int64_t out_stride, int64_t n, int64_t h, float eps, int64_t dt, int64_t wdt) {
    const int64_t size = dt_size(dt);
#pragma omp parallel for schedule(static) if (n * h >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const void *xr = (const char *)x + i * x_stride * size;
        void *r = residual ? (char *)residual + i * h * size : NULL, *o = (char *)out + i * out_stride * size;
        switch (dt * 3 + wdt) { /* constant types: each case its own specialised loops */
        case DT_BF16 * 3 + DT_BF16: rms_norm_row(xr, r, weight, o, h, eps, DT_BF16, DT_BF16); break;
        case DT_BF16 * 3 + DT_F32: rms_norm_row(xr, r, weight, o, h, eps, DT_BF16, DT_F32); break;
        case DT_F16 * 3 + DT_F16: rms_norm_row(xr, r, weight, o, h, eps, DT_F16, DT_F16); break;
        case DT_F16 * 3 + DT_F32: rms_norm_row(xr, r, weight, o, h, eps, DT_F16, DT_F32); break;
        default: rms_norm_row(xr, r, weight, o, h, eps, DT_F32, DT_F32);
        }
    }
}

/* One row of rayllm_silu_and_mul in type dt: silu(gate) is rounded to dt before the multiply
 * and the product after it, as torch's F.silu(gate).mul_(up) in that type. */
INLINE void silu_mul_row(const void *g, void *o, int64_t d, int dt) {
    const void *u = elem_at(g, d, dt);
    int64_t j = 0;
    for (; j + CHUNK <= d; j += CHUNK) {
        const vec gv = load_as_f32(g, j, dt);
        store_as(o, j, round_to(silu(gv), dt) * load_as_f32(u, j, dt), dt);
    }
    for (; j < d; j++) {
        const float gj = load1_as_f32(g, j, dt);
        store1_from_f32(o, j, round1_to(gj / (1.0f + expf(-gj)), dt) * load1_as_f32(u, j, dt), dt);
    }
}

/* out = silu(gate) * up, x = [gate | up]: [n, 2 * d] rows x_stride elements apart; out: [n, d];
 * both of type dt. */
void rayllm_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t n, int64_t d, int64_t dt) {
    const int64_t size = dt_size(dt);
#pragma omp parallel for schedule(static) if (n * d >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const void *g = (const char *)x + i * x_stride * size;
        void *o = (char *)out + i * d * size;
        switch (dt) {
        case DT_BF16: silu_mul_row(g, o, d, DT_BF16); break;
        case DT_F16: silu_mul_row(g, o, d, DT_F16); break;
        default: silu_mul_row(g, o, d, DT_F32);
        }
    }
}

/* One head of rayllm_rotary_neox in type dt, [x1 | x2] halves of `half` elements. In a half
 * type cos and sin are rounded to dt first and every product, difference and sum is rounded as
 * torch's ops in that type round them (_rotate_neox_ in engine/layers/rotary.py). */
INLINE void rotary_head(void *x1, const float *c, const float *s, int64_t half, int dt) {
    void *x2 = (char *)x1 + half * dt_size(dt);
    int64_t j = 0;
    for (; j + CHUNK <= half; j += CHUNK) {
        const vec a = load_as_f32(x1, j, dt), b = load_as_f32(x2, j, dt);
        const vec cj = round_to(LOAD(c + j), dt), sj = round_to(LOAD(s + j), dt);
        const vec a_sin = round_to(a * sj, dt), b_sin = round_to(b * sj, dt);
        store_as(x1, j, round_to(a * cj, dt) - b_sin, dt);
        store_as(x2, j, round_to(b * cj, dt) + a_sin, dt);
    }
    for (; j < half; j++) {
        const float a = load1_as_f32(x1, j, dt), b = load1_as_f32(x2, j, dt);
        const float cj = round1_to(c[j], dt), sj = round1_to(s[j], dt);
        const float a_sin = round1_to(a * sj, dt), b_sin = round1_to(b * sj, dt);
        store1_from_f32(x1, j, round1_to(a * cj, dt) - b_sin, dt);
        store1_from_f32(x2, j, round1_to(b * cj, dt) + a_sin, dt);
    }
}

/* Neox rotary in place: each head [x1 | x2] (halves of D) at position p becomes
 * [x1 * cos - x2 * sin | x2 * cos + x1 * sin]. x: [n, heads, D] of type dt, rows row_stride
 * elements apart, heads D apart; positions: [n]; cos_sin: [max_pos, D] = [cos (D/2) | sin (D/2)]
 * in fp32. */
void rayllm_rotary_neox(void *x, int64_t row_stride, const int64_t *positions, const float *cos_sin,
                        int64_t n, int64_t heads, int64_t D, int64_t dt) {
    const int64_t half = D / 2, size = dt_size(dt);
#pragma omp parallel for schedule(static) if (n * heads * D >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos_sin + positions[i] * D, *s = c + half;
        for (int64_t hd = 0; hd < heads; hd++) {
            char *x1 = (char *)x + (i * row_stride + hd * D) * size;
            if (dt == DT_F32) { /* one expression per element (as before the half types came) */
                float *restrict f1 = (float *)x1, *restrict f2 = f1 + half;
#pragma omp simd
                for (int64_t j = 0; j < half; j++) {
                    const float a = f1[j], b = f2[j];
                    f1[j] = a * c[j] - b * s[j];
                    f2[j] = b * c[j] + a * s[j];
                }
            } else if (dt == DT_BF16) {
                rotary_head(x1, c, s, half, DT_BF16);
            } else {
                rotary_head(x1, c, s, half, DT_F16);
            }
        }
    }
}

/* k_cache/v_cache slot s <- key/value row t for s = slot_mapping[t] >= 0 (< 0: padding).
 * key, value: [n, row_bytes] rows k_stride / v_stride bytes apart (a row is kv_heads * D
 * elements of any type); caches: [num_slots, row_bytes] contiguous. Returns ERR_SLOT (nothing
 * written) for a slot >= num_slots. */
int rayllm_store_kv(const char *key, int64_t k_stride, const char *value, int64_t v_stride, char *k_cache,
                    char *v_cache, const int64_t *slot_mapping, int64_t n, int64_t row_bytes, int64_t num_slots) {
    for (int64_t t = 0; t < n; t++)
        if (slot_mapping[t] >= num_slots) return ERR_SLOT;
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, key + t * k_stride, row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * v_stride, row_bytes);
    }
    return 0;
}
