/* One Llama-family decoder layer on CPU in one call, its linear layers INT8 W8A8: the same C ops
 * the layer's modules call one by one (cpu_ops.c, cpu_int8.c, cpu_chunk_attention.c with
 * cpu_paged_attention.c, included here whole so one library holds them), in the same order on
 * the same bytes, so the result is the modules' to the bit. What it saves is the Python between them: at decode that glue cost
 * about as much as the int8 matmuls (docs/benchmarks.md). The wrapper, the checks and the
 * conditions it applies under are kernels/cpu_decoder_layer.py and engine/layers/cpu_fused_layer.py.
 *
 *   first layer (residual == x):  h = rms_norm(x) * w_in                 (x kept as the residual)
 *   other layers:                 residual += x;  h = rms_norm(residual) * w_in   (h is x's memory)
 *   qkv = int8_linear(h);  rotate q and k heads in place (neox);  store this step's k, v rows
 *   a = paged_attention(q, caches)   (the row kernel up to max_q_len rows a chunk, AMX above)
 *   o = int8_linear(a);  residual += o;  o = rms_norm(residual) * w_post
 *   out = int8_linear(silu(gate) * up),  [gate | up] = int8_linear(o)   (on AMX one pass: gemm_silu)
 */
#include "cpu_ops.c"
#include "cpu_int8.c"
/* cpu_chunk_attention.c includes cpu_paged_attention.c, whose ERR_DTYPE macro would rename
 * cpu_int8.c's enum constant of that name were it included first (a compile error, not a bug). */
#include "cpu_chunk_attention.c"

/* Return codes: 0, or the failing step's code plus its base (kernels/cpu_decoder_layer.py). */
enum { LAYER_ERR_NOMEM = 1, LAYER_ERR_GEMM = 100, LAYER_ERR_SLOT = 200, LAYER_ERR_ATTENTION = 300 };

typedef struct {
    const int8_t *packed;      /* kernels/cpu_int8.py's layout */
    const int32_t *comp;       /* [N] */
    const float *w_scale;      /* [N] */
    const float *input_scale;  /* NULL: per-token activation scales */
    int64_t K, N;
} Int8Linear;

typedef struct {
    /* the layer, fixed once bound (its cache's address and shape set again each call) */
    Int8Linear qkv, o_proj, gate_up, down;
    const void *input_norm, *post_norm; /* [hidden], of dtype */
    const float *cos_sin;               /* [max_pos, head_dim] fp32 */
    const void *k_cache, *v_cache;      /* [num_blocks, block_size, num_kv_heads, head_dim] */
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, num_blocks;
    float eps, scale;
    int64_t sliding_window, dtype; /* sliding_window 0: none; dtype DT_F32 or DT_BF16 */
    /* the call */
    void *x;        /* [n, hidden] the layer's input, overwritten */
    void *residual; /* [n, hidden] the residual stream, updated in place; == x on the first layer */
    void *out;      /* [n, hidden] the layer's output */
    const int64_t *positions, *slot_mapping; /* [n] */
    const int32_t *block_tables, *seq_lens, *cu_seqlens_q;
    int64_t n, num_seqs, bt_stride, max_blocks, max_q_len;
    int64_t chunk_attention; /* 1: chunks over max_q_len rows run in rayllm_chunk_attention (AMX) */
} LayerArgs;

static int linear(const Int8Linear *w, const void *x, int64_t n, void *y, int64_t dt, float *x_scale) {
    const int err = rayllm_int8_w8a8_gemm(x, n, w->K, dt, w->input_scale, w->packed, w->comp, w->w_scale, w->K,
                                          w->N, y, dt, x_scale, ISA_AUTO);
    return err ? LAYER_ERR_GEMM + err : 0;
}

static int attention(const LayerArgs *a, const char *qkv, void *out) {
    const int64_t D = a->head_dim, row = (a->num_heads + 2 * a->num_kv_heads) * D, esize = dt_size(a->dtype);
    const int64_t q_size = a->num_heads * D, kv_size = a->num_kv_heads * D;
    int err = rayllm_store_kv(qkv + q_size * esize, row * esize, qkv + (q_size + kv_size) * esize, row * esize,
                              (char *)a->k_cache, (char *)a->v_cache, a->slot_mapping, a->n, kv_size * esize,
                              a->num_blocks * a->block_size);
    if (err) return LAYER_ERR_SLOT + err;
    const Args args = {.query = qkv, .k_cache = a->k_cache, .v_cache = a->v_cache, .block_tables = a->block_tables,
                       .seq_lens = a->seq_lens, .cu_seqlens_q = a->cu_seqlens_q, .out = out,
                       .q_stride_tok = row, .q_stride_head = D, .o_stride_tok = q_size, .o_stride_head = D,
                       .bt_stride = a->bt_stride, .num_tokens = a->n, .num_seqs = a->num_seqs,
                       .num_heads = a->num_heads, .num_kv_heads = a->num_kv_heads, .head_dim = D,
                       .block_size = a->block_size, .num_blocks = a->num_blocks, .max_blocks = a->max_blocks,
                       .scale = a->scale, .max_q_len = a->max_q_len, .sliding_window = a->sliding_window,
                       .soft_cap = 0.0f, .sinks = NULL, .dtype = a->dtype};
    err = rayllm_paged_attention(&args);
    if (!err && a->chunk_attention) err = rayllm_chunk_attention(&args);
    return err ? LAYER_ERR_ATTENTION + err : 0;
}

/* The layer after its input norm: h [n, hidden] normalised, x's memory free for reuse. */
static int layer_body(const LayerArgs *a, void *h, char *scratch, float *x_scale) {
    const int64_t n = a->n, dt = a->dtype, esize = dt_size(dt), H = a->hidden;
    const int64_t qkv_cols = (a->num_heads + 2 * a->num_kv_heads) * a->head_dim;
    char *qkv = scratch, *attn = qkv + n * qkv_cols * esize;       /* both done before gate_up */
    char *gate_up = scratch, *act = gate_up + n * 2 * a->intermediate * esize;
    char *o = (char *)a->out;                                        /* o_proj's output, then the MLP's input */
    int err = linear(&a->qkv, h, n, qkv, dt, x_scale);
    if (err) return err;
    rayllm_rotary_neox(qkv, qkv_cols, a->positions, a->cos_sin, n, a->num_heads + a->num_kv_heads, a->head_dim, dt);
    if ((err = attention(a, qkv, attn))) return err;
    if ((err = linear(&a->o_proj, attn, n, o, dt, x_scale))) return err;
    rayllm_add_rms_norm(o, H, a->residual, a->post_norm, o, H, n, H, a->eps, dt, dt);
    if (n >= AMX_MIN_M && a->intermediate % LANES == 0 && rayllm_int8_amx_available()) {
        /* gate_up and SiLU-and-mul in one pass: the same bits, without gate_up's output in memory */
        err = rayllm_int8_w8a8_gemm_silu(o, n, H, dt, a->gate_up.input_scale, a->gate_up.packed, a->gate_up.comp,
                                         a->gate_up.w_scale, a->gate_up.K, a->gate_up.N, act, dt, x_scale);
        if (err) return LAYER_ERR_GEMM + err;
    } else {
        if ((err = linear(&a->gate_up, o, n, gate_up, dt, x_scale))) return err;
        rayllm_silu_and_mul(gate_up, 2 * a->intermediate, act, n, a->intermediate, dt);
    }
    return linear(&a->down, act, n, a->out, dt, x_scale);
}

/* Entry point: 0, or a LAYER_ERR_* base plus the failing op's own code. */
int rayllm_decoder_layer(const LayerArgs *a) {
    if (a->n <= 0) return 0;
    const int64_t n = a->n, esize = dt_size(a->dtype), H = a->hidden;
    const int64_t qkv_cols = (a->num_heads + 2 * a->num_kv_heads) * a->head_dim;
    const int64_t attn_phase = qkv_cols + a->num_heads * a->head_dim, mlp_phase = 3 * a->intermediate;
    const int64_t first = a->residual == a->x; /* its norm needs a buffer of its own: x is the residual */
    const int64_t cols = (attn_phase > mlp_phase ? attn_phase : mlp_phase) + (first ? H : 0);
    char *scratch = aligned_alloc(64, (size_t)((n * cols * esize + n * 4 + 63) / 64 * 64));
    if (!scratch) return LAYER_ERR_NOMEM;
    float *x_scale = (float *)(scratch + n * cols * esize);
    void *h = a->x;
    if (first) {
        h = scratch + n * (cols - H) * esize;
        rayllm_add_rms_norm(a->x, H, NULL, a->input_norm, h, H, n, H, a->eps, a->dtype, a->dtype);
    } else {
        rayllm_add_rms_norm(a->x, H, a->residual, a->input_norm, a->x, H, n, H, a->eps, a->dtype, a->dtype);
    }
    const int err = layer_body(a, h, scratch, x_scale);
    free(scratch);
    return err;
}
