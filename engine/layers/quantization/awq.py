"""AWQ checkpoints (AutoAWQ's GEMM layout): 4-bit weights with a zero point per group of inputs.

Per linear layer, for a logical weight W [N out, K in] and G = K / group_size:

    qweight [K, N / 8] int32   eight outputs' codes per word, in AWQ's interleaved nibble order
    qzeros  [G, N / 8] int32   the zero points, packed the same way
    scales  [G, N]     fp16    W[n, k] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n]

AWQ_ORDER: the output (of the word's 8) held by nibble i; AutoAWQ packs outputs 0, 2, 4, 6, 1, 3,
5, 7 into nibbles 0..7 so its CUDA kernel can unpack pairs with one shift. At load the codes are
repacked along K into the layout GPTQ already has (int4_common), and both run one kernel.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.quantization.base import LinearMethodBase, QuantizationConfig, new_param
from engine.layers.quantization.int4_common import (Int4LinearMethod, check_choice, check_layer_dims, pack_rows,
                                                    replace_params, unpack_cols)

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# The nibble holding output i of a word: the inverse of AWQ_ORDER.
AWQ_NIBBLE_OF_OUTPUT = [AWQ_ORDER.index(i) for i in range(8)]
GROUP_SIZES = (32, 64, 128)


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, ignored: list[str] | None = None):
        super().__init__(ignored)
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        # Other keys (backend, do_fuse, ...) steer HF's own kernels, not the stored weights.
        check_choice("awq", config, "bits", (4,), config.get("w_bit"))
        group_size = check_choice("awq", config, "group_size", GROUP_SIZES, config.get("q_group_size"))
        check_choice("awq", config, "zero_point", (True,), True)
        version = config.get("version", "gemm")  # AutoAWQ writes "GEMM"
        check_choice("awq", {"version": version.lower() if isinstance(version, str) else version}, "version",
                     ("gemm",))
        return cls(group_size, config.get("modules_to_not_convert"))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        check_layer_dims("awq", layer, prefix, self.group_size)
        return AWQLinearMethod(self.group_size)


class AWQLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: nn.Module) -> None:
        k, n, g = layer.input_size, layer.output_size, self.group_size
        out_packed = dict(output_dim=1, input_dim=0, output_block=(8, 1))
        layer.register_parameter("qweight", new_param((k, n // 8), torch.int32, **out_packed))
        layer.register_parameter("qzeros", new_param((k // g, n // 8), torch.int32, **out_packed, input_block=(g, 1)))
        layer.register_parameter("scales", new_param((k // g, n), torch.float16, output_dim=1, input_dim=0,
                                                     input_block=(g, 1)))

    def to_shared_layout(self, layer: nn.Module) -> None:
        codes = unpack_cols(layer.qweight.data, AWQ_NIBBLE_OF_OUTPUT)  # [K, N] in output order
        zeros = unpack_cols(layer.qzeros.data, AWQ_NIBBLE_OF_OUTPUT).to(torch.uint8)  # [G, N]
        g_idx = torch.arange(layer.input_size, dtype=torch.int32, device=codes.device) // self.group_size
        replace_params(layer, ("qweight", "qzeros", "scales"), qweight=pack_rows(codes), scales=layer.scales.data,
                       zeros=zeros, g_idx=g_idx)
