"""Ahead-of-time compilation of Triton kernels for an H100 (sm_90), with or without a GPU: the
compile tests (test_kernels_compile*.py) run a child script in a fresh process (compile_in_child),
which builds each kernel config with build() and prints one JSON line of results.

Arguments are specialized as a launch specializes them: an int equal to 1 becomes a constexpr,
pointers and ints divisible by 16 get tt.divisibility=16 (torch allocations are 256-byte aligned,
so every pointer is); they decide vectorization and the dot layouts, so an unspecialized compile
would not build what a GPU runs."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H100 = GPUTarget("cuda", 90, 32)
DIVISIBLE = [["tt.divisibility", 16]]
SHARED_MEM_LIMIT = 227 * 1024  # per-block opt-in maximum on sm_90
ROOT = pathlib.Path(__file__).resolve().parent.parent


def compile_in_child(child: str, configs) -> dict:
    """Run `child` with `configs` (as JSON) in a fresh process, the interpreter off, and return its
    results (name -> build()'s dict), each checked: a cubin came out, within sm_90's shared memory.
    Skips where this triton build has no ahead-of-time CUDA backend."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", child, json.dumps(configs)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0 and "No module named 'triton.backends" in proc.stderr:
        pytest.skip("this triton build has no ahead-of-time CUDA backend")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, info in results.items():
        assert info["cubin"], f"{name}: no cubin produced"
        assert info["shared"] <= SHARED_MEM_LIMIT, f"{name}: {info['shared']} B shared memory"
    return results


def build(kernel, args, consts, options):
    """args: runtime argument -> pointer type ("*bf16") or a sample int. Returns the shared memory
    the compiled kernel takes and whether a cubin came out."""
    sig, attrs, consts = {}, {}, dict(consts)
    for name, value in args.items():
        index = (kernel.arg_names.index(name),)
        if isinstance(value, str):
            sig[name], attrs[index] = value, DIVISIBLE
        elif value == 1:
            consts[name] = 1
        else:
            sig[name] = "i32"
            if value % 16 == 0:
                attrs[index] = DIVISIBLE
    sig.update({name: "constexpr" for name in consts})
    c = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=H100, options=options)
    return {"shared": c.metadata.shared, "cubin": bool(c.asm.get("cubin"))}
