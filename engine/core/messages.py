"""The messages between the engine's stages, and nothing else.

    Scheduler --SchedulerOutput--> ModelRunner --ModelRunnerOutput--> Scheduler.update_from_output
    ModelRunner (rank 0) --ModelInput--> every TP worker's ModelRunner
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.sequence import Sequence
from engine.lora.request import LoRARequest


@dataclass
class SchedulerOutput:
    """What to compute in one step: a snapshot, taken when the step was scheduled.

    Tokens are laid out flat in `seqs` order: sequence i computes positions
    `num_computed_tokens[i] : num_computed_tokens[i] + num_scheduled_tokens[i]`
    (a decode schedules 1, a prefill chunk several; prefill and decode mix).
    The per-sequence lists are fixed by `schedule()`, which then moves each
    sequence's `num_computed_tokens` (and placeholders) past the step; later stages
    take those from here, never from the `Sequence` (with overlapped scheduling it
    may move again before this step's results are processed).

    `ModelRunner.prepare_inputs` does read the rest live (`token_ids[start:end]`,
    `num_tokens`, `block_table`, `sampling_params`, prompt-logprob progress): it runs
    right after `schedule()` in the same thread (`LLMEngine.step`), before any
    `update_from_output`, so those reads see what `schedule()` left. `sample()` may
    run after the previous step was processed, and reads output tokens then on
    purpose (penalties, min_tokens). docs/architecture.md, "What the model runner
    reads live".
    """

    seqs: list[Sequence]               # scheduled sequences, in flat-token order
    num_scheduled_tokens: list[int]    # new tokens computed for each, >= 1
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step (for stats)
    num_computed_tokens: list[int] = field(default_factory=list)  # each one's first position this step
    sample_flags: list[bool] = field(default_factory=list)   # its chunk reaches its last token: sample
    # Speculative decoding: seq_id -> the draft tokens scheduled after its last token. Such a
    # sequence computes 1 + len(drafts) rows, all of which sample (the rejection sampler keeps
    # the agreeing prefix and one more token). Empty when no sequence has drafts.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # ... and q of the drafts the draft model sampled from its distribution: seq_id -> torch.Tensor
    # [len(spec_token_ids[seq_id]), vocab] float32 on the device, row i the normalised q draft i
    # was drawn from (the acceptance test needs q(d), a rejection all of q). Attached after
    # schedule() by SpecDecoder.attach_draft_probs, cut with the drafts; a draft without an entry
    # (n-gram, argmax, grammar-cut) is verified as one-hot. Read by rank 0's rejection sampler
    # only: TP workers get the ModelInput. Typed loosely to keep this module torch-free.
    spec_draft_probs: dict[int, Any] = field(default_factory=dict)
    # The host KV tier's copies, run before the forward, outs first (engine/core/kv_offload.py):
    # (device block, host block) of evicted prefix blocks, (host block, device block) of host hits.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens scheduled this step (each one more row that samples)."""
        return sum(len(d) for d in self.spec_token_ids.values())

    @property
    def sampled_seqs(self) -> list[Sequence]:
        """The sequences that sample this step, in flat order (the rows of the logits)."""
        return [s for s, f in zip(self.seqs, self.sample_flags) if f]


@dataclass
class SampleLogprobs:
    """Log-probabilities around one token: a sampled one, or a prompt token (prompt logprobs)."""

    token_id: int             # the sampled (or prompt) token
    logprob: float            # its log-probability under the sampling distribution's logits (log_softmax of raw logits)
    rank: int                 # 1-based rank of the sampled token among all logits
    top_token_ids: list[int]  # the k most likely tokens, most likely first
    top_logprobs: list[float] # and their log-probabilities


@dataclass
class ModelRunnerOutput:
    """One step's results, for the sequences whose sample flag was set, in scheduler order."""

    sampled_token_ids: list[int]  # one per sampled sequence: its next token (after accepted drafts)
    logprobs: list[SampleLogprobs | None] | None = None  # None when no sequence asked for logprobs
    # seq_id -> this step's new prompt logprob entries (the prompt token is `token_id`), in
    # position order; None when no scheduled sequence asked for prompt logprobs.
    prompt_logprobs: dict[int, list[SampleLogprobs]] | None = None
    # Speculative decoding, per sampled sequence: how many of its draft tokens
    # (SchedulerOutput.spec_token_ids) were accepted; they come before its sampled token, so it
    # gains num_accepted + 1 tokens. None when no sequence had drafts this step.
    num_accepted_tokens: list[int] | None = None
    # ... and the logprob records of those accepted drafts ([num_accepted] per sampled sequence),
    # when `logprobs` is set.
    accepted_logprobs: list[list[SampleLogprobs | None]] | None = None


@dataclass
class ModelInput:
    """One step's flat model inputs as host lists: built by rank 0, replayed by every TP worker.

    Plain lists (not tensors) so the message to worker processes is small and device-free.
    """

    input_ids: list[int]       # [num_tokens]; 0 at the rows listed in prev_token_rows
    positions: list[int]       # [num_tokens]
    slot_mapping: list[int]    # [num_tokens], cache slot of each new token
    block_tables: list[list[int]]  # [num_seqs][max_blocks], padded with 0
    seq_lens: list[int]        # [num_seqs], context length incl. new tokens
    query_lens: list[int]      # [num_seqs], new tokens per sequence
    sample_rows: list[int]     # flat row indices whose logits are sampled (a sequence with k drafts: its last k + 1)
    # Flat rows whose logits give prompt logprobs (row at position p scores prompt token p + 1);
    # empty unless a scheduled prefill chunk asked for them.
    prompt_logprob_rows: list[int] = field(default_factory=list)
    # Overlapped scheduling: flat rows whose input token was sampled by the previous step and is
    # still on the device only, and that token's row in the previous step's sampled ids.
    # Always empty when steps run one after another (and so for TP workers).
    prev_token_rows: list[int] = field(default_factory=list)
    prev_token_src: list[int] = field(default_factory=list)
    # KV cache groups after the first (a model with full and sliding layers: the sliding one),
    # each with its own slot of each new token and block tables: [group - 1][num_tokens],
    # [group - 1][num_seqs][max_blocks]. Empty for a model with one group.
    group_slot_mappings: list[list[int]] = field(default_factory=list)
    group_block_tables: list[list[list[int]]] = field(default_factory=list)
    # LoRA (enable_lora): each sequence's adapter slot, -1 for the base model ([num_seqs]; empty
    # with LoRA off), and the adapters every rank loads into their slots before this step's forward
    # ((slot, LoRARequest), planned by rank 0: engine/lora/worker_manager.py).
    lora_slots: list[int] = field(default_factory=list)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    # The host KV tier's copies (SchedulerOutput's), which every rank runs on its shard first.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
