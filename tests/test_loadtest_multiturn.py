"""loadtest/multiturn.py: chats against the fake OpenAI server (each turn carries the whole history,
sent once the previous answer is in), the hit-rate arithmetic, and its command line."""
import json

import pytest

from loadtest.client import RequestRecord
from loadtest.multiturn import Turn, summarize_turns
from loadtest.sse import parse_chunk
from loadtest.workload import make_conversations
from tests.test_loadtest import fake_server  # noqa: F401 - the fixture


def test_each_turn_carries_the_history_with_the_answers_before_it(fake_server, tmp_path):  # noqa: F811
    from loadtest.__main__ import main

    out = main(["--workload", "multiturn", "--base-url", fake_server.url, "--model", "m", "--num-conversations", "2",
                "--num-turns", "3", "--system-len", "5", "--user-len", "3", "--output-len", "2",
                "--out", str(tmp_path / "mt.json"), "--api-key", "secret"])
    chats = [b["messages"] for b in fake_server.bodies if b["messages"][0]["role"] == "system"]
    assert len(chats) == 6 and len({m[0]["content"] for m in chats}) == 1  # one shared system prompt
    for c in range(2):
        mine = [m for m in chats if m[1]["content"].startswith(f"c{c}t0 ")]
        assert [len(m) for m in mine] == [2, 4, 6]  # in order: each after the answer before it
        assert [m["content"] for m in mine[-1] if m["role"] == "assistant"] == [" w0 w1", " w0 w1"]
        assert [m["content"].split()[0] for m in mine[-1] if m["role"] == "user"] == [f"c{c}t{t}" for t in range(3)]
    run = out["runs"][0]
    assert run["num_completed"] == 6 and run["usage_reported"] and run["prefix_hit_rate"] == 0.0
    assert "secret" not in (tmp_path / "mt.json").read_text()
    assert json.loads((tmp_path / "mt.json").read_text())["summary"]["server"]["num_errors"] == 0


def test_hit_rate_is_cached_over_prompt_tokens_of_the_answered_turns():
    records = [RequestRecord(ok=True, ttft=0.1, e2e=0.5, output_tokens=4, prompt_tokens=100, cached_tokens=60),
               RequestRecord(ok=True, ttft=0.3, e2e=0.7, output_tokens=4, prompt_tokens=50, cached_tokens=0),
               RequestRecord(ok=False, error="HTTP 503")]
    s = summarize_turns([Turn(0, t, r) for t, r in enumerate(records)], duration=2.0)
    assert s["prefix_hit_rate"] == pytest.approx(60 / 150) and s["computed_prompt_tokens_per_turn"] == 45
    assert (s["num_completed"], s["num_errors"], s["errors"]) == (2, 1, ["HTTP 503"])
    assert s["ttft_s"]["p50"] == pytest.approx(0.2) and s["output_token_throughput"] == 4.0


def test_usage_cached_tokens_are_read_from_the_stream():
    usage = parse_chunk('{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,'
                        '"prompt_tokens_details":{"cached_tokens":8}}}', "chat")
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (9, 8, 2)
    assert parse_chunk('{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}', "chat").cached_tokens == 0


def test_bad_sizes_and_routers_are_refused_by_name(capsys):
    from loadtest.__main__ import main

    with pytest.raises(SystemExit):
        main(["--workload", "multiturn", "--model", "m", "--base-url", "http://h:1", "--routers", "random"])
    assert "--routers 'random'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="num_turns=0"):
        make_conversations(2, 0, 8, 4, seed=0)
    with pytest.raises(SystemExit):
        main(["--workload", "multiturn", "--model", "no/such/dir"])
    assert "not a checkpoint dir" in capsys.readouterr().err
