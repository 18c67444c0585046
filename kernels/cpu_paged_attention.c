/* Fused paged attention on CPU for fp32, bf16 and fp16: reads K/V straight from the paged cache.
 *
 * Built at first use by kernels/cpu_build.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes from kernels/cpu_attention.py. No gather copy, no padding.
 *
 * Work item = (sequence, tile of up to ROWS_TILE query rows), every head: M =
 * rows * num_heads query vectors, vector m = (h * nr + r) * G + g for kv head h,
 * row r, query head h * G + g. The keys are walked TILE at a time with an online
 * (flash-style) softmax across tiles and two passes inside one: scores for every
 * vector, softmax, then P @ V. Both passes walk the tile block by block, and a
 * block stores all kv heads of its tokens together ([block_size, kv_heads, D]), so
 * K and V are each read once, front to back; the G query heads of a group reuse
 * their kv head's rows from L1, and up to GROUPED_MAX_D each row is widened to fp32
 * once for all of them (group_scores, group_pv).
 *
 * Causality: query row i of a sequence with q_len new rows sits at position
 * seq_len - q_len + i and sees keys 0 .. that position (bottom-right aligned).
 *
 * Optional score changes (semantics: kernels/reference.py). A sliding window W
 * leaves row p the keys p - W + 1 .. p: the walk starts at the block holding the
 * item's first row's first key, so blocks wholly before every row's window are
 * never read, and a vector skips the CHUNKs before its own window. A soft cap
 * turns scores into cap * tanh(score / cap). A sink is one more logit per head in
 * the softmax, with no value: the online softmax starts from it (max = sink,
 * sum = 1, acc = 0), as if it were a key before all others.
 *
 * Element types: query, caches and out share one (Args.dtype). bf16 and fp16 are widened to
 * fp32 as they are loaded (the query once per item, K and V in registers per CHUNK), all
 * arithmetic and the online-softmax state are fp32, and each output row is rounded back once.
 * The loops are specialised per type (SPECIALISE below), as they are per head_dim.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define ROWS_TILE 4 /* query rows per item: some K/V reuse for chunks with a prefix */
#define MAX_REG_CHUNKS 8 /* head_dim up to 128: an accumulator in registers */
/* head_dim up to this: each K and V row is widened once for every query vector that reads it (a
 * kv head's query heads, GQA), not once per vector. Measured faster at 64 for 2 to 7 query heads
 * per kv head, slower at 128 (docs/benchmarks.md), where the per-vector path stays. */
#define GROUPED_MAX_D 64
#define GROUP 8    /* query vectors per group_scores pass: GROUP x CHUNK partial sums on the stack */
#define PV_GROUP 4 /* query vectors per group_pv call: PV_GROUP x D / CHUNK accumulators in registers */
#define TILE 128    /* keys per online-softmax step, a multiple of CHUNK */
/* K and V rows are prefetched this many CHUNKs ahead of the scores (half as many in fp32: the
 * same bytes): decode reads the cache from memory, block after block in the table's order, and
 * each block is a jump the hardware prefetcher does not foresee (docs/benchmarks.md). */
#define PREFETCH_CHUNKS 2

/* Error codes; the Python wrapper turns them into ValueError / MemoryError. */
#define ERR_SEQ_LEN 1    /* q_len > seq_len or seq_len > max_blocks * block_size */
#define ERR_BLOCK_ID 2   /* a block id the context needs is outside the cache */
#define ERR_NO_MEMORY 3
#define ERR_QUERY_ROWS 4 /* cu_seqlens_q does not cover rows 0 .. num_tokens in order */
#define ERR_DTYPE 5      /* Args.dtype is not a DT_* code */

typedef struct {
    const void *query;           /* [num_tokens, num_heads, head_dim], rows q_stride_tok apart */
    const void *k_cache;         /* [num_blocks, block_size, num_kv_heads, head_dim], contiguous */
    const void *v_cache;         /* same shape as k_cache */
    const int32_t *block_tables; /* [num_seqs, max_blocks], rows bt_stride apart */
    const int32_t *seq_lens;     /* [num_seqs] context length incl. the new rows */
    const int32_t *cu_seqlens_q; /* [num_seqs + 1] query row offsets */
    void *out;                   /* [num_tokens, num_heads, head_dim], rows o_stride_tok apart */
    int64_t q_stride_tok, q_stride_head, o_stride_tok, o_stride_head, bt_stride;
    int64_t num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks;
    float scale;
    int64_t max_q_len; /* sequences with more query rows are skipped (the caller runs them) */
    int64_t sliding_window; /* 0: none, else row p sees keys p - sliding_window + 1 .. p */
    float soft_cap;         /* 0: none, else scores -> soft_cap * tanh(score / soft_cap) */
    const float *sinks;     /* NULL: none, else [num_heads] logits that join the denominator */
    int64_t dtype;          /* DT_* (cpu_simd.h) of query, caches and out; strides count elements */
} Args;

/* One work item's query vectors and their online-softmax state (scratch of one thread). */
typedef struct {
    const Args *a;
    const int32_t *table; /* [max_blocks] the sequence's block ids, checked in range */
    int64_t M, Mh;        /* vectors in all, and per kv head (nr * G) */
    float *q;             /* [M, D] pre-scaled queries */
    float *acc;           /* [M, D] unnormalised outputs */
    float *s;             /* [M, TILE] scores, then probabilities, of the current tile */
    float *m_run, *l_run; /* [M] running max, running sum of exp */
    int64_t *lim;         /* [M] keys before lim are causal for the vector */
    int64_t *lo;          /* [M] keys from lo on are inside its window (0 without one) */
    int64_t *head;        /* [M] its kv head (m / Mh) */
    int64_t num_keys;     /* keys the item's last row sees: the walk's end */
} Item;

/* Offset (elements) of key t's row for kv head 0: row t % bs of block table[t / bs]. */
INLINE int64_t key_offset(const Item *it, int64_t t) {
    const int64_t bs = it->a->block_size;
    return (it->table[t / bs] * bs + t % bs) * it->a->num_kv_heads * it->a->head_dim;
}

/* The kv head of vector m, from a table: a division per vector and chunk cost as much as the
 * chunk's dot products. */
INLINE int64_t kv_head(const Item *it, int64_t m) {
    return it->head[m];
}

/* cap * tanh(x / cap) lane-wise: tanh(y) = sign(y) (1 - e^-2|y|) / (1 + e^-2|y|). */
INLINE vec soft_cap(vec x, float cap) {
    const vec y = x * (1.0f / cap);
    const vec t = exp_nonpos(vmax(y, -y) * -2.0f);
    const vec r = (1.0f - t) / (1.0f + t) * cap;
    const ivec neg = y < 0.0f;
    return (vec)(((ivec)-r & neg) | ((ivec)r & ~neg));
}

/* Whether chunk [k, k + CHUNK) holds no key vector m may see (past its limit or before
 * its window). tile_softmax and tile_pv skip the same chunks. */
INLINE int chunk_hidden(const Item *it, int64_t m, int64_t k) {
    return k >= it->lim[m] || k + CHUNK <= it->lo[m];
}

/* Whether scores and P @ V take the grouped path (group_scores, group_pv): whole CHUNKs of one
 * block and head_dim a multiple of CHUNK up to GROUPED_MAX_D. */
INLINE int grouped_path(const Item *it, int64_t D) {
    return it->a->block_size % CHUNK == 0 && D % CHUNK == 0 && D <= GROUPED_MAX_D;
}

/* s[m, j .. j + CHUNK) = q_m . k_{k0 + j + c} for vectors m0 .. m0 + nm (all of one kv head),
 * the CHUNK key rows from kb (`stride` elements apart): each row is widened once for all the
 * vectors (a kv head's query heads and rows), GROUP of them at a time. */
INLINE void group_scores(const Item *it, int64_t m0, int64_t nm, const void *kb, int64_t stride, int64_t j,
                         int64_t D, int dt) {
    vec part[GROUP][CHUNK]; /* part[g][c]: lane sums of q_{m0+g} . k_c, reduced by transpose_sum */
    vec k[GROUPED_MAX_D / CHUNK];
    for (int64_t g0 = 0; g0 < nm; g0 += GROUP) {
        const int64_t ng = nm - g0 < GROUP ? nm - g0 : GROUP;
        for (int c = 0; c < CHUNK; c++) {
            for (int64_t i = 0; i < D / CHUNK; i++) k[i] = load_as_f32(kb, c * stride + i * CHUNK, dt);
            for (int64_t g = 0; g < ng; g++) {
                const float *q = it->q + (m0 + g0 + g) * D;
                vec acc = LOAD(q) * k[0];
                for (int64_t i = 1; i < D / CHUNK; i++) acc += LOAD(q + i * CHUNK) * k[i];
                part[g][c] = acc;
            }
        }
        for (int64_t g = 0; g < ng; g++) STORE(it->s + (m0 + g0 + g) * TILE + j, transpose_sum(part[g]));
    }
}

/* Prefetch the K and V rows of the CHUNK keys from `key` on (their blocks were checked). */
INLINE void prefetch_chunk(const Item *it, int64_t key, int64_t stride, int dt) {
    const int64_t off = key_offset(it, key), bytes = CHUNK * stride * dt_size(dt);
    const char *k = elem_at(it->a->k_cache, off, dt), *v = elem_at(it->a->v_cache, off, dt);
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(k + b);
        __builtin_prefetch(v + b);
    }
}

/* s[m, j] = q_m . k_{k0 + j} for the kn keys of the tile; -inf where m may not look. */
INLINE void tile_scores(const Item *it, int64_t k0, int64_t kn, int64_t D, int dt) {
    const int64_t stride = it->a->num_kv_heads * D;
    const int fast = it->a->block_size % CHUNK == 0 && D % CHUNK == 0;
    const int grouped = grouped_path(it, D);
    const float cap = it->a->soft_cap;
    const int64_t ahead = (dt == DT_F32 ? PREFETCH_CHUNKS / 2 : PREFETCH_CHUNKS) * CHUNK; /* in bytes alike */
    for (int64_t j = 0; j < kn; j += CHUNK) { /* fast: CHUNK rows of one block */
        const int64_t kb = key_offset(it, k0 + j);
        if (k0 + j + ahead < it->num_keys) prefetch_chunk(it, k0 + j + ahead, stride, dt);
        if (grouped) /* every vector's dots (a hidden chunk's are overwritten below) */
            for (int64_t h = 0; h < it->a->num_kv_heads; h++)
                group_scores(it, h * it->Mh, it->Mh, elem_at(it->a->k_cache, kb + h * D, dt), stride, j, D, dt);
        for (int64_t m = 0; m < it->M; m++) {
            const float *q = it->q + m * D;
            float *s = it->s + m * TILE + j;
            if (chunk_hidden(it, m, k0 + j)) {
                STORE(s, splat(-INFINITY));
                continue;
            } else if (fast && !grouped) {
                STORE(s, dot_chunk(q, elem_at(it->a->k_cache, kb + kv_head(it, m) * D, dt), stride, D, dt));
            } else if (!fast) {
                for (int64_t c = 0; c < CHUNK; c++)
                    s[c] = j + c < kn ? dot(q, elem_at(it->a->k_cache, key_offset(it, k0 + j + c) + kv_head(it, m) * D, dt), D, dt)
                                      : 0.0f;
            }
            if (cap > 0.0f) STORE(s, soft_cap(LOAD(s), cap));
            if (k0 + j + CHUNK <= it->lim[m] && k0 + j >= it->lo[m] && j + CHUNK <= kn) continue; /* all visible */
            for (int64_t c = 0; c < CHUNK; c++) { /* past the causal limit or the tile, before the window */
                const int64_t key = k0 + j + c;
                if (key >= it->lim[m] || key < it->lo[m] || j + c >= kn) s[c] = -INFINITY;
            }
        }
    }
}

/* Softmax of each vector's tile scores against its running max; rescales acc and l.
 * Returns nothing; s holds probabilities afterwards (lanes past the limit unused). */
INLINE void tile_softmax(const Item *it, int64_t k0, int64_t kn, int64_t D) {
    for (int64_t m = 0; m < it->M; m++) {
        const int64_t n = it->lim[m] - k0 < kn ? it->lim[m] - k0 : kn;
        if (n <= 0 || it->lo[m] >= k0 + kn) continue; /* the tile is past or before m's keys */
        /* The first chunk that is not wholly before the window (chunk_hidden's rule). */
        const int64_t j0 = it->lo[m] > k0 ? (it->lo[m] - k0) / CHUNK * CHUNK : 0;
        float *s = it->s + m * TILE;
        vec mx = LOAD(s + j0), sum = splat(0.0f);
        for (int64_t j = j0 + CHUNK; j < n; j += CHUNK) mx = vmax(mx, LOAD(s + j));
        const float m_new = hmax(mx) > it->m_run[m] ? hmax(mx) : it->m_run[m];
        for (int64_t j = j0; j < n; j += CHUNK) {
            vec p = exp_nonpos(LOAD(s + j) - m_new);
            for (int64_t c = 0; j == j0 && c < it->lo[m] - k0 - j; c++) p[c] = 0.0f; /* before the window */
            STORE(s + j, p);
            sum += p; /* lanes past n hold ~1e-38 (exp of -inf, clamped): negligible */
        }
        const float alpha = exp1(it->m_run[m] - m_new);
        it->m_run[m] = m_new;
        it->l_run[m] = it->l_run[m] * alpha + hsum(sum);
        for (int64_t d = 0; d < D; d++) it->acc[m * D + d] *= alpha;
    }
}

/* acc += sum_{c < n} p[c] * v_c over D floats, v_c = vb + c * stride (elements of type dt).
 * With D a constant <= MAX_REG_CHUNKS * CHUNK, acc lives in registers for the whole walk. */
INLINE void pv_rows(float *restrict acc, const float *restrict p, const void *restrict vb,
                    int64_t stride, int64_t n, int64_t D, int dt) {
    if (D % CHUNK || D > MAX_REG_CHUNKS * CHUNK) {
        for (int64_t c = 0; c < n; c++)
            for (int64_t d = 0; d < D; d++) acc[d] += p[c] * load1_as_f32(vb, c * stride + d, dt);
        return;
    }
    vec x[MAX_REG_CHUNKS];
    for (int64_t i = 0; i < D / CHUNK; i++) x[i] = LOAD(acc + i * CHUNK);
    for (int64_t c = 0; c < n; c++) {
        const vec pc = splat(p[c]);
        for (int64_t i = 0; i < D / CHUNK; i++) x[i] += pc * load_as_f32(vb, c * stride + i * CHUNK, dt);
    }
    for (int64_t i = 0; i < D / CHUNK; i++) STORE(acc + i * CHUNK, x[i]);
}

/* acc_m += sum_{c < n} p[m, j + c] * v_c for the R <= PV_GROUP vectors m0 .. m0 + R of one query
 * row and kv head (one limit and window), v_c = vb + c * stride: each V row is widened once for
 * the R of them, their accumulators in registers. Lanes before the window count 0 (the first
 * visible chunk's softmax wrote 0 there); rows past the limit are never read. */
INLINE void group_pv(const Item *it, int64_t m0, const int R, const void *vb, int64_t stride, int64_t j,
                     int64_t n, int64_t D, int dt) {
    vec x[PV_GROUP][GROUPED_MAX_D / CHUNK], v[GROUPED_MAX_D / CHUNK];
    for (int g = 0; g < R; g++)
        for (int64_t i = 0; i < D / CHUNK; i++) x[g][i] = LOAD(it->acc + (m0 + g) * D + i * CHUNK);
    for (int64_t c = 0; c < n; c++) {
        for (int64_t i = 0; i < D / CHUNK; i++) v[i] = load_as_f32(vb, c * stride + i * CHUNK, dt);
        for (int g = 0; g < R; g++) {
            const vec pc = splat(it->s[(m0 + g) * TILE + j + c]);
            for (int64_t i = 0; i < D / CHUNK; i++) x[g][i] += pc * v[i];
        }
    }
    for (int g = 0; g < R; g++)
        for (int64_t i = 0; i < D / CHUNK; i++) STORE(it->acc + (m0 + g) * D + i * CHUNK, x[g][i]);
}

/* acc_m += sum_j p[m, j] * v_{k0 + j}, CHUNK keys at a time (one block's rows each). With
 * head_dim a multiple of CHUNK up to GROUPED_MAX_D, a query row's G heads of one kv head go
 * through group_pv together (a constant group size per call, so x stays in registers). */
INLINE void tile_pv(const Item *it, int64_t k0, int64_t kn, int64_t D, int dt) {
    const int64_t stride = it->a->num_kv_heads * D, G = it->a->num_heads / it->a->num_kv_heads;
    const int fast = it->a->block_size % CHUNK == 0;
    const int grouped = grouped_path(it, D);
    for (int64_t j = 0; j < kn; j += CHUNK) {
        const int64_t vb = key_offset(it, k0 + j);
        for (int64_t m = 0; m < it->M; m += grouped ? G : 1) { /* grouped: m is a row's first head */
            if (chunk_hidden(it, m, k0 + j)) continue; /* its probabilities were never written */
            const int64_t n = it->lim[m] - k0 - j < CHUNK ? it->lim[m] - k0 - j : CHUNK;
            const void *v = elem_at(it->a->v_cache, vb + kv_head(it, m) * D, dt);
            if (grouped) {
                for (int64_t g = 0; g < G; g += PV_GROUP) {
                    switch (G - g < PV_GROUP ? G - g : PV_GROUP) {
                    case 4: group_pv(it, m + g, 4, v, stride, j, n, D, dt); break;
                    case 3: group_pv(it, m + g, 3, v, stride, j, n, D, dt); break;
                    case 2: group_pv(it, m + g, 2, v, stride, j, n, D, dt); break;
                    default: group_pv(it, m + g, 1, v, stride, j, n, D, dt);
                    }
                }
                continue;
            }
            const float *p = it->s + m * TILE + j;
            float *acc = it->acc + m * D;
            if (fast) {
                pv_rows(acc, p, v, stride, n, D, dt);
                continue;
            }
            for (int64_t c = 0; c < n; c++) /* the chunk may span blocks: row by row */
                pv_rows(acc, p + c, elem_at(it->a->v_cache, key_offset(it, k0 + j + c) + kv_head(it, m) * D, dt),
                        stride, 1, D, dt);
        }
    }
}

/* Every vector of the item over keys [first_key, num_keys), all any of them sees, TILE
 * keys at a time. first_key is a multiple of the block size: a CHUNK stays in one block. */
INLINE void attend(const Item *it, int64_t first_key, int64_t num_keys, int64_t D, int dt) {
    for (int64_t k0 = first_key; k0 < num_keys; k0 += TILE) {
        const int64_t kn = num_keys - k0 < TILE ? num_keys - k0 : TILE;
        tile_scores(it, k0, kn, D, dt);
        tile_softmax(it, k0, kn, D);
        tile_pv(it, k0, kn, D, dt);
    }
}

typedef void (*attend_fn)(const Item *, int64_t, int64_t, int64_t);
#define SPECIALISE(NAME, D_EXPR, DT)                                                  \
    static void NAME(const Item *it, int64_t first_key, int64_t num_keys, int64_t D) { \
        (void)D;                                                                      \
        attend(it, first_key, num_keys, D_EXPR, DT);                                  \
    }
#define SPECIALISE_TYPE(T, DT)                 \
    SPECIALISE(attend_d64_##T, 64, DT)         \
    SPECIALISE(attend_d128_##T, 128, DT)       \
    SPECIALISE(attend_any_##T, D, DT)
SPECIALISE_TYPE(f32, DT_F32)
SPECIALISE_TYPE(bf16, DT_BF16)
SPECIALISE_TYPE(f16, DT_F16)

/* The specialisation for a head_dim and a DT_* code (checked by the entry point). */
static attend_fn pick_attend(int64_t D, int64_t dt) {
    static const attend_fn fns[3][3] = {{attend_d64_f32, attend_d128_f32, attend_any_f32},
                                        {attend_d64_bf16, attend_d128_bf16, attend_any_bf16},
                                        {attend_d64_f16, attend_d128_f16, attend_any_f16}};
    return fns[dt][D == 64 ? 0 : D == 128 ? 1 : 2];
}

/* Query rows [r0, r0 + nr) of sequence `seq`, every head. */
static int run_item(Item *it, attend_fn fn, int64_t seq, int64_t r0, int64_t nr) {
    const Args *a = it->a;
    const int64_t D = a->head_dim, BS = a->block_size, G = a->num_heads / a->num_kv_heads;
    const int64_t q_start = a->cu_seqlens_q[seq];
    const int64_t first_pos = a->seq_lens[seq] - (a->cu_seqlens_q[seq + 1] - q_start) + r0;
    const int64_t num_keys = first_pos + nr; /* the tile's last row sees the most */
    const int64_t W = a->sliding_window;
    /* Its first row the earliest: the walk starts at the block holding that row's first key. */
    const int64_t first_key = W > 0 && first_pos + 1 > W ? (first_pos + 1 - W) / BS * BS : 0;
    it->table = a->block_tables + seq * a->bt_stride;
    for (int64_t b = first_key / BS; b * BS < num_keys; b++)
        if (it->table[b] < 0 || it->table[b] >= a->num_blocks) return ERR_BLOCK_ID;
    it->Mh = nr * G;
    it->M = a->num_kv_heads * it->Mh;
    it->num_keys = num_keys;
    for (int64_t m = 0; m < it->M; m++) {
        const int64_t h = m / it->Mh, r = m % it->Mh / G, g = m % G;
        const int64_t src = (q_start + r0 + r) * a->q_stride_tok + (h * G + g) * a->q_stride_head;
        widen_row(it->q + m * D, a->query, src, D, a->scale, a->dtype);
        memset(it->acc + m * D, 0, D * sizeof(float));
        it->m_run[m] = a->sinks ? a->sinks[h * G + g] : -INFINITY; /* the sink: exp(0) = 1, no value */
        it->l_run[m] = a->sinks ? 1.0f : 0.0f;
        it->lim[m] = first_pos + r + 1;
        it->lo[m] = W > 0 && it->lim[m] > W ? it->lim[m] - W : 0;
        it->head[m] = h;
    }
    fn(it, first_key, num_keys, D);
    for (int64_t m = 0; m < it->M; m++) {
        const int64_t h = m / it->Mh, r = m % it->Mh / G, g = m % G;
        const int64_t o = (q_start + r0 + r) * a->o_stride_tok + (h * G + g) * a->o_stride_head;
        narrow_row(a->out, o, it->acc + m * D, D, 1.0f / it->l_run[m], a->dtype);
    }
    return 0;
}

/* first[s] = work items (row tiles) of sequences before s; skipped sequences get none. */
/* ERR_QUERY_ROWS or ERR_SEQ_LEN where the batch's query rows or lengths do not fit together, else 0:
 * what both entry points (this file's and cpu_chunk_attention.c's) check before reading a row. */
static int check_seqs(const Args *a) {
    if (a->cu_seqlens_q[0] != 0 || a->cu_seqlens_q[a->num_seqs] != a->num_tokens) return ERR_QUERY_ROWS;
    for (int64_t s = 0; s < a->num_seqs; s++) {
        const int64_t q_len = a->cu_seqlens_q[s + 1] - a->cu_seqlens_q[s], seq_len = a->seq_lens[s];
        if (q_len < 0) return ERR_QUERY_ROWS;
        if (q_len > seq_len || seq_len > a->max_blocks * a->block_size) return ERR_SEQ_LEN;
    }
    return 0;
}

static int plan_tiles(const Args *a, int64_t *first) {
    const int err = check_seqs(a);
    if (err) return err;
    first[0] = 0;
    for (int64_t s = 0; s < a->num_seqs; s++) {
        const int64_t q_len = a->cu_seqlens_q[s + 1] - a->cu_seqlens_q[s];
        first[s + 1] = first[s] + (q_len > a->max_q_len ? 0 : (q_len + ROWS_TILE - 1) / ROWS_TILE);
    }
    return 0;
}

static int64_t find_seq(const int64_t *first, int64_t num_seqs, int64_t item) {
    int64_t lo = 0, hi = num_seqs - 1; /* the largest s with first[s] <= item */
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= item) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* This thread's share of the items (an orphaned omp for); returns its first error. */
static int run_items(const Args *a, const int64_t *first, int64_t num_items) {
    const int64_t M = ROWS_TILE * a->num_heads, D = a->head_dim;
    const attend_fn fn = pick_attend(D, a->dtype);
    /* One block: q, acc [M, D]; s [M, TILE]; m_run, l_run [M]; lim, lo, head [M] (int64). */
    float *mem = malloc((M * (2 * D + TILE + 2)) * sizeof(float) + 3 * M * sizeof(int64_t));
    int64_t *bounds = (int64_t *)(mem + M * (2 * D + TILE + 2));
    Item it = {a, NULL, 0, 0, mem, mem + M * D, mem + 2 * M * D, mem + M * (2 * D + TILE),
               mem + M * (2 * D + TILE + 1), bounds, bounds + M, bounds + 2 * M, 0};
    int err = mem ? 0 : ERR_NO_MEMORY;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; i++) {
        if (err) continue;
        const int64_t s = find_seq(first, a->num_seqs, i);
        const int64_t q_len = a->cu_seqlens_q[s + 1] - a->cu_seqlens_q[s];
        const int64_t r0 = (i - first[s]) * ROWS_TILE;
        err = run_item(&it, fn, s, r0, q_len - r0 < ROWS_TILE ? q_len - r0 : ROWS_TILE);
    }
    free(mem);
    return err;
}

/* Entry point; returns 0 or an ERR_* code. Rows of skipped sequences are not written. */
int rayllm_paged_attention(const Args *a) {
    if (a->dtype != DT_F32 && a->dtype != DT_BF16 && a->dtype != DT_F16) return ERR_DTYPE;
    if (a->num_seqs <= 0) return 0;
    int64_t *first = malloc((a->num_seqs + 1) * sizeof(int64_t));
    if (!first) return ERR_NO_MEMORY;
    int err = plan_tiles(a, first);
    const int64_t num_items = err ? 0 : first[a->num_seqs];
#pragma omp parallel if (num_items > 1)
    {
        const int my_err = num_items ? run_items(a, first, num_items) : 0;
#pragma omp critical
        if (my_err && !err) err = my_err;
    }
    free(first);
    return err;
}
