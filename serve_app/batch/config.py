"""`BatchConfig`: what a batch job runs, as plain values validated once.

No I/O here: `from_files` (the CLI's path) is the one place that reads a template or schema file.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import DEVICES, EngineConfig
from engine.errors import check_int
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from serve_app.lora.adapters import parse_lora_modules

_DEVICES = ("auto", *DEVICES)  # the engine's devices, plus "auto"
_MAX_CONCURRENT_BATCHES = 16  # bounds the actor's threads and the blocks it holds
# response_format {"type": FORM, FORM: value}: the value under the key vLLM's structured_outputs uses
_KEYED_FORMS = {"regex": "a Python regular expression", "choice": "a list of strings",
                "grammar": "an EBNF grammar with a root rule"}


@dataclass
class BatchConfig:
    model: str                              # checkpoint directory or hub id, as engine.LLM takes it
    prompt_column: str | None = None        # the prompt is this column's text ("prompt" when no template)
    template: str | None = None             # or: a Jinja template rendered with the row's columns
    chat: bool = False                      # wrap the prompt as a user message in the model's chat template
    id_column: str | None = None            # the row's id; None: its position in the input (0, 1, ...)
    max_tokens: int = 256
    temperature: float = 0.0                # greedy by default: a batch job should be reproducible
    top_p: float = 1.0
    seed: int | None = None                 # with temperature > 0: each row samples with a seed derived from (seed, id)
    response_format: dict | None = None     # a JSON Schema, an OpenAI response_format, or a regex / choice /
                                            # grammar / structural_tag form; see `structured_outputs`
    num_replicas: int = 1                   # engine actors (each holds one engine.LLM)
    tensor_parallel_size: int = 1           # GPUs per actor on CUDA
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 256                   # rows per engine call (and per shard)
    max_concurrent_batches: int | None = None  # batches in one engine at once; None: enough to keep it full
    max_batch_retries: int = 2              # a batch whose generation raises is retried on a fresh engine
    continue_on_error: bool = False         # a row the engine refuses is written with its error, not fatal
    cpu_threads: int | None = None          # torch threads of a CPU engine actor; None: every core it may use
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # more engine.LLM knobs (max_num_seqs, ...)
    loras: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> PEFT adapter directory (--lora)
    lora_column: str | None = None          # the row's adapter by name (null or "": the base model);
                                            # "lora" when loras are given

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} is invalid: must be a checkpoint directory or hub id")
        if self.template is not None and self.prompt_column is not None:
            raise ValueError("give either prompt_column or template, not both")
        if self.template is None and self.prompt_column is None:
            self.prompt_column = "prompt"
        self.loras = parse_lora_modules(self.loras, "--lora")
        if self.loras and self.lora_column is None:
            self.lora_column = "lora"
        if self.lora_column is not None and not self.loras:
            raise ValueError(f"lora_column={self.lora_column!r} names adapters, but no adapter is given "
                             "(--lora NAME=PATH)")
        if self.device not in _DEVICES:
            raise ValueError(f"device={self.device!r} is invalid: must be one of {_DEVICES}")
        for name in ("num_replicas", "tensor_parallel_size", "batch_size"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("max_batch_retries", self.max_batch_retries, minimum=0)
        if not isinstance(self.continue_on_error, bool):
            raise ValueError(f"continue_on_error={self.continue_on_error!r} is invalid: must be true or false")
        if self.cpu_threads is not None:
            check_int("cpu_threads", self.cpu_threads, minimum=1)
        if self.max_concurrent_batches is not None:
            check_int("max_concurrent_batches", self.max_concurrent_batches, minimum=1)
        if self.response_format is not None:
            # Refuse a bad response_format now, not in an actor; xgrammar (and torch) load only then.
            from engine.core.grammar_forms import check_form
            check_form(self.structured_outputs())
        self.sampling_params(0)  # SamplingParams' own checks on max_tokens, temperature, top_p, seed

    @classmethod
    def from_files(cls, template_file: str | None = None, response_format_file: str | None = None,
                   **kwargs: Any) -> BatchConfig:
        """The CLI's constructor: the template and the response format come from files."""
        if template_file is not None:
            kwargs["template"] = _read_text(template_file, "template")
        if response_format_file is not None:
            text = _read_text(response_format_file, "response format")
            try:
                kwargs["response_format"] = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"response format file {response_format_file} is not valid JSON: {e}") from None
        return cls(**kwargs)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The engine constraint of `response_format` (one JSON object; docs/batch.md):

            {"type": "json_schema", "json_schema": {"schema": {...}}}    OpenAI
            {"type": "json_object"}                                      OpenAI
            {"type": "regex", "regex": "..."}                            vLLM's structured_outputs keys
            {"type": "choice", "choice": ["...", ...]}
            {"type": "grammar", "grammar": "root ::= ..."}
            {"type": "structural_tag", "structures": [...], "triggers": [...]} or {..., "format": {...}}
            any other object: a JSON Schema
        """
        rf = self.response_format
        if rf is None:
            return None
        if not isinstance(rf, dict):
            raise ValueError(f"response_format must be a JSON object, got {type(rf).__name__}")
        kind = rf.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if schema is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            return StructuredOutputsParams(json=schema)
        if kind in _KEYED_FORMS:
            if kind not in rf:
                raise ValueError(f"response_format of type {kind} needs a {kind!r} key ({_KEYED_FORMS[kind]})")
            return StructuredOutputsParams(**{kind: rf[kind]})
        if kind == "structural_tag":
            return StructuredOutputsParams(structural_tag=rf)
        return StructuredOutputsParams(json=rf)

    def sampling_params(self, row_id: Any) -> SamplingParams:
        """The row's sampling parameters. The seed depends on the row's id, not on its batch or
        position, so a resumed job samples every row exactly as the first run would have."""
        seed = None if self.seed is None else row_seed(self.seed, row_id)
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=seed, structured_outputs=self.structured_outputs())

    def concurrent_batches(self) -> int:
        """Batches an engine actor works on at once. The default keeps the engine's running batch
        (max_num_seqs) full and one more batch queued behind it, so that the next batch's rows join
        as the current one's finish instead of the engine draining at each batch's end."""
        if self.max_concurrent_batches is not None:
            return self.max_concurrent_batches
        max_num_seqs = self.engine_kwargs.get("max_num_seqs", EngineConfig.max_num_seqs)
        return min(_MAX_CONCURRENT_BATCHES, -(-max_num_seqs // self.batch_size) + 1)

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.engine_kwargs, device=self.device, dtype=self.dtype,
                      tensor_parallel_size=self.tensor_parallel_size)
        if self.loras:
            kwargs.setdefault("enable_lora", True)
        return kwargs

    def max_lora_rank(self) -> int:
        return self.engine_kwargs.get("max_lora_rank", EngineConfig.max_lora_rank)


def row_seed(seed: int, row_id: Any) -> int:
    """63 bits of sha256("<seed>:<id>"): stable across runs and processes (Python's hash() is not)."""
    digest = hashlib.sha256(f"{seed}:{row_id!r}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _read_text(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the {what} file {path}: {e.strerror or e}") from None
