"""`python -m loadtest.offline --lora N`: offline throughput with N LoRA adapters against the base model.

    python -m loadtest.offline --lora 4 [--max-loras 4] [--lora-rank 8] [--rounds 3] [--quick]

The bench model (or --model) with N random adapters of rank --lora-rank, written by the benchmark to
a temporary directory in PEFT's format (adapter_config.json, adapter_model.safetensors) and
targeting q/k/v/o/gate/up/down_proj of every layer. The workload is offline.py's; request i runs
adapter i mod N. Two engines, built first: the base model (enable_lora off) and the same model with
enable_lora, max_loras = min(N, --max-loras), max_lora_rank = --lora-rank and every adapter kept in
host memory (max_cpu_loras = N). Rounds alternate base, LoRA, base, LoRA, ...; the figure is the
median of the rounds' own ratios (LoRA tok/s / base tok/s, the pair seconds apart, as
overhead.py's --paired). The warm-up runs one short request per adapter, so the adapters' first
read from disk is not timed (as model loading is not); moving them into slots during the run is.
"""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import torch

from loadtest.measure import run_metadata
from loadtest.ours import shutdown
from loadtest.report import Stopwatch, format_table, write_json
from loadtest.workload import BenchRequest, make_offline_workload, num_useful_tokens

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_OUT = Path("bench_out/offline.json")  # offline.py's; --lora writes offline_lora.json instead


def add_lora_args(ap) -> None:
    ap.add_argument("--lora", type=int, default=0, metavar="N",
                    help="with N > 0: N random LoRA adapters against the base model (loadtest/offline_lora.py)")
    ap.add_argument("--max-loras", type=int, default=4, help="with --lora: the engine's max_loras is min(N, this)")
    ap.add_argument("--lora-rank", type=int, default=8, help="with --lora: the adapters' rank (= max_lora_rank)")


def check_lora_args(ap, args) -> None:
    for flag, value, low in (("--lora", args.lora, 0), ("--max-loras", args.max_loras, 1),
                             ("--lora-rank", args.lora_rank, 1)):
        if value < low:
            ap.error(f"{flag}={value} must be >= {low}")


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) in one decoder layer of this HF config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_random_adapter(out: Path, config: dict, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter with random A and B (PEFT starts B at zero, which changes nothing)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (n_in, n_out) in module_shapes(config).items():
            block = "self_attn" if module in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "task_type": "CAUSAL_LM"}))
    return out


def generate(llm, requests: list[BenchRequest], lora_requests) -> list[list[int]]:
    """Greedy, ignore_eos, each request its own length and adapter (None: the base model)."""
    from engine import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    if any(len(t) != r.max_tokens for t, r in zip(token_ids, requests)):
        raise RuntimeError("a request returned the wrong number of tokens")
    return token_ids


def timed_rounds(engines: dict, requests: list[BenchRequest], loras: list, rounds: int, progress) -> dict:
    """Alternating rounds; per engine its round times, CPU seconds and the token ids of one run."""
    runs = {name: {"wall_s": [], "cpu_s": []} for name in engines}
    for i in range(rounds):
        for name, llm in engines.items():
            with Stopwatch() as watch:
                runs[name]["token_ids"] = generate(llm, requests, loras if name == "lora" else None)
            runs[name]["wall_s"].append(watch.wall_s)
            runs[name]["cpu_s"].append(watch.cpu_s)
            progress(f"round {i + 1}/{rounds} {name}: {watch.wall_s:.1f} s")
    return runs


def build_report(args, requests, runs: dict, max_loras: int) -> dict:
    useful = num_useful_tokens(requests)
    ratios = [b / lo for b, lo in zip(runs["base"]["wall_s"], runs["lora"]["wall_s"])]
    side = {name: {"tokens_per_s_rounds": [useful / s for s in r["wall_s"]], "elapsed_s_rounds": r["wall_s"],
                   "cpu_s_rounds": r["cpu_s"], "tokens_per_s_best": useful / min(r["wall_s"])}
            for name, r in runs.items()}
    changed = sum(a != b for a, b in zip(runs["base"]["token_ids"], runs["lora"]["token_ids"]))
    return {
        "benchmark": "offline_lora_cpu",
        "workload": {"num_requests": len(requests), "seed": args.seed, "prompt_len_range": list(args.prompt_len),
                     "output_len_range": list(args.output_len), "num_useful_output_tokens": useful},
        "model": {"path": args.model or str(args.model_dir), "dtype": args.dtype[0]},
        "lora": {"num_adapters": args.lora, "max_loras": max_loras, "rank": args.lora_rank,
                 "target_modules": list(TARGETS), "assignment": "request i -> adapter i mod N"},
        "base": side["base"], "with_lora": side["lora"],
        "ratio_rounds": ratios, "ratio_median": statistics.median(ratios),
        "ratio_best": side["lora"]["tokens_per_s_best"] / side["base"]["tokens_per_s_best"],
        # Greedy tokens that differ from the base model's: the adapters do act (random weights).
        "requests_changed_by_adapter": changed,
    }


def summary_table(report: dict) -> str:
    lora, base, machine = report["lora"], report["base"], report["machine"]
    changed = f"{report['requests_changed_by_adapter']}/{report['workload']['num_requests']}"
    # The part of torch_threads cores each side got: near 1 on an idle machine.
    shares = [sum(side["cpu_s_rounds"]) / (sum(side["elapsed_s_rounds"]) * machine["torch_threads"])
              for side in (base, report["with_lora"])]
    cpu_share = " / ".join(f"{x:.2f}" for x in shares)
    rows = [["base tok/s (best round)", base["tokens_per_s_best"]],
            ["LoRA tok/s (best round)", report["with_lora"]["tokens_per_s_best"]],
            ["LoRA / base, per round", " ".join(f"{r:.3f}" for r in report["ratio_rounds"])],
            ["requests changed by their adapter", changed],
            ["CPU share base / LoRA", cpu_share],
            ["machine", f"{machine['cpu_count']} CPUs, load {machine['load_average']}"]]
    headline = (f"LoRA / base throughput: {report['ratio_median']:.3f} (median of {len(report['ratio_rounds'])} "
                f"rounds; {lora['num_adapters']} adapters, max_loras {lora['max_loras']}, rank {lora['rank']})")
    return format_table(["metric", "value"], rows) + "\n" + headline


def run(args, argv: list[str], model_path: Path, config: dict, requests: list[BenchRequest], progress) -> dict:
    """The whole --lora mode: adapters, both engines, the rounds, the JSON and the table."""
    from engine import LLM, LoRARequest

    max_loras = min(args.lora, args.max_loras)
    engines = {}
    with tempfile.TemporaryDirectory(prefix="offline-lora-") as tmp:
        loras = [LoRARequest(f"bench-{i}", i + 1, str(write_random_adapter(Path(tmp) / f"a{i}", config,
                                                                             args.lora_rank, seed=1000 + i)))
                 for i in range(args.lora)]
        common = dict(model=str(model_path), dtype=args.dtype[0], device="cpu", max_num_seqs=256,
                      max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
        try:
            engines["base"] = LLM(**common)
            engines["lora"] = LLM(**common, enable_lora=True, max_loras=max_loras, max_lora_rank=args.lora_rank,
                                  max_cpu_loras=args.lora)
            warmup = make_offline_workload(args.lora, args.seed + 1, config["vocab_size"], (16, 32), (4, 4))
            generate(engines["base"], warmup, None)
            generate(engines["lora"], warmup, loras)  # each adapter read from disk once, untimed
            runs = timed_rounds(engines, requests, [loras[i % args.lora] for i in range(len(requests))],
                                args.rounds, progress)
        finally:
            for llm in engines.values():
                shutdown(llm)
    report = run_metadata(["python", "-m", "loadtest.offline", *argv])
    report.update(build_report(args, requests, runs, max_loras))
    out = Path("bench_out/offline_lora.json") if Path(args.out) == DEFAULT_OUT else Path(args.out)
    write_json(out, report)
    print(f"wrote {out}")
    print(summary_table(report))
    return report
