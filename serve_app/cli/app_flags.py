"""`rayllm serve`'s flags, derived from `AppArgs` (serve_app/args.py): one flag per field, named after
it (`max_num_seqs` -> `--max-num-seqs`), its default and type shown, its help taken from the field's
description or the comment beside it in the class that declares it. A knob added to the engine or
the app is a flag with no edit here.

Values stay strings until `AppArgs` validates them, as in a Serve config's `args`: pydantic's lax
mode turns "8" into 8 and "true" into True. `none`/`null` is None where a field allows it; a dict or
list field takes JSON (`--guardrails '{"max_depth": 8}'`).
"""
from __future__ import annotations

import argparse
import functools
import inspect
import io
import json
import re
import tokenize
import types
import typing
from typing import Any

from pydantic.fields import FieldInfo

# Fields that are not flags: `model` is the positional MODEL.
POSITIONAL = ("model",)
# Fields whose flag takes one or more words, as vLLM's `--lora-modules sql=/a/sql chat=/a/chat`
# (each word `name=path` or a JSON object); the field's validator reads the list.
MULTI_WORD = ("lora_modules",)


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_app_flags(parser: argparse.ArgumentParser, model: type) -> None:
    """One flag per field of the pydantic `model`; an unset flag leaves the field to its default."""
    group = parser.add_argument_group("application args (serve_app/args.py; docs/serving.md, \"App args\")")
    comments = _field_comments(model)
    for name, info in model.model_fields.items():
        if name in POSITIONAL:
            continue
        kwargs: dict[str, Any] = {"dest": f"app_{name}", "default": None, "metavar": _metavar(info),
                                  "help": _help(name, info, comments)}
        if _is_bool(info.annotation):
            kwargs.update(nargs="?", const="true")  # `--flag` alone is `--flag true`
        elif name in MULTI_WORD:
            kwargs.update(nargs="+", metavar="NAME=PATH")
        group.add_argument(flag_name(name), **kwargs)


def app_args_from(ns: argparse.Namespace, model: type) -> dict[str, Any]:
    """The `args` dict of the fields given on the command line (the rest keep their defaults)."""
    args = {}
    for name, info in model.model_fields.items():
        value = getattr(ns, f"app_{name}", None)
        if value is not None:
            args[name] = parse_value(name, value, info)
    return args


def parse_value(name: str, text: str | list[str], info: FieldInfo) -> Any:
    """A flag's text as the value AppArgs validates: None, JSON for containers, else the string; a
    MULTI_WORD flag's words as they are."""
    if isinstance(text, list):
        return text
    if text.lower() in ("none", "null") and _allows_none(info.annotation):
        return None
    if _is_container(info.annotation):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag_name(name)}: expected JSON, got {text!r} ({e.msg})") from None
    return text


def _help(name: str, info: FieldInfo, comments: dict[str, str]) -> str:
    text = info.description or comments.get(name, "")
    default = "(required)" if info.is_required() else _default_text(info)
    return f"{text} [default: {default}]".strip().replace("%", "%%")


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return json.dumps(info.default_factory())
    return "none" if info.default is None else str(info.default).lower() if isinstance(info.default, bool) \
        else str(info.default)


def _metavar(info: FieldInfo) -> str:
    ann = info.annotation
    if typing.get_origin(ann) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(ann))) + "}"
    if _is_bool(ann):
        return "true|false"
    if _is_container(ann):
        return "JSON"
    names = [a.__name__ for a in _members(ann) if a is not type(None) and hasattr(a, "__name__")]
    return (names[0] if len(names) == 1 else "VALUE").upper()


def _members(ann) -> tuple:
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return typing.get_args(ann)
    return (ann,)


def _allows_none(ann) -> bool:
    return type(None) in _members(ann)


def _is_bool(ann) -> bool:
    return bool in _members(ann)


def _is_container(ann) -> bool:
    return any((typing.get_origin(a) or a) in (dict, list, tuple) for a in _members(ann))


@functools.lru_cache(maxsize=None)
def _field_comments(model: type) -> dict[str, str]:
    """`name -> comment` for the fields of `model` and every class it was built from (pydantic models
    and the dataclasses they copy, e.g. EngineConfig): the comment at the end of the field's line,
    else the comment lines right above it."""
    comments: dict[str, str] = {}
    for cls in _declaring_classes(model):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        for name, text in _comments_in(source).items():
            comments.setdefault(name, text)
    return comments


def _declaring_classes(model: type) -> list[type]:
    import serve_app.args as app_args  # the classes AppArgs copies its fields from
    from engine.config import EngineConfig

    return [c for c in model.__mro__ if c.__module__ not in ("builtins", "pydantic.main")] + [
        EngineConfig, app_args.BatchingConfig, app_args.StreamingConfig]


_FIELD = re.compile(r"^\s+([a-z_][a-z0-9_]*)\s*:")


def _comments_in(source: str) -> dict[str, str]:
    lines = source.splitlines()
    trailing = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][:tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("# ")
    found, block = {}, []
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("# "))
            continue
        match = _FIELD.match(line)
        if match and match.group(1) not in found:
            text = trailing.get(number) or " ".join(b for b in block if not b.startswith("--"))
            if text:
                found[match.group(1)] = text
        block = []
    return found
