"""Per-sequence state. No torch: the scheduler and block manager are tested in milliseconds.

A request with n > 1 becomes n `Sequence`s that share the prompt; `index` says
which completion each one is.
"""
from __future__ import annotations

import enum
import itertools
import time

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # queued, or preempted and waiting to be recomputed
    RUNNING = enum.auto()   # holds KV blocks and is scheduled every step
    FINISHED = enum.auto()  # done; finish_reason says why; its blocks are freed


class Sequence:
    @property
    def block_table(self) -> list[int]:
        """The first KV cache group's table (the only one unless a model mixes full and sliding layers)."""
        return self.block_tables[0]

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 index: int = 0, arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                 priority: int = 0):
        self.request_id = request_id
        # Under scheduling_policy="priority": lower runs first (vLLM's field); 0 under "fcfs".
        self.priority = priority
        self.lora_request = lora_request  # the adapter it runs with; None: the base model
        self.seq_id = next(_seq_counter)  # unique across the process; keys per-sequence sampler state
        self.index = index                # which of the request's n completions this is
        self.sampling_params = sampling_params
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt followed by output tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens whose K/V are in the cache or written by a step already scheduled: the
        # scheduler moves it when it schedules, so the next step can be planned before this
        # one's results are back (overlapped scheduling).
        self.num_computed_tokens = 0
        # Output tokens sampled by a launched step whose ids are not back on the host yet
        # (0 or 1 at a scheduling point; always 0 without overlapped scheduling between steps).
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0        # of those, how many came from the prefix cache at admission
        # KV block ids, in order, one table per KV cache group (engine.core.kv_cache_groups):
        # block_tables[0] is `block_table`; a model with full and sliding layers has two.
        self.block_tables: list[list[int]] = [[]]
        self.block_hashes: list[int] = [] # chained hashes of this sequence's full blocks (prefix caching)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        # With n > 1: the sibling whose prompt blocks this sequence shares once they are computed.
        self.prefix_source: Sequence | None = None
        # Filled by the sampler when logprobs are requested: one entry per output token.
        self.output_logprobs: list = []
        # Filled by the engine when prompt_logprobs are requested: one entry per prompt token from
        # the second on (the first has no context). Kept across preemption: a recompute only adds
        # the positions still missing.
        self.prompt_logprobs: list = []
        # Structured output: this sequence's grammar matcher (engine.core.structured_output), or None. Opaque here.
        self.grammar = None
        # sampling_params.bad_words as token id sequences (tokenized once by the engine; shared by
        # the request's n sequences): the sampler bans each one's last token after the others.
        self.bad_words_token_ids: list[list[int]] = []
        # Speculative decoding (engine/spec_decode): tokens proposed to follow the last one, set by
        # the engine after each step and verified by the next; the scheduler takes them when it
        # schedules the sequence (SchedulerOutput.spec_token_ids).
        self.spec_token_ids: list[int] = []
        # Tokens appended by the last processed step: 1, or more when draft tokens were accepted.
        self.num_new_tokens = 0

    # -- token views -------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model (the scheduler's max_loras rule, the prefix-cache hashes)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_missing_prompt_logprobs(self) -> int:
        """Prompt logprob entries still to compute; only completion 0 computes them for its request."""
        if self.sampling_params.prompt_logprobs is None or self.index != 0:
            return 0
        return self.num_prompt_tokens - 1 - len(self.prompt_logprobs)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those sampled but still on the device: where the next step starts."""
        return len(self.token_ids) + self.num_output_placeholders

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, idx={self.index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.name})")
