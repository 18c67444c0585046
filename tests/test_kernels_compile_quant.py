"""Compile the quantized GEMM kernels (block FP8, int4, GGUF) for an H100 (sm_90), GPU or not.

Same scheme as test_kernels_compile.py: the interpreter runs code the real compiler rejects, so
a fresh child process (interpreter off) compiles each kernel ahead of time with the tiles,
num_warps / num_stages and constexprs its wrapper launches with. Arguments are specialized as a
launch specializes them: an int equal to 1 (M at decode, unit strides) becomes a constexpr,
pointers and ints divisible by 16 get tt.divisibility=16 (they decide vectorization and the
dot layouts, so an unspecialized compile would not build what a GPU runs).
"""
from kernels.torch_gguf import BLOCK_LAYOUTS, TYPE_NAMES
from tests.triton_aot import compile_in_child

# Runs in the child: compile each config, print one JSON line of results.
CHILD = r'''
import inspect, json, sys
import triton
from tests.triton_aot import build
from kernels import triton_fp8_gemm as fp8, triton_gguf_gemm as gguf, triton_int4_gemm as int4
from kernels.torch_gguf import BLOCK_LAYOUTS


def defaults(fn):
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()}

def fp8_gemm(out, m, k, n, bn=128, bk=128):
    # fp8_block_gemm's tiles: decode streams the weight with the smallest dot tile in M.
    block_m, block_n = (16, 64) if m <= 16 else (64, 128)
    groups = triton.cdiv(k, bk)
    args = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*" + out, a_scale_ptr="*fp32",
                b_scale_ptr="*fp32", M=m, N=n, K=k, GROUP_N=bn, stride_am=k, stride_ak=1,
                stride_bn=k, stride_bk=1, stride_cm=n, stride_cn=1, stride_asm=groups, stride_asg=1,
                stride_bsn=groups, stride_bsg=1)
    consts = dict(UPCAST=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk)
    return build(fp8._fp8_block_gemm_kernel, args, consts, {"num_warps": 4, "num_stages": 3})

def int4_gemm(elem, scale_elem, m, k, n):
    block_m, block_n, block_k = defaults(int4.int4_gemm)["block"]
    args = dict(x_ptr="*" + elem, qweight_ptr="*i32", scales_ptr="*" + scale_elem, zeros_ptr="*u8",
                g_idx_ptr="*i32", y_ptr="*" + elem, M=m, N=n, K=k, stride_xm=k, stride_ym=n)
    consts = dict(IEEE_DOT=elem == "fp32", UPCAST=False, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=block_k)
    return build(int4._int4_gemm_kernel, args, consts, {})  # the wrapper passes no options

def gguf_gemm(qtype, elem, m, k, n):
    elems, nbytes = BLOCK_LAYOUTS[qtype]
    tiles = defaults(gguf.gguf_gemm)
    args = dict(x_ptr="*" + elem, w_ptr="*u8", y_ptr="*" + elem, M=m, N=n, K=k, stride_xm=k,
                stride_wn=k // elems * nbytes, stride_ym=n)
    consts = dict(QTYPE=qtype, BLOCK_ELEMS=elems, BLOCK_BYTES=nbytes, BLOCK_M=tiles["block_m"],
                  BLOCK_N=tiles["block_n"], IEEE_DOT=elem == "fp32")
    return build(gguf._gguf_gemm_kernel, args, consts, {})  # the wrapper passes no options

configs = json.loads(sys.argv[1])
results = {}
for kind, make in (("fp8", fp8_gemm), ("int4", int4_gemm), ("gguf", gguf_gemm)):
    for cfg in configs[kind]:
        results["-".join(map(str, [kind, *cfg]))] = make(*cfg)
print(json.dumps(results))
'''

# (out dtype, M, K, N): decode (M = 1 is a constexpr, a 16-row tile), prefill (64 x 128
# tiles, the fp8 wgmma path), and fp32 activations with an M that is no multiple of 16.
FP8_CONFIGS = [("bf16", 1, 4096, 6144), ("fp16", 512, 4096, 6144), ("fp32", 7, 2048, 2816)]
# (x dtype, scales dtype, M, K, N): one tile for every M, so M = 1 and a prefill M; fp32 takes
# the IEEE dot; fp32 x with fp16 scales (an fp16 checkpoint run in fp32).
INT4_CONFIGS = [("fp16", "fp16", 1, 4096, 11008), ("bf16", "bf16", 512, 4096, 11008),
                ("fp32", "fp16", 33, 2048, 5632)]
# (type, x dtype, M, K, N): every type, decode and prefill, all three activation dtypes, row
# strides aligned to 16 bytes or not (K = 2880: 90 Q4_0 blocks of 18 bytes; 6 Q6_K of 210).
GGUF_CONFIGS = [(8, "fp16", 1, 4096, 4096), (2, "bf16", 512, 2880, 2880), (3, "fp32", 7, 4096, 4096),
                (6, "fp16", 256, 2880, 4096), (7, "bf16", 1, 4096, 4096), (12, "bf16", 1, 4096, 14336),
                (13, "fp16", 512, 1536, 1536), (14, "fp32", 33, 1536, 8960)]


def test_every_gguf_type_has_a_config():
    covered = {cfg[0] for cfg in GGUF_CONFIGS}
    assert covered == set(BLOCK_LAYOUTS), [TYPE_NAMES[q] for q in set(BLOCK_LAYOUTS) - covered]


def test_quant_gemm_kernels_compile_for_h100():
    configs = {"fp8": FP8_CONFIGS, "int4": INT4_CONFIGS, "gguf": GGUF_CONFIGS}
    results = compile_in_child(CHILD, configs)
    assert len(results) == len(FP8_CONFIGS) + len(INT4_CONFIGS) + len(GGUF_CONFIGS)
