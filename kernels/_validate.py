"""Boundary checks shared by every attention / cache-write entry point.

Each check raises ValueError naming the offending argument and its value, so
a shape bug in the engine surfaces at the call site instead of as a silent
out-of-bounds read inside a kernel. Nothing here reads tensor *contents*: on
CUDA that would force a host sync on every layer of every step.
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_KV_DTYPE = torch.float8_e4m3fn  # kernels/fp8_kv.py: the fp8 KV cache's format
CACHE_DTYPES = FLOAT_DTYPES + (FP8_KV_DTYPE,)


def _fail(msg: str) -> None:
    raise ValueError(msg)


def check_tensor(name: str, t, ndim: int, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        _fail(f"{name} has dtype {t.dtype}; expected one of {allowed}")


def check_same_device(**tensors) -> None:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            _fail(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_caches(k_cache, v_cache, dtypes=CACHE_DTYPES) -> None:
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    check_tensor("k_cache", k_cache, 4, dtypes)
    check_tensor("v_cache", v_cache, 4, dtypes)
    if v_cache.shape != k_cache.shape:
        _fail(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        _fail(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    # Kernels index blocks with flat offsets; a strided view would be read wrongly.
    if not k_cache.is_contiguous():
        _fail(f"k_cache must be contiguous, got strides {k_cache.stride()}")
    if not v_cache.is_contiguous():
        _fail(f"v_cache must be contiguous, got strides {v_cache.stride()}")
    if k_cache.shape[1] < 1 or k_cache.shape[2] < 1 or k_cache.shape[3] < 1:
        _fail(f"k_cache has an empty dimension: shape {tuple(k_cache.shape)}")


def check_kv_scales(k_cache, k_scale, v_scale) -> None:
    """An fp8 cache needs both per-tensor scales ([1] fp32 on the cache's device); any other
    cache takes none (a scale there would be silently ignored, hiding a config mix-up)."""
    if k_cache.dtype != FP8_KV_DTYPE:
        if k_scale is not None or v_scale is not None:
            _fail(f"k_scale/v_scale apply to an {FP8_KV_DTYPE} cache only; the cache is {k_cache.dtype}")
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            _fail(f"{name} is required with an {FP8_KV_DTYPE} cache (use a [1] tensor of 1.0 for no scaling)")
        check_tensor(name, s, 1, (torch.float32,))
        if s.shape[0] != 1:
            _fail(f"{name} must be per-tensor, shape [1]; got shape {tuple(s.shape)}")
        check_same_device(k_cache=k_cache, **{name: s})


def check_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Validate store_kv arguments (any backend)."""
    check_tensor("key", key, 3, FLOAT_DTYPES)
    check_tensor("value", value, 3, FLOAT_DTYPES)
    check_caches(k_cache, v_cache)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    if value.shape != key.shape:
        _fail(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        _fail(
            f"key [num_tokens, num_kv_heads, head_dim] = {tuple(key.shape)} does not match "
            f"k_cache [..., num_kv_heads, head_dim] = {tuple(k_cache.shape)}"
        )
    # A silent cast on write would hide a dtype mix-up in the model code (an fp8 cache
    # quantizes on purpose, from any float dtype).
    for name, t in (("key", key), ("value", value)):
        if t.dtype != k_cache.dtype and k_cache.dtype != FP8_KV_DTYPE:
            _fail(f"{name} dtype {t.dtype} != cache dtype {k_cache.dtype}")
    check_kv_scales(k_cache, k_scale, v_scale)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                      slot_mapping=slot_mapping)


def _check_scalars(max_seqlen_q, softmax_scale) -> None:
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
        _fail(f"max_seqlen_q must be a python int >= 1, got {max_seqlen_q!r}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        _fail(f"softmax_scale must be a python float, got {softmax_scale!r}")
    if not softmax_scale > 0:
        _fail(f"softmax_scale must be > 0, got {softmax_scale!r}")


def check_score_options(query, sliding_window, logits_soft_cap, sinks) -> None:
    """The optional score changes: a window >= 1 keys, a soft cap > 0, sinks [num_heads]."""
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int) or sliding_window < 1):
        _fail(f"sliding_window must be None or a python int >= 1, got {sliding_window!r}")
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)):
            _fail(f"logits_soft_cap must be None or a python float, got {logits_soft_cap!r}")
        if not logits_soft_cap > 0 or logits_soft_cap == float("inf"):
            _fail(f"logits_soft_cap must be finite and > 0, got {logits_soft_cap!r}")
    if sinks is not None:
        check_tensor("sinks", sinks, 1, FLOAT_DTYPES)
        if sinks.shape[0] != query.shape[1]:
            _fail(f"sinks has shape {tuple(sinks.shape)}; expected [num_heads] = [{query.shape[1]}]")
        if not sinks.is_contiguous():
            _fail(f"sinks must be contiguous, got strides {sinks.stride()}")
        check_same_device(query=query, sinks=sinks)


def check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                          cu_seqlens_q, max_seqlen_q, softmax_scale, out, *,
                          sliding_window=None, logits_soft_cap=None, sinks=None,
                          k_scale=None, v_scale=None) -> None:
    """Validate paged_attention arguments (any backend)."""
    check_tensor("query", query, 3, FLOAT_DTYPES)
    check_caches(k_cache, v_cache)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES)
    _check_scalars(max_seqlen_q, softmax_scale)
    check_score_options(query, sliding_window, logits_soft_cap, sinks)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.dtype != query.dtype and k_cache.dtype != FP8_KV_DTYPE:
        _fail(f"k_cache dtype {k_cache.dtype} != query dtype {query.dtype}")
    check_kv_scales(k_cache, k_scale, v_scale)
    if k_cache.shape[3] != head_dim:
        _fail(f"query head_dim {head_dim} != k_cache head_dim {k_cache.shape[3]}")
    if num_heads < 1 or num_heads % num_kv_heads != 0:
        _fail(f"num_heads {num_heads} is not a positive multiple of num_kv_heads {num_kv_heads}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        _fail(f"seq_lens has {seq_lens.shape[0]} entries but block_tables has {num_seqs} rows")
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        _fail(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries; "
              f"expected num_seqs + 1 = {num_seqs + 1}")
    if num_seqs > 0 and block_tables.shape[1] < 1:
        _fail(f"block_tables has no columns: shape {tuple(block_tables.shape)}")
    if out is not None:
        check_tensor("out", out, 3)
        if out.shape != query.shape:
            _fail(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
        if out.dtype != query.dtype:
            _fail(f"out dtype {out.dtype} != query dtype {query.dtype}")
    tensors = dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                   seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q)
    if out is not None:
        tensors["out"] = out
    check_same_device(**tensors)
