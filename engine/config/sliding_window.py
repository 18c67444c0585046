"""Which layers attend through a sliding window, as HF's model for each family builds them, from
either config form; checked at start."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config.model import ModelConfig

LAYER_TYPES = ("full_attention", "sliding_attention")
# The architectures whose model passes each layer's window to its attention (the Llama graph,
# engine/models/llama.py, and Gemma's); any other with a sliding layer is refused by name.
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                               "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")
# Those that slide only with use_sliding_window (default off), and those whose HF model gives
# every layer the window whatever layer_types says.
_QWEN_WINDOW_ARCHS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_EVERY_LAYER_SLIDES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM")


def read_layer_types(hf: dict[str, Any], arch: str, num_layers: int) -> list[str] | None:
    """Each layer's "full_attention" / "sliding_attention" as HF's model builds them; None when
    no layer slides. transformers 5 writes `layer_types`; older configs only the keys each
    family reads: Mistral's `sliding_window` (every layer; null: none), Qwen2's
    `use_sliding_window` with `max_window_layers` (layers from that index on slide), Gemma 2's
    alternation (even layers slide), Gemma 3's `sliding_window_pattern` (every Nth layer full)."""
    if hf.get("sliding_window") is None:
        return None
    if arch in _QWEN_WINDOW_ARCHS and not hf.get("use_sliding_window", False):
        return None
    first_full = hf.get("max_window_layers", 28)
    if arch in _EVERY_LAYER_SLIDES:
        slides = [True] * num_layers
    elif hf.get("layer_types") is not None:
        return list(hf["layer_types"]) if "sliding_attention" in hf["layer_types"] else None
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        slides = [i >= first_full for i in range(num_layers)]
    elif arch == "Qwen2MoeForCausalLM":
        slides = [i % 2 == 0 and i < first_full for i in range(num_layers)]
    elif arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        slides = [i % 2 == 0 for i in range(num_layers)]
    elif arch.startswith("Gemma3"):
        slides = [(i + 1) % hf.get("sliding_window_pattern", 6) != 0 for i in range(num_layers)]
    else:  # Llama and the rest: HF's model has no window
        return None
    return [LAYER_TYPES[s] for s in slides] if any(slides) else None


def checked_sliding_window(config: ModelConfig) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types), validated; (None, None) when no layer slides over less than
    the whole context (max_position_embeddings): such a window never masks a key."""
    window, types = config.sliding_window, config.layer_types
    if types is None:
        if window is not None:
            raise ValueError(f"sliding_window={window} needs layer_types (which layers slide)")
        return None, None
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries; expected num_hidden_layers="
                         f"{config.num_hidden_layers}")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
    if "sliding_attention" not in types:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} is invalid: sliding_attention layers need an int >= 1")
    if window >= config.max_position_embeddings:
        return None, None
    if config.architecture not in SLIDING_WINDOW_ARCHITECTURES:
        raise ValueError(f"sliding_window={window} is not supported for {config.architecture} "
                         f"(sliding-window attention runs on {', '.join(SLIDING_WINDOW_ARCHITECTURES)})")
    return window, list(types)
