"""`LoRARequest`: which adapter a request runs with, as vLLM names it. No torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter, named for logs by `lora_name` and identified by `lora_int_id` (>= 1, unique per
    adapter: the engine's slots, host cache and prefix-cache hashes are keyed by it, as in vLLM).
    `lora_path`: a directory holding PEFT's `adapter_config.json` and `adapter_model.safetensors`."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} is invalid: must be an integer >= 1 "
                             f"(0 is the base model)")
        if not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} is invalid: must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r} is invalid: must name the adapter's directory")
