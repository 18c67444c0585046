"""loadtest/vllm_cpu.py without vLLM: the runner's protocol (through a stand-in runner), a vLLM
process that fails, the report's ratios, the arguments it refuses."""
import json
import os
import sys

import pytest

from loadtest import vllm_cpu

FAKE_RUNNER = '''
import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
work = json.load(open(args["--workload"]))
print("INFO vLLM logs go to stdout too")
print("VLLM_PEER " + json.dumps({"wall_s": 2.0, "cpu_s": 3.0, "token_ids": [[7] * r["max_tokens"] for r in work["requests"]],
                                 "env": [os.environ.get("PYTHONPATH"), os.environ["VLLM_CPU_KVCACHE_SPACE"],
                                         os.environ.get("VLLM_CPU_OMP_THREADS_BIND")],
                                 "dtype": args["--dtype"]}))
'''


def test_run_vllm_reads_the_marked_line_in_a_clean_environment(tmp_path, monkeypatch):
    runner = tmp_path / "runner.py"
    runner.write_text(FAKE_RUNNER)
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": [{"prompt_token_ids": [1, 2], "max_tokens": 3}], "warmup": []}))
    monkeypatch.setattr(vllm_cpu, "RUNNER", runner)
    monkeypatch.setenv("PYTHONPATH", "/our/tree")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    run = vllm_cpu.run_vllm(sys.executable, tmp_path / "model", "bfloat16", "auto", workload, timeout_s=60)
    assert run["token_ids"] == [[7, 7, 7]] and run["wall_s"] == 2.0 and run["dtype"] == "bfloat16"
    assert run["env"] == [None, "2", None]  # our tree off vLLM's path; a KV space that fits the box
    every_core = vllm_cpu.run_vllm(sys.executable, tmp_path / "model", "float32", "all", workload, timeout_s=60)
    assert every_core["env"][2] == f"0-{os.cpu_count() - 1}"


def test_a_vllm_process_that_fails_raises_with_its_last_lines(tmp_path):
    """The real runner under our Python: no vllm there, so it exits non-zero at the import."""
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": [], "warmup": []}))
    with pytest.raises(vllm_cpu.VllmFailed,
                       match=r"vLLM \(float32, bind auto\) exited with 1: ModuleNotFoundError: No module named 'vllm'"):
        vllm_cpu.run_vllm(sys.executable, tmp_path, "float32", "auto", workload, timeout_s=60)


FAILING_RUNNER = FAKE_RUNNER.replace("work = json", """with open(os.environ["CALLS"], "a") as f:
    f.write(args["--dtype"] + " " + args["--model"] + "\\n")
if args["--dtype"] == "float32" and args["--model"].endswith("-w8a8"):
    print("(Worker) ERROR RuntimeError: int8_scaled_mm_with_quant: expect A to be bfloat16 or half.")
    print("RuntimeError: Engine core initialization failed.")
    sys.exit(1)
work = json""")


def test_a_variant_vllm_cannot_run_is_recorded_and_not_retried(tmp_path, monkeypatch):
    """vLLM's W8A8 on an AMX host takes bf16 activations only: that variant fails, its root cause
    is kept, the next round skips it, and every other variant still runs."""
    runner, calls, workload = tmp_path / "runner.py", tmp_path / "calls", tmp_path / "w.json"
    runner.write_text(FAILING_RUNNER)
    workload.write_text(json.dumps({"requests": [{"prompt_token_ids": [1], "max_tokens": 2}], "warmup": []}))
    monkeypatch.setattr(vllm_cpu, "RUNNER", runner)
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setattr(vllm_cpu, "engine_source",  # no checkpoint written: the fake reads only its name
                        lambda model, quant: (model.with_name(model.name + "-w8a8") if quant == "w8a8" else model, None))
    args = vllm_cpu.parse_args(["--vllm-python", sys.executable, "--quantization", "none,w8a8", "--vllm-bind", "all"])
    model = tmp_path / "model-bench"
    best, failed = {}, {}
    for r in range(2):
        vllm_cpu.vllm_round(args, model, workload, best, failed, r)
    assert failed == {"float32+w8a8 bind=all": "RuntimeError: int8_scaled_mm_with_quant: expect A to be bfloat16 or half."}
    assert sorted(best) == ["vllm bfloat16 bind=all", "vllm bfloat16+w8a8 bind=all", "vllm float32 bind=all"]
    assert sum("float32 " in c and c.endswith("-w8a8") for c in calls.read_text().splitlines()) == 1
    assert len(calls.read_text().splitlines()) == 7  # 3 variants twice, the failing one once


def _run(wall_s, tokens):
    return {"wall_s": wall_s, "cpu_s": wall_s * 2, "token_ids": tokens}


def test_report_compares_each_sides_best_dtype_and_dtype_by_dtype():
    same, other = [[1, 2], [3]], [[1, 9], [3]]
    best = {"ours float32": _run(10.0, same), "ours bfloat16": _run(8.0, other), "ours float32+w8a8": _run(9.0, same),
            "vllm float32+w8a8 bind=all": _run(18.0, same),
            "vllm float32 bind=auto": _run(16.0, same), "vllm float32 bind=all": _run(20.0, same),
            "vllm bfloat16 bind=auto": _run(14.0, same), "vllm bfloat16 bind=all": _run(12.0, same)}
    report = vllm_cpu.build_report(best, useful=1200, threads=2)
    assert report["best"] == {"ours": "ours bfloat16", "vllm": "vllm bfloat16 bind=all"}
    assert report["ours_best_vs_vllm_best"] == pytest.approx(12.0 / 8.0)
    assert report["ours_vs_vllm_by_dtype"] == pytest.approx({"float32": 1.6, "bfloat16": 1.5, "float32+w8a8": 2.0})
    v = report["variants"]
    assert v["ours bfloat16"]["tokens_per_s"] == 150.0 and v["vllm float32 bind=auto"]["cpu_share"] == 1.0
    assert v["ours bfloat16"]["greedy_vs_first"]["num_mismatched"] == 1
    assert v["vllm bfloat16 bind=all"]["greedy_vs_first"]["num_mismatched"] == 0
    assert "1.50x" in vllm_cpu.summary_table(report)


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float32,int8"], "--dtype has unknown value(s) ['int8']"),
    (["--vllm-dtype", "fp8"], "--vllm-dtype has unknown value(s) ['fp8']"),
    (["--rounds", "0"], "--rounds=0 must be >= 1"),
    (["--vllm-bind", "auto,numa"], "--vllm-bind has unknown value(s) ['numa']"),
    (["--quantization", "none,awq"], "--quantization has unknown value(s) ['awq']"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--vllm-python", sys.executable, *argv])
    assert message in capsys.readouterr().err


def test_a_missing_vllm_python_is_refused(capsys):
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--vllm-python", "/nowhere/python"])
    assert "--vllm-python=/nowhere/python is not a file" in capsys.readouterr().err
