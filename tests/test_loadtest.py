"""Tests of the benchmarks in loadtest/: the pure pieces, the online client against a fake
OpenAI-compatible server on 127.0.0.1, and the offline CPU benchmark end to end."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loadtest import stats
from loadtest.client import build_payload, endpoint_url
from loadtest.roofline import ModelShape, decode_limit_seconds, gpu_limit_seconds, request_flops, workload_flops
from loadtest.sse import DONE, parse_chunk, sse_data
from loadtest.workload import (make_copy_workload, make_offline_workload, make_token_id_prompts, make_word_prompts,
                               num_useful_tokens)

# A shape small enough to count by hand: q_dim 8, kv_dim 4.
SMALL = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=10, bytes_per_param=1)
BENCH_CONFIG = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 512, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1408, "vocab_size": 4032}
QWEN3_CONFIG = {"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16,
                "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
                "tie_word_embeddings": True}


# ---- workloads ---------------------------------------------------------------------------------

def test_offline_workload_is_deterministic_and_in_range():
    a = make_offline_workload(64, 0, 4032, (16, 256), (16, 128))
    assert a == make_offline_workload(64, 0, 4032, (16, 256), (16, 128))
    assert a != make_offline_workload(64, 1, 4032, (16, 256), (16, 128))
    assert all(16 <= len(r.prompt_token_ids) <= 256 and 16 <= r.max_tokens <= 128 for r in a)
    assert all(3 <= t < 4032 for r in a for t in r.prompt_token_ids)  # no special ids 0..2
    assert num_useful_tokens(a) == sum(r.max_tokens for r in a)
    # Both ends of a range are reachable: it is closed, as docs/benchmarks.md writes it.
    lengths = {r.max_tokens for r in make_offline_workload(500, 0, 100, (1, 1), (1, 3))}
    assert lengths == {1, 2, 3}


@pytest.mark.parametrize("kwargs, bad", [(dict(num_requests=0), "num_requests"),
                                         (dict(prompt_len=(5, 4)), "prompt_len"),
                                         (dict(output_len=(0, 4)), "output_len"),
                                         (dict(vocab_size=3), "vocab_size")])
def test_offline_workload_rejects_bad_arguments(kwargs, bad):
    args = dict(num_requests=2, seed=0, vocab_size=100, prompt_len=(1, 4), output_len=(1, 4)) | kwargs
    with pytest.raises(ValueError, match=bad):
        make_offline_workload(**args)


def test_copy_workload_repeats_one_span_per_prompt():
    """Speculative decoding's workload: each prompt is a span written out again and again."""
    requests = make_copy_workload(16, 0, 4032, (40, 80), (8, 16), span_len=(4, 12))
    assert requests == make_copy_workload(16, 0, 4032, (40, 80), (8, 16), span_len=(4, 12))
    plain = make_offline_workload(16, 0, 4032, (40, 80), (8, 16))
    for r, p in zip(requests, plain):
        ids = r.prompt_token_ids
        span = next(n for n in range(4, 13) if ids[n:] == ids[:-n])  # its period
        assert len(ids) == len(p.prompt_token_ids) and r.max_tokens == p.max_tokens
        assert ids[:span] == p.prompt_token_ids[:span] and len(ids) >= 3 * span


def test_online_prompts_are_deterministic_and_distinct():
    words = make_word_prompts(8, 32, seed=0)
    assert words == make_word_prompts(8, 32, seed=0)
    assert len(set(words)) == 8 and all(len(p.split()) == 32 for p in words)
    ids = make_token_id_prompts(4, 16, seed=0)
    assert all(len(p) == 16 and all(10 <= t < 1000 for t in p) for p in ids)


# ---- FLOPs and the roofline --------------------------------------------------------------------

def test_request_flops_by_hand():
    # layer: q,k,v,o = 8*(8+4+4) + 8*8 = 192; mlp 3*8*16 = 384 -> 576; two layers 1152.
    assert SMALL.non_embedding_params == 1152 and SMALL.lm_head_params == 80
    # P=3, O=2: 4 tokens through the layers, 2 LM-head rows, 1+2+3+4 = 10 (query, key) pairs.
    assert request_flops(SMALL, 3, 2) == {"linear": 2 * 1152 * 4, "lm_head": 2 * 80 * 2,
                                          "attention": 4 * 2 * 8 * 10}
    total = workload_flops(SMALL, [(3, 2), (3, 2)])
    assert total["total"] == 2 * (9216 + 320 + 640)


def test_bench_model_shape_matches_its_parameter_count():
    shape = ModelShape.from_hf_config(BENCH_CONFIG, bytes_per_param=4)
    # 6 * (512*(512+256+256) + 512*512 + 3*512*1408): what HF counts outside embed/lm_head/norms.
    assert shape.non_embedding_params == 17_694_720
    assert shape.kv_bytes_per_token == 2 * 6 * 256 * 4


def test_decode_limit_by_hand():
    # One request, P=3, O=3: two decode steps, seeing 4 and then 5 keys.
    weights = (1152 + 80 + 2 * 2 * 8 + 8)  # bytes at 1 byte/param: matmuls, LM head, norms
    kv_per_token = 2 * 2 * 4
    assert SMALL.weight_bytes_per_step == weights
    memory_bound = decode_limit_seconds(SMALL, [(3, 3)], bandwidth=1.0, flop_rate=1e30)
    assert memory_bound == pytest.approx(2 * weights + 9 * kv_per_token)
    flops = 2 * (1152 + 80) * 2 + 4 * 2 * 8 * 9
    assert decode_limit_seconds(SMALL, [(3, 3)], bandwidth=1e30, flop_rate=1.0) == pytest.approx(flops)
    split = gpu_limit_seconds(SMALL, [(3, 3)], bandwidth=1.0, flop_rate=1e30)
    assert split["total_s"] == pytest.approx(split["prefill_s"] + split["decode_s"])


def test_qwen3_shape_reads_about_1_2_gb_per_decode_step():
    shape = ModelShape.from_hf_config(QWEN3_CONFIG, bytes_per_param=2)
    assert 1.1e9 < shape.weight_bytes_per_step < 1.25e9  # Qwen3-0.6B: ~0.6B params in bf16
    assert shape.kv_bytes_per_token == 28 * 2 * 8 * 128 * 2


def test_gpu_workloads_follow_benchmarks_md():
    from loadtest.gpu_bench import WORKLOADS, compare, workload_requests

    requests, warmup = workload_requests(WORKLOADS["A"], 256, 0, 151936, quick=False)
    assert len(requests) == 256 and len(warmup) > 0
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in requests)
    peers = {"ours": {"name": "ours", "tokens_per_s": 300.0},
             "hf_static_bs64": {"name": "hf_static_bs64", "tokens_per_s": 100.0},
             "hf_static_bs128": {"name": "hf_static_bs128", "error": "out of GPU memory"},
             "hf_cb": {"name": "hf_cb", "tokens_per_s": 150.0}}
    assert compare(peers) == {"best_hf_static": "hf_static_bs64", "vs_best_hf_static": 3.0,
                              "vs_hf_cb": 2.0, "best_peer": "hf_cb", "vs_best_peer": 2.0}


def test_gpu_workload_report_from_canned_peers(tmp_path, monkeypatch):
    import argparse

    from loadtest import gpu_bench

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    canned = {"ours": {"name": "ours", "elapsed_s": 10.0, "tokens_per_s": 300.0},
              "hf_static": {"name": "hf_static", "error": "out of GPU memory"},
              "hf_cb": {"name": "hf_cb", "elapsed_s": 20.0, "tokens_per_s": 150.0}}
    monkeypatch.setattr(gpu_bench, "ensure_checkpoint", lambda cache_dir, preset: tmp_path)
    monkeypatch.setattr(gpu_bench, "spawn_child", lambda peer, *a: dict(canned[peer]))
    args = argparse.Namespace(cache_dir=tmp_path, num_requests=8, seed=0, quick=True,
                              peers=["ours", "hf_static", "hf_cb"], hf_batch_sizes=[64])
    wl = gpu_bench.run_workload(gpu_bench.WORKLOADS["A"], args, {"copy_bandwidth": 3e12, "bf16_flop_rate": 7e14})
    assert set(wl["peers"]) == {"ours", "hf_static_bs64", "hf_cb"}
    assert wl["peers"]["ours"]["fraction_of_limit"] == pytest.approx(wl["limit"]["total_s"] / 10.0)
    assert wl["comparison"]["vs_hf_cb"] == 2.0 and wl["comparison"]["best_hf_static"] is None
    report = {"workloads": {"A": wl}, "machine": {"gpu": "X"}, "rates": {"copy_bandwidth": 3e12,
                                                                         "bf16_flop_rate": 7e14}}
    table = gpu_bench.summary_table(report)
    assert "out of GPU memory" in table and table.splitlines()[-1].startswith("X: copy 3,000 GB/s")


def test_gpu_bench_without_cuda_says_so_and_exits_cleanly(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: this checks the CPU-only path")
    from loadtest.gpu_bench import main

    assert main(["--workload", "A"]) is None
    assert "needs CUDA" in capsys.readouterr().out


# ---- percentiles and the knee ------------------------------------------------------------------

def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert stats.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert stats.summarize([])["p50"] is None


def test_knee_is_the_last_level_before_latency_outgrows_throughput():
    # 1->4: latency x1.1, throughput x3.6; 4->16: x1.5 vs x2.7; 16->64: x3.8 vs x1.05.
    sweep = [(1, 1.0, 100.0), (4, 1.1, 360.0), (16, 1.65, 960.0), (64, 6.2, 1010.0)]
    knee = stats.find_knee(sweep)
    assert knee["concurrency"] == 16 and knee["reached"]
    beyond = stats.find_knee(sweep[:3])
    assert beyond["concurrency"] == 16 and not beyond["reached"]
    assert stats.find_knee([(1, 1.0, 10.0), (2, 1.0, 0.0)])["concurrency"] == 1  # all failed at 2


# ---- SSE -------------------------------------------------------------------------------------

def test_sse_parsing_of_canned_streams():
    completions = ['data: {"choices":[{"index":0,"text":"Hel","finish_reason":null}]}', "",
                   ": keep-alive", 'data: {"choices":[{"index":0,"text":"lo","finish_reason":"length"}]}',
                   'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}', "data: [DONE]"]
    payloads = [p for p in map(sse_data, completions) if p is not None]
    assert payloads[-1] == DONE
    chunks = [parse_chunk(p, "completions") for p in payloads[:-1]]
    assert [c.text for c in chunks] == ["Hel", "lo", ""]
    assert chunks[1].finish_reason == "length" and chunks[2].completion_tokens == 2
    chat = parse_chunk('{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}', "chat")
    assert chat.text == "Hi"
    assert parse_chunk('{"error":{"message":"boom"}}', "completions").error == "boom"
    assert "malformed" in parse_chunk("{not json", "completions").error


def test_payload_and_url():
    assert endpoint_url("http://127.0.0.1:8000", "completions") == "http://127.0.0.1:8000/v1/completions"
    assert endpoint_url("http://h:1/v1/", "chat") == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="base_url"):
        endpoint_url("127.0.0.1:8000", "completions")
    body = build_payload("m", [1, 2], 8, "completions")
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="completions"):
        build_payload("m", [1, 2], 8, "chat")


# ---- the online client against a fake OpenAI-compatible server ----------------------------------

@pytest.fixture
def fake_server():
    pytest.importorskip("aiohttp")
    from loadtest.fake_server import FakeOpenAIServer

    with FakeOpenAIServer() as server:
        yield server


def _run_online(tmp_path, url, model, *extra):
    from loadtest.__main__ import main

    return main(["--base-url", url, "--model", model, "--concurrency", "1,4", "--num-prompts", "6",
                 "--input-len", "8", "--output-len", "5", "--out", str(tmp_path), "--request-timeout", "10",
                 *extra])


def test_online_sweep_writes_results_and_plots(fake_server, tmp_path, capsys):
    results = _run_online(tmp_path, fake_server.url, "m", "--api-key", "secret")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [lv["concurrency"] for lv in saved["levels"]] == [1, 4]
    for level in saved["levels"]:
        assert level["num_completed"] == 6 and level["num_errors"] == 0
        assert level["total_output_tokens"] == 6 * 5
        assert 0 < level["ttft_s"]["p50"] <= level["e2e_s"]["p50"]
        assert level["itl_s"]["count"] == 6 * 4 and level["tpot_s"]["p50"] > 0
    assert saved["knee"]["concurrency"] in (1, 4)
    assert "secret" not in (tmp_path / "results.json").read_text()
    for name in results["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sent = fake_server.bodies[-1]
    assert sent["stream"] and sent["ignore_eos"] and sent["max_tokens"] == 5
    assert sent["stream_options"] == {"include_usage": True}
    assert "knee: concurrency" in capsys.readouterr().out.strip().splitlines()[-1]


def test_online_counts_errors_and_bounds_slow_requests(fake_server, tmp_path):
    flaky = _run_online(tmp_path, fake_server.url, "flaky", "--num-warmup", "0")
    for level in flaky["levels"]:
        assert level["num_errors"] > 0 and level["num_completed"] + level["num_errors"] == 6
        assert "HTTP 500" in level["errors"][0]
    from loadtest.__main__ import main

    slow = main(["--base-url", fake_server.url, "--model", "slow", "--concurrency", "2", "--num-prompts", "2",
                 "--input-len", "4", "--output-len", "2", "--out", str(tmp_path), "--request-timeout", "0.5",
                 "--num-warmup", "0"])
    assert slow["levels"][0]["num_errors"] == 2 and "timed out" in slow["levels"][0]["errors"][0]


def test_online_chat_endpoint(fake_server, tmp_path):
    from loadtest.__main__ import main

    chat = main(["--base-url", fake_server.url + "/v1", "--model", "m", "--endpoint", "chat", "--concurrency", "2",
                 "--num-prompts", "2", "--input-len", "4", "--output-len", "3", "--out", str(tmp_path)])
    assert chat["levels"][0]["total_output_tokens"] == 6 and chat["url"].endswith("/v1/chat/completions")
    assert fake_server.bodies[-1]["messages"][0]["role"] == "user"


def test_online_stops_when_the_server_refuses_the_warmup(fake_server, tmp_path):
    with pytest.raises(SystemExit, match="warm-up request"):
        _run_online(tmp_path, fake_server.url, "fail")


# ---- the offline CPU benchmark, end to end ------------------------------------------------------

def _engine_importable() -> bool:
    try:
        from engine import LLM, SamplingParams  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_llama):
    return tiny_llama  # the session's checkpoint (tests/conftest.py)


def test_hf_static_batching_matches_unpadded_greedy(tiny_model_dir):
    torch = pytest.importorskip("torch")
    from loadtest.hf_peer import hf_greedy_reference, load_hf_model, make_batches, run_static_batch

    model = load_hf_model(str(tiny_model_dir), torch.float32, "cpu")
    requests = make_offline_workload(4, 0, 1000, (3, 20), (2, 6))
    assert make_batches(requests, 2, sort_by_output=True) == [
        sorted(range(4), key=lambda i: requests[i].max_tokens)[:2],
        sorted(range(4), key=lambda i: requests[i].max_tokens)[2:]]
    batched = run_static_batch(model, requests, [0, 1, 2, 3])  # left padding, one generate
    assert batched == [hf_greedy_reference(model, r.prompt_token_ids, r.max_tokens) for r in requests]


@pytest.mark.skipif(not _engine_importable(), reason="engine.LLM does not import yet")
def test_offline_quick_end_to_end(tiny_model_dir, tmp_path, capsys):
    from loadtest.offline import main

    report = main(["--quick", "--skip-hf", "--num-requests", "3", "--model-dir", str(tiny_model_dir),
                   "--out", str(tmp_path / "offline.json")])
    saved = json.loads((tmp_path / "offline.json").read_text())
    assert saved["ours"]["tokens_per_s"] > 0 and 0 < saved["ours"]["fraction_of_limit"]
    assert saved["workload"]["num_useful_output_tokens"] == report["workload"]["num_useful_output_tokens"]
    assert saved["correctness"]["num_mismatched"] == 0  # our greedy tokens equal HF's
    assert saved["peers"] == {} and saved["git_commit"] and saved["date"]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("torch threads")


@pytest.mark.skipif(not _engine_importable(), reason="engine.LLM does not import yet")
def test_offline_w8a8_writes_a_compressed_tensors_checkpoint_and_runs_it(tiny_model_dir, tmp_path):
    from loadtest.offline import main

    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    report = main(["--quick", "--skip-hf", "--num-requests", "2", "--model-dir", str(model_dir),
                   "--quantization", "none,w8a8", "--out", str(tmp_path / "offline.json")])
    group = json.loads((tmp_path / "model-w8a8" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert group["group_0"]["weights"]["type"] == "int" and group["group_0"]["input_activations"]["dynamic"]
    plain, w8a8 = report["variants"]["float32"], report["variants"]["float32+w8a8"]
    assert w8a8["tokens_per_s"] > 0 and w8a8["weight_mb"] < plain["weight_mb"]  # the embeddings stay fp32


def test_offline_arch_flag_builds_its_own_bench_model_dir():
    from loadtest.offline import parse_args

    assert parse_args([]).model_dir == Path("bench_out/model-bench")
    assert parse_args(["--arch", "qwen3_moe"]).model_dir == Path("bench_out/model-bench-qwen3_moe")
    assert parse_args(["--arch", "qwen3_moe", "--model-dir", "x"]).model_dir == Path("x")


def test_step_profile_union_of_kernel_intervals():
    from loadtest.step_profile import union_length

    assert union_length([]) == 0.0
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0  # overlaps count once, gaps not at all
    assert union_length([(4, 5), (0, 1)]) == 2.0


def test_step_profile_runs_on_cpu(tiny_llama, tmp_path):
    import json

    from loadtest.step_profile import main

    out = tmp_path / "p.json"
    assert main(["--model", tiny_llama, "--device", "cpu", "--num-seqs", "3", "--prompt-len", "9",
                 "--steps", "4", "--warmup-steps", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["async_scheduling"] for r in results] == [False, True]
    assert all(r["step_ms"] > 0 and "gpu_busy_share" not in r for r in results)


# ---- open loop (--request-rate) and compare ------------------------------------------------------

def test_poisson_arrivals_have_the_asked_rate_and_repeat():
    from loadtest.open_loop import arrival_offsets

    offsets = arrival_offsets(4000, 20.0, seed=1)
    assert offsets == arrival_offsets(4000, 20.0, seed=1) and offsets[0] == 0.0
    assert offsets == sorted(offsets)
    assert 4000 / offsets[-1] == pytest.approx(20.0, rel=0.05)  # mean gap 1/rate
    assert arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate 0"):
        arrival_offsets(3, 0.0, seed=0)


def test_open_loop_levels_in_the_order_given(fake_server, tmp_path, capsys):
    from loadtest.__main__ import main

    results = main(["--base-url", fake_server.url, "--model", "m", "--request-rate", "50,inf,50", "--num-prompts",
                    "6", "--input-len", "4", "--output-len", "3", "--out", str(tmp_path), "--num-warmup", "0"])
    assert [lv["request_rate"] for lv in results["levels"]] == [50.0, float("inf"), 50.0]  # a ramp: not sorted
    for level in results["levels"]:
        assert level["num_completed"] == 6 and level["total_output_tokens"] == 18
        sent = [t["sent_s"] for t in level["timeline"]]
        assert len(sent) == 6 and all(t["ok"] and t["e2e_s"] > 0 for t in level["timeline"])
    assert max(t["sent_s"] for t in results["levels"][1]["timeline"]) < 0.5  # inf: all at once
    assert results["knee"]["load"] == "request_rate" and "request_rate" in results["knee"]
    assert {"latency_vs_request_rate.png", "throughput_vs_request_rate.png"} == set(results["plots"])
    assert "req/s in" in capsys.readouterr().out


def test_open_loop_max_concurrency_bounds_requests_in_flight(fake_server, tmp_path):
    from loadtest.__main__ import main

    results = main(["--base-url", fake_server.url, "--model", "slow", "--request-rate", "inf", "--max-concurrency",
                    "2", "--num-prompts", "4", "--input-len", "4", "--output-len", "2", "--out", str(tmp_path),
                    "--num-warmup", "0", "--request-timeout", "10"])
    sent = sorted(t["sent_s"] for t in results["levels"][0]["timeline"])
    assert sent[1] < 0.5 and sent[2] >= 1.9  # "slow" holds each request 2 s: the third waits for a slot


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1", "--request-rate", "2"], "exclusive"),
    (["--max-concurrency", "2"], "needs --request-rate"),
    (["--request-rate", "0"], "request_rates"),
    (["--request-rate", "fast"], "comma-separated numbers"),
])
def test_open_loop_bad_arguments_are_named(argv, message, capsys):
    from loadtest.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--base-url", "http://127.0.0.1:1", "--model", "m", *argv])
    assert message in capsys.readouterr().err


def test_compare_draws_runs_on_the_same_axes(fake_server, tmp_path, capsys):
    from loadtest.__main__ import main

    paths = []
    for name in ("ours", "peer"):
        _run_online(tmp_path / name, fake_server.url, "m", "--num-warmup", "0")
        paths.append(str(tmp_path / name / "results.json"))
    out = main(["compare", *paths, "--out", str(tmp_path / "cmp")])
    assert out["plots"] == ["latency_vs_concurrency.png", "throughput_vs_concurrency.png"]
    for name in out["plots"]:
        assert (tmp_path / "cmp" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "ours: knee at" in text and "peer: knee at" in text


def test_compare_refuses_what_it_cannot_compare(fake_server, tmp_path, capsys):
    from loadtest.__main__ import main

    _run_online(tmp_path / "closed", fake_server.url, "m", "--num-warmup", "0")
    main(["--base-url", fake_server.url, "--model", "m", "--request-rate", "inf", "--num-prompts", "2",
          "--input-len", "4", "--output-len", "2", "--out", str(tmp_path / "open"), "--num-warmup", "0"])
    (tmp_path / "junk.json").write_text("{}")
    for argv, message in ([str(tmp_path / "closed/results.json")], "at least two"), \
            ([str(tmp_path / "closed/results.json"), str(tmp_path / "open/results.json")], "cannot compare"), \
            ([str(tmp_path / "closed/results.json"), str(tmp_path / "junk.json")], "junk.json"):
        with pytest.raises(SystemExit):
            main(["compare", *argv, "--out", str(tmp_path / "cmp")])
        assert message in capsys.readouterr().err


def test_guided_bench_runs_schema_and_plain_twins_of_equal_length(tiny_llama, tmp_path):
    import json

    from loadtest.guided_bench import main

    out = tmp_path / "g.json"
    assert main(["--model", tiny_llama, "--num-requests", "2", "--max-tokens", "40", "--rounds", "1",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())["result"]
    assert result["output_tokens"] > 0 and len(result["round_ratios"]) == 1
    assert result["ratio"] == result["round_ratios"][0] > 0


@pytest.mark.parametrize("flag", ["--num-rows", "--input-words", "--max-tokens", "--batch-size", "--rounds"])
def test_batch_bench_refuses_non_positive_sizes(flag, capsys):
    from loadtest.batch_bench import parse_args

    with pytest.raises(SystemExit):
        parse_args([flag, "0"])
    assert f"{flag}=0 must be >= 1" in capsys.readouterr().err
    assert parse_args(["--quick"]).num_rows == 64


def test_batch_bench_takes_each_ratio_within_its_round():
    from loadtest.batch_bench import combine_rounds, round_figures, summary_table
    from serve_app.batch.job import JobSummary

    def job(wall_s, check_s):
        return JobSummary(num_rows=100, num_generated_tokens=6400, num_shards=4, check_s=check_s,
                          first_shard_s=wall_s / 4, first_shard_rows=25, wall_s=wall_s)
    # The second round's box is slower for both paths: its ratio is the same as the first's.
    rounds = [round_figures(100, 60.0, 6400, job(80.0, 5.0), 100),
              round_figures(100, 90.0, 6400, job(120.0, 7.5), 100),
              round_figures(100, 60.0, 6400, job(100.0, 5.0), 99)]
    assert [r["ratio"] for r in rounds] == [0.75, 0.75, 0.6]
    assert rounds[0]["ratio_after_checks"] == 0.8
    assert rounds[0]["ratio_after_first_shard"] == pytest.approx((75 / 60) / (100 / 60))
    combined = combine_rounds(rounds)
    assert combined["ratio"] == 0.75 and combined["ratio_after_checks"] == 0.8
    table = summary_table(rounds, combined)
    assert "0.75 0.75 0.60" in table and "batch job, after the first shard" in table


def test_batch_bench_rotates_three_paths_and_runs_the_batch_job_first_on_cuda():
    from loadtest.batch_bench import round_order

    assert [round_order(k, "cpu", True) for k in range(4)] == [
        ["peer", "actor", "batch"], ["actor", "batch", "peer"], ["batch", "peer", "actor"], ["peer", "actor", "batch"]]
    assert [round_order(k, "cpu", False) for k in range(2)] == [["peer", "batch"], ["batch", "peer"]]
    assert round_order(1, "cuda", True) == ["batch", "actor", "peer"]
    assert round_order(0, "cuda", False) == ["batch", "peer"]


def test_batch_bench_engine_actor_ratio_and_the_jobs_cpu_by_role():
    from loadtest.batch_bench import combine_rounds, cpu_table, job_cpu, round_figures, summary_table
    from serve_app.batch.job import JobSummary

    used = {10: (50.0, "ray::EngineStage.generate_batch"), 11: (1.0, "ray::RetryCounter"),
            12: (2.0, "/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=..."), 13: (1.0, "ray::DashboardAgent"),
            14: (3.0, "ray::IDLE"), 15: (2.5, "ray::_StatsActor"), 16: (4.0, "python -m loadtest.batch_bench"),
            17: (9.0, "/usr/bin/some-other-program")}
    cpu = job_cpu(used, driver_pid=16)
    assert cpu == {"driver": 4.0, "engine actor": 50.0, "retry counter actor": 1.0, "Ray daemons": 3.0,
                   "Ray Data workers": 5.5}  # the box's other programs are not the job's
    job = JobSummary(num_rows=100, num_generated_tokens=6400, num_shards=1, wall_s=80.0)
    rounds = [round_figures(100, 60.0, 6400, job, 100, actor=(64.0, 6400, 100), cpu=cpu),
              round_figures(100, 60.0, 6400, job, 100, actor=(75.0, 6400, 99), cpu=cpu)]
    assert rounds[0]["ratio_actor"] == 0.9375 and rounds[1]["actor"]["rows_equal"] == 99
    combined = combine_rounds(rounds)
    assert combined["ratio_actor"] == pytest.approx((0.9375 + 0.8) / 2) and combined["ratio"] == 0.75
    assert "engine actor alone" in summary_table(rounds, combined)
    table = cpu_table(rounds)
    assert "Ray Data workers" in table and "63.5" in table  # all of the above: 63.5 CPU s over 80 s
    assert cpu_table([round_figures(100, 60.0, 6400, job, 100)]) == ""


def test_process_sampler_keeps_the_name_of_a_process_read_as_it_exits(monkeypatch):
    """An exited, unreaped process still has its CPU in /proc/PID/stat but an empty cmdline: the
    last name seen stays (a sample that caught it then used to drop the name)."""
    from loadtest import proc_cpu

    cpu = iter([{7: 0.1}, {7: 0.5}])
    names = iter(["python -c busy", ""])
    monkeypatch.setattr(proc_cpu, "per_process", lambda: next(cpu))
    monkeypatch.setattr(proc_cpu, "cmdline", lambda pid: next(names))
    sampler = proc_cpu.ProcessSampler(interval=60)
    sampler._sample()  # seen running
    sampler._sample()  # read again as it exits: stat still there, cmdline empty
    assert sampler._names[7] == "python -c busy" and sampler._last[7] == 0.5


def test_process_sampler_counts_a_process_that_starts_and_ends_inside_the_block():
    import subprocess
    import sys

    from loadtest.proc_cpu import ProcessSampler

    busy = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.6: pass  # sampler-probe"
    with ProcessSampler(interval=0.05) as sampler:
        subprocess.run([sys.executable, "-c", busy], check=True)
    probes = [(cpu, cmd) for cpu, cmd in sampler.used.values() if "sampler-probe" in cmd]
    assert len(probes) == 1
    assert 0.4 <= probes[0][0] <= 1.5  # its CPU, less at most the last interval before it ended
