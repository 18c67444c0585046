"""EngineConfig: validation at construction, and `resolve`, the one place "auto" and the None
defaults become the device, dtype, attention backend and limits every stage reads."""
import dataclasses
import subprocess
import sys

import pytest
import torch

from engine.config import ATTENTION_BACKENDS, DEFAULT_CUDA_KV_OFFLOAD_GB, DEVICES, DTYPES, EngineConfig, ModelConfig
from engine.config.sliding_window import read_layer_types


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


def test_enable_lora_keeps_cuda_graphs(with_cuda):
    """The adapters' kernels read the step's rows from static buffers, so LoRA keeps graphs on
    (docs/lora.md); enforce_eager still turns them off."""
    assert EngineConfig(model="m", enable_lora=True).resolve(model_config()).enforce_eager is False
    assert EngineConfig(model="m", enable_lora=True, enforce_eager=True).resolve(model_config()).enforce_eager is True


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


def test_speculative_config_takes_vllms_dict_and_fills_the_ngram_window():
    from engine.config import SpeculativeConfig

    c = EngineConfig(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert c.speculative_config == SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)
    only_max = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)  # vLLM's rule
    assert SpeculativeConfig(model="ngram", num_speculative_tokens=2).prompt_lookup_min == 5
    assert SpeculativeConfig(model="/ckpt/draft", num_speculative_tokens=3).method == "draft_model"


@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, r"speculative_config.method='medusa' is invalid"),
    ({"method": "ngram"}, r"speculative_config.num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"speculative_config.num_speculative_tokens=0 is invalid"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"speculative_config.prompt_lookup_min=4 is invalid: must be <= prompt_lookup_max=2"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config.model=None is invalid"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, r"speculative_config: unknown field\(s\) \['k'\]"),
    ("ngram", r"speculative_config='ngram' is invalid: pass a dict"),
])
def test_bad_speculative_config_names_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", speculative_config=spec)


def test_speculation_keeps_overlapped_scheduling_on_cuda(with_cuda):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert EngineConfig(model="m", speculative_config=spec).resolve(model_config()).async_scheduling is True
    assert EngineConfig(model="m", speculative_config=spec, async_scheduling=False).resolve(
        model_config()).async_scheduling is False


def test_unsupported_architecture_is_refused_from_the_registry():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, "):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "num_attention_heads": 4})


def test_importing_the_config_does_not_import_torch():
    """The HTTP tier builds EngineConfigs (serve_app/args.py) and must not need torch."""
    code = "import sys, engine.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- RoPE: both config forms, per-layer-type RoPE, partial rotary (engine.config.rope.read_rope) --

def _hf(**kw) -> dict:
    return dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=128, max_position_embeddings=4096, **kw)


def _rope_fields(config: ModelConfig) -> tuple:
    return (config.rope_theta, config.rope_scaling, config.rope_local, config.partial_rotary_factor,
            config.max_position_embeddings)


def test_rope_reads_alike_in_transformers_4_and_5_forms():
    yarn = {"factor": 4.0, "original_max_position_embeddings": 4096}
    v4 = ModelConfig.from_hf_dict(_hf(rope_theta=1e6, rope_scaling={"type": "yarn", **yarn}))
    v5 = ModelConfig.from_hf_dict(_hf(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, **yarn}))
    assert _rope_fields(v4) == _rope_fields(v5) == (1e6, {"rope_type": "yarn", **yarn}, None, 1.0, 16384)
    plain = ModelConfig.from_hf_dict(_hf(rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert _rope_fields(plain) == (5e5, None, None, 1.0, 4096)


def test_per_layer_type_rope_in_both_gemma3_forms():
    """Gemma 3: global layers linear-scaled on base 1e6, sliding layers plain on base 1e4."""
    v4 = ModelConfig.from_hf_dict(_hf(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                      rope_local_base_freq=10000.0))
    v5 = ModelConfig.from_hf_dict(_hf(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}))
    expected = (1e6, {"rope_type": "linear", "factor": 8.0}, {"rope_type": "default", "rope_theta": 10000.0}, 1.0, 4096)
    assert _rope_fields(v4) == _rope_fields(v5) == expected
    same = ModelConfig.from_hf_dict(_hf(rope_parameters={"full_attention": {"rope_theta": 1e4},
                                                         "sliding_attention": {"rope_theta": 1e4}}))
    assert (same.rope_theta, same.rope_scaling, same.rope_local) == (1e4, None, None)


def test_longrope_and_partial_rotary_as_phi3_configs_spell_them():
    factors = [1.0] * 6
    early = _hf(partial_rotary_factor=0.75, original_max_position_embeddings=1024,
                rope_scaling={"type": "su", "short_factor": factors, "long_factor": factors})
    config = ModelConfig.from_hf_dict(early)
    assert config.partial_rotary_factor == 0.75 and config.max_position_embeddings == 4096
    assert config.rope_scaling == {"rope_type": "longrope", "short_factor": factors, "long_factor": factors,
                                   "original_max_position_embeddings": 1024, "factor": 4.0}
    inside = _hf(rope_parameters={"rope_type": "longrope", "partial_rotary_factor": 0.75, "rope_theta": 1e4,
                                  "short_factor": factors, "long_factor": factors, "factor": 4.0,
                                  "original_max_position_embeddings": 1024})
    assert _rope_fields(ModelConfig.from_hf_dict(inside)) == _rope_fields(config)


@pytest.mark.parametrize("hf,message", [
    (_hf(rope_scaling={"rope_type": "xpos", "factor": 2.0}), "rope_scaling type 'xpos' is not supported"),
    (_hf(rope_scaling={"type": "linear"}), r"rope_scaling of type 'linear' lacks \['factor'\]"),
    (_hf(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     r"lacks \['low_freq_factor', 'high_freq_factor'\]"),
    (_hf(partial_rotary_factor=1.5), r"partial_rotary_factor=1.5 is invalid"),
    (_hf(partial_rotary_factor=0.3125), "gives an odd rotary dimension 5"),  # head_dim 16
    (_hf(rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}),
     r"rope_scaling\['short_factor'\] has 3 factors, expected rotary_dim / 2 = 8"),
    (_hf(rope_parameters={"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_type": "nope"}}),
     "rope_local type 'nope' is not supported"),
])
def test_bad_rope_fails_at_start_naming_it(hf, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(hf)



def test_phi3_sliding_window_on_every_layer_inside_the_context():
    """Phi-3-mini-4k's 2047-token window slides on every layer; the 128k checkpoints' 262144
    covers their whole context, so none does."""
    phi3 = dict(_hf(sliding_window=2047), architectures=["Phi3ForCausalLM"])
    assert [ModelConfig.from_hf_dict(phi3).layer_sliding_window(i) for i in range(2)] == [2047, 2047]
    assert ModelConfig.from_hf_dict(dict(phi3, sliding_window=262144)).layer_types is None


# -- sliding window: which layers slide, in both config forms (engine.config.sliding_window.read_layer_types) --------

S, F = "sliding_attention", "full_attention"


def _arch(arch: str, **kw) -> dict:
    return dict(_hf(**kw), architectures=[arch], num_hidden_layers=4)


@pytest.mark.parametrize("hf, window, layer_types", [
    (_arch("MistralForCausalLM", sliding_window=512), 512, [S] * 4),
    (_arch("MistralForCausalLM", sliding_window=None), None, None),
    # HF's Mistral gives every layer the window, whatever layer_types says
    (_arch("MistralForCausalLM", sliding_window=512, layer_types=[F] * 4), 512, [S] * 4),
    (_arch("Qwen2ForCausalLM", sliding_window=512, max_window_layers=2), None, None),  # use_sliding_window off
    (_arch("Qwen2ForCausalLM", sliding_window=512, use_sliding_window=True, max_window_layers=2), 512, [F, F, S, S]),
    (_arch("Qwen2ForCausalLM", sliding_window=512, use_sliding_window=True, layer_types=[F, S, F, S]),
     512, [F, S, F, S]),  # transformers 5's form
    (_arch("Qwen2ForCausalLM", sliding_window=None, use_sliding_window=False, layer_types=[F] * 4), None, None),
    (_arch("Qwen3ForCausalLM", sliding_window=512, use_sliding_window=True, max_window_layers=3), 512, [F, F, F, S]),
    (_arch("Qwen2ForCausalLM", sliding_window=512, use_sliding_window=True, max_window_layers=4), None, None),
    # a window covering the whole context (max_position_embeddings 4096) masks nothing
    (_arch("MistralForCausalLM", sliding_window=4096), None, None),
    (_arch("LlamaForCausalLM", sliding_window=512), None, None),  # HF's Llama has no window
])
def test_sliding_window_in_both_config_forms(hf, window, layer_types):
    config = ModelConfig.from_hf_dict(hf)
    assert (config.sliding_window, config.layer_types) == (window, layer_types)
    assert [config.layer_sliding_window(i) for i in range(4)] == [
        window if t == S else None for t in (layer_types or [F] * 4)]


@pytest.mark.parametrize("arch, kw, expected", [
    ("Gemma2ForCausalLM", {}, [S, F, S, F, S, F]),                       # even layers slide
    ("Gemma3ForCausalLM", {}, [S, S, S, S, S, F]),                       # sliding_window_pattern 6
    ("Gemma3ForCausalLM", dict(sliding_window_pattern=2), [S, F, S, F, S, F]),
    ("Gemma3ForCausalLM", dict(layer_types=[F, S, S, F, S, S]), [F, S, S, F, S, S]),
    ("GptOssForCausalLM", {}, [S, F, S, F, S, F]),
    ("Qwen2MoeForCausalLM", dict(use_sliding_window=True, max_window_layers=3), [S, F, S, F, F, F]),
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=True), [S] * 6),
    ("Qwen3MoeForCausalLM", {}, None),
    ("MixtralForCausalLM", {}, [S] * 6),
    ("Phi3ForCausalLM", {}, [S] * 6),
])
def test_layer_types_of_each_family(arch, kw, expected):
    """As HF's config classes build layer_types from the older keys (checked against them)."""
    assert read_layer_types(dict(sliding_window=128, **kw), arch, 6) == expected


def test_layer_types_equal_transformers_config_classes():
    import transformers

    for cls, kw in (("Qwen2Config", dict(use_sliding_window=True, max_window_layers=2)),
                    ("Gemma2Config", {}), ("Gemma3TextConfig", dict(sliding_window_pattern=3))):
        hf = getattr(transformers, cls)(num_hidden_layers=6, sliding_window=64, **kw)
        arch = {"Qwen2Config": "Qwen2ForCausalLM", "Gemma2Config": "Gemma2ForCausalLM"}.get(cls, "Gemma3ForCausalLM")
        assert read_layer_types(dict(sliding_window=64, **kw), arch, 6) == hf.layer_types, cls


@pytest.mark.parametrize("kw, message", [
    (dict(sliding_window=16, layer_types=[S]), "layer_types has 1 entries; expected num_hidden_layers=2"),
    (dict(sliding_window=16, layer_types=[S, "chunked_attention"]),
     r"layer_types \['chunked_attention'\] are not supported"),
    (dict(sliding_window=0, layer_types=[S, F]), "sliding_window=0 is invalid"),
    (dict(sliding_window=None, layer_types=[S, F]), "sliding_window=None is invalid"),
    (dict(sliding_window=16), "sliding_window=16 needs layer_types"),
])
def test_bad_sliding_window_fails_at_start_naming_it(kw, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(model_config(), **kw)


def test_sliding_window_on_an_architecture_without_it_is_refused():
    with pytest.raises(ValueError, match="sliding_window=512 is not supported for MixtralForCausalLM"):
        ModelConfig.from_hf_dict(_arch("MixtralForCausalLM", sliding_window=512, num_local_experts=4,
                                       num_experts_per_tok=2))


def test_kv_offload_default_is_cudas_only_where_it_works(no_cuda, monkeypatch):
    """The host KV tier: off on CPU (the cache is host memory already), DEFAULT_CUDA_KV_OFFLOAD_GB
    on CUDA (0 until gpu_session.sh kv-offload has passed) unless prefix caching is off or a layer
    slides; an explicit size is kept."""
    mistral = ModelConfig.from_hf_dict(_arch("MistralForCausalLM", sliding_window=512))
    assert EngineConfig(model="m").resolve(model_config()).kv_offload_gb == 0
    assert EngineConfig(model="m", kv_offload_gb=0.5).resolve(model_config()).kv_offload_gb == 0.5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig(model="m").resolve(model_config()).kv_offload_gb == DEFAULT_CUDA_KV_OFFLOAD_GB
    assert EngineConfig(model="m", enable_prefix_caching=False).resolve(model_config()).kv_offload_gb == 0
    assert EngineConfig(model="m").resolve(mistral).kv_offload_gb == 0


@pytest.mark.parametrize("kw, message", [
    (dict(kv_offload_gb=-1.0), r"kv_offload_gb=-1.0 is invalid: must be >= 0 \(0: off\)"),
    (dict(kv_offload_gb=2.0, enable_prefix_caching=False), "kv_offload_gb=2.0 needs enable_prefix_caching=True"),
])
def test_kv_offload_refusals_name_the_combination(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **kw)


def test_kv_offload_with_sliding_window_layers_is_refused(no_cuda):
    mistral = ModelConfig.from_hf_dict(_arch("MistralForCausalLM", sliding_window=512))
    with pytest.raises(ValueError, match="kv_offload_gb=1.0 is not supported with sliding-window attention "
                                         r"\(MistralForCausalLM has sliding layers\)"):
        EngineConfig(model="m", kv_offload_gb=1.0).resolve(mistral)
