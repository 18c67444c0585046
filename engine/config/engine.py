"""EngineConfig: the engine's knobs, as vLLM names them, and the one place "auto" is decided."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config.quantization import QUANTIZATION_METHODS, resolve_quantization
from engine.config.speculative import SpeculativeConfig
from engine.errors import check_int as _positive

if TYPE_CHECKING:
    from engine.config.model import ModelConfig


# The valid concrete values; each EngineConfig field also takes "auto".
DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names: getattr(torch, name)
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("triton", "torch")     # engine/layers/attention.py loads their kernels
# vLLM's names: "auto" = the model's dtype; "fp8" and "fp8_e4m3" = float8_e4m3fn, per-tensor scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's --scheduling-policy (engine/core/request_queue.py): arrival order, or each request's
# `priority` (lower first, arrival order within a level).
SCHEDULING_POLICIES = ("fcfs", "priority")
# Default KV-cache budget on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE default is 4 GiB).
# Pages are only touched when used, so an unused budget costs address space, not RAM.
DEFAULT_CPU_KV_CACHE_GB = 4.0
# Default host KV tier on CUDA (kv_offload_gb), the engine's total. Off until its CUDA copies (own
# stream, registered host memory) have run on a GPU (loadtest/gpu_session.sh kv-offload); then
# vLLM V0's swap_space default, 4 GiB per GPU. Off on CPU, where the KV cache is host memory already.
DEFAULT_CUDA_KV_OFFLOAD_GB = 0.0


@dataclass
class EngineConfig:
    """Engine knobs, as vLLM names them. `model` is a local directory (or a hub id resolved by the loader).

    Each field is also an arg of the Serve app under its name (serve_app/args.py reads them), so a
    new knob needs a type pydantic can parse from a string and its check in __post_init__.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    # None: the checkpoint's own (its quantization_config, or a GGUF's blocks); "fp8" / "int8" on an
    # unquantized checkpoint quantize its linear weights at load (engine/layers/quantization).
    quantization: str | None = None
    device: str = "auto"
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on CUDA, 2048 on CPU
    max_model_len: int | None = None            # None: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None            # None: from gpu_memory_utilization / cpu_kv_cache_gb
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = DEFAULT_CPU_KV_CACHE_GB
    # The host tier of the prefix cache (engine/core/kv_offload.py, docs/fleet.md): GiB of host memory,
    # the engine's total (split over TP ranks), holding blocks evicted from the device pool, which
    # come back on a hit instead of being recomputed. 0: off. None: DEFAULT_CUDA_KV_OFFLOAD_GB on
    # CUDA, 0 on CPU (and 0 where it cannot work: prefix caching off, sliding-window layers).
    kv_offload_gb: float | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    attention_backend: str = "auto"
    # "fp8": K/V cached as e4m3 with a scale per layer (the checkpoint's k_scale / v_scale, else 1.0),
    # half fp16's bytes per block, so twice the blocks fit the same budget.
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # "priority": requests carry a `priority` (lower runs first; docs/fleet.md), and a waiting
    # request may preempt a running one of lower priority. "fcfs" refuses a priority other than 0.
    scheduling_policy: str = "fcfs"
    # Overlapped scheduling: plan and launch step N+1 before step N's tokens are read back.
    # None: on for CUDA with tensor_parallel_size 1 (on CPU the forward is synchronous, so there
    # is nothing to overlap). True with tensor_parallel_size > 1 is refused.
    async_scheduling: bool | None = None
    # A reasoning model's parser (vLLM's --reasoning-parser: "qwen3", "deepseek_r1"; engine/reasoning):
    # a request's structured output then constrains only the answer, from the token after the thinking ends.
    reasoning_parser: str | None = None
    distributed_init_method: str | None = None  # "tcp://host:port" for TP workers; None picks a free local port
    worker_start_timeout_s: float = 120.0       # a TP worker not up by then fails start-up, naming its rank
    # Multi-LoRA (docs/lora.md): requests may name a PEFT adapter (LoRARequest). max_loras adapters
    # run in one step (slots on the device), each of rank <= max_lora_rank; max_cpu_loras are kept
    # in host memory, least recently used dropped (None: max_loras). On CUDA the deltas are Triton
    # kernels, captured in the decode graphs with the step's rows in static buffers.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (docs/spec_decode.md), vLLM's shape: {"method": "ngram" | "draft_model",
    # "num_speculative_tokens": k, "prompt_lookup_min"/"prompt_lookup_max" (n-gram), "model" (the
    # draft)}. A dict becomes a SpeculativeConfig here. Its steps run without overlapped scheduling
    # (the next proposals need this step's accepted tokens on the host). None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, ("auto",) + DTYPES)
        _choice("device", self.device, ("auto",) + DEVICES)
        _choice("attention_backend", self.attention_backend, ("auto",) + ATTENTION_BACKENDS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATION_METHODS)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("block_size", self.block_size)
        if self.block_size % 8 or self.block_size > 256:
            raise ValueError(f"block_size={self.block_size} is invalid: must be a multiple of 8 and <= 256")
        for name in ("max_num_batched_tokens", "max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} is invalid: must be in (0, 1]")
        if not self.worker_start_timeout_s > 0:
            raise ValueError(f"worker_start_timeout_s={self.worker_start_timeout_s} is invalid: must be > 0")
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"cpu_kv_cache_gb={self.cpu_kv_cache_gb} is invalid: must be > 0")
        if self.kv_offload_gb is not None and not self.kv_offload_gb >= 0:
            raise ValueError(f"kv_offload_gb={self.kv_offload_gb} is invalid: must be >= 0 (0: off)")
        if self.kv_offload_gb and not self.enable_prefix_caching:
            raise ValueError(f"kv_offload_gb={self.kv_offload_gb} needs enable_prefix_caching=True: the host "
                             "tier keeps prefix-cache blocks by their hashes")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} is invalid: choose True, False or None")
        if self.reasoning_parser is not None:
            _check_reasoning_parser(self.reasoning_parser)
        _check_lora(self)
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(f"async_scheduling=True is not supported with tensor_parallel_size="
                             f"{self.tensor_parallel_size} (TP workers replay host-side inputs)")

    def resolve(self, model_config: ModelConfig) -> EngineConfig:
        """A copy with every "auto" and None default decided for this machine and model.

        The one place they are decided: LLMEngine calls it once, and the executors, TP workers,
        model runner and attention layers read only its result (device "cpu" / "cuda", a name
        in DTYPES, a name in ATTENTION_BACKENDS), so no two stages can decide differently.
        Raises ValueError for device="cuda" without CUDA and for max_model_len over the model's.
        """
        device = _resolve_device(self.device)
        on_cuda = device == "cuda"
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{model_config.max_position_embeddings}")
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            async_scheduling = on_cuda and self.tensor_parallel_size == 1
        if on_cuda and self.kv_cache_dtype != "auto":
            _check_fp8_kv_cache(self.kv_cache_dtype)
        kv_offload_gb = _resolve_kv_offload_gb(self.kv_offload_gb, on_cuda, self.enable_prefix_caching, model_config)
        quantization = resolve_quantization(self.quantization, model_config.quantization, _is_gguf(self.model))
        if quantization is not None:
            _check_quantization_config(quantization, model_config)
        return dataclasses.replace(
            self, device=device, quantization=quantization, dtype=_resolve_dtype(self.dtype, on_cuda, model_config.torch_dtype),
            attention_backend=_resolve_attention_backend(self.attention_backend, on_cuda),
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens or (8192 if on_cuda else 2048),
            async_scheduling=async_scheduling, kv_offload_gb=kv_offload_gb)

    @property
    def is_resolved(self) -> bool:
        """Whether every value `resolve` decides is concrete (stages check it before reading them)."""
        return ("auto" not in (self.device, self.dtype, self.attention_backend)
                and None not in (self.max_model_len, self.max_num_batched_tokens, self.async_scheduling,
                                 self.kv_offload_gb))


def _resolve_device(device: str) -> str:
    import torch  # here, not at the top: the HTTP tier imports this module without torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available on this machine")
    return device


def _check_fp8_kv_cache(kv_cache_dtype: str) -> None:
    """Triton converts to and from e4m3 only from sm_89 (Ada, Hopper) on: refuse older GPUs at
    start, naming the knob, rather than failing in the first kernel compile."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability >= 8.9 "
                         f"(Ada, Hopper); this one is {major}.{minor}")


def _resolve_kv_offload_gb(kv_offload_gb: float | None, on_cuda: bool, enable_prefix_caching: bool,
                           model_config: ModelConfig) -> float:
    """The host tier's size; ValueError naming the combination if one was asked for a model with
    sliding-window layers (their blocks are freed behind the window, never needed again)."""
    sliding = "sliding_attention" in (model_config.layer_types or ())
    if kv_offload_gb is None:
        return DEFAULT_CUDA_KV_OFFLOAD_GB if on_cuda and enable_prefix_caching and not sliding else 0.0
    if kv_offload_gb and sliding:
        raise ValueError(f"kv_offload_gb={kv_offload_gb} is not supported with sliding-window attention "
                         f"({model_config.architecture} has sliding layers); set kv_offload_gb=0")
    return kv_offload_gb


def _is_gguf(model: str) -> bool:
    """Whether `model` names a GGUF: a .gguf file, a directory holding one, or a GGUF's HF view.
    Local paths only (a hub id is never a GGUF here: the hub download takes no .gguf)."""
    from pathlib import Path

    from engine.loader.gguf_config import find_gguf, gguf_source  # torch-free

    path = Path(model).expanduser()
    try:
        return find_gguf(path) is not None or (path.is_dir() and gguf_source(path) is not None)
    except (OSError, ValueError):  # several .gguf files: resolve_model_path names that first
        return False


def _check_quantization_config(method: str, model_config: ModelConfig) -> None:
    """Read the checkpoint's quantization_config once here, so what the layers cannot run (a bit
    width, a group size, a scheme) fails at start, before workers spawn, naming it."""
    from engine.layers.quantization import get_quantization_config  # torch: only when quantized

    get_quantization_config(method, model_config.hf_config.get("quantization_config"))


def _resolve_dtype(dtype: str, on_cuda: bool, checkpoint_dtype: str) -> str:
    if dtype != "auto":
        return dtype
    if not on_cuda:
        # fp32: bf16 matmuls are slower than fp32 on hosts without BF16 instructions; with them
        # (AVX512-BF16, AMX) bf16 is the faster dtype here too, but a default chosen by CPU flags
        # would change every CPU run's numerics (docs/quantization.md, "Speed").
        return "float32"
    # On GPU: the checkpoint's half type if it has one, else bf16.
    return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"


def _resolve_attention_backend(backend: str, on_cuda: bool) -> str:
    if backend != "auto":
        return backend  # "triton" on CPU runs under TRITON_INTERPRET=1 (tests only)
    return "triton" if on_cuda else "torch"  # "torch": the CPU path (kernels/cpu_attention.py)


def _check_reasoning_parser(name: Any) -> None:
    from engine.reasoning import get_reasoning_parser  # torch-free, like this module

    try:
        get_reasoning_parser(name)
    except (ValueError, TypeError) as e:
        raise ValueError(f"reasoning_parser={name!r} is invalid: {e}") from None


def _check_lora(c: EngineConfig) -> None:
    _positive("max_loras", c.max_loras)
    _positive("max_lora_rank", c.max_lora_rank)
    if c.max_cpu_loras is not None:
        _positive("max_cpu_loras", c.max_cpu_loras)
        if c.max_cpu_loras < c.max_loras:
            raise ValueError(f"max_cpu_loras={c.max_cpu_loras} is invalid: must be >= max_loras={c.max_loras} "
                             f"(every adapter in a slot is also in the host cache)")


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is invalid: choose one of {choices}")
