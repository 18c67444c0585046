"""Turn a micro-batch of requests into token ids: chat templates rendered and prompts tokenized in one call each.

This is the work the Ingress micro-batches: a fast tokenizer encodes a list of texts in
one Rust call (in parallel), so per-request Python and FFI overhead is paid once per
batch. The rules (templates, special tokens, checks) are engine.entrypoints.prompts', shared
with engine.LLM.chat and the batch jobs; here each request's problem becomes its own 400.
Pure functions of (tokenizer, jobs): tested without Ray.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.entrypoints.prompts import ModelLimits, check_prompt, encode, has_chat_template, render_chats
from engine.errors import InvalidRequestError
from serve_app.http.errors import OpenAIError, bad_request

__all__ = ["ModelLimits", "PrepJob", "Prepared", "check_prompts", "prepare_batch"]  # ModelLimits: the shared one


@dataclass
class PrepJob:
    """One HTTP request's prompt work. Exactly one of `prompts` / `messages` is set."""

    max_tokens: int | None                       # to check prompt + completion against max_model_len
    prompts: list[str | list[int]] | None = None  # completions: texts or token id lists
    messages: list[dict] | None = None            # chat: [{"role", "content"}], rendered with the template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None               # chat: OpenAI function tools, for the template
    chat_template_kwargs: dict | None = None      # chat: template variables (enable_thinking, ...)
    adapter: str | None = None                    # the LoRA adapter it runs with: a batch is routed per adapter
    submit_time: float = 0.0                     # time.monotonic() when it entered the micro-batch queue

    def template_key(self) -> tuple:
        """Jobs with equal keys render in one template call (same flags, tools and variables)."""
        return (self.add_generation_prompt, self.continue_final_message,
                _canonical(self.tools), _canonical(self.chat_template_kwargs))


def _canonical(value) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass
class Prepared:
    """The token ids (and text, when known) of each of a job's prompts, in order."""

    prompt_token_ids: list[list[int]] = field(default_factory=list)
    prompt_texts: list[str | None] = field(default_factory=list)
    batch_id: str | None = None  # set by the Ingress when the job shared a micro-batch (routing affinity)


def prepare_batch(tokenizer, jobs: list[PrepJob], limits: ModelLimits) -> list[Prepared | OpenAIError]:
    """One result per job, in order: its token ids, or the 400 for that job alone."""
    results: list[Prepared | OpenAIError | None] = [None] * len(jobs)
    rendered = _render_chats(tokenizer, jobs, results)
    texts, owners = _collect_texts(jobs, rendered, results)
    encoded = _encode(tokenizer, texts)
    return [_assemble(job, rendered.get(i), encoded, owners, i, limits) if results[i] is None else results[i]
            for i, job in enumerate(jobs)]


def _render_chats(tokenizer, jobs, results) -> dict[int, str]:
    """Chat template for every chat job; one call per group of jobs with the same template_key."""
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        if job.messages is not None:
            groups.setdefault(job.template_key(), []).append(i)
    rendered: dict[int, str] = {}
    for idx in groups.values():
        first = jobs[idx[0]]
        texts = render_chats(tokenizer, [jobs[i].messages for i in idx],
                             add_generation_prompt=first.add_generation_prompt,
                             continue_final_message=first.continue_final_message, tools=first.tools,
                             chat_template_kwargs=first.chat_template_kwargs)
        for i, text in zip(idx, texts):
            if isinstance(text, InvalidRequestError):
                results[i] = _template_refused(text, tokenizer)
            else:
                rendered[i] = text
    return rendered


def _template_refused(error: InvalidRequestError, tokenizer) -> OpenAIError:
    reason = str(error) if has_chat_template(tokenizer) else "the model has no chat template; use /v1/completions"
    return bad_request(f"The chat template cannot render these messages: {reason}", param=error.param or "messages")


def _collect_texts(jobs, rendered, results) -> tuple[dict[bool, list[str]], dict[tuple[int, int], tuple[bool, int]]]:
    """Every text to encode, grouped by whether it is a rendered chat (the special-token rule differs)."""
    texts: dict[bool, list[str]] = {False: [], True: []}
    owners: dict[tuple[int, int], tuple[bool, int]] = {}  # (job, prompt) -> (chat, position in its group)
    for i, job in enumerate(jobs):
        if results[i] is not None:
            continue
        if job.messages is not None:
            owners[(i, 0)] = (True, len(texts[True]))
            texts[True].append(rendered[i])
            continue
        for j, p in enumerate(job.prompts or ()):
            if isinstance(p, str):
                if not p:
                    results[i] = bad_request("The prompt is empty.", param="prompt")
                    break
                owners[(i, j)] = (False, len(texts[False]))
                texts[False].append(p)
    return texts, owners


def _encode(tokenizer, texts: dict[bool, list[str]]) -> dict[bool, list[list[int]]]:
    return {chat: encode(tokenizer, group, chat=chat) for chat, group in texts.items()}


def _assemble(job: PrepJob, rendered: str | None, encoded, owners, i: int, limits: ModelLimits):
    prepared = Prepared()
    if job.messages is not None:
        chat, pos = owners[(i, 0)]
        prepared.prompt_token_ids.append(encoded[chat][pos])
        prepared.prompt_texts.append(rendered)
    else:
        for j, p in enumerate(job.prompts or ()):
            if isinstance(p, str):
                chat, pos = owners[(i, j)]
                prepared.prompt_token_ids.append(encoded[chat][pos])
                prepared.prompt_texts.append(p)
            else:
                prepared.prompt_token_ids.append(list(p))
                prepared.prompt_texts.append(None)
    error = check_prompts(prepared.prompt_token_ids, job.max_tokens, limits, chat=job.messages is not None)
    return error or prepared


def check_prompts(prompts: list[list[int]], max_tokens: int | None, limits: ModelLimits,
                  chat: bool = False) -> OpenAIError | None:
    """Empty prompt, token id out of vocabulary, prompt + completion longer than the model: a 400 each."""
    try:
        for ids in prompts:
            check_prompt(ids, max_tokens, limits, param="messages" if chat else "prompt")
    except InvalidRequestError as e:
        return bad_request(str(e), param=e.param, code=e.code)
    return None
