"""The speed limit of a workload: FLOP and byte counts, no torch.

Conventions (the same for CPU and GPU):

* A request with P prompt tokens and O output tokens runs T = P + O - 1 tokens
  through the model: the prompt, then every sampled token but the last, which
  is returned and never fed back.
* Linear layers cost 2 FLOPs per weight per token they run on. The decoder
  layers run on all T tokens; the LM head only on the O tokens that are sampled
  (engines compute logits for the last position of a prefill, not all of it).
  The embedding is a gather, not a matmul, and costs nothing.
* Attention costs 4 * num_heads * head_dim FLOPs per layer per (query, key)
  pair: 2 for q.k and 2 for p.v. A token at position i (0-based) sees i + 1
  keys under the causal mask, so a request's T tokens see T (T + 1) / 2 keys.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama/Qwen decoder that decide its cost."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False          # Qwen3: two extra RMSNorm weights of head_dim per layer
    bytes_per_param: int = 4       # 4 for float32, 2 for bf16

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "bytes_per_param"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @classmethod
    def from_hf_config(cls, cfg: dict, bytes_per_param: int) -> "ModelShape":
        heads = cfg["num_attention_heads"]
        return cls(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                   num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   qk_norm=cfg.get("model_type") == "qwen3", bytes_per_param=bytes_per_param)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's linear layers: q, k, v, o and gate, up, down."""
        attn = self.hidden_size * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden_size
        return attn + 3 * self.hidden_size * self.intermediate_size

    @property
    def non_embedding_params(self) -> int:
        """Decoder-layer linear weights; norms are left out (they are not matmuls and tiny)."""
        return self.num_layers * self.layer_matmul_params

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes one decode step must read: every matmul weight plus the norms, once.

        The LM head is read even when tied (it is the embedding matrix then); the
        embedding gather touches a few rows only and is left out.
        """
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        if self.qk_norm:
            norms += self.num_layers * 2 * self.head_dim
        return (self.non_embedding_params + self.lm_head_params + norms) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return 2 * self.num_layers * self.kv_dim * self.bytes_per_param


def request_flops(shape: ModelShape, prompt_len: int, output_len: int) -> dict[str, int]:
    """Matmul FLOPs of one request, split as `linear`, `lm_head` and `attention`."""
    num_tokens = prompt_len + output_len - 1
    num_pairs = num_tokens * (num_tokens + 1) // 2
    return {
        "linear": 2 * shape.non_embedding_params * num_tokens,
        "lm_head": 2 * shape.lm_head_params * output_len,
        "attention": 4 * shape.num_layers * shape.q_dim * num_pairs,
    }


def workload_flops(shape: ModelShape, lengths: list[tuple[int, int]]) -> dict[str, int]:
    """Sum of `request_flops` over (prompt_len, output_len) pairs, with a `total`."""
    totals = {"linear": 0, "lm_head": 0, "attention": 0}
    for prompt_len, output_len in lengths:
        for key, value in request_flops(shape, prompt_len, output_len).items():
            totals[key] += value
    totals["total"] = sum(totals.values())
    return totals


def prefill_flops(shape: ModelShape, prompt_len: int) -> int:
    """The prompt pass: P tokens through the layers, P(P+1)/2 attention pairs, one LM-head row."""
    pairs = prompt_len * (prompt_len + 1) // 2
    return (2 * shape.non_embedding_params * prompt_len + 2 * shape.lm_head_params
            + 4 * shape.num_layers * shape.q_dim * pairs)


def decode_limit_seconds(shape: ModelShape, lengths: list[tuple[int, int]],
                         bandwidth: float, flop_rate: float) -> float:
    """Least time for all decode steps, every running request in one batch each step.

    Step s (0-based) feeds each request still decoding (output_len - 1 > s) its
    token at position P + s, which reads the P + s cached keys and values plus
    its own. The step reads the weights once and that KV; it cannot beat that
    at `bandwidth` bytes/s, nor its matmuls at `flop_rate` FLOP/s, so it takes
    the larger of the two. One batch of everyone is the fewest steps possible.
    """
    if bandwidth <= 0 or flop_rate <= 0:
        raise ValueError(f"bandwidth={bandwidth} and flop_rate={flop_rate} must be > 0")
    num_steps = max((o - 1 for _, o in lengths), default=0)
    per_token = 2 * (shape.non_embedding_params + shape.lm_head_params)
    total = 0.0
    for step in range(num_steps):
        running = [p + step + 1 for p, o in lengths if o - 1 > step]  # keys each one sees
        kv_bytes = sum(running) * shape.kv_bytes_per_token
        flops = per_token * len(running) + 4 * shape.num_layers * shape.q_dim * sum(running)
        total += max((shape.weight_bytes_per_step + kv_bytes) / bandwidth, flops / flop_rate)
    return total


def gpu_limit_seconds(shape: ModelShape, lengths: list[tuple[int, int]],
                      bandwidth: float, flop_rate: float) -> dict[str, float]:
    """docs/benchmarks.md's GPU limit: prefill FLOPs at the matmul rate plus the decode steps."""
    prefill = sum(prefill_flops(shape, p) for p, _ in lengths) / flop_rate
    decode = decode_limit_seconds(shape, lengths, bandwidth, flop_rate)
    return {"prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode}
