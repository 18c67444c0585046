"""Multi-LoRA: many fine-tunes of one base model served together (docs/lora.md).

    request.py        LoRARequest, the public handle of an adapter
    peft_adapter.py   a PEFT adapter on disk, read and checked (torch-free: runs on request arrival)
    worker_manager.py the adapters of one rank: a host LRU cache and the layers' slots
and engine/layers/lora.py, the slots of one linear layer and their per-step delta.
"""
from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
