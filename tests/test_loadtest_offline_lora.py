"""loadtest/offline_lora.py (`python -m loadtest.offline --lora N`) end to end on the tiny model:
random PEFT adapters the engine accepts, both engines in alternating rounds, the ratio and the JSON."""
import json

import pytest
import torch

from loadtest.offline import main, parse_args


def test_lora_mode_writes_the_ratio_of_both_engines(tiny_llama, tmp_path, capsys):
    out = tmp_path / "lora.json"
    threads = torch.get_num_threads()  # main() sets its --threads for the process
    try:
        report = main(["--quick", "--num-requests", "3", "--model-dir", tiny_llama, "--lora", "3",
                       "--max-loras", "2", "--rounds", "2", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.read_text())
    assert saved["lora"] == {**saved["lora"], "num_adapters": 3, "max_loras": 2, "rank": 8}
    assert len(saved["ratio_rounds"]) == 2 and saved["ratio_median"] > 0
    assert len(saved["base"]["elapsed_s_rounds"]) == len(saved["with_lora"]["elapsed_s_rounds"]) == 2
    # Random adapters of rank 8 on every projection change the greedy tokens of every request.
    assert saved["requests_changed_by_adapter"] == 3
    assert saved["workload"]["num_useful_output_tokens"] == report["workload"]["num_useful_output_tokens"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("LoRA / base throughput: ") and "3 adapters, max_loras 2, rank 8" in last


@pytest.mark.parametrize("flags,named", [(["--lora", "-1"], "--lora=-1"), (["--max-loras", "0"], "--max-loras=0"),
                                         (["--lora-rank", "0"], "--lora-rank=0")])
def test_bad_lora_flags_are_refused_by_name(flags, named, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert named in capsys.readouterr().err
