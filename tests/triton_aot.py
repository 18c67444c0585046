"""Ahead-of-time compilation of a Triton kernel for an H100 (sm_90), with or without a GPU: the
compile tests' children (test_kernels_compile_quant.py, test_kernels_compile_lora.py) import it.

Arguments are specialized as a launch specializes them: an int equal to 1 becomes a constexpr,
pointers and ints divisible by 16 get tt.divisibility=16 (torch allocations are 256-byte aligned,
so every pointer is); they decide vectorization and the dot layouts, so an unspecialized compile
would not build what a GPU runs."""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H100 = GPUTarget("cuda", 90, 32)
DIVISIBLE = [["tt.divisibility", 16]]


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
