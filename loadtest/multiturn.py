"""Multi-turn chat benchmark: conversations sharing a long system prompt, compared across request routers.

    python -m loadtest --workload multiturn --model models/tiny-llama \\
        [--routers power_of_two,batch_affinity,prefix_affinity] [--replicas 2] [--num-conversations 8] \\
        [--num-turns 6] [--system-len 1024] [--user-len 64] [--output-len 64] [--rounds 1] \\
        [--serve-arg key=value ...] [--out bench_out/multiturn.json]
    python -m loadtest --workload multiturn --base-url http://127.0.0.1:8000 --model NAME ...  # a running server

A conversation is a chat [system, user 1, assistant 1, ..., user t]: turn t is sent once the answer
to turn t-1 is in (its text becomes the assistant message); the conversations run concurrently.
Every turn streams (greedy, ignore_eos, usage included), so the client times TTFT and reads the
usage's `prompt_tokens_details.cached_tokens`: the prefix hit rate is cached / prompt tokens over
all turns, and the prompt tokens computed per turn are what the cache did not save.

With a checkpoint dir as --model, one local Ray cluster runs the app once per router (each a fresh
app: a cold cache), `--replicas` engine replicas each, the same conversations for every router, in
the order given, `--rounds` times in turn. Printed last, per router (medians over rounds): hit rate,
prompt tokens computed per turn, TTFT p50/p90, e2e p50, output tok/s, and ratios to the first router.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.client import RequestRecord, Target, build_payload, endpoint_url, open_session, send_request
from loadtest.report import base_metadata, format_table, write_json
from loadtest.stats import summarize
from loadtest.workload import Conversation, make_conversations

ROUTERS = ("power_of_two", "batch_affinity", "prefix_affinity")
SERVED_NAME = "bench"
MAX_ERRORS_KEPT = 5


@dataclass
class Turn:
    conversation: int
    turn: int
    record: RequestRecord


async def run_conversation(client, target: Target, model: str, index: int, conv: Conversation,
                           output_len: int) -> list[Turn]:
    """The conversation's turns in order, each after the previous answer; it stops at a failed turn."""
    messages = [{"role": "system", "content": conv.system}]
    turns = []
    for t, user in enumerate(conv.user_turns):
        messages.append({"role": "user", "content": user})
        record = await send_request(client, target, build_payload(model, list(messages), output_len, "chat"))
        turns.append(Turn(index, t, record))
        if not record.ok:
            break
        messages.append({"role": "assistant", "content": record.text})
    return turns


def summarize_turns(turns: list[Turn], duration: float) -> dict:
    done = [t.record for t in turns if t.record.ok]
    errors = [t.record.error for t in turns if not t.record.ok]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    return {
        "num_turns": len(turns), "num_completed": len(done), "num_errors": len(errors),
        "errors": errors[:MAX_ERRORS_KEPT], "duration_s": duration,
        "usage_reported": all(r.prompt_tokens is not None for r in done),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else None,
        "computed_prompt_tokens_per_turn": (prompt - cached) / len(done) if done else None,
        "ttft_s": summarize([r.ttft for r in done]),
        "e2e_s": summarize([r.e2e for r in done]),
        "output_token_throughput": sum(r.output_tokens for r in done) / duration,
    }


async def run_workload(base_url: str, model: str, conversations: list[Conversation], output_len: int,
                       api_key: str | None = None, timeout_s: float = 300.0, num_warmup: int = 2) -> dict:
    """Warm-up requests (another system prompt: they share no prefix with the workload), then every
    conversation at once."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    target = Target(endpoint_url(base_url, "chat"), "chat", headers, timeout_s)
    async with open_session(len(conversations) + num_warmup) as client:
        warmups = [build_payload(model, [{"role": "user", "content": f"warm-up {i}"}], 4, "chat")
                   for i in range(num_warmup)]
        for record in await asyncio.gather(*(send_request(client, target, w) for w in warmups)):
            if not record.ok:
                raise RuntimeError(f"warm-up request to {target.url} failed: {record.error}")
        start = time.perf_counter()
        per_conv = await asyncio.gather(*(run_conversation(client, target, model, i, c, output_len)
                                          for i, c in enumerate(conversations)))
        duration = time.perf_counter() - start
    return summarize_turns([t for turns in per_conv for t in turns], duration)


def app_args(a: argparse.Namespace, router: str) -> dict:
    """The app for one router: `--replicas` engine replicas sharing this machine's cores."""
    threads = max(1, len(os.sched_getaffinity(0)) // a.replicas)
    args = {"model": str(a.model), "served_model_name": SERVED_NAME, "device": "cpu", "dtype": "float32",
            "min_replicas": a.replicas, "max_replicas": a.replicas, "engine_cpu_threads": threads,
            "request_router": router}
    return {**args, **dict(a.serve_arg)}


def run_routers(a: argparse.Namespace, conversations: list[Conversation]) -> list[dict]:
    """Each router's app in turn on one local cluster, `a.rounds` times; one result per run."""
    from serve_app.local import deployed_app, local_cluster

    runs = []
    num_cpus = max(a.replicas, len(os.sched_getaffinity(0)))
    with local_cluster(num_cpus=num_cpus) as cluster_url:
        for rnd in range(a.rounds):
            for router in a.routers:
                _progress(f"round {rnd + 1}/{a.rounds}: {router}")
                with deployed_app(cluster_url, app_args(a, router), f"multiturn_{router}") as url:
                    result = asyncio.run(run_workload(url, SERVED_NAME, conversations, a.output_len,
                                                      timeout_s=a.request_timeout, num_warmup=a.replicas))
                runs.append({"router": router, "round": rnd, **result})
    return runs


def medians(runs: list[dict]) -> dict[str, dict]:
    """Per router, the median over its rounds of each headline figure."""
    keys = {"prefix_hit_rate": lambda r: r["prefix_hit_rate"],
            "computed_prompt_tokens_per_turn": lambda r: r["computed_prompt_tokens_per_turn"],
            "ttft_p50_s": lambda r: r["ttft_s"]["p50"], "ttft_p90_s": lambda r: r["ttft_s"]["p90"],
            "e2e_p50_s": lambda r: r["e2e_s"]["p50"], "output_token_throughput": lambda r: r["output_token_throughput"]}
    out: dict[str, dict] = {}
    for router in dict.fromkeys(r["router"] for r in runs):
        mine = [r for r in runs if r["router"] == router]
        out[router] = {k: _median([get(r) for r in mine]) for k, get in keys.items()}
        out[router]["num_errors"] = sum(r["num_errors"] for r in mine)
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | str:
    return a / b if a is not None and b else "-"


def summary_table(summary: dict[str, dict]) -> str:
    base = next(iter(summary.values()))
    rows = [[router, s["prefix_hit_rate"] if s["prefix_hit_rate"] is not None else "-",
             _ratio(s["prefix_hit_rate"], base["prefix_hit_rate"]), s["computed_prompt_tokens_per_turn"] or "-",
             1e3 * s["ttft_p50_s"] if s["ttft_p50_s"] is not None else "-", _ratio(s["ttft_p50_s"], base["ttft_p50_s"]),
             1e3 * s["ttft_p90_s"] if s["ttft_p90_s"] is not None else "-",
             1e3 * s["e2e_p50_s"] if s["e2e_p50_s"] is not None else "-", s["output_token_throughput"],
             s["num_errors"]]
            for router, s in summary.items()]
    header = ["router", "hit rate", "hit x", "computed tok/turn", "TTFT p50 ms", "TTFT p50 x", "TTFT p90 ms",
              "E2E p50 ms", "out tok/s", "errors"]
    return format_table(header, rows) + f"\n(x: against {next(iter(summary))})"


def _progress(message: str) -> None:
    print(f"[loadtest multiturn] {message}", file=sys.stderr, flush=True)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, value


def _routers(text: str) -> list[str]:
    routers = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if not routers or bad:
        raise argparse.ArgumentTypeError(f"--routers {text!r}: choose from {', '.join(ROUTERS)}")
    return routers


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtest --workload multiturn", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint dir (the app is started per router), or with "
                    "--base-url the served model's name")
    ap.add_argument("--base-url", default=None, help="a running server: measure it as it is (no --routers)")
    ap.add_argument("--routers", type=_routers, default=list(ROUTERS))
    ap.add_argument("--replicas", type=int, default=2, help="engine replicas of each app")
    ap.add_argument("--num-conversations", type=int, default=8)
    ap.add_argument("--num-turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=1024, help="shared system prompt, in words (~tokens)")
    ap.add_argument("--user-len", type=int, default=64, help="each user message, in words")
    ap.add_argument("--output-len", type=int, default=64, help="tokens per answer")
    ap.add_argument("--rounds", type=int, default=1, help="run the routers this many times in turn; medians")
    ap.add_argument("--serve-arg", type=_key_value, action="append", default=[], help="an app arg for every router")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per turn")
    ap.add_argument("--out", type=Path, default=Path("bench_out/multiturn.json"))
    a = ap.parse_args(argv)
    for name in ("replicas", "rounds", "output_len"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.base_url is None and not Path(a.model).is_dir():
        ap.error(f"--model {a.model!r} is not a checkpoint dir (or give --base-url for a running server)")
    return a


def main(argv: list[str], command: list[str] | None = None) -> dict:
    """`command`: the command line to record (the API key redacted by the caller)."""
    a = parse_args(argv)
    try:
        conversations = make_conversations(a.num_conversations, a.num_turns, a.system_len, a.user_len, a.seed)
    except ValueError as e:
        sys.exit(f"loadtest multiturn: {e}")
    results = base_metadata(command or ["python", "-m", "loadtest", "--workload", "multiturn"])
    if a.base_url is not None:
        run = asyncio.run(run_workload(a.base_url, a.model, conversations, a.output_len, a.api_key,
                                       a.request_timeout))
        runs = [{"router": "server", "round": 0, **run}]
    else:
        runs = run_routers(a, conversations)
    results.update({"benchmark": "multiturn", "runs": runs, "summary": medians(runs),
                    "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                               if k != "api_key"}})
    write_json(a.out, results)
    print(f"wrote {a.out}")
    print(summary_table(results["summary"]))
    return results
