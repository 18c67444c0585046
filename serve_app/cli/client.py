"""A small OpenAI-protocol client for the verbs that talk to a running server (chat, complete,
models): httpx, SSE parsed by hand, no openai dependency."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from serve_app.cli.preflight import CliError

DEFAULT_URL = "http://127.0.0.1:8000"


def add_endpoint_args(parser) -> None:
    parser.add_argument("--url", default=os.environ.get("RAYLLM_URL", DEFAULT_URL),
                        help="the server's base URL, with or without /v1 [default: $RAYLLM_URL or %(default)s]")
    parser.add_argument("--api-key", default=os.environ.get("RAYLLM_API_KEY"),
                        help="sent as `Authorization: Bearer KEY` [default: $RAYLLM_API_KEY]")


def add_model_arg(parser) -> None:
    parser.add_argument("--model", help="the served model name [default: the server's first model]")


class Client:
    def __init__(self, url: str, api_key: str | None, timeout_s: float = 600.0):
        import httpx

        self.base = url.rstrip("/").removesuffix("/v1") + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=5.0))

    def models(self) -> list[dict[str, Any]]:
        return self._request("GET", "/models").json()["data"]

    def model_name(self, name: str | None) -> str:
        if name:
            return name
        models = self.models()
        if not models:
            raise CliError(f"{self.base}/models lists no model")
        return models[0]["id"]

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The SSE chunks of a streamed request, up to `[DONE]`; an `error` event raises CliError."""
        import httpx

        try:
            with self._http.stream("POST", self.base + path, json={**body, "stream": True}) as response:
                if response.status_code != 200:
                    response.read()
                    raise CliError(_error_text(response))
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise CliError(chunk["error"].get("message", str(chunk["error"])))
                    yield chunk
        except httpx.HTTPError as e:
            raise CliError(f"{self.base}: {e or type(e).__name__}") from None

    def _request(self, method: str, path: str, **kwargs):
        import httpx

        try:
            response = self._http.request(method, self.base + path, **kwargs)
        except httpx.HTTPError as e:
            raise CliError(f"{self.base}{path}: {e or type(e).__name__} (is `rayllm serve` running there?)") from None
        if response.status_code != 200:
            raise CliError(_error_text(response))
        return response


def _error_text(response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return f"HTTP {response.status_code}: {message}"
