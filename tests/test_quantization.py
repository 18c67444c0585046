"""The quantization framework: methods resolved at start, ignore lists, and the one loader sharding
any packed parameter by the layout its method recorded (engine/layers/quantization/base.py)."""
from __future__ import annotations

import pytest
import torch

import engine.layers.linear as linear
from engine.config.quantization import checkpoint_quantization, resolve_quantization
from engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                  RowParallelLinear)
from engine.layers.quantization import (LinearMethodBase, QuantizationConfig, checkpoint_prefixes,
                                        new_param, quantize_linear_layers, quantized_build)


class Packed8(LinearMethodBase):
    """AWQ's shape of packing: 8 output features per int32 column; a per-part scalar per fused part."""

    def create_weights(self, layer):
        layer.register_parameter("qweight", new_param((layer.input_size, layer.output_size // 8), torch.int32,
                                                      output_dim=1, input_dim=0, output_block=(8, 1)))
        layer.register_parameter("scales", new_param((layer.input_size // 4, layer.output_size), torch.float32,
                                                     output_dim=1, input_dim=0, input_block=(4, 1)))
        parts = 3 if isinstance(layer, QKVParallelLinear) else 1
        layer.register_parameter("part_scale", new_param((parts,), torch.float32, per_shard=True))


def _on_rank(monkeypatch, rank: int, size: int):
    monkeypatch.setattr(linear, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(linear, "get_tp_size", lambda: size)


def _build(cls, *args):
    with quantized_build():
        layer = cls(*args)
    assert layer.quant_method is None and not hasattr(layer, "weight")
    layer.set_quant_method(Packed8())
    return layer


@pytest.mark.parametrize("rank", [0, 1])
def test_column_parallel_shards_packed_columns_in_whole_packs(monkeypatch, rank):
    _on_rank(monkeypatch, rank, 2)
    layer = _build(ColumnParallelLinear, 16, 64)
    full = torch.arange(16 * 8, dtype=torch.int32).reshape(16, 8)  # 64 outputs = 8 packed columns
    layer.qweight.weight_loader(layer.qweight, full)
    assert torch.equal(layer.qweight, full[:, rank * 4:(rank + 1) * 4])
    scales = torch.randn(4, 64)
    layer.scales.weight_loader(layer.scales, scales)
    assert torch.equal(layer.scales, scales[:, rank * 32:(rank + 1) * 32])


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_shards_input_groups(monkeypatch, rank):
    _on_rank(monkeypatch, rank, 2)
    layer = _build(RowParallelLinear, 32, 16)
    scales = torch.randn(8, 16)  # 32 inputs in groups of 4
    layer.scales.weight_loader(layer.scales, scales)
    assert torch.equal(layer.scales, scales[rank * 4:(rank + 1) * 4])
    qweight = torch.randint(0, 99, (32, 2), dtype=torch.int32)
    layer.qweight.weight_loader(layer.qweight, qweight)
    assert torch.equal(layer.qweight, qweight[rank * 16:(rank + 1) * 16])


def test_qkv_parts_land_in_their_packed_columns_and_per_part_slots(monkeypatch):
    _on_rank(monkeypatch, 1, 2)
    layer = _build(QKVParallelLinear, 16, 16, 4, 2)  # rank 1: q 32 outputs, k and v 16 each
    q = torch.arange(16 * 8, dtype=torch.int32).reshape(16, 8)
    k = -torch.arange(16 * 4, dtype=torch.int32).reshape(16, 4)
    for shard_id, t in (("q", q), ("k", k)):
        layer.qweight.weight_loader(layer.qweight, t, shard_id)
        layer.part_scale.weight_loader(layer.part_scale, torch.tensor(2.0 if shard_id == "q" else 3.0), shard_id)
    assert torch.equal(layer.qweight[:, :4], q[:, 4:])     # this rank's second half of q's packed columns
    assert torch.equal(layer.qweight[:, 4:6], k[:, 2:])
    assert layer.part_scale[:2].tolist() == [2.0, 3.0]


def test_fused_checkpoint_tensor_splits_along_packed_rows(monkeypatch):
    _on_rank(monkeypatch, 0, 1)
    layer = _build(MergedColumnParallelLinear, 16, [16, 32])
    fused = torch.arange(16 * 6, dtype=torch.int32).reshape(16, 6)  # [gate | up] = 2 + 4 packed columns
    layer.qweight.weight_loader(layer.qweight, fused)
    assert torch.equal(layer.qweight, fused)


def test_a_shard_off_the_packing_fails_naming_it(monkeypatch):
    _on_rank(monkeypatch, 1, 2)
    layer = _build(RowParallelLinear, 24, 16)  # 12 inputs a rank, groups of 8 would straddle
    layer.register_parameter("zeros", new_param((3, 16), torch.float32, input_dim=0, input_block=(8, 1)))
    with pytest.raises(ValueError, match="does not fall on whole quantization blocks of 8"):
        layer.weight_loader(layer.zeros, torch.zeros(3, 16))


class _Ignoring(QuantizationConfig):
    name = "test"

    def get_linear_method(self, layer, prefix):
        return Packed8()


class _Tiny(torch.nn.Module):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                              "v_proj": ("qkv_proj", "v"), "block_sparse_moe": ("mlp", None)}

    def __init__(self):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(16, 8, 2, 2)
        self.o_proj = RowParallelLinear(16, 16)


def test_ignore_list_by_checkpoint_names(monkeypatch):
    _on_rank(monkeypatch, 0, 1)
    with quantized_build():
        model = _Tiny()
    quantize_linear_layers(model, _Ignoring(ignored=["o_proj"]))
    assert hasattr(model.qkv_proj, "qweight") and model.o_proj.weight.shape == (16, 16)
    with quantized_build():
        model = _Tiny()
    with pytest.raises(ValueError, match="quantized differently"):
        quantize_linear_layers(model, _Ignoring(ignored=["re:.*k_proj"]))
    assert checkpoint_prefixes(model, "layers.0.mlp.gate") == ["layers.0.block_sparse_moe.gate"]
    assert checkpoint_prefixes(model, "qkv_proj") == ["q_proj", "k_proj", "v_proj"]


def test_unquantized_layers_are_built_as_before():
    layer = ColumnParallelLinear(8, 4, bias=True)
    assert layer.weight.shape == (4, 8) and layer.bias.shape == (4,)
    layer.weight.weight_loader(layer.weight, torch.ones(4, 8))
    assert torch.equal(layer(torch.ones(1, 8)), torch.full((1, 4), 8.0) + layer.bias)


def test_methods_resolved_by_name():
    assert checkpoint_quantization({}) is None
    with pytest.raises(ValueError, match="quant_method='bitsandbytes' is not supported"):
        checkpoint_quantization({"quantization_config": {"quant_method": "bitsandbytes"}})
    assert resolve_quantization(None, "awq", False) == "awq"
    assert resolve_quantization("int8", None, False) == "int8"
    assert resolve_quantization(None, None, True) == "gguf"
    with pytest.raises(ValueError, match="does not match the checkpoint, which is 'awq'"):
        resolve_quantization("fp8", "awq", False)
    with pytest.raises(ValueError, match="cannot be applied to an unquantized checkpoint"):
        resolve_quantization("gptq", None, False)
