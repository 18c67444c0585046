"""EngineConfig: validation at construction, and `resolve`, the one place "auto" and the None
defaults become the device, dtype, attention backend and limits every stage reads."""
import subprocess
import sys

import pytest
import torch

from engine.config import ATTENTION_BACKENDS, DEVICES, DTYPES, EngineConfig, ModelConfig


def model_config(torch_dtype: str = "float32", max_position_embeddings: int = 4096) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                       torch_dtype=torch_dtype, max_position_embeddings=max_position_embeddings)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as far as resolve knows


def test_auto_without_cuda_resolves_to_cpu_float32_torch(no_cuda):
    resolved = EngineConfig(model="m").resolve(model_config(torch_dtype="bfloat16"))
    assert (resolved.device, resolved.dtype, resolved.attention_backend) == ("cpu", "float32", "torch")
    assert resolved.max_model_len == 4096 and resolved.max_num_batched_tokens == 2048
    assert resolved.async_scheduling is False and resolved.is_resolved


@pytest.mark.parametrize("checkpoint_dtype, expected", [("float16", "float16"), ("bfloat16", "bfloat16"),
                                                        ("float32", "bfloat16")])
def test_auto_with_cuda_resolves_to_cuda_half_triton(with_cuda, checkpoint_dtype, expected):
    resolved = EngineConfig(model="m").resolve(model_config(torch_dtype=checkpoint_dtype))
    assert (resolved.device, resolved.dtype, resolved.attention_backend) == ("cuda", expected, "triton")
    assert resolved.max_num_batched_tokens == 8192 and resolved.async_scheduling is True


def test_async_scheduling_stays_off_with_tensor_parallel_on_cuda(with_cuda):
    assert EngineConfig(model="m", tensor_parallel_size=2).resolve(model_config()).async_scheduling is False


def test_explicit_values_are_kept(with_cuda):
    """device='cpu' on a GPU host stays on the CPU (and so picks the CPU backend), and explicit
    values win over every rule, including Triton on the CPU (interpreted, for tests)."""
    resolved = EngineConfig(model="m", device="cpu").resolve(model_config())
    assert (resolved.device, resolved.dtype, resolved.attention_backend) == ("cpu", "float32", "torch")
    resolved = EngineConfig(model="m", device="cpu", dtype="bfloat16", attention_backend="triton",
                            max_model_len=100, max_num_batched_tokens=64, async_scheduling=True).resolve(model_config())
    assert (resolved.device, resolved.dtype, resolved.attention_backend) == ("cpu", "bfloat16", "triton")
    assert (resolved.max_model_len, resolved.max_num_batched_tokens, resolved.async_scheduling) == (100, 64, True)


def test_resolve_returns_a_copy_and_is_idempotent(no_cuda):
    config = EngineConfig(model="m")
    resolved = config.resolve(model_config())
    assert config.device == "auto" and not config.is_resolved  # the user's config is untouched
    assert resolved.resolve(model_config()) == resolved


def test_cuda_requested_without_cuda_names_the_device(no_cuda):
    with pytest.raises(ValueError, match="device='cuda' was requested but CUDA is not available"):
        EngineConfig(model="m", device="cuda").resolve(model_config())


def test_max_model_len_over_the_model_is_refused(no_cuda):
    with pytest.raises(ValueError, match="max_model_len=8192 exceeds the model's max_position_embeddings=4096"):
        EngineConfig(model="m", max_model_len=8192).resolve(model_config())


@pytest.mark.parametrize("field, value", [("attention_backend", "flash"), ("device", "tpu"), ("dtype", "float64")])
def test_bad_choice_is_refused_at_construction_naming_field_and_choices(field, value):
    with pytest.raises(ValueError, match=rf"{field}='{value}' is invalid: choose one of \('auto', "):
        EngineConfig(model="m", **{field: value})


def test_valid_values_are_one_list_each():
    """What the constructor accepts is "auto" plus the resolvable values, nothing else."""
    for field, values in (("device", DEVICES), ("dtype", DTYPES), ("attention_backend", ATTENTION_BACKENDS)):
        for value in ("auto",) + values:
            EngineConfig(model="m", **{field: value})


def test_unsupported_architecture_is_refused_from_the_registry():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, "):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "num_attention_heads": 4})


def test_importing_the_config_does_not_import_torch():
    """The HTTP tier builds EngineConfigs (serve_app/args.py) and must not need torch."""
    code = "import sys, engine.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
