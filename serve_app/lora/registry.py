"""`LoRARegistry`: the adapters a server answers to, each name with its `LoRARequest`. Pure: no I/O.

One id must always mean one adapter (the engine keys its slots, host cache and prefix-cache
hashes by `lora_int_id`), on every replica. So:

    lora_modules (the app args)   ids 1..N in the order given: every Ingress replica, built from the
                                  same args, holds the same table
    loaded at run time            the next id after every id handed out so far, never reused: an
                                  adapter unloaded and loaded again (maybe from another path, maybe
                                  with new weights) is a new adapter to every engine cache

The Ingress holds the registry and sends each request's `LoRARequest` (name, id, path) with it,
so engine replicas need no table of their own: they load what a request names, lazily.
"""
from __future__ import annotations

from engine.lora.request import LoRARequest


class AdapterNotFoundError(LookupError):
    """No adapter of that name."""


class LoRARegistry:
    def __init__(self, base_model: str, lora_modules: dict[str, str]):
        """base_model: the served name of the base model, which no adapter may take."""
        self.base_model = base_model
        self._adapters: dict[str, LoRARequest] = {}
        self._last_id = 0
        for name, path in lora_modules.items():
            self.add(self.new_adapter(name, path))

    def resolve(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model."""
        if model == self.base_model:
            return None
        lora = self._adapters.get(model)
        if lora is None:
            raise AdapterNotFoundError(model)
        return lora

    def new_adapter(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest under a fresh id for `name` (not registered yet: `add` does that once it
        checks out). ValueError if the name is taken."""
        self.check_name(name)
        self._last_id += 1
        return LoRARequest(name, self._last_id, path)

    def add(self, lora: LoRARequest) -> None:
        self.check_name(lora.lora_name)  # again: another load may have taken it meanwhile
        self._adapters[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest:
        """Unregister `name` (requests already running with it finish); AdapterNotFoundError if unknown."""
        lora = self._adapters.pop(name, None)
        if lora is None:
            raise AdapterNotFoundError(name)
        return lora

    def adapters(self) -> list[LoRARequest]:
        """In the order they were added."""
        return list(self._adapters.values())

    def check_name(self, name: str) -> None:
        """ValueError unless `name` is free for a new adapter."""
        if not name:
            raise ValueError("lora_name must be a non-empty string")
        if name == self.base_model:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if name in self._adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
