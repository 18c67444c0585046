"""The synchronous engine core: requests in, one step at a time, RequestOutputs out.

`LLM` (offline) and `AsyncLLM` (serving) both wrap it. One thread drives it.
"""
from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Any

from transformers import AutoTokenizer

from engine.core.kv_cache_groups import kv_cache_groups, make_block_manager
from engine.core.kv_offload import offload_stats
from engine.config import EngineConfig, ModelConfig
from engine.core.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.loader.model_path import resolve_model_path
from engine.lora.peft_adapter import read_peft_adapter
from engine.lora.request import LoRARequest
from engine.outputs import RequestMetrics, RequestOutput
from engine.core.request_state import RequestState
from engine.sampling_params import SamplingParams, bad_words_token_ids
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.new_tokens import detokenize_new_tokens, drop_new_tokens, logprobs_by_seq
from engine.core.stats import StatsLog
from engine.spec_decode import make_spec_decoder

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_path(config.tokenizer) if config.tokenizer else model_path)
        # Device, dtype, attention backend and the None defaults are decided here, once; every
        # stage below (executor, TP workers, model runner, attention) reads this resolved copy.
        self.config = config = config.resolve(self.model_config)
        self.eos_token_ids = _eos_token_ids(self.model_config, self.tokenizer)
        self.reasoning_parser = _make_reasoning_parser(config.reasoning_parser, self.tokenizer)
        self.executor = _make_executor(config, self.model_config, model_path, self.eos_token_ids)
        # Workers and the process group go when the engine does, even if nobody calls shutdown().
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        # One pool per KV cache group (full layers, sliding layers); one BlockManager when alike.
        self.block_manager = make_block_manager(
            kv_cache_groups(self.model_config.layer_types, self.model_config.sliding_window,
                            self.model_config.num_hidden_layers),
            self.executor.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            config.max_num_seqs, config.max_num_batched_tokens, num_host_blocks=self.executor.num_host_kv_blocks)
        self.scheduler = Scheduler(max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=config.max_model_len, block_manager=self.block_manager,
                                   eos_token_ids=self.eos_token_ids,
                                   max_loras=config.max_loras if config.enable_lora else None,
                                   policy=config.scheduling_policy)
        self.requests: dict[str, RequestState] = {}
        self.async_scheduling = bool(config.async_scheduling)
        self._inflight = None  # the launched step whose tokens are not processed yet (a StepHandle)
        self.num_host_waits = 0  # overlapped steps that waited for the previous tokens (grammar, penalties)
        self.num_spec_waits = 0  # overlapped steps that waited for them to propose drafts (speculation)
        self.num_generated_tokens = 0  # lifetime counter, for metrics
        self.stats_log = StatsLog()  # per-step and per-request observations; off until enabled
        # Speculative decoding's drafts and counters (a no-op without speculative_config).
        self.spec_decoder = make_spec_decoder(config, self.model_config, self.executor.num_kv_blocks,
                                              self.eos_token_ids)
        logger.info("engine ready: %s, %d KV blocks of %d tokens", self.model_config.architecture,
                    self.executor.num_kv_blocks, config.block_size)

    # -- requests --------------------------------------------------------------
    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                     arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                     priority: int = 0) -> RequestState:
        """Tokenize and validate; touches no engine state, so a caller may run it on any thread."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._check_priority(priority)
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids, params)
        if lora_request is not None:
            self._check_lora(lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id, token_ids, params, index=i, arrival_time=arrival, lora_request=lora_request,
                         priority=priority) for i in range(params.n)]
        for sib in seqs[1:]:
            sib.prefix_source = seqs[0]
        if params.bad_words:
            bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
            self._check_token_ids("bad_words", [t for word in bad_words for t in word])
            for seq in seqs:
                seq.bad_words_token_ids = bad_words
        if params.structured_outputs is not None:
            compiled = self.structured_outputs.compile(params.structured_outputs)  # ValueError if unusable
            for seq in seqs:
                seq.grammar = self.structured_outputs.new_matcher(compiled, self.reasoning_parser, token_ids)
        detoks = [IncrementalDetokenizer(self.tokenizer, token_ids, params) for _ in seqs]
        return RequestState(request_id, text, token_ids, params, seqs, detoks, RequestMetrics(arrival))

    def add_request_state(self, state: RequestState) -> None:
        if state.request_id in self.requests:
            raise ValueError(f"request_id {state.request_id!r} is already in use")
        added = []
        try:
            for seq in state.seqs:
                self.scheduler.add_seq(seq)
                added.append(seq)
        except BaseException:
            if added:  # registered only once whole, so a refused request never lingers
                self.scheduler.abort(state.request_id)
            raise
        self.requests[state.request_id] = state

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        self.add_request_state(self.make_request(request_id, prompt, params or SamplingParams(), arrival_time,
                                                 priority=priority))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort and free; returns the request's final output (finish_reason "abort"), or None if unknown."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        for seq in state.seqs:
            self.executor.free_seq(seq.seq_id)
        self.stats_log.on_finished(state.metrics, "abort", len(state.prompt_token_ids),
                                   [s.num_output_tokens for s in state.seqs], time.monotonic())
        return state.make_output(set(range(len(state.seqs))), self.tokenizer)

    def has_unfinished_requests(self) -> bool:
        # A launched step still to process counts: its sequences may all have finished already,
        # but its tokens must be collected before the engine goes idle.
        return bool(self.requests) or self._inflight is not None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, the host tier's too (vLLM's `reset_prefix_cache`), so the next
        request computes its whole prompt. False, and nothing changes, while a request is unfinished.
        (A draft model's own pool keeps its prefixes: they change no token and no counter.)"""
        return not self.has_unfinished_requests() and self.block_manager.reset_prefix_cache()

    # -- stepping ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step that completed.

        Without overlapped scheduling that is this step. With it, this step's forward (and
        usually its sampling) is launched first and the previous step is processed while the
        device runs it; a step whose sampling needs the previous tokens on the host (grammar
        bitmask, penalties, min_tokens) samples after that processing instead, and with
        speculation a step waits for the previous one before it is scheduled whenever drafts may
        follow its tokens (SpecDecoder.needs_previous_tokens).
        """
        outputs = []
        if self._inflight is not None and self.spec_decoder.needs_previous_tokens(
                self.scheduler.running, self._inflight.scheduler_output):
            self.num_spec_waits += 1
            outputs = self._process_inflight()  # drafts follow the accepted tokens
        self.spec_decoder.propose(self.scheduler.running)
        sched_out = self.scheduler.schedule()
        self.spec_decoder.attach_draft_probs(sched_out)  # q of the drafts it kept, for the rejection sampler
        outputs += self._process_inflight() if sched_out.is_empty else self._launch(sched_out)
        self.spec_decoder.retain(self.scheduler.running)  # drop finished and preempted sequences' drafting state
        return outputs

    def _launch(self, sched_out) -> list[RequestOutput]:
        """Run the scheduled step; process the previous one while it runs (or before its sampling)."""
        self._record_scheduled(sched_out)
        handle = self.executor.forward(sched_out)
        if any(_needs_host_state(s) for s in sched_out.sampled_seqs):
            if self._inflight is not None:
                self.num_host_waits += 1
            outputs = self._process_inflight()
            handle = self.executor.sample(handle, self._grammar_bitmask(sched_out))
        else:
            handle = self.executor.sample(handle)
            outputs = self._process_inflight()  # the previous step, while this one runs
        self._inflight = handle
        if not self.async_scheduling:
            outputs += self._process_inflight()
        return outputs

    def _grammar_bitmask(self, sched_out):
        """[sampled rows, words]: a row per sampling sequence, or per verified position with drafts."""
        sampled = sched_out.sampled_seqs
        if not any(s.grammar is not None for s in sampled):
            return None
        matchers = [s.grammar for s in sampled]
        if sched_out.spec_token_ids:
            drafts = [sched_out.spec_token_ids.get(s.seq_id, []) for s in sampled]
            return self.structured_outputs.fill_bitmask_rows(matchers, drafts)
        return self.structured_outputs.fill_bitmask(matchers)

    def _process_inflight(self) -> list[RequestOutput]:
        """Wait for the launched step's tokens and turn them into request outputs."""
        handle, self._inflight = self._inflight, None
        if handle is None:
            return []
        sched_out = handle.scheduler_output
        runner_out = self.executor.collect(handle)
        logprobs = logprobs_by_seq(sched_out, runner_out)
        if runner_out.prompt_logprobs:
            for seq in sched_out.seqs:
                seq.prompt_logprobs.extend(runner_out.prompt_logprobs.get(seq.seq_id, ()))
        updated = self.scheduler.update_from_output(sched_out, runner_out)
        for seq, entries in logprobs:  # one per token appended (fewer than verified when one stopped it)
            seq.output_logprobs.extend(entries[:seq.num_new_tokens])
        self.spec_decoder.record(sched_out, runner_out)
        return self._process_updates(updated)

    def _record_scheduled(self, sched_out) -> None:
        if not self.stats_log.enabled:  # queue times are only read by an enabled StatsLog
            return
        now = time.monotonic()
        self.stats_log.on_step(sched_out.total_num_scheduled_tokens)
        for seq in sched_out.seqs:
            state = self.requests.get(seq.request_id)
            if state is not None:
                self.stats_log.on_scheduled(state.metrics, now)

    def _process_updates(self, updated: list[Sequence]) -> list[RequestOutput]:
        now = time.monotonic()
        changed: dict[str, set[int]] = {}
        for seq in updated:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            if seq.grammar is not None:  # first: it may drop accepted drafts after the document's end
                self._advance_grammar(seq)
            stop_str = detokenize_new_tokens(state.detokenizers[seq.index], seq)  # may drop tokens after a stop string
            self.num_generated_tokens += seq.num_new_tokens
            if seq.request_id not in changed:  # once per request and step (vLLM's ITL unit)
                num_new = sum(s.num_new_tokens for s in updated if s.request_id == seq.request_id) \
                    if len(state.seqs) > 1 else seq.num_new_tokens
                self.stats_log.on_new_tokens(state.metrics, len(state.prompt_token_ids), num_new, now)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                state.metrics.num_cached_tokens = state.seqs[0].num_cached_tokens
            if stop_str is not None:
                self._finish_on_stop_string(seq, stop_str)
            if seq.is_finished:
                self.executor.free_seq(seq.seq_id)
            changed.setdefault(seq.request_id, set()).add(seq.index)
        return self._collect_outputs(changed, now)

    def _advance_grammar(self, seq: Sequence) -> None:
        """Follow the step's new tokens; once the document is complete, end there (tokens after
        it, accepted drafts and their bonus token, are dropped, as one token per step would)."""
        for position in range(seq.num_tokens - seq.num_new_tokens, seq.num_tokens):
            seq.grammar.follow(seq.token_ids, position)
            if seq.grammar.is_finished():
                drop_new_tokens(seq, seq.num_tokens - position - 1)
                if not seq.is_finished:
                    self.scheduler.finish_seq(seq, "stop", None)
                return

    @functools.cached_property
    def structured_outputs(self):
        from engine.core.structured_output import StructuredOutputManager  # xgrammar is loaded only when first needed
        return StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                       stop_token_ids=self.eos_token_ids)

    def _finish_on_stop_string(self, seq: Sequence, stop_str: str) -> None:
        if seq.is_finished:  # also hit a length limit on this token: the stop string wins, as in vLLM
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        else:
            self.scheduler.finish_seq(seq, "stop", stop_str)

    def _collect_outputs(self, changed: dict[str, set[int]], now: float) -> list[RequestOutput]:
        outputs = []
        for request_id, indices in changed.items():
            state = self.requests[request_id]
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[request_id]
                self.stats_log.on_finished(state.metrics, state.seqs[0].finish_reason or "stop",
                                           len(state.prompt_token_ids),
                                           [s.num_output_tokens for s in state.seqs], now)
            out = state.make_output(indices, self.tokenizer)
            if out is not None:
                outputs.append(out)
        return outputs

    # -- helpers ------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in ids):
                raise InvalidRequestError("prompt_token_ids must be a list of integers", param="prompt")
            return prompt.get("prompt"), list(ids)
        raise InvalidRequestError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, "
                                  f"got {type(prompt).__name__}", param="prompt")

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty (0 tokens)", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is out of vocabulary (vocab_size={vocab})", param="prompt")
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", params.logit_bias or ())
        self._check_token_ids("allowed_token_ids", params.allowed_token_ids or ())
        self.scheduler.check_fits(len(token_ids), params.max_tokens)

    def _check_priority(self, priority) -> None:
        """An int; other than 0 only under scheduling_policy="priority" (as vLLM refuses it)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority={priority!r} is invalid: must be an integer", param="priority")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority={priority} needs scheduling_policy='priority'; this engine "
                                      f"runs {self.config.scheduling_policy!r}", param="priority")

    def _check_lora(self, lora_request: LoRARequest) -> None:
        """The adapter is one the engine runs (engine/lora/peft_adapter.py); ValueError naming it if not."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request={lora_request!r} is invalid: pass a LoRARequest")
        if not self.config.enable_lora:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is off (start the engine "
                             f"with enable_lora=True)")
        read_peft_adapter(lora_request, self.config.max_lora_rank, self.model_config)

    def _check_token_ids(self, name: str, token_ids) -> None:
        """Token ids a request names must be rows of the logits (not just of the tokenizer)."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{name}: token id {bad} is out of vocabulary (vocab_size={vocab})", param=name)

    def get_stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": bm.usage,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "num_generated_tokens": self.num_generated_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_host_waits": self.num_host_waits,
            "num_spec_waits": self.num_spec_waits,
            "prefix_cache_queries": bm.num_queried_tokens,  # tokens looked up (lifetime), as vLLM counts
            "prefix_cache_hits": bm.num_hit_tokens,
            **self.spec_decoder.get_stats(),  # spec_decode_* counters, with speculative_config only
            **offload_stats(bm),
        }

    def shutdown(self) -> None:
        """Stop the TP workers and leave the process group; idempotent."""
        self._finalizer()


def _needs_host_state(seq: Sequence) -> bool:
    """Sampling this sequence reads its latest tokens on the host: a grammar matcher, penalties
    over its output, a min_tokens count still in force, or a bad word of several tokens (whose
    last token is banned only after the others). logit_bias, allowed_token_ids and one-token bad
    words are the same at every step, so they never wait."""
    p = seq.sampling_params
    return (seq.grammar is not None or p.has_penalties
            or bool(p.min_tokens and seq.num_output_tokens < p.min_tokens)
            or any(len(word) > 1 for word in seq.bad_words_token_ids))


def _make_reasoning_parser(name: str | None, tokenizer):
    if name is None:
        return None
    from engine.reasoning import get_reasoning_parser

    parser = get_reasoning_parser(name)(tokenizer)
    if parser.end_token_id is None:
        raise ValueError(f"reasoning_parser={name!r} needs {parser.end_tag!r} as one token of the tokenizer's "
                         "vocabulary (the grammar of a request starts after it)")
    return parser


def _eos_token_ids(model_config: ModelConfig, tokenizer) -> list[int]:
    ids = list(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _make_executor(config: EngineConfig, model_config: ModelConfig, model_path, eos_token_ids):
    if config.tensor_parallel_size > 1:
        from engine.executor.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor(config, model_config, model_path, eos_token_ids)
    from engine.executor.uniproc_executor import UniprocExecutor
    return UniprocExecutor(config, model_config, model_path, eos_token_ids)
