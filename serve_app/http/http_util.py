"""HTTP plumbing of the Ingress: body limits, API key, and OpenAI-shaped error answers for every failure."""
from __future__ import annotations

import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.http.access_log import log_access
from serve_app.http.errors import OpenAIError, bad_request, body_too_large, internal_error, route_not_found, unauthorized

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes before reading it all."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            if int(length) > limit:
                raise body_too_large(limit)
        except ValueError:
            raise bad_request("Invalid Content-Length header.") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless `Authorization: Bearer <api_key>` (when a key is configured)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise unauthorized()


def error_response(err: OpenAIError, request: Request | None = None) -> JSONResponse:
    """The error as OpenAI's body; counted in the replica's request metrics and written to its access
    log when `request` is given."""
    if request is not None:
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.count_status(err.status_code)
        arrival = getattr(request.state, "arrival", None)  # unset: refused before a route ran (404, 405)
        info = getattr(request.state, "access_info", None)  # set: the engine had the request
        log_access(request.method, request.url.path, err.status_code,
                   None if arrival is None else time.monotonic() - arrival,
                   None if info is None else info.num_prompt_tokens, None, None if info is None else info.request_id)
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's body: ours, unknown routes, and (never expected) our own bugs."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc, request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):
            return error_response(route_not_found(request.url.path, exc.status_code), request)
        err = OpenAIError(exc.status_code, str(exc.detail), type="invalid_request_error")
        return error_response(err, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(bad_request(f"Invalid request: {exc.errors()[:1]}"), request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the Ingress")
        return error_response(internal_error(), request)
