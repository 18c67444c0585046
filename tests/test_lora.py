"""Multi-LoRA in the engine (engine/lora, engine/layers/lora.py): random PEFT adapters on a tiny
llama, against HF transformers greedy on the base model with each adapter merged."""
from __future__ import annotations

import asyncio
import functools
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, AsyncLLM, LoRARequest, SamplingParams
from engine.layers.lora import TritonLoRASlots
from engine.lora import worker_manager
from engine.worker.cuda_graph import CUDAGraphRunner
from engine.worker.forward_context import set_forward_context
from engine.worker.model_runner import ModelRunner
from tests.hf_reference import assert_matches, hf_greedy

peft = pytest.importorskip("peft")

MAX_TOKENS = 8
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _write_adapter(base: str, out, seed: int, **lora_kwargs) -> str:
    """A PEFT adapter with random A and B (PEFT starts B at zero: no delta to test)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    model.save_pretrained(out)
    return str(out)


def _merge(base: str, adapter: str, out) -> str:
    """The base model with the adapter merged in, saved: HF's oracle for that adapter."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """{name: (LoRARequest, merged checkpoint)}; "base" runs without an adapter."""
    d = tmp_path_factory.mktemp("lora")
    a = _write_adapter(tiny_llama, d / "a", seed=1, r=8, lora_alpha=16, target_modules=ALL_TARGETS)
    # rsLoRA (alpha / sqrt(r)), and only some parts of the fused layers (k and up stay base).
    b = _write_adapter(tiny_llama, d / "b", seed=2, r=4, lora_alpha=8, use_rslora=True,
                       target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    return {"base": (None, tiny_llama),
            "a": (LoRARequest("a", 1, a), _merge(tiny_llama, a, d / "a-merged")),
            "b": (LoRARequest("b", 2, b), _merge(tiny_llama, b, d / "b-merged"))}


@pytest.fixture(scope="module")
def lora_llm(tiny_llama):
    with LLM(tiny_llama, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=16) as llm:
        yield llm


def _prompts(n: int, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 900, (length + 3 * i,), generator=gen).tolist() for i in range(n)]


def _check(outputs, prompts, names, adapters) -> None:
    for out, prompt, name in zip(outputs, prompts, names):
        assert_matches(out.outputs[0].token_ids, hf_greedy(adapters[name][1], prompt, MAX_TOKENS), name)


def test_each_adapter_equals_hf_with_it_merged(lora_llm, adapters):
    prompts = _prompts(2)
    for name, (lora, _) in adapters.items():
        outs = lora_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                                 lora_request=lora)
        _check(outs, prompts, [name] * 2, adapters)
        assert all(out.lora_request == lora for out in outs)
    ref_a = hf_greedy(adapters["a"][1], prompts[0], MAX_TOKENS).token_ids
    assert ref_a != hf_greedy(adapters["base"][1], prompts[0], MAX_TOKENS).token_ids, "the adapter changes nothing"


def test_one_batch_mixes_base_and_two_adapters(lora_llm, adapters):
    """Each prompt of a mixed batch gets what it gets alone (= HF merged)."""
    prompts = _prompts(6)
    names = ["base", "a", "b", "a", "base", "b"]
    outs = lora_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                             lora_request=[adapters[n][0] for n in names])
    _check(outs, prompts, names, adapters)


def test_speculative_decoding_with_adapters_gives_the_tokens_without_it(lora_llm, adapters):
    """N-gram drafts verified through the adapters' deltas (k + 1 rows per sequence in each adapter's
    slot): the same greedy tokens as without speculation, base and two adapters in one batch. The
    output is kept to 16 one-letter tokens, over which greedy text soon cycles, so drafts are
    accepted (tests/test_spec_decode.py)."""
    letters = list(range(40, 56))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, allowed_token_ids=letters)
    span = _prompts(1, 9)[0]
    prompts = [span * 3, _prompts(2)[1], span * 2 + span[:4]]
    loras = [adapters[n][0] for n in ("a", "base", "b")]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False, lora_request=loras)]
    with LLM(lora_llm.llm_engine.config.model, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
             block_size=16, speculative_config=ngram) as spec_llm:
        assert run(spec_llm) == run(lora_llm)
        assert spec_llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0


class EagerReplayRunner(CUDAGraphRunner):
    """CUDAGraphRunner without CUDA: capture records nothing, and a replay runs the model eagerly on
    the static buffers, as the captured graph would (the decode steps' inputs, padding rows and the
    LoRA kernels' mapping all come from the buffers)."""

    def capture(self) -> None:
        self.replays = 0
        for bs in self.batch_sizes:
            self.graphs[bs] = SimpleNamespace(replay=functools.partial(self._replay, bs))

    def _replay(self, bs: int) -> None:
        self.replays += 1
        with set_forward_context(self._metadata(bs), self._lora_mapping(bs)):
            self.outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs without CUDA only; natively: below")
def test_cuda_path_on_cpu_kernels_and_graph_buffers_equal_hf(tiny_llama, adapters, monkeypatch):
    """The CUDA path's pieces under the Triton interpreter: the layers' shrink / expand kernels
    (TritonLoRASlots), the manager's sorted-row mapping, and decode steps replayed from the graph
    runner's static buffers, 3 sequences padded to a batch of 4."""
    monkeypatch.setattr(worker_manager, "use_lora_kernels", lambda device: True)

    def capture(runner):
        graphs = EagerReplayRunner(runner.model, runner.config.max_num_seqs, runner.config.max_model_len,
                                   runner.block_size, runner.device, max_loras=runner.config.max_loras)
        graphs.capture()
        return graphs

    monkeypatch.setattr(ModelRunner, "_maybe_capture_cuda_graphs", capture)
    prompts, names = _prompts(3), ["base", "a", "b"]
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)  # the interpreter is slow
    with LLM(tiny_llama, device="cpu", enable_lora=True, max_loras=2, max_num_seqs=4) as llm:
        runner = llm.llm_engine.executor.runner
        assert isinstance(runner.model.model.layers[0].mlp.gate_up_proj.lora, TritonLoRASlots)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], short, use_tqdm=False,
                            lora_request=[adapters[n][0] for n in names])
        assert runner.graph_runner.replays == 3  # one prefill step, then every decode step replayed
    for out, prompt, name in zip(outs, prompts, names):
        assert_matches(out.outputs[0].token_ids, hf_greedy(adapters[name][1], prompt, 4), name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_kernels_with_and_without_graphs_equal_hf(tiny_llama, adapters, enforce_eager):
    """Natively: the Triton kernels, eagerly and captured in the decode graphs (fp32, so HF's greedy
    stays exact); decode batches of several sizes mixing the base model and both adapters."""
    prompts = _prompts(7)
    names = ["a", "base", "b", "b", "a", "base", "a"]
    with LLM(tiny_llama, device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_num_seqs=8,
             enforce_eager=enforce_eager) as llm:
        assert (llm.llm_engine.executor.runner.graph_runner is None) == enforce_eager
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                            lora_request=[adapters[n][0] for n in names])
    _check(outs, prompts, names, adapters)


def test_max_loras_one_still_finishes_every_request(tiny_llama, adapters):
    """One adapter at a time among the running sequences (the others wait), prompts in chunks."""
    prompts = _prompts(5)
    names = ["a", "b", "base", "b", "a"]
    with LLM(tiny_llama, device="cpu", enable_lora=True, max_loras=1, max_num_batched_tokens=24) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                            lora_request=[adapters[n][0] for n in names])
    _check(outs, prompts, names, adapters)


def test_preemption_recomputes_with_the_adapter(tiny_llama, adapters):
    prompts = _prompts(5)
    names = ["a", "b", "a", "base", "b"]
    with LLM(tiny_llama, device="cpu", enable_lora=True, max_loras=2, num_kv_blocks=6) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                            lora_request=[adapters[n][0] for n in names])
        assert llm.llm_engine.scheduler.num_preemptions > 0
    _check(outs, prompts, names, adapters)


def test_prefix_cache_is_per_adapter(lora_llm, adapters):
    """The same prompt under the base model and two adapters: three outputs, each its own model's,
    and a repeat under the same adapter hits the cache."""
    prompt = _prompts(1, length=40)[0]
    seen = {}
    for name in ["base", "a", "b", "a"]:
        out = lora_llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                                lora_request=adapters[name][0])[0]
        _check([out], [prompt], [name], adapters)
        seen.setdefault(name, []).append((tuple(out.outputs[0].token_ids), out.num_cached_tokens))
    assert len({seen[n][0][0] for n in ("base", "a", "b")}) == 3
    assert seen["a"][0][1] == 0 and seen["b"][0][1] == 0  # the base model's blocks are not theirs
    assert seen["a"][1][1] == 32  # its own: two full blocks of 16


def test_tensor_parallel_equals_one_rank(tiny_llama, adapters):
    prompts = _prompts(2)
    with LLM(tiny_llama, device="cpu", enable_lora=True, tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                            lora_request=[adapters["a"][0], None])
    _check(outs, prompts, ["a", "base"], adapters)


def test_slots_and_host_cache_are_reused_least_recently_used_first(tiny_llama, adapters):
    """max_loras=2 slots, max_cpu_loras=2 host entries; "a2" is adapter a under another id."""
    a, b = adapters["a"][0], adapters["b"][0]
    a2 = LoRARequest("a2", 3, a.lora_path)
    prompt = _prompts(1)[0]
    with LLM(tiny_llama, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=2) as llm:
        manager = llm.llm_engine.executor.runner.lora_manager
        for lora, name, slots, host in [(a, "a", {1: 0}, [1]), (b, "b", {1: 0, 2: 1}, [1, 2]),
                                        (a2, "a", {2: 1, 3: 0}, [2, 3]), (a, "a", {3: 0, 1: 1}, [3, 1])]:
            out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=lora)
            _check(out, [prompt], [name], adapters)
            assert dict(manager._slot_of) == slots and list(manager._host) == host, lora.lora_name


@pytest.mark.parametrize("engine_process", [False, True])
def test_async_llm_takes_a_lora_request(tiny_llama, adapters, engine_process):
    async def run(llm, prompt, lora):
        async for out in llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=lora):
            final = out
        return final

    prompt = _prompts(1)[0]
    bad = LoRARequest("big", 9, adapters["a"][0].lora_path)
    with AsyncLLM(model=tiny_llama, device="cpu", enable_lora=True, max_lora_rank=4,
                  engine_process=engine_process) as llm:
        out = asyncio.run(run(llm, prompt, adapters["b"][0]))
        with pytest.raises(ValueError, match="r=8 exceeds max_lora_rank=4"):  # an error on the request
            asyncio.run(run(llm, prompt, bad))
        assert llm.is_running
    _check([out], [prompt], ["b"], adapters)


def _edit_adapter(src: str, dst, **config_changes) -> LoRARequest:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return LoRARequest(dst.name, 9, str(dst))


@pytest.mark.parametrize("kind,named", [
    ("rank", r"r=32 exceeds max_lora_rank=16"),
    ("embed", r"target_modules \['embed_tokens'\] are not supported"),
    ("embed_regex", r"tensor 'base_model\.model\.model\.embed_tokens\.[^']+' adapts a module"),
    ("dora", r"use_dora=True is not supported"),
    ("bias", r"bias='lora_only' is not supported"),
    ("modules_to_save", r"modules_to_save=\['lm_head'\] is not supported"),
    ("lm_head", r"target_modules \['lm_head'\] are not supported"),
    ("bad_json", r"LoRA adapter 'bad' \(.*\): .*adapter_config\.json is not valid JSON"),
    ("bad_weights", r"LoRA adapter 'bad' \(.*\): .*adapter_model\.safetensors is not a safetensors file"),
])
def test_unsupported_adapters_are_refused_by_name(lora_llm, adapters, tiny_llama, tmp_path, kind, named):
    a = adapters["a"][0].lora_path
    if kind == "rank":
        lora = LoRARequest("big", 9, _write_adapter(tiny_llama, tmp_path / "big", seed=3, r=32,
                                                    target_modules=["q_proj"]))
    elif kind == "embed":
        lora = LoRARequest("emb", 9, _write_adapter(tiny_llama, tmp_path / "emb", seed=3, r=4,
                                                    target_modules=["q_proj", "embed_tokens"]))
    elif kind == "embed_regex":  # a regex passes the config check: the tensors tell
        lora = LoRARequest("emb", 9, _write_adapter(tiny_llama, tmp_path / "emb", seed=3, r=4,
                                                    target_modules=r".*(q_proj|embed_tokens)"))
    elif kind == "dora":
        lora = _edit_adapter(a, tmp_path / "dora", use_dora=True)
    elif kind == "bias":
        lora = _edit_adapter(a, tmp_path / "bias", bias="lora_only")
    elif kind == "modules_to_save":
        lora = _edit_adapter(a, tmp_path / "mts", modules_to_save=["lm_head"])
    elif kind.startswith("bad_"):  # a file cut short: named, not a JSON or struct error from deep inside
        lora = LoRARequest("bad", 9, shutil.copytree(a, tmp_path / "bad"))
        name = "adapter_config.json" if kind == "bad_json" else "adapter_model.safetensors"
        (tmp_path / "bad" / name).write_bytes(b"{\"r\"")
    else:
        lora = _edit_adapter(a, tmp_path / "head", target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=named):
        lora_llm.generate("hello", GREEDY, use_tqdm=False, lora_request=lora)
    # Refused before anything was queued: the engine still serves.
    assert lora_llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_lora_request_without_enable_lora_is_refused(tiny_llama, adapters):
    with LLM(tiny_llama, device="cpu") as llm:
        with pytest.raises(ValueError, match="lora_request 'a': LoRA is off"):
            llm.generate("hello", GREEDY, use_tqdm=False, lora_request=adapters["a"][0])


def test_lora_requests_must_match_the_prompts(lora_llm, adapters):
    with pytest.raises(ValueError, match="got 2 lora_requests for 3 prompts"):
        lora_llm.generate(["a", "b", "c"], GREEDY, use_tqdm=False, lora_request=[adapters["a"][0], None])


@pytest.mark.parametrize("kwargs,named", [
    ({"max_loras": 0}, "max_loras=0"), ({"max_lora_rank": -1}, "max_lora_rank=-1"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras=2 is invalid: must be >= max_loras=4"),
])
def test_bad_lora_knobs_are_refused_by_name(kwargs, named):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match=named):
        EngineConfig(model="m", enable_lora=True, **kwargs)


@pytest.mark.parametrize("bad", [0, -3, True, "1"])
def test_lora_int_id_must_be_positive(bad):
    with pytest.raises(ValueError, match="lora_int_id="):
        LoRARequest("x", bad, "/nowhere")
