"""The HF transformers peers: static-batching `generate`, and a plain greedy reference.

Both take the same `BenchRequest`s as our engine and run under
`torch.inference_mode()` in the checkpoint's own dtype.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from loadtest.report import Stopwatch
from loadtest.workload import BenchRequest


@dataclass
class PeerResult:
    """One timed pass of a peer over the whole workload."""

    name: str                   # e.g. "hf_sorted16"
    elapsed_s: float            # wall time from the first batch's submission to the last token
    num_useful_tokens: int      # each request's own output length, padding excluded
    settings: dict              # batch size, ordering, ... as run
    cpu_s: float | None = None  # CPU seconds of this process meanwhile (report.Stopwatch)

    @property
    def tokens_per_s(self) -> float:
        return self.num_useful_tokens / self.elapsed_s

    def to_dict(self) -> dict:
        return {"name": self.name, "elapsed_s": self.elapsed_s, "num_useful_tokens": self.num_useful_tokens,
                "tokens_per_s": self.tokens_per_s, "cpu_s": self.cpu_s, "settings": self.settings}


def load_hf_model(path: str, dtype: torch.dtype, device: str, **kwargs):
    """`from_pretrained` in the given dtype on either side of the transformers 5 rename
    (torch_dtype -> dtype; 4.x would silently store an unknown `dtype` kwarg in the config).
    A GGUF's HF view (engine.loader.gguf_config) is read by transformers' own GGUF code."""
    from transformers import AutoModelForCausalLM

    from engine.loader.gguf_config import gguf_source

    gguf_file = gguf_source(Path(path))
    if gguf_file is not None:
        return load_hf_from_gguf(path, gguf_file, dtype).to(device).eval()
    major = int(transformers.__version__.split(".")[0])
    dtype_kw = {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(path, **dtype_kw, **kwargs)
    return model.to(device).eval()


def load_hf_from_gguf(view: str | Path, gguf_file: Path, dtype: torch.dtype = torch.float32):
    """HF on a GGUF: transformers' own dequantization and Q/K un-permutation (not ours). Not
    `from_pretrained(gguf_file=)`, which insists on accelerate: the model is built from the
    view's config and given the tensors transformers read from the file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(view), dtype=dtype)
    with _one_tensor_name_map():
        tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{gguf_file.name}: transformers' tensors do not fit the model: "
                         f"missing {missing[:10]}, unexpected {unexpected[:10]}")
    model.tie_weights()
    return model


@contextlib.contextmanager
def _one_tensor_name_map():
    """transformers asks gguf for its tensor name map once per module of the model it maps, and
    gguf builds the map anew each time (most of a small model's load); the map is a pure function
    of (architecture, depth), so one of each is built while transformers loads."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def left_pad(prompts: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, max_len] ids and attention mask, pads on the left so every row's last
    position is its last prompt token (where generation continues)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def make_batches(requests: list[BenchRequest], batch_size: int, sort_by_output: bool) -> list[list[int]]:
    """Request indices per batch: submission order, or grouped by output length so a batch
    wastes few steps on requests that have already finished."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    order = list(range(len(requests)))
    if sort_by_output:
        order.sort(key=lambda i: requests[i].max_tokens)
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _pad_token_id(model) -> int:
    gen = model.generation_config
    for candidate in (gen.pad_token_id, model.config.pad_token_id, gen.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def run_static_batch(model, requests: list[BenchRequest], batch: list[int]) -> list[list[int]]:
    """One `generate` call for the batch: every row runs to the batch's longest output
    (min_new_tokens = max_new_tokens, so EOS cannot end it early, like ignore_eos)."""
    from transformers import GenerationConfig

    pad = _pad_token_id(model)
    ids, mask = left_pad([requests[i].prompt_token_ids for i in batch], pad, model.device)
    num_new = max(requests[i].max_tokens for i in batch)
    config = GenerationConfig(max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                              use_cache=True, pad_token_id=pad,
                              eos_token_id=model.generation_config.eos_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    new_tokens = out[:, ids.shape[1]:].tolist()
    return [row[:requests[i].max_tokens] for row, i in zip(new_tokens, batch)]


def hf_static(model, requests: list[BenchRequest], batch_size: int, sort_by_output: bool,
              name: str) -> PeerResult:
    """Static batching over the whole workload, timed from the first batch to the last token."""
    batches = make_batches(requests, batch_size, sort_by_output)
    _sync(model.device)
    with Stopwatch() as watch:
        for batch in batches:
            run_static_batch(model, requests, batch)
        _sync(model.device)
    return PeerResult(name=name, elapsed_s=watch.wall_s, cpu_s=watch.cpu_s,
                      num_useful_tokens=sum(r.max_tokens for r in requests),
                      settings={"batch_size": batch_size, "sorted_by_output_len": sort_by_output,
                                "num_batches": len(batches), "padding": "left"})


@torch.inference_mode()
def hf_greedy_reference(model, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from a bare forward loop: no padding, no generation config, no EOS
    handling to get in the way, so it is the plainest reference there is."""
    ids = torch.tensor([prompt_token_ids], dtype=torch.long, device=model.device)
    out = model(input_ids=ids, use_cache=True)
    tokens: list[int] = []
    for _ in range(max_tokens):
        next_id = out.logits[0, -1].argmax()
        tokens.append(int(next_id))
        if len(tokens) == max_tokens:
            break
        out = model(input_ids=next_id.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def compare_tokens(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """How many requests differ from the reference, and where each first diverges.

    Random-weight models have near-ties in their logits, so a last-bit difference in a
    reduction can flip one argmax and everything after it: this is reported, not fatal.
    """
    first_diff = []
    for a, b in zip(ours, reference):
        pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is None and len(a) != len(b):
            pos = min(len(a), len(b))
        first_diff.append(pos)
    return {"num_compared": len(first_diff),
            "num_mismatched": sum(p is not None for p in first_diff),
            "first_divergence": first_diff}
