"""The LoRA adapters of one engine replica, as Serve's model multiplexing sees them.

    caller: handle.options(multiplexed_model_id="sql@3")      (stream_from: EngineRequest.multiplexed_model_id)
       -> Serve's router prefers a replica that reported "sql@3" (routing.py for BatchAffinityRouter)
       -> generate(): ReplicaAdapters.ensure_loaded(lora) -> @serve.multiplexed loader on a miss

A load checks the adapter on this replica (its files, then what the engine checks when a request
names it: engine/lora/peft_adapter.py) and counts it in `rayllm_lora_adapter_loads{lora_name}`;
the engine itself reads the weights into its host cache when a step first runs the adapter. Serve
keeps the `max_num_models_per_replica` most recently used ids (the engine's max_cpu_loras) and
reports them to every caller's router, so repeat requests go where the adapter is. The request's
own LoRARequest, sent by the Ingress, is what the engine runs: a replica keeps no registry.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from ray import serve

from engine.lora.request import LoRARequest
from serve_app.http.messages import adapter_model_id
from serve_app.lora.adapters import check_adapter


class ReplicaAdapters:
    def __init__(self, llm, max_adapters: int, count_load: Callable[[str], None]):
        """llm: the replica's AsyncLLM; max_adapters: Serve's max_num_models_per_replica; count_load(name)."""
        self._llm = llm
        self._count_load = count_load
        # model id -> [adapter, requests waiting for its load]: the loader gets only the id from Serve,
        # so the adapter is kept here while a request that named it waits.
        self._waiting: dict[str, list] = {}
        self._load = serve.multiplexed(max_num_models_per_replica=max_adapters)(self._loader())

    async def ensure_loaded(self, lora: LoRARequest) -> None:
        """Return once the adapter is among this replica's (loaded now on a miss); ValueError saying
        why the engine cannot run it."""
        model_id = adapter_model_id(lora)
        entry = self._waiting.setdefault(model_id, [lora, 0])
        entry[1] += 1
        try:
            await self._load(model_id)
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._waiting[model_id]

    async def check(self, lora: LoRARequest) -> str | None:
        """Why the engine cannot run `lora` (files, rank, modules, shapes), or None. Off the event loop:
        it reads the adapter's config and safetensors header."""
        cfg = self._llm.engine_config
        if not cfg.enable_lora:
            return f"LoRA adapter {lora.lora_name!r}: LoRA is off in this engine (enable_lora)"
        try:
            await asyncio.to_thread(check_adapter, lora, cfg.max_lora_rank, self._llm.model_config)
        except ValueError as e:
            return str(e)
        return None

    def _loader(self):
        """The @serve.multiplexed load function: a plain function of the model id (Serve keeps its cache
        on the function object), made per replica because the cache's size is an app arg."""

        async def load_lora_adapter(model_id: str) -> LoRARequest:
            lora = self._waiting[model_id][0]  # a request for it is waiting: ensure_loaded put it there
            problem = await self.check(lora)
            if problem is not None:
                raise ValueError(problem)
            self._count_load(lora.lora_name)
            return lora

        return load_lora_adapter
