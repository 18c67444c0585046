"""store_kv: Triton scatter and torch index_copy_ path against the reference."""

import pytest
import torch

from tests.triton_device import DEVICE  # before kernels: sets the interpreter up

from kernels import store_kv, store_kv_ref, store_kv_torch  # noqa: E402

BACKENDS = {"triton": lambda: store_kv, "torch": lambda: store_kv_torch}


def make_inputs(num_tokens, num_blocks, block_size, kv_heads, head_dim, dtype, pad_every=0,
                seed=0, fused=True):
    """Random K/V rows (as strided views of a fused qkv tensor) and distinct slots.

    key, value: [num_tokens, kv_heads, head_dim]; slots: [num_tokens] int64,
    every pad_every-th slot set to -1 (padding row, must be skipped).
    """
    gen = torch.Generator().manual_seed(seed)
    width = 3 * kv_heads * head_dim if fused else 2 * kv_heads * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(DEVICE)  # [num_tokens, width]
    kv_off = width - 2 * kv_heads * head_dim
    key = qkv[:, kv_off:kv_off + kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, kv_off + kv_heads * head_dim:].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if pad_every:
        slots[::pad_every] = -1
    return key, value, slots.to(DEVICE)


def fresh_caches(num_blocks, block_size, kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, -7.0, dtype=dtype, device=DEVICE)
    return k_cache, torch.full_like(k_cache, -7.0)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(1, 64, 16), (2, 80, 32), (8, 128, 16)])
def test_matches_reference(backend, dtype, kv_heads, head_dim, block_size):
    num_blocks = 6
    key, value, slots = make_inputs(20, num_blocks, block_size, kv_heads, head_dim, dtype, pad_every=4)
    want_k, want_v = fresh_caches(num_blocks, block_size, kv_heads, head_dim, dtype)
    store_kv_ref(key, value, want_k, want_v, slots)
    got_k, got_v = fresh_caches(num_blocks, block_size, kv_heads, head_dim, dtype)
    BACKENDS[backend]()(key, value, got_k, got_v, slots)
    # A pure copy: bit-exact, and untouched slots (incl. padding rows) stay -7.
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_all_padding_and_int32_slots(backend):
    key, value, slots = make_inputs(5, 2, 16, 2, 64, torch.float32, fused=False)
    k_cache, v_cache = fresh_caches(2, 16, 2, 64, torch.float32)
    BACKENDS[backend]()(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    assert bool((k_cache == -7).all()) and bool((v_cache == -7).all())
    BACKENDS[backend]()(key, value, k_cache, v_cache, slots.to(torch.int32))
    want_k, want_v = fresh_caches(2, 16, 2, 64, torch.float32)
    store_kv_ref(key, value, want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_empty_batch(backend):
    key, value, slots = make_inputs(0, 2, 16, 2, 64, torch.float32)
    k_cache, v_cache = fresh_caches(2, 16, 2, 64, torch.float32)
    BACKENDS[backend]()(key, value, k_cache, v_cache, slots)
    assert bool((k_cache == -7).all())


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_slots_beyond_int32_offsets(backend):
    """Slots in blocks past id 32768 of a cache with 65536 elements per block.

    The ~4.4 GB caches are only reserved, never touched except the written rows.
    """
    num_blocks, block_size, kv_heads, head_dim = 32800, 32, 8, 256
    shape = (num_blocks, block_size, kv_heads, head_dim)
    try:
        k_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
        v_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:
        pytest.skip(f"cannot reserve the large cache: {exc}")
    key = torch.randn(3, kv_heads, head_dim, device=DEVICE).half()
    value = torch.randn(3, kv_heads, head_dim, device=DEVICE).half()
    slots = torch.tensor([32769 * block_size + 5, -1, num_blocks * block_size - 1], device=DEVICE)
    BACKENDS[backend]()(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[32769, 5], key[0]) and torch.equal(v_cache[32769, 5], value[0])
    assert torch.equal(k_cache[-1, -1], key[2]) and torch.equal(v_cache[-1, -1], value[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_realistic_batch():
    num_blocks, block_size, kv_heads, head_dim = 4096, 16, 8, 128
    key, value, slots = make_inputs(8192, num_blocks, block_size, kv_heads, head_dim,
                                    torch.bfloat16, pad_every=7)
    want_k, want_v = fresh_caches(num_blocks, block_size, kv_heads, head_dim, torch.bfloat16)
    store_kv_torch(key, value, want_k, want_v, slots)
    got_k, got_v = fresh_caches(num_blocks, block_size, kv_heads, head_dim, torch.bfloat16)
    store_kv(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
