"""Online serving sweep against one endpoint: closed-loop concurrency levels, or open-loop request rates.

At concurrency c, c workers each send their next request as soon as the last
one finishes, until `num_prompts` requests are done. At request rate r, requests
arrive as a Poisson process of rate r/s (loadtest.open_loop), `num_prompts` per
level, in the order given (so `1,4,8,4,1` is a ramp up and down). Every level
gets prompts of its own (a different seed), so a prefix cache warmed by one level
cannot flatter the next.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from loadtest.client import RequestRecord, Target, build_payload, endpoint_url, open_session, send_request
from loadtest.open_loop import run_rate_level
from loadtest.stats import find_knee, summarize
from loadtest.workload import make_token_id_prompts, make_word_prompts

MAX_ERRORS_KEPT = 5  # error messages stored per level; the count is always exact


@dataclass
class OnlineConfig:
    base_url: str
    model: str
    concurrency: list[int]
    num_prompts: int
    input_len: int
    output_len: int
    out_dir: Path
    endpoint: str = "completions"
    api_key: str | None = None
    seed: int = 0
    request_timeout: float = 300.0
    token_ids: bool = False          # send prompts as lists of token ids (completions only)
    num_warmup: int = 1              # untimed requests before the first level
    extra: dict = field(default_factory=dict)  # anything else to record with the results
    request_rates: list[float] | None = None  # open loop: requests/s per level (then `concurrency` is unused)
    max_concurrency: int | None = None        # open loop: cap on requests in flight (None: no cap)

    def __post_init__(self) -> None:
        endpoint_url(self.base_url, self.endpoint)  # validates both
        if self.request_rates is not None and (not self.request_rates or any(not r > 0 for r in self.request_rates)):
            raise ValueError(f"request_rates={self.request_rates!r} must be a non-empty list of rates > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be >= 1")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency={self.concurrency!r} must be a non-empty list of ints >= 1")
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout={self.request_timeout} must be > 0")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup={self.num_warmup} must be >= 0")
        if self.token_ids and self.endpoint != "completions":
            raise ValueError("token_ids=True needs endpoint='completions' (chat takes text)")
        self.concurrency = sorted(set(self.concurrency))
        self.out_dir = Path(self.out_dir)

    def target(self) -> Target:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return Target(url=endpoint_url(self.base_url, self.endpoint), endpoint=self.endpoint,
                      headers=headers, timeout_s=self.request_timeout)

    def prompts(self, seed: int, num: int) -> list:
        if self.token_ids:
            return make_token_id_prompts(num, self.input_len, seed)
        return make_word_prompts(num, self.input_len, seed)


async def run_level(client: aiohttp.ClientSession, cfg: OnlineConfig, concurrency: int) -> dict:
    """Send `num_prompts` requests through `concurrency` workers; summarize the records."""
    target = cfg.target()
    prompts = cfg.prompts(seed=cfg.seed * 100_003 + concurrency, num=cfg.num_prompts)
    pending = iter(prompts)  # shared: each worker takes the next prompt, so the count is bounded
    records: list[RequestRecord] = []

    async def worker() -> None:
        for prompt in pending:
            payload = build_payload(cfg.model, prompt, cfg.output_len, cfg.endpoint)
            records.append(await send_request(client, target, payload))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, cfg.num_prompts))))
    duration = time.perf_counter() - start
    return summarize_level(records, duration, concurrency=concurrency)


def summarize_level(records: list[RequestRecord], duration: float, **load) -> dict:
    """`load`: concurrency=c (closed loop), or request_rate=r and max_concurrency (open loop)."""
    done = [r for r in records if r.ok]
    errors = [r.error for r in records if not r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        **load,
        "num_requests": len(records),
        "num_completed": len(done),
        "num_errors": len(errors),
        "errors": errors[:MAX_ERRORS_KEPT],
        "duration_s": duration,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_token_throughput": output_tokens / duration,
        "ttft_s": summarize([r.ttft for r in done]),
        "tpot_s": summarize([r.tpot for r in done if r.tpot is not None]),
        "itl_s": summarize([gap for r in done for gap in r.itls]),
        "e2e_s": summarize([r.e2e for r in done]),
    }


async def warm_up(client: aiohttp.ClientSession, cfg: OnlineConfig) -> None:
    """Untimed requests first (compilation, allocation); the server must answer at all."""
    if cfg.num_warmup == 0:
        return
    target = cfg.target()
    for prompt in cfg.prompts(seed=cfg.seed * 100_003 + 99_991, num=cfg.num_warmup):
        record = await send_request(client, target, build_payload(cfg.model, prompt, min(cfg.output_len, 16),
                                                                  cfg.endpoint))
        if not record.ok:
            raise RuntimeError(f"warm-up request to {target.url} failed: {record.error}")


def load_kind(levels: list[dict]) -> str:
    """The x axis of a run: "concurrency" (closed loop) or "request_rate" (open loop)."""
    return "request_rate" if levels and "request_rate" in levels[0] else "concurrency"


def knee_of(levels: list[dict]) -> dict:
    kind = load_kind(levels)
    knee = find_knee([(lv[kind], lv["e2e_s"]["p50"] or 0.0, lv["output_token_throughput"]) for lv in levels])
    value = knee.pop("concurrency")  # find_knee's x is whatever the load is
    return {"load": kind, kind: value, **knee}


async def run_sweep(cfg: OnlineConfig) -> dict:
    """Every level in increasing concurrency, over one connection pool sized for the largest."""
    pool = max(cfg.concurrency) if cfg.request_rates is None else (cfg.max_concurrency or cfg.num_prompts)
    async with open_session(pool) as client:  # each request is bounded by cfg.request_timeout (send_request)
        await warm_up(client, cfg)
        if cfg.request_rates is None:
            levels = [await run_level(client, cfg, c) for c in cfg.concurrency]
        else:
            levels = [await run_rate_level(client, cfg, r, i) for i, r in enumerate(cfg.request_rates)]
    config = asdict(cfg) | {"out_dir": str(cfg.out_dir), "api_key": "***" if cfg.api_key else None}
    return {"benchmark": "online", "config": config, "url": cfg.target().url,
            "levels": levels, "knee": knee_of(levels)}
