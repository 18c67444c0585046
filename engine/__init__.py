"""Our inference engine: continuous batching over a paged KV cache, with vLLM's public surface.

    from engine import LLM, SamplingParams
"""
from engine.config import EngineConfig, ModelConfig
from engine.lora.request import LoRARequest
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "AsyncLLM", "CompletionOutput", "EngineConfig", "LLM", "LLMEngine", "Logprob", "LoRARequest", "ModelConfig",
    "RequestOutput", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams",
]


def __getattr__(name: str):
    # Lazy: `import engine` (e.g. for SamplingParams in the HTTP layer) must not load torch models.
    if name == "LLM":
        from engine.entrypoints.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from engine.entrypoints.async_llm import AsyncLLM
        return AsyncLLM
    if name == "LLMEngine":
        from engine.core.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
