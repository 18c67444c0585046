"""loadtest/online_spec.py without a cluster: its arguments, its reading of /metrics, its summary.
The benchmark itself runs two apps (docs/benchmarks.md has its figures)."""
import httpx
import pytest

from loadtest import online_spec


def _run(variant: str, rnd: int, tok_s: float, texts: list[str], counters: dict | None = None) -> dict:
    level = {"tokens_per_s": tok_s, "ttft_p50_s": 0.1, "tpot_p50_s": 0.02, "texts": texts,
             "counters": counters or dict.fromkeys(online_spec.SPEC_COUNTERS, 0.0)}
    return {"variant": variant, "round": rnd, "levels": [level]}


def test_summary_takes_medians_and_counts_what_drafts_did_and_where_greedy_answers_differ():
    levels = [("copy", 1, 0.0, [object()] * 3)]
    spec = {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 30.0}
    runs = [_run("baseline", 0, 100.0, ["a", "b", "c"]), _run("spec", 0, 250.0, ["a", "b", "c"], spec),
            _run("spec", 1, 150.0, ["a", "x", "c"], spec), _run("baseline", 1, 100.0, ["a", "b", "c"]),
            _run("spec", 2, 200.0, ["a", "b", "c"], spec), _run("baseline", 2, 120.0, ["a", "b", "c"])]
    (row,) = online_spec.summarize_runs(runs, levels)
    assert row["baseline"]["tokens_per_s"] == 100.0 and row["spec"]["tokens_per_s"] == 200.0
    assert row["speedup"] == 2.0
    assert row["acceptance_rate"] == 0.75 and row["mean_acceptance_length"] == 4.0
    assert row["greedy_mismatches"] == 1  # the worst round counts


def test_sampled_levels_are_not_compared_token_for_token():
    levels = [("random", 4, 1.0, [object()])]
    runs = [_run("baseline", 0, 10.0, ["p"]), _run("spec", 0, 9.0, ["q"])]
    (row,) = online_spec.summarize_runs(runs, levels)
    assert "greedy_mismatches" not in row and row["mean_acceptance_length"] == 1.0  # no drafts: 1 token a step


def test_spec_counters_sum_the_apps_series_only(monkeypatch):
    text = ('ray_rayllm_spec_decode_num_drafts_total{application="spec_spec",replica="r1"} 3.0\n'
            'ray_rayllm_spec_decode_num_drafts_total{application="spec_spec",replica="r2"} 4.0\n'
            'ray_rayllm_spec_decode_num_drafts_total{application="other",replica="r3"} 100.0\n'
            'ray_rayllm_spec_decode_num_accepted_tokens_total{application="spec_spec",replica="r1"} 9.0\n'
            'ray_rayllm_spec_decode_num_accepted_tokens_per_pos_0_total{application="spec_spec"} 50.0\n')
    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(200, text=text))
    assert online_spec.spec_counters("http://h:1/spec_spec") == {"drafts": 7.0, "draft_tokens": 0.0,
                                                                 "accepted_tokens": 9.0}


def test_app_args_add_the_speculative_config_to_the_spec_app_only(tmp_path):
    a = online_spec.parse_args(["--model", str(tmp_path), "--concurrency", "1,8", "--serve-arg", "max_model_len=512"])
    base, spec = online_spec.app_args(a, "baseline"), online_spec.app_args(a, "spec")
    assert "speculative_config" not in base and base["max_num_seqs"] == 8 and base["max_model_len"] == "512"
    assert spec["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                          "prompt_lookup_max": 4}


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1,x"], "--concurrency '1,x'"),
    (["--concurrency", "0"], "every level must be >= 1"),
    (["--workloads", "copy,nope"], "choose from copy, random"),
    (["--rounds", "0"], "--rounds=0 must be >= 1"),
    (["--speculative", "draft"], "--speculative draft needs --draft-model"),
])
def test_bad_arguments_are_refused_naming_them(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        online_spec.parse_args(["--model", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_a_model_that_is_not_a_directory_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        online_spec.parse_args(["--model", str(tmp_path / "nope")])
    assert "is not a checkpoint dir" in capsys.readouterr().err
