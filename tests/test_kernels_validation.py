"""Wrapper boundary checks: bad arguments raise ValueError naming the problem."""

import ast
import math
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

import kernels  # noqa: E402
from kernels import paged_attention, paged_attention_torch, store_kv, store_kv_torch  # noqa: E402


def attn_args(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32):
    """Valid arguments: two sequences (a decode and a 3-row chunk), block_size 16."""
    return dict(
        query=torch.randn(4, num_heads, head_dim, dtype=dtype, device=DEVICE),
        k_cache=torch.randn(4, 16, num_kv_heads, head_dim, dtype=dtype, device=DEVICE),
        v_cache=torch.randn(4, 16, num_kv_heads, head_dim, dtype=dtype, device=DEVICE),
        block_tables=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([20, 3], dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32, device=DEVICE),
        max_seqlen_q=3,
        softmax_scale=1 / math.sqrt(head_dim),
    )


def _bad(**changes):
    def mutate(args):
        args.update({k: (v(args) if callable(v) else v) for k, v in changes.items()})
        return args
    return mutate


ATTN_ERRORS = {
    "query_2d": (_bad(query=lambda a: a["query"][0]), "query must be 3-D"),
    "query_int": (_bad(query=lambda a: a["query"].to(torch.int32)), "query has dtype"),
    "cache_dtype": (_bad(k_cache=lambda a: a["k_cache"].half(), v_cache=lambda a: a["v_cache"].half()),
                    "k_cache dtype"),
    "v_shape": (_bad(v_cache=lambda a: a["v_cache"][:2]), "v_cache shape"),
    "head_dim": (_bad(query=lambda a: torch.randn(4, 4, 32, device=DEVICE)), "head_dim"),
    "gqa_ratio": (_bad(query=lambda a: torch.randn(4, 3, 64, device=DEVICE)), "num_kv_heads"),
    "cache_strided": (_bad(k_cache=lambda a: a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
                      "k_cache must be contiguous"),
    "table_float": (_bad(block_tables=lambda a: a["block_tables"].float()), "block_tables has dtype"),
    "seq_lens_float": (_bad(seq_lens=lambda a: a["seq_lens"].float()), "seq_lens has dtype"),
    "seq_lens_count": (_bad(seq_lens=lambda a: a["seq_lens"][:1]), "seq_lens has 1 entries"),
    "cu_count": (_bad(cu_seqlens_q=lambda a: a["cu_seqlens_q"][:2]), "cu_seqlens_q has 2 entries"),
    "max_seqlen_q": (_bad(max_seqlen_q=0), "max_seqlen_q"),
    "max_seqlen_q_tensor": (_bad(max_seqlen_q=lambda a: torch.tensor(3)), "max_seqlen_q"),
    "scale": (_bad(softmax_scale=-1.0), "softmax_scale"),
    "out_shape": (_bad(out=lambda a: torch.empty(3, 4, 64, device=DEVICE)), "out shape"),
    "out_dtype": (_bad(out=lambda a: torch.empty(4, 4, 64, dtype=torch.float16, device=DEVICE)),
                  "out dtype"),
    "device": (_bad(seq_lens=lambda a: a["seq_lens"].to("meta")), "seq_lens is on meta"),
}


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_torch], ids=["triton", "torch"])
@pytest.mark.parametrize("case", list(ATTN_ERRORS), ids=list(ATTN_ERRORS))
def test_attention_rejects(fn, case):
    mutate, message = ATTN_ERRORS[case]
    args = mutate(attn_args())
    with pytest.raises(ValueError, match=message):
        fn(**args)


@pytest.mark.parametrize("head_dim", [8, 512])
def test_triton_rejects_head_dim_out_of_range(head_dim):
    with pytest.raises(ValueError, match=f"head_dim {head_dim}"):
        paged_attention(**attn_args(num_heads=2, num_kv_heads=1, head_dim=head_dim))


def test_torch_rejects_inconsistent_lengths():
    args = attn_args()
    args["seq_lens"] = torch.tensor([20, 2], dtype=torch.int32, device=DEVICE)  # chunk of 3 > 2
    with pytest.raises(ValueError, match="query length 3"):
        paged_attention_torch(**args)
    args = attn_args()
    args["seq_lens"] = torch.tensor([40, 3], dtype=torch.int32, device=DEVICE)  # 2 blocks hold 32
    with pytest.raises(ValueError, match="exceeds block_tables capacity"):
        paged_attention_torch(**args)


def store_args():
    return dict(
        key=torch.randn(3, 2, 64, device=DEVICE),
        value=torch.randn(3, 2, 64, device=DEVICE),
        k_cache=torch.zeros(4, 16, 2, 64, device=DEVICE),
        v_cache=torch.zeros(4, 16, 2, 64, device=DEVICE),
        slot_mapping=torch.tensor([0, 17, -1], device=DEVICE),
    )


STORE_ERRORS = {
    "key_2d": (_bad(key=lambda a: a["key"][0]), "key must be 3-D"),
    "value_shape": (_bad(value=lambda a: a["value"][:2]), "value shape"),
    "heads": (_bad(key=lambda a: torch.randn(3, 4, 32, device=DEVICE),
                   value=lambda a: torch.randn(3, 4, 32, device=DEVICE)), "does not match"),
    "dtype": (_bad(key=lambda a: a["key"].half(), value=lambda a: a["value"].half()), "key dtype"),
    "slots_float": (_bad(slot_mapping=lambda a: a["slot_mapping"].float()), "slot_mapping has dtype"),
    "slots_count": (_bad(slot_mapping=lambda a: a["slot_mapping"][:2]), "slot_mapping has 2 entries"),
    "cache_strided": (_bad(v_cache=lambda a: a["v_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
                      "v_cache must be contiguous"),
}


@pytest.mark.parametrize("fn", [store_kv, store_kv_torch], ids=["triton", "torch"])
@pytest.mark.parametrize("case", list(STORE_ERRORS), ids=list(STORE_ERRORS))
def test_store_kv_rejects(fn, case):
    mutate, message = STORE_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        fn(**mutate(store_args()))


def test_torch_store_rejects_slot_past_cache():
    args = store_args()
    args["slot_mapping"] = torch.tensor([0, 64, -1], device=DEVICE)
    with pytest.raises(ValueError, match="slot 64"):
        store_kv_torch(**args)


def test_kernels_import_only_torch_triton_math():
    # The standard library is fine (the CPU kernel's build uses ctypes, subprocess, ...);
    # engine code and other third-party packages are not.
    allowed = {"torch", "triton", "kernels", "__future__"} | set(sys.stdlib_module_names)
    root = pathlib.Path(kernels.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_cpu_path_does_not_import_triton():
    # The engine's CPU layers import kernels.cpu_ops / kernels.cpu_attention; triton (and its
    # start-up cost, or its absence on a CPU image) must not come with them. Fresh interpreter:
    # this one has triton loaded already.
    code = ("import sys\nfrom kernels import cpu_ops\nimport kernels.cpu_attention, engine.layers.attention\n"
            "print('triton' in sys.modules)")
    root = pathlib.Path(kernels.__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False"]


def test_package_names_still_resolve():
    assert kernels.paged_attention is paged_attention and kernels.store_kv is store_kv
    assert {"paged_attention", "store_kv_torch"} <= set(dir(kernels))
    with pytest.raises(AttributeError, match="no_such_kernel"):
        getattr(kernels, "no_such_kernel")
