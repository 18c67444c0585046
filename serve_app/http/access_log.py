"""The Ingress's access log: one INFO line per finished request, never its text.

    POST /v1/chat/completions 200 prompt_tokens=31 completion_tokens=16 latency=0.412s id=chatcmpl-9f...
    POST /v1/completions 400 prompt_tokens=- completion_tokens=- latency=0.002s id=-

Written where the outcome is known: the generation routes' RequestRecorder
(serve_app/metrics.py) when the body or the stream ends (499: the client went away), and
every error answer (http_util.error_response). It goes to the Ingress replica's log under
Serve's logger, in Serve's high-throughput mode too, where Serve writes no access log of its
own. Token counts are the engine's (a prompt's tokens, the tokens generated for it, all
choices together); a completion's text and the prompt's never appear at any level.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("ray.serve.serve_app.access")  # under Serve's logger: in the replica logs


@dataclass
class RequestInfo:
    """What the access line says about a generation request, besides its outcome."""

    method: str  # "POST"
    route: str  # the URL path, "/v1/completions"
    request_id: str  # "cmpl-...", what the response's `id` says
    num_prompt_tokens: int  # all prompts of the request together
    arrival: float  # time.monotonic() when the Ingress began reading the request


def log_access(method: str, route: str, status: int, latency_s: float | None,
               num_prompt_tokens: int | None = None, num_output_tokens: int | None = None,
               request_id: str | None = None) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    logger.info("%s %s %d prompt_tokens=%s completion_tokens=%s latency=%s id=%s", method, route, status,
                "-" if num_prompt_tokens is None else num_prompt_tokens,
                "-" if num_output_tokens is None else num_output_tokens,
                "-" if latency_s is None else f"{latency_s:.3f}s", request_id or "-")
