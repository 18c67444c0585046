"""CPU: one C call per decoder layer (engine/layers/cpu_fused_layer.py) against the layer's modules,
on real steps of the `loadtest.offline` workload replayed through the model runner.

    python -m loadtest.cpu_fused_bench [--model bench_out/model-bench] [--dtype bfloat16] [--repeats 200]

The bench model as an INT8 W8A8 checkpoint (written once beside it, as `loadtest.offline
--quantization w8a8` does) runs the workload once; the first prefill step and a decode step of 64
sequences are captured, then each is replayed through `ModelRunner.run_model`, with the fused layers
and with the modules, alternating in every repeat (the K/V slots a step writes are written again
with the same values). The logits must be equal to the bit; the figure is modules / fused, the
median step time of each (above 1: the fused layers are faster).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from loadtest.offline import OUTPUT_LEN, PROMPT_LEN, engine_source, ensure_bench_model
from loadtest.report import base_metadata, format_table, write_json
from loadtest.workload import make_offline_workload

DECODE_ROWS = 64


def capture_steps(llm, vocab: int) -> dict:
    """{"prefill": the first step's ModelInput, "decode": one with DECODE_ROWS single-token rows}."""
    from engine.worker.model_runner import ModelRunner

    steps, run_model = {}, ModelRunner.run_model

    def spy(runner, mi):
        if "prefill" not in steps:
            steps["prefill"] = mi
        elif "decode" not in steps and len(mi.input_ids) == DECODE_ROWS and max(mi.query_lens) == 1:
            steps["decode"] = mi
        return run_model(runner, mi)

    ModelRunner.run_model = spy
    try:
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in make_offline_workload(
            DECODE_ROWS, 0, vocab, PROMPT_LEN, OUTPUT_LEN)], _params(), use_tqdm=False)
    finally:
        ModelRunner.run_model = run_model
    return steps


def _params():
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=OUTPUT_LEN[0], ignore_eos=True)


def replay(runner, mi, layers, fused: list, repeats: int) -> dict:
    """Median ms of run_model on `mi`, fused and not, alternating; the logits compared."""
    mi.prev_token_rows = []  # the decode's input ids as captured, not the last sampled ones
    times = {"fused": [], "modules": []}
    logits = {}
    with torch.inference_mode():
        for i in range(repeats + 2):
            for mode in ("fused", "modules"):
                for layer, f in zip(layers, fused):
                    layer.fused = f if mode == "fused" else None
                t = time.perf_counter()
                out = runner.run_model(mi)
                if i >= 2:  # two rounds of warm-up
                    times[mode].append(time.perf_counter() - t)
                logits[mode] = out
    for layer, f in zip(layers, fused):
        layer.fused = f
    if not torch.equal(logits["fused"], logits["modules"]):
        raise AssertionError("the fused layers' logits differ from the modules'")
    return {mode: 1e3 * statistics.median(ts) for mode, ts in times.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m loadtest.cpu_fused_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench_out/model-bench", help="the bench checkpoint (built if missing)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=200, help="timed replays of each step and mode")
    ap.add_argument("--out", default="bench_out/cpu_fused_bench.json")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    from engine import LLM
    from engine.models.llama import LlamaDecoderLayer

    model = ensure_bench_model(Path(args.model))
    path, quantization = engine_source(model, "w8a8")
    llm = LLM(model=str(path), dtype=args.dtype, device="cpu", quantization=quantization, seed=0,
              enable_prefix_caching=False)
    runner = llm.llm_engine.executor.runner
    layers = [m for m in runner.model.modules() if isinstance(m, LlamaDecoderLayer)]
    fused = [layer.fused for layer in layers]
    if not all(fused):
        sys.exit("the fused decoder layer does not run here (no AVX-512 VNNI or no C compiler): nothing to compare")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rows = []
    for kind, mi in capture_steps(llm, vocab).items():
        ms = replay(runner, mi, layers, fused, args.repeats)
        rows.append({"step": f"{kind}: {len(mi.input_ids)} tokens, {len(mi.seq_lens)} sequences, "
                             f"{sum(mi.seq_lens)} keys", "fused_ms": ms["fused"], "modules_ms": ms["modules"],
                     "ratio": ms["modules"] / ms["fused"]})
    report = {**base_metadata(sys.argv if argv is None else ["cpu_fused_bench", *argv]), "dtype": args.dtype,
              "repeats": args.repeats, "rows": rows}
    print(f"wrote {write_json(args.out, report)}")
    print(format_table(["step", "fused ms", "modules ms", "modules / fused"],
                       [[r["step"], r["fused_ms"], r["modules_ms"], r["ratio"]] for r in rows]))
    return report


if __name__ == "__main__":
    main()
