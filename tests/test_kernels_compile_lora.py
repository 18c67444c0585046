"""Compile the LoRA shrink / expand kernels for an H100 (sm_90), GPU or not.

Same scheme as test_kernels_compile_quant.py: a fresh child process (interpreter off) compiles
each kernel ahead of time with the tiles, num_warps / num_stages and constexprs its wrapper
launches with (kernels/triton_lora.py's choose_config, shrink_meta, expand_meta) and the slots'
layout engine/layers/lora.py keeps (lora_b stored as B^T), arguments specialized as a launch
specializes them (an int equal to 1 becomes a constexpr; pointers and ints divisible by 16 get
tt.divisibility=16).
"""
from tests.triton_aot import compile_in_child

CHILD = r'''
import json, sys
import torch, triton
from tests.triton_aot import build
from kernels import triton_lora as lora

TT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

def shrink(elem, tokens, k, n, max_loras):
    config = lora.choose_config(tokens, k, TT[elem])
    meta = lora.shrink_meta(n, k, config)
    args = dict(x_ptr="*" + elem, a_ptr="*" + elem, buf_ptr="*fp32", sorted_ids_ptr="*i32",
                slot_starts_ptr="*i32", N=n, K=k, k_per_split=meta.pop("k_per_split"),
                stride_xm=k, stride_xk=1, stride_as=n * k, stride_an=k, stride_ak=1,
                stride_bufs=tokens * n, stride_bufm=n)
    consts = dict(meta, IEEE_DOT=elem == "fp32", UPCAST=False)
    return build(lora._lora_shrink_kernel, args, consts, {"num_warps": 4, "num_stages": 3})

def expand(elem, tokens, k, out, rank, parts):
    config = lora.choose_config(tokens, k, TT[elem])
    n = parts * rank
    args = dict(buf_ptr="*fp32", b_ptr="*" + elem, y_ptr="*" + elem, sorted_ids_ptr="*i32",
                slot_starts_ptr="*i32", part_offsets_ptr="*i32", R=rank, stride_bufs=tokens * n,
                stride_bufm=n, stride_bs=out * n, stride_bn=1, stride_bk=out, stride_ym=out, stride_yn=1)
    consts = dict(lora.expand_meta(rank, config), SPLIT_K=config["SPLIT_K"], NUM_PARTS=parts,
                  IEEE_DOT=elem == "fp32", UPCAST=False)
    return build(lora._lora_expand_kernel, args, consts, {"num_warps": 4, "num_stages": 1})

results = {}
for cfg in json.loads(sys.argv[1]):
    elem, tokens, k, out, rank, parts, max_loras = cfg
    name = "-".join(map(str, cfg))
    results["shrink-" + name] = shrink(elem, tokens, k, parts * rank, max_loras)
    results["expand-" + name] = expand(elem, tokens, k, out, rank, parts)
print(json.dumps(results))
'''

# (dtype, tokens, K, out, rank, parts, max_loras), Llama-3-8B's layers: a bf16 decode step of
# qkv_proj (K split 8 ways), an fp16 prefill chunk of gate_up_proj at rank 64, and an fp32 decode
# of down_proj at rank 8 (the IEEE dot, BLOCK_R padded to 16, an odd row count).
CONFIGS = [("bf16", 8, 4096, 6144, 16, 3, 4), ("fp16", 2048, 4096, 28672, 64, 2, 4),
           ("fp32", 7, 14336, 4096, 8, 1, 2)]


def test_lora_kernels_compile_for_h100():
    results = compile_in_child(CHILD, CONFIGS)
    assert len(results) == 2 * len(CONFIGS)
