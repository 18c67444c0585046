/* The multi-LoRA delta of one linear layer for fp32 on CPU, every adapter row of a step in one
 * call (engine/layers/lora.py's layout). Built and loaded like cpu_ops.c (kernels/cpu_build.py);
 * the wrapper with its torch fallback is kernels/cpu_lora.py.
 *
 * Per row t of slot s = token_slots[t] >= 0 (rows of slot -1, the base model, are skipped):
 *     h = A_s x_t                 [P*R]   shrink: P*R dot products over the input
 *     y_t[part p] += h[p*R:(p+1)*R] . B_s^T rows of that block
 *                                         expand: R axpys per part over its outputs
 * B is held transposed (bt [max_loras, P*R, out], row j = column j of B), so each expand step is
 * a contiguous axpy; only the diagonal blocks are read, and a rank row whose shrink is exactly 0
 * (the zero padding of an adapter below the max rank) is skipped.
 *
 * Rows are independent. A decode step's rows stay on the calling thread: waking the OpenMP
 * pool costs more than their work, and far more on a loaded machine, where every parallel
 * region waits for a descheduled thread. Prefill-sized calls split rows across threads.
 */
#include <stdint.h>

#include "cpu_simd.h"

#define PARALLEL_MIN_MACS (1 << 22) /* below this many multiply-adds a call runs single-threaded */
#define MAX_PR 1024                 /* P * R of the largest layer (3 parts x rank 256, rounded up) */

static float dot_f32(const float *restrict a, const float *restrict b, int64_t n) {
    vec acc = splat(0.0f);
    int64_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK) acc += LOAD(a + i) * LOAD(b + i);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_f32(float *restrict y, const float *restrict x, float c, int64_t n) {
    const vec cv = splat(c);
    int64_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK) STORE(y + i, LOAD(y + i) + cv * LOAD(x + i));
    for (; i < n; i++) y[i] += c * x[i];
}

/* x: [n, in] rows x_stride apart; y: [n, out] rows y_stride apart, += the delta in place;
 * a: [max_loras, P*R, in] contiguous; bt: [max_loras, P*R, out] contiguous; token_slots: [n];
 * part_offsets: [P + 1], part p's outputs part_offsets[p] .. part_offsets[p + 1].
 * Returns 0; 1 if P * R exceeds MAX_PR, 2 if a slot is >= max_loras or the part offsets leave
 * [0, out] (nothing written: the caller takes its torch path, which raises on bad input). */
int rayllm_lora_delta_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *a,
                          const float *bt, const int32_t *token_slots, int64_t n, int64_t max_loras, int64_t in,
                          int64_t out, int64_t num_parts, int64_t rank, const int64_t *part_offsets) {
    const int64_t pr = num_parts * rank;
    if (pr > MAX_PR) return 1;
    for (int64_t t = 0; t < n; t++)
        if (token_slots[t] >= max_loras) return 2;
    for (int64_t p = 0; p < num_parts; p++)
        if (part_offsets[p] < 0 || part_offsets[p] > part_offsets[p + 1] || part_offsets[p + 1] > out) return 2;
#pragma omp parallel for schedule(static) if (n * pr * (in + out / num_parts) >= PARALLEL_MIN_MACS)
    for (int64_t t = 0; t < n; t++) {
        const int64_t s = token_slots[t];
        if (s < 0) continue;
        const float *xr = x + t * x_stride, *as = a + s * pr * in, *bs = bt + s * pr * out;
        float *yr = y + t * y_stride;
        float h[MAX_PR];
        for (int64_t j = 0; j < pr; j++) h[j] = dot_f32(xr, as + j * in, in);
        for (int64_t p = 0; p < num_parts; p++) {
            const int64_t lo = part_offsets[p], width = part_offsets[p + 1] - lo;
            for (int64_t j = p * rank; j < (p + 1) * rank; j++)
                if (h[j] != 0.0f) axpy_f32(yr + lo, bs + j * out + lo, h[j], width);
        }
    }
    return 0;
}
