"""Token-budget continuous batching with chunked prefill and preemption by recompute. No torch.

One step, under `max_num_batched_tokens` tokens and `max_num_seqs` sequences:

  1. running sequences, in order: a decode token each, or their next prefill
     chunk. When one cannot get a block, the last running sequence is
     preempted (blocks freed, back to the queue, recomputed later) until it
     fits, or it is itself the last and steps back.
  2. waiting sequences, in queue order, while tokens, sequence slots and blocks
     last; a prompt may be admitted with only its first chunk. Skipped in a step
     that preempted: there was no room for what was already running. With LoRA, a
     sequence whose adapter would make more than `max_loras` distinct adapters
     among the running sequences keeps its place and waits (later ones may pass
     it, as in vLLM), so a step never needs more adapter slots than there are.

The order of both lists is the scheduling policy's (engine/core/request_queue.py):
"fcfs" keeps arrival order and preempts the newest; "priority" keeps (priority, arrival)
order, so the lowest-priority, latest-arrived sequence is preempted first, and a waiting
sequence that does not fit (no sequence slot or no blocks) preempts running ones of a
strictly lower priority, lowest first, then the step admits nothing more.

Prefill and decode mix in one step; the model runner sees one flat batch.

Speculative decoding: a decoding sequence with draft tokens (`spec_token_ids`, proposed by the
engine after the previous step) gets lookahead slots for them, within the token budget and never
past max_model_len or its max_tokens (k drafts may add k + 1 tokens); when its blocks don't fit
it decodes without them rather than preempt anyone. After the step the rejected drafts' slots
are rolled back: `num_computed_tokens` moves back and blocks past it are freed, so only
accepted tokens ever fill a block that the prefix cache registers.

Scheduling a step moves `num_computed_tokens` at once (the step's K/V will be
written before any later step reads it: steps run in order on one stream), so
step N+1 can be scheduled while step N still runs. A token sampled by a step
whose result is not back yet is a placeholder (`num_output_placeholders`):
the next decode of that sequence feeds it from the device, and a sequence
that turns out to have stopped has that next step's token discarded.
"""
from __future__ import annotations

from engine.core.block_manager import BlockManager
from engine.core.kv_cache_groups import HybridBlockManager, blocks_needed
from engine.errors import InvalidRequestError, PromptTooLongError, check_int
from engine.core.messages import ModelRunnerOutput, SchedulerOutput
from engine.core.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from engine.core.sequence import Sequence, SequenceStatus

FINISH_REASONS = ("stop", "length", "abort")
# A chunk of a request still owed prompt logprobs is scored row by row: [rows, vocab] logits
# plus their log_softmax. Capping its rows per step bounds that memory (512 x a 152k vocab in
# fp32 is ~0.6 GB with the copy), which the start-up memory profile does not account for.
MAX_PROMPT_LOGPROB_ROWS = 512


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_manager: BlockManager | HybridBlockManager, eos_token_ids: list[int] | tuple[int, ...] = (),
                 max_loras: int | None = None, policy: SchedulingPolicy | str = SchedulingPolicy.FCFS):
        check_int("max_num_seqs", max_num_seqs)
        if max_loras is not None:
            check_int("max_loras", max_loras)
        self.max_loras = max_loras  # None: LoRA is off
        check_int("max_num_batched_tokens", max_num_batched_tokens)
        check_int("max_model_len", max_model_len)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: RequestQueue = create_request_queue(policy)
        # In the policy's order (admission, or priority): the last one is preempted first.
        self.running: list[Sequence] = []
        self._seqs_by_request: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0  # total, for metrics

    # -- queue state ---------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running)

    # -- requests in and out -----------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raise PromptTooLongError (InvalidRequestError for an empty prompt), naming the numbers,
        for a request that could never run.

        Checked up front so that a lone sequence can always make progress later:
        it fits max_model_len and, even with every other request preempted, the cache.
        """
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty (0 tokens)", param="prompt")
        if max_tokens is None and num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(f"prompt ({num_prompt_tokens} tokens) leaves no room for output "
                                     f"within max_model_len={self.max_model_len}")
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise PromptTooLongError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                                     f"{num_prompt_tokens + max_tokens} tokens exceeds max_model_len={self.max_model_len}")
        num_output = self.max_model_len - num_prompt_tokens if max_tokens is None else max_tokens
        # The last sampled token is never fed back, so it needs no KV slot.
        needs = blocks_needed(self.block_manager, num_prompt_tokens + num_output - 1, self.max_num_batched_tokens)
        for group, (num_kv_blocks, num_blocks) in enumerate(needs):
            if num_kv_blocks > num_blocks:
                where = "the whole cache has" if len(needs) == 1 else f"KV cache group {group} has"
                raise PromptTooLongError(
                    f"prompt ({num_prompt_tokens} tokens) + max_tokens ({num_output}) needs {num_kv_blocks} KV blocks "
                    f"of {self.block_manager.block_size} tokens, but {where} num_blocks={num_blocks}")

    def add_seq(self, seq: Sequence) -> None:
        """Queue a sequence; PromptTooLongError / InvalidRequestError (see check_fits) if it could never run."""
        assert seq.status is SequenceStatus.WAITING and not seq.block_table, seq
        try:
            self.check_fits(seq.num_prompt_tokens, seq.sampling_params.max_tokens)
        except InvalidRequestError as e:  # the same error (type, param, code), naming the request
            raise type(e)(f"request {seq.request_id!r}: {e}", e.param, e.code) from None
        self.waiting.add_request(seq)
        self._seqs_by_request.setdefault(seq.request_id, []).append(seq)

    def finish_seq(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish `seq` (waiting or running) and free its blocks; a no-op if it already finished."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason {reason!r} is invalid: choose one of {FINISH_REASONS}")
        if seq.is_finished:
            return
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.free(seq)
        siblings = self._seqs_by_request[seq.request_id]
        siblings.remove(seq)
        if not siblings:
            del self._seqs_by_request[seq.request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every live sequence of `request_id` with reason "abort"; returns them ([] if none)."""
        seqs = list(self._seqs_by_request.get(request_id, ()))
        for seq in seqs:
            self.finish_seq(seq, "abort")
        return seqs

    # -- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(seqs=[], num_scheduled_tokens=[])
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self._update_after_schedule(out)
        if out.seqs:  # else the copies wait for the next step that runs (nothing reads them before)
            out.blocks_to_swap_out, out.blocks_to_swap_in = self.block_manager.take_swaps()
        return out

    @staticmethod
    def _update_after_schedule(out: SchedulerOutput) -> None:
        """Snapshot where each chunk starts and whether it samples, then move the sequences on."""
        spec = out.spec_token_ids
        for seq, num_new in zip(out.seqs, out.num_scheduled_tokens):
            out.num_computed_tokens.append(seq.num_computed_tokens)
            seq.num_computed_tokens += num_new
            num_spec = len(spec[seq.seq_id]) if spec and seq.seq_id in spec else 0
            samples = seq.num_computed_tokens == seq.num_tokens_with_placeholders + num_spec
            out.sample_flags.append(samples)
            seq.num_output_placeholders += samples  # its token is unknown until the step is processed

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._ends_with_placeholder(seq):
                i += 1  # its in-flight token is its last: it finishes when that step is processed
                continue
            num_new = min(seq.num_tokens_with_placeholders - seq.num_computed_tokens, _chunk_limit(seq, budget))
            assert num_new >= 1, seq
            num_spec = self._num_lookahead_slots(seq, num_new, budget)
            drafts, seq.spec_token_ids = seq.spec_token_ids[:num_spec], []  # taken now, stale after the step
            if num_spec and self.block_manager.allocate_slots(seq, num_new + num_spec):
                out.spec_token_ids[seq.seq_id] = drafts
                num_new += num_spec
            elif not self._allocate_or_preempt(seq, num_new, out):
                break  # seq was the newest and stepped back itself; nothing runs after it
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
            i += 1
        return budget

    def _num_lookahead_slots(self, seq: Sequence, num_new: int, budget: int) -> int:
        """How many of `seq`'s draft tokens it may verify this step: 0 unless it decodes a known
        token; never past the budget, and never more than leave room for the bonus token within
        max_model_len and max_tokens (k verified drafts add up to k + 1 tokens)."""
        if not seq.spec_token_ids or num_new != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
            return 0
        room = self.max_model_len - seq.num_tokens - 1
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return max(0, min(len(seq.spec_token_ids), budget - 1, room))

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the last running sequences until `seq` gets its blocks; False if `seq` itself went.

        Victims are always after `seq` in `running`, so nothing already scheduled this step is touched.
        """
        while not self.block_manager.allocate_slots(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _ends_with_placeholder(self, seq: Sequence) -> bool:
        """An in-flight token that reaches max_tokens or max_model_len: never schedule past it
        (check_fits sized the cache for exactly that many tokens)."""
        if not seq.num_output_placeholders:
            return False
        max_tokens = seq.sampling_params.max_tokens
        return (seq.num_tokens_with_placeholders >= self.max_model_len
                or (max_tokens is not None and seq.num_output_tokens + seq.num_output_placeholders >= max_tokens))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)  # its full blocks stay in the prefix cache, so recompute may hit
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(seq)  # fcfs: popped newest-first, so older victims end up in front

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Sequence] = []  # siblings waiting for their source's prompt; keep their place
        while self.waiting and budget > 0:
            seq = self.waiting.peek_request()
            if seq.num_output_placeholders or self._waits_for_prefix_source(seq) or self._waits_for_lora(seq):
                # A placeholder: preempted while its last step was in flight; back once processed.
                skipped.append(self.waiting.pop_request())
                continue
            num_new = self._admit(seq, budget) if len(self.running) < self.max_num_seqs else 0
            if num_new == 0:
                num_new, budget = self._admit_by_preempting(seq, out, budget)
            if num_new == 0:
                break  # no slot or no blocks: in queue order, later requests don't jump it
            self.waiting.pop_request()
            self.waiting.insert_running(self.running, seq)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
            if out.preempted:
                break  # room was made for `seq` alone
        self.waiting.prepend_requests(skipped)

    def _admit_by_preempting(self, seq: Sequence, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        """Preempt the last running sequences while the policy lets waiting `seq` preempt them
        (priority: strictly lower priority; fcfs: never) until `seq` is admitted.

        Returns (tokens scheduled for `seq`, 0 if it still does not fit; the budget, with the
        tokens of victims scheduled earlier this step given back: they no longer run in it).
        """
        while self.running and self.waiting.preempts(seq, self.running[-1]):
            victim = self.running.pop()
            if victim in out.seqs:
                i = out.seqs.index(victim)
                del out.seqs[i]
                budget += out.num_scheduled_tokens.pop(i)
            self._preempt(victim)
            out.preempted.append(victim)
            num_new = self._admit(seq, budget) if len(self.running) < self.max_num_seqs else 0
            if num_new:
                return num_new, budget
        return 0, budget

    def _waits_for_lora(self, seq: Sequence) -> bool:
        """Its adapter is not running and max_loras others are."""
        if self.max_loras is None or not seq.lora_int_id:
            return False
        running = {s.lora_int_id for s in self.running if s.lora_int_id}
        return seq.lora_int_id not in running and len(running) >= self.max_loras

    @staticmethod
    def _live_prefix_source(seq: Sequence) -> Sequence | None:
        """The running sibling whose prompt blocks an n > 1 sequence may share, if any.
        A preempted or finished source (or a sequence that already has output) means: go alone."""
        src = seq.prefix_source
        if src is None or src is seq or seq.num_output_tokens or src.status is not SequenceStatus.RUNNING:
            return None
        return src

    def _waits_for_prefix_source(self, seq: Sequence) -> bool:
        src = self._live_prefix_source(seq)
        return src is not None and src.num_computed_tokens < src.num_prompt_tokens

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take blocks for `seq`'s first chunk (reusing a sibling's prompt or the prefix cache);
        returns the number of tokens scheduled, 0 (and no change) if the blocks don't fit."""
        bm, src = self.block_manager, self._live_prefix_source(seq)
        num_cached = 0
        shared = src is not None  # and its prompt is computed: _waits_for_prefix_source said so
        if shared:
            bm.share_prefix(src, seq)
        elif not seq.num_missing_prompt_logprobs:
            # Cached positions have no hidden states to take prompt logprobs from, so, as vLLM
            # does, a request still missing some computes its whole prompt (its blocks are still
            # cached for others).
            num_cached = bm.get_computed_blocks(seq)
        num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, _chunk_limit(seq, budget))
        if not bm.allocate_slots(seq, num_new, num_computed_from_cache=num_cached):
            if shared:
                bm.free(seq)
                seq.num_computed_tokens = 0
            return 0
        seq.status = SequenceStatus.RUNNING
        if seq.num_preemptions == 0:  # report what the prompt reused, not what a recompute got back
            seq.num_cached_tokens = seq.num_computed_tokens
        return num_new

    # -- after the model ran -------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Sequence]:
        """Advance each scheduled sequence, append sampled tokens, finish what must stop.

        Returns the sequences that got new tokens (`num_new_tokens` says how many), finished
        ones included. A sequence preempted after this step was scheduled still gets its token
        (it is recomputed with it); one that finished meanwhile (stop, abort) has it discarded.
        With draft tokens, the accepted ones come first, then the sampled one; tokens after one
        that stops the sequence (EOS, a stop token, max_tokens) are dropped.
        """
        flags = scheduler_output.sample_flags
        sampled = runner_output.sampled_token_ids
        assert len(sampled) == sum(flags), (len(sampled), sum(flags))
        spec, num_accepted = scheduler_output.spec_token_ids, runner_output.num_accepted_tokens
        updated: list[Sequence] = []
        k = 0  # index into the sampled rows
        for seq, samples in zip(scheduler_output.seqs, flags):
            k += samples
            if seq.is_finished:
                continue  # aborted or stopped while the step ran: its token is dropped
            stop = None
            if samples:
                seq.num_output_placeholders -= 1
                drafts = spec.get(seq.seq_id) if spec else None
                new_token_ids = [sampled[k - 1]]
                if drafts:
                    new_token_ids = self._rollback_rejected(seq, drafts, num_accepted[k - 1]) + new_token_ids
                stop = self._append_tokens(seq, new_token_ids)  # (the engine records the logprobs itself)
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq)
            if stop is not None:
                self.finish_seq(seq, *stop)
            if samples:
                updated.append(seq)
        return updated

    def _rollback_rejected(self, seq: Sequence, drafts: list[int], num_accepted: int) -> list[int]:
        """Forget the KV slots of the drafts after the first `num_accepted` (the step wrote them,
        but for tokens that are not the sequence's); returns the accepted drafts."""
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens -= len(drafts) - num_accepted
            self.block_manager.free_blocks_past(seq, seq.num_computed_tokens)
        return drafts[:num_accepted]

    def _append_tokens(self, seq: Sequence, token_ids: list[int]) -> tuple[str, int | None] | None:
        """Append until a token stops `seq`; returns (finish reason, stop reason) if one did."""
        seq.num_new_tokens = 0
        for token_id in token_ids:
            seq.append_token(token_id)
            seq.num_new_tokens += 1
            stop = self._stop_reason(seq)
            if stop is not None:
                return stop
        return None

    def _stop_reason(self, seq: Sequence) -> tuple[str, int | None] | None:
        """Whether the token just appended ends `seq`: ("stop", token) or ("length", None)."""
        sp, token_id = seq.sampling_params, seq.last_token_id
        if seq.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
            if token_id in sp.stop_token_ids:
                return "stop", token_id
        # min_tokens never outlasts the context: max_model_len always ends the sequence.
        if (sp.max_tokens is not None and seq.num_output_tokens >= sp.max_tokens) \
                or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None


def _chunk_limit(seq: Sequence, budget: int) -> int:
    """Tokens `seq` may take this step: the budget, or fewer while it is owed prompt logprobs."""
    return min(budget, MAX_PROMPT_LOGPROB_ROWS) if seq.num_missing_prompt_logprobs else budget
