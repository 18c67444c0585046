"""One streaming request against an OpenAI-compatible server, timed per chunk.

Raw SSE over aiohttp rather than the openai client: the timestamps are taken
the moment each `data:` line arrives, with no client-side parsing in between.
aiohttp, not httpx: the load generator may share the cores with the server it
measures, and httpx's line reader costs more CPU per request and per streamed chunk
(docs/benchmarks.md, fifth session, "The load generator on aiohttp").
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from loadtest.sse import DONE, parse_chunk, sse_data

ENDPOINT_PATHS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass
class RequestRecord:
    """The timing of one request; all times in seconds from its submission."""

    ok: bool = False
    ttft: float | None = None                         # first non-empty text chunk
    itls: list[float] = field(default_factory=list)   # gaps between consecutive non-empty text chunks
    e2e: float | None = None                          # until the stream ended
    output_tokens: int = 0                            # usage.completion_tokens, else non-empty chunks
    error: str | None = None
    prompt_tokens: int | None = None                  # usage.prompt_tokens, when the server sends usage
    cached_tokens: int | None = None                  # of those, served from a prefix cache
    text: str = ""                                    # the generated text (choice 0)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def endpoint_url(base_url: str, endpoint: str) -> str:
    """`http://host:port` or `http://host:port/v1` plus the endpoint's path."""
    if endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"endpoint={endpoint!r} must be one of {sorted(ENDPOINT_PATHS)}")
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url={base_url!r} must start with http:// or https://")
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ENDPOINT_PATHS[endpoint]


def build_payload(model: str, prompt: str | list[int] | list[dict], max_tokens: int, endpoint: str) -> dict:
    """Greedy, exactly `max_tokens` tokens (`ignore_eos` is vLLM's extra; others ignore it),
    with the usage chunk so the token count is the server's, not a chunk count. For chat the
    prompt is the user's text, or the whole list of messages."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if endpoint == "chat":
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            body["messages"] = prompt
            return body
        if not isinstance(prompt, str):
            raise ValueError("token-id prompts need the completions endpoint")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def open_session(max_connections: int, timeout_s: float | None = None) -> aiohttp.ClientSession:
    """The connection pool of a run. No proxy from the environment (aiohttp's default): requests
    go to the URL given and nowhere else."""
    # read_bufsize: a line (one SSE event) may be up to twice this long; logprobs make long ones.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s), read_bufsize=1 << 20)


async def _read_stream(response: aiohttp.ClientResponse, endpoint: str, start: float, max_events: int,
                       record: RequestRecord) -> None:
    last_token_at = None
    num_text_chunks = 0
    texts = []
    num_events = 0
    async for raw in response.content:  # one line at a time, b"\n" included
        now = time.perf_counter()
        payload = sse_data(raw.decode().rstrip("\r\n"))
        if payload is None:
            continue
        if payload.strip() == DONE:
            break
        num_events += 1
        if num_events > max_events:
            raise RuntimeError(f"more than {max_events} events in one stream")
        chunk = parse_chunk(payload, endpoint)
        if chunk.error is not None:
            raise RuntimeError(f"server error mid-stream: {chunk.error}")
        if chunk.completion_tokens is not None:
            record.output_tokens = chunk.completion_tokens
        if chunk.prompt_tokens is not None:
            record.prompt_tokens, record.cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
        if chunk.text:
            texts.append(chunk.text)
            num_text_chunks += 1
            if last_token_at is None:
                record.ttft = now - start
            else:
                record.itls.append(now - last_token_at)
            last_token_at = now
    record.e2e = time.perf_counter() - start
    record.text = "".join(texts)
    if record.output_tokens == 0:
        record.output_tokens = num_text_chunks
    if record.ttft is None:
        raise RuntimeError("the stream ended without any generated text")


@dataclass(frozen=True)
class Target:
    """Where and how every request of a run is sent."""

    url: str                 # the full endpoint URL, from endpoint_url()
    endpoint: str            # "completions" | "chat": where the text sits in a chunk
    headers: dict            # e.g. the Authorization header
    timeout_s: float         # per request, connect to last byte


async def _post_and_read(client: aiohttp.ClientSession, target: Target, payload: dict,
                         record: RequestRecord) -> None:
    # Bounds a stream that never ends; a normal one has about max_tokens + 2 events.
    max_events = 4 * payload["max_tokens"] + 64
    start = time.perf_counter()
    async with client.post(target.url, json=payload, headers=target.headers) as response:
        if response.status != 200:
            body = (await response.read())[:300].decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status}: {body}")
        await _read_stream(response, target.endpoint, start, max_events, record)


async def send_request(client: aiohttp.ClientSession, target: Target, payload: dict) -> RequestRecord:
    """A failed request (HTTP status, connection, timeout, bad stream) comes back as
    `RequestRecord(ok=False, error=...)`, so one failure never stops a level."""
    record = RequestRecord()
    try:
        await asyncio.wait_for(_post_and_read(client, target, payload, record), target.timeout_s)
        record.ok = True
    except (asyncio.TimeoutError, TimeoutError):
        record.error = f"timed out after {target.timeout_s:g} s"
    except (aiohttp.ClientError, RuntimeError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record
