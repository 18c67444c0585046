"""`LLM`: vLLM's offline, synchronous entry point."""
from __future__ import annotations

import itertools
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """`LLM(model=..., **engine_knobs)`; `generate(prompts, sampling_params)` returns outputs in input order."""

    def __init__(self, model: str, **kwargs: Any):
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _broadcast_params(sampling_params, len(prompts))
        engine = self.llm_engine
        # Validate every prompt before adding any, so a bad one leaves nothing half-queued.
        states = [engine.make_request(str(next(self._counter)), p, _final_only(sp))
                  for p, sp in zip(prompts, params)]
        for state in states:
            engine.add_request_state(state)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(states), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for state in states:  # leave the engine clean for the next call
                    engine.abort_request(state.request_id)
                raise
        return [finished[s.request_id] for s in states]


def _broadcast_params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one or one per prompt")
    return params


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    p = params.clone()
    p.output_kind = RequestOutputKind.FINAL_ONLY
    return p
