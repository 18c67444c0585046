"""Turn a micro-batch of requests into token ids: chat templates rendered and prompts tokenized in one call each.

This is the work the Ingress micro-batches: a fast tokenizer encodes a list of texts in
one Rust call (in parallel), so per-request Python and FFI overhead is paid once per
batch. Pure functions of (tokenizer, jobs): tested without Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jinja2 import TemplateError

from serve_app.http.errors import OpenAIError, bad_request


@dataclass
class ModelLimits:
    """What the Ingress checks before a request reaches an engine (the engine checks again)."""

    max_model_len: int
    vocab_size: int


@dataclass
class PrepJob:
    """One HTTP request's prompt work. Exactly one of `prompts` / `messages` is set."""

    max_tokens: int | None                       # to check prompt + completion against max_model_len
    prompts: list[str | list[int]] | None = None  # completions: texts or token id lists
    messages: list[dict] | None = None            # chat: [{"role", "content"}], rendered with the template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    submit_time: float = 0.0                     # time.monotonic() when it entered the micro-batch queue


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
    """Chat template for every chat job; one call per (add_generation_prompt, continue) flag pair."""
    groups: dict[tuple[bool, bool], list[int]] = {}
    for i, job in enumerate(jobs):
        if job.messages is not None:
            groups.setdefault((job.add_generation_prompt, job.continue_final_message), []).append(i)
    rendered: dict[int, str] = {}
    for (gen, cont), idx in groups.items():
        try:
            texts = _apply_template(tokenizer, [jobs[i].messages for i in idx], gen, cont)
            rendered.update(zip(idx, texts))
        except (TemplateError, ValueError, TypeError):
            for i in idx:  # isolate the conversation(s) the template refuses
                try:
                    rendered[i] = _apply_template(tokenizer, [jobs[i].messages], gen, cont)[0]
                except (TemplateError, ValueError, TypeError) as e:
                    results[i] = bad_request(f"The chat template cannot render these messages: {e}",
                                             param="messages")
    return rendered


def _apply_template(tokenizer, conversations, add_generation_prompt: bool, continue_final_message: bool):
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model has no chat template; use /v1/completions")
    out = tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message)
    return [out] if isinstance(out, str) else list(out)


def _collect_texts(jobs, rendered, results) -> tuple[dict[bool, list[str]], dict[tuple[int, int], tuple[bool, int]]]:
    """Every text to encode, grouped by add_special_tokens (prompts: yes; rendered chats: the template has them)."""
    texts: dict[bool, list[str]] = {True: [], False: []}
    owners: dict[tuple[int, int], tuple[bool, int]] = {}  # (job, prompt) -> (group, position)
    for i, job in enumerate(jobs):
        if results[i] is not None:
            continue
        if job.messages is not None:
            owners[(i, 0)] = (False, len(texts[False]))
            texts[False].append(rendered[i])
            continue
        for j, p in enumerate(job.prompts or ()):
            if isinstance(p, str):
                if not p:
                    results[i] = bad_request("The prompt is empty.", param="prompt")
                    break
                owners[(i, j)] = (True, len(texts[True]))
                texts[True].append(p)
    return texts, owners


def _encode(tokenizer, texts: dict[bool, list[str]]) -> dict[bool, list[list[int]]]:
    out = {}
    for special, group in texts.items():
        out[special] = tokenizer(group, add_special_tokens=special)["input_ids"] if group else []
    return out


def _assemble(job: PrepJob, rendered: str | None, encoded, owners, i: int, limits: ModelLimits):
    prepared = Prepared()
    if job.messages is not None:
        special, pos = owners[(i, 0)]
        prepared.prompt_token_ids.append(list(encoded[special][pos]))
        prepared.prompt_texts.append(rendered)
    else:
        for j, p in enumerate(job.prompts or ()):
            if isinstance(p, str):
                special, pos = owners[(i, j)]
                prepared.prompt_token_ids.append(list(encoded[special][pos]))
                prepared.prompt_texts.append(p)
            else:
                prepared.prompt_token_ids.append(list(p))
                prepared.prompt_texts.append(None)
    error = check_prompts(prepared.prompt_token_ids, job.max_tokens, limits, chat=job.messages is not None)
    return error or prepared


def check_prompts(prompts: list[list[int]], max_tokens: int | None, limits: ModelLimits,
                  chat: bool = False) -> OpenAIError | None:
    """Empty prompt, token id out of vocabulary, prompt + completion longer than the model: a 400 each."""
    param = "messages" if chat else "prompt"
    for ids in prompts:
        if not ids:
            return bad_request("The prompt is empty (0 tokens).", param=param)
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            return bad_request(f"Token id {bad} is out of vocabulary (vocab_size={limits.vocab_size}).",
                               param=param)
        asked = len(ids) + (max_tokens or 1)
        if asked > limits.max_model_len:
            where = "messages" if chat else "prompt"
            return bad_request(
                f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
                f"{asked} tokens ({len(ids)} in the {where}, {max_tokens or 1} in the completion). "
                f"Please reduce the length of the {where} or completion.",
                param="max_tokens" if max_tokens and len(ids) < limits.max_model_len else param,
                code="context_length_exceeded")
    return None
