"""`LLM`: vLLM's offline, synchronous entry point."""
from __future__ import annotations

import itertools
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine, PromptType
from engine.entrypoints.prompts import encode, has_chat_template, render_chats
from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """`LLM(model=..., **engine_knobs)`; `generate(prompts, sampling_params)` returns outputs in input order.

    Lifecycle: `llm.shutdown()`, or `with LLM(...) as llm:`, stops the TP worker processes and
    leaves the process group, so another engine (TP or not) can start in this process. An
    engine that is simply dropped is shut down when it is garbage collected (best effort).
    """

    def __init__(self, model: str, **kwargs: Any):
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = itertools.count()
        self._closed = False

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop worker processes and release the process group; idempotent."""
        self._closed = True
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`): True once done, False while a
        request is unfinished. Benchmarks call it between rounds of the same prompts."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or a list with one (or None) per prompt (docs/lora.md).
        priority: one per prompt, as vLLM's (lower runs first); needs scheduling_policy="priority"."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down; build a new one")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _broadcast_params(sampling_params, len(prompts))
        loras = _broadcast_loras(lora_request, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; pass one per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        engine = self.llm_engine
        # Validate every prompt before adding any, so a bad one leaves nothing half-queued.
        states = [engine.make_request(str(next(self._counter)), p, _final_only(sp), lora_request=lr, priority=pr)
                  for p, sp, lr, pr in zip(prompts, params, loras, priorities)]
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

    def chat(self, messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered with the checkpoint's chat template (or `chat_template`), then generated as `generate`
        does; one output per conversation, in order. `tools` (OpenAI function tools) and
        `chat_template_kwargs` (e.g. {"enable_thinking": False}) reach the template, as in vLLM;
        `lora_request` as for `generate`."""
        conversations = _as_conversations(messages)
        tokenizer = self.get_tokenizer()
        if not has_chat_template(tokenizer, chat_template):
            raise ValueError("the model has no chat template; pass chat_template= or use generate()")
        texts = render_chats(tokenizer, conversations, add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message, chat_template=chat_template,
                             tools=tools, chat_template_kwargs=chat_template_kwargs)
        for i, text in enumerate(texts):
            if isinstance(text, InvalidRequestError):
                raise InvalidRequestError(f"messages[{i}]: the chat template cannot render it: {text}",
                                          param=text.param) from text.__cause__
        # The special-token rule (engine/entrypoints/prompts.py): the template wrote the special
        # tokens (a BOS among them), so none are added; the server's chat route does the same.
        token_ids = encode(tokenizer, texts, chat=True)
        prompts = [{"prompt": text, "prompt_token_ids": ids} for text, ids in zip(texts, token_ids)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _as_conversations(messages) -> list[list[dict[str, Any]]]:
    """One conversation, or a list of them, as a list; an empty one is refused."""
    conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    if not conversations or not all(conversations):
        raise ValueError("messages must be a non-empty conversation or a list of non-empty conversations")
    return conversations


def _broadcast_params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one or one per prompt")
    return params


def _broadcast_loras(lora_request, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_requests for {n} prompts; pass one or one per prompt")
    return loras


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    p = params.clone()
    p.output_kind = RequestOutputKind.FINAL_ONLY
    return p
