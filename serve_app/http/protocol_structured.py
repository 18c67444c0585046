"""Structured output and token-level controls, as OpenAI and vLLM clients send them, on both routes.

    response_format      OpenAI: text | json_object | json_schema; vLLM adds structural_tag
    structured_outputs   vLLM: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...}
    guided_json, guided_regex, guided_choice, guided_grammar, structural_tag
                         vLLM's older names for the same
    logit_bias           OpenAI: {"<token id>": bias in [-100, 100]}
    allowed_token_ids, bad_words   vLLM

At most one structured form per request (a tool_choice that forces a call counts as one: the
call's grammar); each becomes the engine's StructuredOutputsParams. `source` remembers which field
it came from, so that an error the engine raises about `structured_outputs.<form>` names the field
the client sent. JSON forms go through the guardrail (the whole schema validated, retries, 422).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from engine.errors import InvalidRequestError
from engine.sampling_params import STRUCTURED_OUTPUT_FORMS, StructuredOutputsParams
from serve_app.http.protocol_base import StrictModel, Unsupported, check_token_ids

MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "structural_tag": "structural_tag"}
GRAMMAR_BACKENDS = ("xgrammar", "auto")  # the one backend there is, and vLLM's word for "the server's"


class JsonSchemaSpec(StrictModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced whole (grammar, then guardrail)

    model_config = {**StrictModel.model_config, "populate_by_name": True}


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    # structural_tag (vLLM): {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, or {"format": {...}}
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format: json_schema does not go with type {self.type!r}")
        tag_fields = [n for n in ("structures", "triggers", "format") if getattr(self, n) is not None]
        if self.type != "structural_tag" and tag_fields:
            raise ValueError(f"response_format: {tag_fields[0]} goes with type 'structural_tag' only")
        return self

    def form(self) -> dict[str, Any] | None:
        """StructuredOutputsParams' keyword for this format; None for text."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.json_schema}
        if self.type == "structural_tag":
            return {"structural_tag": self.model_dump(include={"type", "structures", "triggers", "format"},
                                                      exclude_none=True)}
        return None


class StructuredOutputsField(StrictModel):
    """vLLM's `structured_outputs` request field: exactly one form."""

    UNSUPPORTED = {
        "whitespace_pattern": Unsupported("grammars write no free whitespace"),
        "disable_any_whitespace": Unsupported("grammars never allow free whitespace", (True,)),
        "disable_additional_properties": Unsupported(
            "JSON grammars are strict: properties beyond the schema's only where it allows them", (True,)),
        "backend": Unsupported("xgrammar is the only backend", GRAMMAR_BACKENDS),
        "disable_fallback": Unsupported("there is no fallback backend", (True, False)),
    }

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    @model_validator(mode="after")
    def _one_form(self):
        if len(self.form()) != 1:
            raise ValueError(f"needs exactly one of {', '.join(STRUCTURED_OUTPUT_FORMS)}; got "
                             f"{', '.join(self.form()) or 'none'}")
        return self

    def form(self) -> dict[str, Any]:
        values = self.model_dump(by_alias=True, exclude_none=True)
        return {k: v for k, v in values.items() if not (k == "json_object" and not v)}


@dataclass(frozen=True)
class StructuredChoice:
    """The request's one structured-output form and the field it came from."""

    params: StructuredOutputsParams
    source: str  # the request field: "response_format", "guided_regex", "structured_outputs", "tools", ...

    @property
    def is_json(self) -> bool:
        """JSON forms are validated whole by the guardrail."""
        return self.params.form in ("json", "json_object")


class StructuredFields(StrictModel):
    """The structured-output and token-control fields, shared by both routes."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    guided_decoding_backend: str | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None

    @field_validator("guided_decoding_backend")
    @classmethod
    def _check_backend(cls, v: str | None) -> str | None:
        if v is not None and v not in GRAMMAR_BACKENDS:
            raise ValueError(f"{v!r} is not available: xgrammar is the only backend ('xgrammar' or 'auto')")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not token.isascii() or not token.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {token} is {bias}: must be in [-100, 100]")
        return v

    _check_allowed_token_ids = field_validator("allowed_token_ids")(check_token_ids)

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not w.strip() for w in v):
            raise ValueError("bad words must not be empty")
        return v

    @model_validator(mode="after")
    def _one_form(self):
        sources = self._form_sources()
        if len(sources) > 1:
            raise ValueError(f"{sources[1][0]}: a request takes one structured-output form; got "
                             f"{' and '.join(s for s, _ in sources)}")
        return self

    def _form_sources(self) -> list[tuple[str, dict[str, Any]]]:
        """(field, StructuredOutputsParams keyword) for every form the request sets."""
        sources = []
        if self.response_format is not None and (form := self.response_format.form()) is not None:
            sources.append(("response_format", form))
        if self.structured_outputs is not None:
            sources.append(("structured_outputs", self.structured_outputs.form()))
        for name, form in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                sources.append((name, {form: getattr(self, name)}))
        return sources

    def structured_choice(self) -> StructuredChoice | None:
        """The one form as the engine's params (a shape error raises InvalidRequestError naming
        `structured_outputs.<form>`, which the caller renames after `source`)."""
        sources = self._form_sources()
        if not sources:
            return None
        source, form = sources[0]
        return StructuredChoice(structured_params(form, source), source)

    @property
    def structured_source(self) -> str | None:
        """The field the structured-output form came in (what an error about it names)."""
        sources = self._form_sources()
        return sources[0][0] if sources else None

    @property
    def json_mode(self) -> bool:
        """The output is one JSON document the guardrail validates."""
        return any(("json" in form or "json_object" in form) for _, form in self._form_sources())

    def token_controls(self) -> dict[str, Any]:
        """SamplingParams' keywords for the token-level controls that are set."""
        controls: dict[str, Any] = {}
        if self.logit_bias:
            controls["logit_bias"] = {int(t): b for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            controls["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.bad_words:
            controls["bad_words"] = list(self.bad_words)
        return controls


def structured_params(form: dict[str, Any], source: str) -> StructuredOutputsParams:
    """StructuredOutputsParams(**form); its shape errors name `source`, the field the client sent."""
    try:
        return StructuredOutputsParams(**form)
    except InvalidRequestError as e:
        param = engine_param_for(e.param, source)
        message = str(e).replace(e.param, param, 1) if e.param and param else str(e)
        raise InvalidRequestError(message, param=param) from None


def engine_param_for(param: str | None, source: str | None) -> str | None:
    """The request field an engine error's `structured_outputs[.form]` param stands for."""
    if param is None or source is None or source == "structured_outputs":
        return param
    if param == "structured_outputs" or param.startswith("structured_outputs."):
        return source
    return param
