"""Obviously-correct pure-torch oracles for the kernels (tests only: slow).

One python loop per sequence, explicit gathers, an explicit causal mask and a
float32 softmax: nothing clever, so the fast paths can be checked against it.
"""

import torch

from kernels.fp8_kv import dequantize_fp8, quantize_fp8


def store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Write each token's K/V into its cache slot; slot < 0 means skip the token.

    key, value:       [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:     [num_tokens]  slot = block_id * block_size + offset
    k_scale, v_scale: [1] fp32, an fp8 cache's scales: rows are stored quantize_fp8(row, scale)
    """
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k, v = key[t], value[t]  # [num_kv_heads, head_dim]
        if k_scale is not None:
            k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
        k_cache[block, offset] = k
        v_cache[block, offset] = v


def _gather_context(cache, block_row, seq_len: int, scale=None):
    """[num_blocks, block_size, kv_heads, D] -> this sequence's [seq_len, kv_heads, D] fp32
    (an fp8 cache's values times its scale)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_row[:num_blocks].long()]  # [num_blocks, block_size, kv_heads, D]
    ctx = blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]
    return ctx.float() if scale is None else dequantize_fp8(ctx, scale, torch.float32)


def paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                        max_seqlen_q, softmax_scale, out=None, *, sliding_window=None,
                        logits_soft_cap=None, sinks=None, k_scale=None, v_scale=None):
    """Causal attention of each sequence's new query rows over its paged context.

    query:        [num_tokens, num_heads, head_dim]
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq]
    seq_lens:     [num_seqs]       context length incl. the new tokens
    cu_seqlens_q: [num_seqs + 1]   query rows of seq s are cu[s]:cu[s+1]
    max_seqlen_q is unused here (kept for the shared signature).
    sliding_window:  None, or the query at position p sees keys p - sliding_window + 1 .. p
                     (HF's sliding_window_overlay: kv_idx > q_idx - sliding_window)
    logits_soft_cap: None, or scaled scores become cap * tanh(scores / cap) (Gemma 2)
    sinks:           None, or [num_heads]: a logit per head that joins the softmax's
                     denominator and has no value (gpt-oss)
    k_scale, v_scale: [1] fp32 for an fp8 cache: K and V are read as cached value * scale
    """
    del max_seqlen_q
    if out is None:
        out = torch.empty_like(query)
    num_heads = query.shape[1]
    group = num_heads // k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        # Query head h reads kv head h // group, so repeat each kv head group times.
        k = _gather_context(k_cache, block_tables[s], seq_len, k_scale)  # [seq_len, kv_heads, D]
        v = _gather_context(v_cache, block_tables[s], seq_len, v_scale)
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [q_len, num_heads, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale  # [num_heads, q_len, seq_len]
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        # The new rows are the last q_len positions of the sequence.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
        k_pos = torch.arange(seq_len, device=query.device)  # [seq_len]
        allowed = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        if sinks is not None:  # one more column per row: the head's sink logit
            sink_col = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
            scores = torch.cat([scores, sink_col], dim=-1)  # [num_heads, q_len, seq_len + 1]
        probs = torch.softmax(scores, dim=-1)[..., :seq_len]  # [num_heads, q_len, seq_len]
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def lora_shrink_ref(x, lora_a, token_slots: list[int]) -> torch.Tensor:
    """Each row through its adapter's A, in float64: [num_tokens, N] fp32, rows of slot -1 zero.

    x:           [num_tokens, K]
    lora_a:      [max_loras, N, K]   N = parts x max rank, the parts' A stacked
    token_slots: one slot per row, -1 for the base model
    """
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            out[t] = (x[t].double() @ lora_a[slot].double().T).float()
    return out


def lora_expand_ref(buf, lora_b, y, token_slots: list[int]) -> None:
    """y[t] += buf[t] @ lora_b[slot].T for each row of a slot, in float64, with the whole B (its
    zero off-diagonal blocks too: the layout's meaning, not the kernel's shortcut).

    buf:    [num_tokens, N]
    lora_b: [max_loras, out, N]
    y:      [num_tokens, out], rows of slot -1 left as they are
    """
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            y[t] = (y[t].double() + buf[t].double() @ lora_b[slot].double().T).to(y.dtype)
