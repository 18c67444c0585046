"""gpt-oss's MXFP4 checkpoints: the experts are dequantized at load (engine/loader/mxfp4.py) and
every linear layer is stored unquantized in the checkpoint (its `modules_to_not_convert`)."""
from __future__ import annotations

from typing import Any

from torch import nn

from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod

_KEYS = ("quant_method", "modules_to_not_convert")  # what the hub's MXFP4 configs hold


class Mxfp4Config(QuantizationConfig):
    name = "mxfp4"
    handles_experts = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Mxfp4Config":
        extra = sorted(set(config) - set(_KEYS))
        if extra:
            raise ValueError(f"quantization_config keys {extra} are not supported for quant_method='mxfp4'")
        return cls(config.get("modules_to_not_convert"))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return UnquantizedLinearMethod()  # only the experts are MXFP4, and those load dequantized
