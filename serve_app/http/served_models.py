"""The models the Ingress answers to (vLLM's OpenAIServingModels): the base model under its served
name and the LoRA adapters of its registry (serve_app/lora/registry.py). It resolves a request's
`model`, lists the models (GET /v1/models) and loads and unloads adapters at run time
(POST /v1/load_lora_adapter, /v1/unload_lora_adapter: vLLM's routes, bodies and messages).

A runtime load is checked before the adapter is registered, so a request never meets a broken one:
the path (inside lora_adapter_dir, symlinks and `..` resolved), the directory's files here, then the
engine's checks on an engine replica (rank, modules, shapes against the base model). The Ingress and
the engine replicas must see the same files (one node, or shared storage), as for lora_modules.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import ValidationError

from engine.lora.request import LoRARequest
from serve_app.args import AppArgs
from serve_app.http.errors import OpenAIError, adapter_not_found, bad_request, from_validation_error, \
    model_not_found, overloaded
from serve_app.http.protocol_base import StrictModel, Unsupported
from serve_app.lora.adapters import check_adapter_dir, resolve_under
from serve_app.lora.registry import AdapterNotFoundError, LoRARegistry


class LoadLoRAAdapterRequest(StrictModel):
    UNSUPPORTED = {"load_inplace": Unsupported("a loaded name must be unloaded first", (False,))}
    lora_name: str
    lora_path: str  # absolute, or relative to lora_adapter_dir


class UnloadLoRAAdapterRequest(StrictModel):
    UNSUPPORTED = {"lora_int_id": Unsupported("adapters are unloaded by lora_name")}
    lora_name: str


class ServedModels:
    def __init__(self, args: AppArgs, engine):
        """engine: the Ingress's engine client (serve_app/replica/client.py), which checks adapters."""
        self.args = args
        self.engine = engine
        self.registry = LoRARegistry(args.model_name, args.lora_modules)
        self.created = int(time.time())

    def resolve(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 if neither."""
        try:
            return self.registry.resolve(model)
        except AdapterNotFoundError:
            raise model_not_found(model) from None

    def cards(self, max_model_len: int) -> list[dict[str, Any]]:
        """OpenAI model objects: the base model, then each adapter (parent: the base model, root: its path)."""
        base = self._card(self.args.model_name, self.args.model, None, max_model_len)
        return [base] + [self._card(lora.lora_name, lora.lora_path, self.args.model_name, max_model_len)
                         for lora in self.registry.adapters()]

    def card(self, model_id: str, max_model_len: int) -> dict[str, Any]:
        self.resolve(model_id)  # 404 for neither
        return next(c for c in self.cards(max_model_len) if c["id"] == model_id)

    def _card(self, model_id: str, root: str, parent: str | None, max_model_len: int) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "rayllm", "root": root,
                "parent": parent, "max_model_len": max_model_len}

    # -- runtime loading ----------------------------------------------------------------
    async def load(self, body: bytes) -> str:
        req = self._parse(body, LoadLoRAAdapterRequest)
        self._check_name(req.lora_name)
        try:
            path = resolve_under(req.lora_path, self.args.lora_adapter_dir)
            await asyncio.to_thread(check_adapter_dir, path)
        except ValueError as e:
            raise bad_request(str(e), param="lora_path") from None
        self._check_name(req.lora_name)  # again, after the wait
        lora = self.registry.new_adapter(req.lora_name, path)
        try:
            problem = await self.engine.check_lora(lora)
        except Exception as e:  # noqa: BLE001 - no engine to ask: a 503, not a 500
            raise overloaded(f"The engine is unavailable: {type(e).__name__}", self.args.retry_after_s) from e
        if problem is not None:
            raise bad_request(problem, param="lora_path")
        self._check_name(lora.lora_name)  # another load of the name may have won while this one was checked
        self.registry.add(lora)
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    async def unload(self, body: bytes) -> str:
        """Requests already running with the adapter finish; new ones naming it get 404."""
        req = self._parse(body, UnloadLoRAAdapterRequest)
        try:
            self.registry.remove(req.lora_name)
        except AdapterNotFoundError:
            raise adapter_not_found(req.lora_name) from None
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def _check_name(self, name: str) -> None:
        try:
            self.registry.check_name(name)
        except ValueError as e:
            raise bad_request(str(e), param="lora_name") from None

    def _parse(self, body: bytes, model_cls):
        if not self.args.allow_runtime_lora_updating:
            raise OpenAIError(404, "Loading and unloading LoRA adapters at run time is off (app arg "
                              "allow_runtime_lora_updating).", type="NotFoundError", code=404)
        try:
            return model_cls.model_validate_json(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
