"""Tensor-parallel primitives: the process group and the two collectives the layers use.

One engine is one torch.distributed world, so the TP group is the default group:
rank r of `tp_size` holds a 1/tp_size slice of every sharded weight. When
torch.distributed is not initialized the engine runs as rank 0 of 1 and every
collective is a no-op, so single-process code never pays for (or needs) a group.
Worker processes that call `init_tp_group` are started elsewhere.

`unsharded()` makes this thread see a world of one for a while: a draft model (speculative
decoding) is built and run whole on rank 0 beside a sharded target, as vLLM's draft TP of 1.
"""
from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from engine.config import DEVICES, EngineConfig


def init_tp_group(rank: int, world_size: int, init_method: str, backend: str | None = None,
                  timeout: timedelta | None = None) -> None:
    """Join the TP group. `init_method` ("tcp://host:port") comes from the caller, never a fixed port.

    backend: None picks NCCL when CUDA is available, else gloo. With NCCL the
    process binds to GPU `rank % device_count`, so each rank owns one device.
    timeout: how long the rendezvous and each collective may wait for the other ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid: must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is invalid for world_size={world_size}")
    if not init_method:
        raise ValueError("init_method is required, e.g. 'tcp://127.0.0.1:29500'")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: another "
                           "tensor-parallel engine is still alive here. Shut it down first "
                           "(llm.shutdown(), or build it with `with LLM(...) as llm:`)")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs)


def init_group(rank: int, config: EngineConfig) -> None:
    # The engine's device picks the backend, not the machine: device="cpu" on a host with
    # GPUs still needs gloo (NCCL cannot reduce CPU tensors). The config is resolved
    # (EngineConfig.resolve), so its device is "cpu" or "cuda", never "auto".
    assert config.device in DEVICES, f"init_group needs a resolved config, got device={config.device!r}"
    backend = "nccl" if config.device == "cuda" else "gloo"
    init_tp_group(rank, config.tensor_parallel_size, config.distributed_init_method, backend=backend,
                  timeout=timedelta(seconds=config.worker_start_timeout_s))


def destroy_tp_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_thread = threading.local()


@contextlib.contextmanager
def unsharded() -> Iterator[None]:
    """Inside, in this thread only: rank 0 of 1, every collective a no-op. Layers read the rank and
    size when built and the collectives at each call, so a model built and run inside holds and
    computes every weight here, whatever the TP group outside."""
    before = getattr(_thread, "unsharded", False)
    _thread.unsharded = True
    try:
        yield
    finally:
        _thread.unsharded = before


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized() and not getattr(_thread, "unsharded", False)


def get_tp_rank() -> int:
    return dist.get_rank() if _in_group() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if _in_group() else 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place; returns `x`."""
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order: [..., d, ...] -> [..., d * tp_size, ...]."""
    tp_size = get_tp_size()
    if tp_size == 1:
        return x
    x = x.contiguous()  # gloo and NCCL send whole buffers
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
