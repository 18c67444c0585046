"""KV bytes one conversation holds, before and after sliding layers free the blocks behind
their window: `python -m loadtest.kv_bytes [--tokens 32768] [--block-size 16]`. No torch.

"Before": every layer holds a block for every token (one table for all layers). "After": the
full-attention layers still do; a sliding layer holds the blocks that its pool keeps while
the last token, at position `num_tokens - 1`, is computed (engine.core.block_manager: from the
block holding `num_tokens - W` on), whatever the conversation's length. The layer types come from the
config as the engine reads it (ModelConfig.from_hf_dict), and the groups from
engine.core.kv_cache_groups.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.core.kv_cache_groups import kv_cache_groups

# google/gemma-3-27b-it's text_config (the keys that decide KV bytes; the rest as on the hub):
# 62 layers, 5 local (window 1024) to 1 global, 16 KV heads of 128, bf16.
GEMMA3_27B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "vocab_size": 262208, "hidden_size": 5376, "intermediate_size": 21504,
    "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
    "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 168,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class KVBytes:
    num_tokens: int
    before: int   # bytes, every layer holding every token
    after: int    # bytes, sliding layers holding their window's blocks

    @property
    def before_per_token(self) -> float:
        return self.before / self.num_tokens

    @property
    def after_per_token(self) -> float:
        return self.after / self.num_tokens


def sliding_blocks_held(position: int, window: int, block_size: int) -> int:
    """Blocks a sliding pool holds for a sequence whose next row is at `position`."""
    first = max(0, position - window + 1) // block_size
    return position // block_size - first + 1


def kv_bytes(hf_config: dict, num_tokens: int, block_size: int = 16, dtype_bytes: int = 2) -> KVBytes:
    """KV bytes of one sequence of `num_tokens` tokens (whole blocks, as the cache holds them)."""
    mc = ModelConfig.from_hf_dict(hf_config)
    per_layer_block = 2 * block_size * mc.num_key_value_heads * mc.head_dim * dtype_bytes  # K and V
    num_blocks = -(-num_tokens // block_size)
    groups = kv_cache_groups(mc.layer_types, mc.sliding_window, mc.num_hidden_layers)
    after = 0
    for g in groups:
        held = num_blocks if g.sliding_window is None else min(
            num_blocks, sliding_blocks_held(num_tokens - 1, g.sliding_window, block_size))
        after += len(g.layer_indices) * held * per_layer_block
    return KVBytes(num_tokens, mc.num_hidden_layers * num_blocks * per_layer_block, after)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    r = kv_bytes(GEMMA3_27B, args.tokens, args.block_size)
    print(f"gemma-3-27b, {args.tokens} tokens, bf16, blocks of {args.block_size}:")
    print(f"  before: {r.before / 2**30:.2f} GiB, {r.before_per_token / 2**10:.1f} KiB per token")
    print(f"  after:  {r.after / 2**30:.2f} GiB, {r.after_per_token / 2**10:.1f} KiB per token "
          f"({r.before / r.after:.1f}x less)")


if __name__ == "__main__":
    main()
