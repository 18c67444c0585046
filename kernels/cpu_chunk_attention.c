/* Paged attention for long bf16 chunks (prefill) on AMX tiles; with cpu_paged_attention.c, which
 * it includes whole, one library: kernels/cpu_attention.py calls rayllm_paged_attention for decode
 * rows and short chunks, and rayllm_chunk_attention for the sequences that call skips (more than
 * Args.max_q_len query rows), where torch's SDPA ran before.
 *
 * A work item is one sequence and one kv head. It first copies the keys any of its rows sees out
 * of the cache blocks into the two layouts AMX-BF16 multiplies (tdpbf16ps takes its B operand as
 * pairs of bf16 along the inner dim):
 *
 *   kt: per 16 keys and 32 dims, a B tile of S = Q K^T: row r holds dims (2r, 2r + 1) of each key
 *   vv: per 32 keys and 16 dims, a B tile of O = P V:   row r holds keys (2r, 2r + 1) of each dim
 *
 * (keys past the sequence are zeros), then for each query head of the group and each block of 16
 * query rows walks the keys 32 at a time with an online softmax: S (two 16 x 16 fp32 tiles)
 * stored, scaled, masked (causal, sliding window) and exponentiated per row in fp32, P rounded to
 * bf16 as one A tile, O's new part (up to 4 tiles of 16 dims at a time) added to the rescaled
 * fp32 accumulator. As in SDPA's bf16 path, the products of Q K^T and P V are of bf16 values
 * summed in fp32, and P is rounded to bf16 before P V; each output row is rounded once.
 *
 * Where AMX-BF16 is missing (or Linux refuses the tiles), rayllm_chunk_attention_available() says
 * 0 and the caller keeps SDPA. Soft caps and sinks are not taken here (the caller keeps SDPA).
 */
#include "cpu_amx.h"
#include "cpu_paged_attention.c"

#if HAVE_AMX && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX_BF16 1
#else
#define HAVE_AMX_BF16 0
#endif

int rayllm_chunk_attention_available(void) { return HAVE_AMX_BF16 && amx_ready(); }

#if HAVE_AMX_BF16
#define QB 16 /* query rows per block: one A tile */
#define KS 32 /* keys per step: the inner dim of one P tile */

typedef struct {
    const Args *a;
    int64_t h, q_start, q_len, ctx, seq_len, k_lo, D; /* ctx: keys before the chunk; keys k_lo.. are copied */
    const int32_t *table;
    uint32_t *kt;  /* [steps * 2][D / 32][16][16] pairs of bf16 */
    uint16_t *vv;  /* [steps][D / 16][16][32] */
    uint16_t *q;   /* [QB][D] the block's query rows, zero padded */
    float *s;      /* [QB][KS] */
    uint16_t *p;   /* [QB][KS] */
    float *o;      /* [QB][D] */
    float *opart;  /* [QB][64] */
    float m[QB], l[QB], alpha[QB];
} Chunk;

/* Key t's row for this item's kv head, in `cache` (the item's k_cache or v_cache). */
INLINE const uint16_t *key_row(const Chunk *c, const void *cache, int64_t t) {
    const Args *a = c->a;
    const int64_t bs = a->block_size;
    return (const uint16_t *)cache + (c->table[t / bs] * bs + t % bs) * a->num_kv_heads * c->D + c->h * c->D;
}

/* dst[r][j] = src[j][r]: a 16 x 16 matrix of 32-bit words transposed in registers (pairs of
 * words, then pairs of pairs within 128-bit lanes, then the lanes themselves). */
static void transpose16(uint32_t *dst, const uint32_t *src) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + 16 * i);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* r[g + c]: word c of each lane, rows g .. g + 3 */
        r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++)
        for (int h = 0; h < 16; h += 8) {
            t[h + c] = _mm512_shuffle_i32x4(r[h + c], r[h + 4 + c], 0x88);     /* lanes 0, 2 */
            t[h + 4 + c] = _mm512_shuffle_i32x4(r[h + c], r[h + 4 + c], 0xdd); /* lanes 1, 3 */
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + 16 * i, r[i]);
}

/* kt and vv for keys k_lo .. k_lo + steps * KS (zeros past seq_len). */
static void copy_keys(Chunk *c, int64_t steps) {
    const int64_t D = c->D, dc = D / 32, dt = D / 16;
    uint32_t rows[16 * 16] __attribute__((aligned(64)));
    for (int64_t kb = 0; kb < 2 * steps; kb++)
        for (int64_t x = 0; x < dc; x++) {
            for (int64_t j = 0; j < 16; j++) {
                const int64_t t = c->k_lo + kb * 16 + j;
                if (t < c->seq_len)
                    memcpy(rows + 16 * j, (const uint32_t *)key_row(c, c->a->k_cache, t) + x * 16, 64);
                else
                    memset(rows + 16 * j, 0, 64);
            }
            transpose16(c->kt + (kb * dc + x) * 256, rows);
        }
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t st = 0; st < steps; st++)
        for (int64_t r = 0; r < 16; r++) {
            const int64_t t = c->k_lo + st * KS + 2 * r;
            const uint16_t *v0 = t < c->seq_len ? key_row(c, c->a->v_cache, t) : NULL;
            const uint16_t *v1 = t + 1 < c->seq_len ? key_row(c, c->a->v_cache, t + 1) : NULL;
            for (int64_t x = 0; x < dt; x++) { /* word d = (key t's dim, key t + 1's dim) */
                const __m512i lo = v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + 16 * x))) : zero;
                const __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + 16 * x))) : zero;
                _mm512_storeu_si512(c->vv + ((st * dt + x) * 16 + r) * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
}

/* S = Q K^T for keys of step st, into c->s [QB][KS]. */
static void scores(const Chunk *c, int64_t st) {
    const int64_t dc = c->D / 32;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t x = 0; x < dc; x++) {
        _tile_loadd(2, c->q + x * 32, c->D * 2);
        _tile_loadd(3, c->kt + ((2 * st) * dc + x) * 256, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, c->kt + ((2 * st + 1) * dc + x) * 256, 64);
        _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, c->s, KS * 4);
    _tile_stored(1, c->s + 16, KS * 4);
}

/* v with the lanes of `hide` (all ones or zeros each) set to -inf. */
INLINE vec hidden_to_ninf(vec v, ivec hide) {
    return (vec)(((ivec)v & ~hide) | ((ivec)splat(-INFINITY) & hide));
}

/* The step's scores scaled and masked (causal, window; padding rows wholly), folded into each
 * row's running max and sum 16 rows at once; the probabilities rounded to bf16 into c->p, each
 * row's accumulator factor into c->alpha. */
static void softmax_rows(Chunk *c, int64_t r0, int64_t nr, int64_t st) {
    const Args *a = c->a;
    const int64_t W = a->sliding_window, k0 = c->k_lo + st * KS;
    const vec scale = splat(a->scale);
    ivec lane;
    for (int j = 0; j < CHUNK; j++) lane[j] = j;
    /* Masks only on the steps that cross a row's causal edge or window start. */
    const int masked = c->ctx + r0 - k0 < KS - 1 || (W > 0 && c->ctx + r0 + nr - W - k0 > 0) || nr < QB;
    vec rmax[QB];
    for (int64_t r = 0; r < QB; r++) {
        vec s0 = LOAD(c->s + r * KS) * scale, s1 = LOAD(c->s + r * KS + 16) * scale;
        if (masked) {
            const int64_t pos = c->ctx + r0 + r;
            const int64_t hi = r < nr ? pos - k0 : -1, lo = W > 0 ? pos - W + 1 - k0 : 0; /* keys lo..hi */
            s0 = hidden_to_ninf(s0, (lane > (int32_t)hi) | (lane < (int32_t)lo));
            s1 = hidden_to_ninf(s1, (lane + 16 > (int32_t)hi) | (lane + 16 < (int32_t)lo));
        }
        STORE(c->s + r * KS, s0);
        STORE(c->s + r * KS + 16, s1);
        rmax[r] = vmax(s0, s1);
    }
    const vec m_old = LOAD(c->m), m_new = vmax(m_old, transpose_max(rmax));
    vec sums[QB];
    for (int64_t r = 0; r < QB; r++) {
        const float mr = m_new[r];
        vec p0 = splat(0.0f), p1 = splat(0.0f);
        if (mr != -INFINITY) { /* else every key so far hidden: nothing */
            const vec s0 = LOAD(c->s + r * KS), s1 = LOAD(c->s + r * KS + 16);
            p0 = exp_nonpos(s0 - mr);
            p1 = exp_nonpos(s1 - mr);
            if (masked) { /* hidden keys: 0, not exp(-87) */
                p0 = (vec)((ivec)p0 & ~(s0 == splat(-INFINITY)));
                p1 = (vec)((ivec)p1 & ~(s1 == splat(-INFINITY)));
            }
        }
        sums[r] = p0 + p1;
        __m512 v0, v1;
        memcpy(&v0, &p0, sizeof v0);
        memcpy(&v1, &p1, sizeof v1);
        _mm512_storeu_si512(c->p + r * KS, (__m512i)_mm512_cvtne2ps_pbh(v1, v0)); /* round to nearest even */
    }
    /* m_old = -inf: the accumulator and sum are still 0, so any finite factor does */
    const vec alpha = exp_nonpos(vmax(m_old - m_new, splat(-87.0f)));
    STORE(c->alpha, alpha);
    STORE(c->l, LOAD(c->l) * alpha + transpose_sum(sums));
    STORE(c->m, m_new);
}

/* o = o * alpha + P V for dims d0 .. d0 + 16 * nt (nt <= 4 tiles of 16); P in c->p. */
static void add_pv(Chunk *c, int64_t st, int64_t d0, int nt) {
    const int64_t dt = c->D / 16;
    const uint16_t *b = c->vv + (st * dt + d0 / 16) * 512; /* tile t at b + 512 t: 16 rows x 32 */
    _tile_loadd(2, c->p, KS * 2);
    _tile_zero(4);
    _tile_loadd(3, b, 64);
    _tile_dpbf16ps(4, 2, 3);
    if (nt > 1) { /* the S tiles (0, 1) are free now: B operands, so the loads need not wait */
        _tile_zero(5);
        _tile_loadd(0, b + 512, 64);
        _tile_dpbf16ps(5, 2, 0);
    }
    if (nt > 2) {
        _tile_zero(6);
        _tile_loadd(1, b + 1024, 64);
        _tile_dpbf16ps(6, 2, 1);
    }
    if (nt > 3) {
        _tile_zero(7);
        _tile_loadd(3, b + 1536, 64);
        _tile_dpbf16ps(7, 2, 3);
    }
    _tile_stored(4, c->opart, 64 * 4);
    if (nt > 1) _tile_stored(5, c->opart + 16, 64 * 4);
    if (nt > 2) _tile_stored(6, c->opart + 32, 64 * 4);
    if (nt > 3) _tile_stored(7, c->opart + 48, 64 * 4);
    for (int64_t r = 0; r < QB; r++) {
        float *o = c->o + r * c->D + d0;
        const vec alpha = splat(c->alpha[r]);
        for (int64_t x = 0; x < 16 * nt; x += CHUNK) STORE(o + x, LOAD(o + x) * alpha + LOAD(c->opart + r * 64 + x));
    }
}

/* Query rows r0 .. r0 + nr of the chunk, query head `head`: all its keys, then the output rows. */
static void attend_block(Chunk *c, int64_t head, int64_t r0, int64_t nr) {
    const Args *a = c->a;
    const int64_t D = c->D, W = a->sliding_window;
    for (int64_t r = 0; r < QB; r++) {
        if (r < nr)
            memcpy(c->q + r * D, (const uint16_t *)a->query + (c->q_start + r0 + r) * a->q_stride_tok +
                                     head * a->q_stride_head, D * 2);
        else
            memset(c->q + r * D, 0, D * 2);
        c->m[r] = -INFINITY;
        c->l[r] = 0.0f;
    }
    memset(c->o, 0, QB * D * sizeof(float));
    const int64_t first = W > 0 && c->ctx + r0 + 1 > W ? c->ctx + r0 + 1 - W : 0; /* row r0's first key */
    const int64_t st_lo = (first - c->k_lo) / KS, st_hi = (c->ctx + r0 + nr - 1 - c->k_lo) / KS;
    for (int64_t st = st_lo; st <= st_hi; st++) {
        scores(c, st);
        softmax_rows(c, r0, nr, st);
        for (int64_t d0 = 0; d0 < D; d0 += 64) add_pv(c, st, d0, D - d0 >= 64 ? 4 : (int)((D - d0) / 16));
    }
    for (int64_t r = 0; r < nr; r++)
        narrow_row_as(a->out, (c->q_start + r0 + r) * a->o_stride_tok + head * a->o_stride_head, c->o + r * D, D,
                      1.0f / c->l[r], DT_BF16);
}

/* Sequence s, kv head h: the keys copied once, then every query head of the group. */
static int run_chunk(const Args *a, int64_t s, int64_t h) {
    const int64_t D = a->head_dim, BS = a->block_size, W = a->sliding_window, G = a->num_heads / a->num_kv_heads;
    Chunk c = {.a = a, .h = h, .q_start = a->cu_seqlens_q[s], .seq_len = a->seq_lens[s], .D = D,
               .table = a->block_tables + s * a->bt_stride};
    c.q_len = a->cu_seqlens_q[s + 1] - c.q_start;
    c.ctx = c.seq_len - c.q_len;
    c.k_lo = W > 0 && c.ctx + 1 > W ? c.ctx + 1 - W : 0; /* the first row's first key: no row sees earlier ones */
    for (int64_t b = c.k_lo / BS; b * BS < c.seq_len; b++)
        if (c.table[b] < 0 || c.table[b] >= a->num_blocks) return ERR_BLOCK_ID;
    const int64_t steps = (c.seq_len - c.k_lo + KS - 1) / KS, keys = steps * KS;
    /* kt, vv: keys * D bf16 each; q [QB, D] bf16, p [QB, KS] bf16; s [QB, KS], o [QB, D], opart [QB, 64] fp32 */
    char *mem = aligned_alloc(64, (size_t)((4 * keys * D + 2 * QB * D + 2 * QB * KS + 4 * QB * (KS + D + 64) + 63) / 64 * 64));
    if (!mem) return ERR_NO_MEMORY;
    c.kt = (uint32_t *)mem;
    c.vv = (uint16_t *)(mem + 2 * keys * D);
    c.q = (uint16_t *)(mem + 4 * keys * D);
    c.p = c.q + QB * D;
    c.s = (float *)(c.p + QB * KS);
    c.o = c.s + QB * KS;
    c.opart = c.o + QB * D;
    copy_keys(&c, steps);
    for (int64_t g = 0; g < G; g++)
        for (int64_t r0 = 0; r0 < c.q_len; r0 += QB) attend_block(&c, h * G + g, r0, c.q_len - r0 < QB ? c.q_len - r0 : QB);
    free(mem);
    return 0;
}
#endif

/* The sequences rayllm_paged_attention skips (more than a->max_q_len query rows), on AMX tiles:
 * bf16, head_dim a multiple of 32, no soft cap, no sinks. Returns 0, ERR_UNSUPPORTED (nothing
 * written) where it cannot run them, or the row kernel's codes for bad metadata. */
#define ERR_UNSUPPORTED 6
int rayllm_chunk_attention(const Args *a) {
#if HAVE_AMX_BF16
    if (!amx_ready() || a->dtype != DT_BF16 || a->head_dim % 32 || a->soft_cap != 0.0f || a->sinks)
        return ERR_UNSUPPORTED;
    const int checked = check_seqs(a);
    if (checked) return checked;
    int64_t num_long = 0;
    for (int64_t s = 0; s < a->num_seqs; s++) num_long += a->cu_seqlens_q[s + 1] - a->cu_seqlens_q[s] > a->max_q_len;
    if (!num_long) return 0; /* a decode step (the fused layer calls every step): no tiles, no scratch */
    int64_t *longs = malloc((num_long + 1) * sizeof(int64_t));
    if (!longs) return ERR_NO_MEMORY;
    for (int64_t s = 0, i = 0; s < a->num_seqs; s++)
        if (a->cu_seqlens_q[s + 1] - a->cu_seqlens_q[s] > a->max_q_len) longs[i++] = s;
    const int64_t num_items = num_long * a->num_kv_heads;
    int err = 0;
#pragma omp parallel if (num_items > 1)
    {
        int my_err = 0;
        amx_load_full_tiles();
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++)
            if (!my_err) my_err = run_chunk(a, longs[i / a->num_kv_heads], i % a->num_kv_heads);
        _tile_release();
#pragma omp critical
        if (my_err && !err) err = my_err;
    }
    free(longs);
    return err;
#else
    (void)a;
    return ERR_UNSUPPORTED;
#endif
}
