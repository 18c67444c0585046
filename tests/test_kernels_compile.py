"""Compile the Triton kernels for an H100 (sm_90) on any machine, GPU or not.

The interpreter accepts code that the real compiler rejects (e.g. reading a
non-constexpr global), so CPU-only CI would otherwise never see such errors.
The compile runs in a fresh subprocess with the interpreter off: once an
interpreted kernel has called a jitted helper, triton.language stays patched
for the rest of the process and native compilation fails there.
"""
from tests.triton_aot import compile_in_child

# Runs in the child: compile each config, print one JSON line of results.
CHILD = r'''
import json, sys
import torch, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from kernels import triton_attention as wrapper, triton_attention_kernel as attn, triton_store_kv as skv
from kernels import triton_attention_split as split_kv

TT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
H100 = GPUTarget("cuda", 90, 32)

def build(kernel, sig, consts, options):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    c = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=H100, options=options)
    return {"shared": c.metadata.shared, "cubin": bool(c.asm.get("cubin"))}

def attention(elem, max_q, group, head_dim, block_size, split, score_options=0, fp8_kv=0):
    cfg = wrapper._launch_config(max_q, group, head_dim, block_size, TT[elem])
    options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
    sig = {n: "*" + elem for n in ("out_ptr", "query_ptr")}
    sig.update({n: "*fp8e4nv" if fp8_kv else "*" + elem for n in ("k_cache_ptr", "v_cache_ptr")})
    sig.update({n: "*fp32" for n in ("k_scale_ptr", "v_scale_ptr")})
    sig.update({n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr")})
    sig.update({n: "*fp32" for n in ("part_o_ptr", "part_m_ptr", "part_l_ptr")})
    sig["sinks_ptr"] = "*" + elem
    sig["scale_log2"] = sig["soft_cap_log2"] = "fp32"
    sig["sliding_window"] = "i32"
    for n in ("num_seqs", "max_blocks", "num_splits", "stride_q_tok", "stride_q_head",
              "stride_q_dim", "stride_o_tok", "stride_o_head", "stride_o_dim", "stride_c_blk",
              "stride_c_pos", "stride_c_head", "stride_bt_seq", "stride_p_tok", "stride_p_head",
              "stride_ml_tok", "stride_ml_head"):
        sig[n] = "i32"
    flags = bool(score_options)  # sliding window, soft cap and sinks, all on or all off
    consts = dict(cfg, BLOCK_SIZE=block_size, SPLIT=bool(split), SLIDING=flags, SOFT_CAP=flags,
                  HAS_SINKS=flags, FP8_KV=bool(fp8_kv))
    return build(attn.paged_attention_kernel, sig, consts, options)

def reduce_splits(elem, head_dim, splits):
    sig = {"out_ptr": "*" + elem}
    sig.update({n: "*fp32" for n in ("part_o_ptr", "part_m_ptr", "part_l_ptr")})
    for n in ("num_rows", "num_heads", "num_splits", "stride_o_tok", "stride_o_head",
              "stride_o_dim"):
        sig[n] = "i32"
    splits_p, head_dim_p = triton.next_power_of_2(splits), triton.next_power_of_2(head_dim)
    block_r = max(1, split_kv.REDUCE_TILE_ELEMS // (splits_p * head_dim_p))
    consts = dict(HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS_P=splits_p, BLOCK_R=block_r)
    return build(split_kv.reduce_splits_kernel, sig, consts, {"num_warps": 4})

def store_kv(fp8=False):
    sig = {n: "*bf16" for n in ("key_ptr", "value_ptr")}
    sig.update({n: "*fp8e4nv" if fp8 else "*bf16" for n in ("k_cache_ptr", "v_cache_ptr")})
    sig["slot_ptr"] = "*i64"
    sig.update({n: "*fp32" for n in ("k_scale_ptr", "v_scale_ptr")})
    for n in ("num_tokens", "num_kv_heads", "stride_k_tok", "stride_k_head", "stride_k_dim",
              "stride_v_tok", "stride_v_head", "stride_v_dim", "stride_c_slot", "stride_c_head"):
        sig[n] = "i32"
    sig["num_slots"] = "i64"
    return build(skv._store_kv_kernel, sig, dict(HEAD_DIM=80, HEAD_DIM_P=128, BLOCK_H=8, FP8=fp8),
                 {"num_warps": 4})

results = {"store_kv": store_kv(), "store_kv-fp8": store_kv(fp8=True), "reduce-bf16-128-9": reduce_splits("bf16", 128, 9),
           "reduce-fp16-80-16": reduce_splits("fp16", 80, 16)}
for cfg in json.loads(sys.argv[1]):
    results["-".join(map(str, cfg))] = attention(*cfg)
print(json.dumps(results))
'''

# (dtype, max_seqlen_q, group, head_dim, block_size, split[, score_options]): decode and
# prefill, both K/V addressing paths (block_size 24 takes the per-key gather), padded
# head_dims, the split-KV variant (partials instead of the output) for decode and a chunk,
# sliding window + soft cap + sinks, split and not, and an fp8 cache.
ATTN_CONFIGS = [
    ("fp16", 1, 4, 128, 16, 0),
    ("bf16", 512, 1, 80, 32, 0),
    ("fp16", 64, 8, 64, 24, 0),
    ("bf16", 128, 2, 256, 16, 0),
    ("bf16", 1, 4, 128, 16, 1),
    ("bf16", 8, 2, 80, 24, 1),
    ("bf16", 64, 4, 64, 16, 0, 1),
    ("fp16", 1, 8, 128, 16, 1, 1),
    ("bf16", 1, 4, 128, 16, 1, 0, 1),   # an fp8 KV cache: decode split, and a prefill chunk
    ("bf16", 128, 2, 64, 16, 0, 0, 1),
]
NUM_REDUCE_CONFIGS = 2


def test_kernels_compile_for_h100():
    results = compile_in_child(CHILD, ATTN_CONFIGS)
    assert len(results) == len(ATTN_CONFIGS) + 2 + NUM_REDUCE_CONFIGS
