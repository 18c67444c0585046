"""The Ingress deployment: OpenAI's HTTP surface (FastAPI under `@serve.ingress`) with micro-batched prompt work.

    request -> auth, body limit, pydantic validation (400s) -> admission (503 + Retry-After)
            -> _prepare: @serve.batch of PrepJobs: chat templates + tokenization, one call per batch
            -> one engine stream per prompt (via Guardrails when the output has a contract: JSON, tool calls)
            -> JSON body, or SSE chunks ... data: [DONE]

Batching and streaming: the batch covers only the prompt work, which ends before any
token is generated; then every request opens its own stream, from its own task. So a
disconnect cancels exactly that task's stream (and through it the engine request),
whether or not the request went through a batch, and a slow reader never holds up
the others. A request cancelled while waiting in the batch queue is dropped from the
batch by Serve before it reaches the engine at all.

Where the engine is (`colocate_ingress`) is build_app's choice, made once: by default the
Ingress gets the engine replicas' and Guardrails' handles (one gRPC stream per engine request)
and scales apart from them. With `colocate_ingress` it gets a LocalEngineFactory instead and
calls it once here: every engine replica is an Ingress replica too, whose streams are iterated
directly, and JSON requests go through a JsonGuard here instead of the Guardrails deployment.
Either way the Ingress talks to one client interface (serve_app/replica/client.py). On a CPU box
the colocated shape takes a process and a hop per stream off the engine's cores; on a GPU host
the separate shape keeps the HTTP work and the engine's front in two processes (two GILs):
docs/benchmarks.md.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from engine.core.detokenizer import decode_token
from engine.entrypoints.prompts import load_tokenizer
from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from serve_app.args import AppArgs, BatchingConfig, describe_validation_error
from serve_app.replica.client import LocalEngineFactory, RemoteEngine, merge_streams
from serve_app.replica.draining import flush_serve_logs
from serve_app.http.errors import OpenAIError, bad_request, from_validation_error, from_value_error, overloaded
from serve_app.http.http_util import check_api_key, error_response, install_error_handlers, read_body
from serve_app.http.access_log import RequestInfo
from serve_app.http.messages import EngineRequest, OutputSpec, adapter_model_id
from serve_app.http.cluster_metrics import ClusterMetrics
from serve_app.metrics import IngressMetrics
from serve_app.http.preprocess import ModelLimits, Prepared, PrepJob, prepare_batch
from serve_app.http.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.http.responses import ChatBuilder, CompletionBuilder, ResponseBuilder
from serve_app.http.served_models import ServedModels
from serve_app.http.streaming import Generation

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs

app = FastAPI(title="rayllm: OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(app)

_INLINE_PREP_CHARS = 16_384  # below this much text a batch is tokenized on the event loop (no thread hop)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# The engine's tokenizer class (AutoTokenizer), so the prompt ids we send are the ones it would make;
# transformers is imported when it is called, not here: importing this module stays torch-free.
_load_tokenizer = load_tokenizer


def _sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    try:
        return req.to_sampling_params()
    except InvalidRequestError as e:  # named already after the field the client sent
        raise bad_request(str(e), param=e.param, code=e.code) from None
    except ValueError as e:
        raise from_value_error(e) from None


def _output_spec(req: ChatCompletionRequest, args: AppArgs) -> OutputSpec:
    try:
        return req.output_spec(args.reasoning_parser, args.tool_call_parser)
    except InvalidRequestError as e:
        raise bad_request(str(e), param=e.param) from None


def _adapter_key(lora: LoRARequest | None) -> str | None:
    """What a micro-batch's routing decisions are per: the adapter (None: the base model). A batch goes
    to one engine replica, and a replica that holds one adapter may not hold another."""
    return adapter_model_id(lora) if lora is not None else None


class _SSEResponse(StreamingResponse):
    """A Generation's SSE answer; owns the request's admission slot and engine streams until it ends.

    The cleanup is in __call__'s `finally`, not in the body generator's: Starlette starts the
    generator only once http.response.start has gone out, so for a client gone before that
    (the send fails, or its http.disconnect wins) the generator's `finally` never runs: the
    slot would leak, and the engine would keep generating for nobody.
    """

    def __init__(self, gen: Generation, items, release: Callable[[], None]):
        self._gen = gen
        self._events = gen.sse()
        self._items = items
        self._release: Callable[[], None] | None = release
        super().__init__(self._events, media_type="text/event-stream", headers=_SSE_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._end()

    async def _end(self) -> None:
        release, self._release = self._release, None
        if release is None:  # ended already: the slot is released exactly once
            return
        release()  # first, and synchronously: nothing below can keep the slot taken
        try:
            await self._events.aclose()  # a started stream records its outcome (499: the client left)
        finally:
            # A stream that never started recorded nothing: the client left before the first byte.
            self._gen.metrics.finished(499, time.monotonic() - self._gen.start)  # no-op if recorded
            await self._items.aclose()  # stops every engine stream of this request still running


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: DeploymentHandle | None, guardrails: DeploymentHandle | None, args: AppArgs,
                 local_engine: LocalEngineFactory | None = None):
        """engine and guardrails: the deployments' handles; or, with `colocate_ingress`, both None and
        `local_engine`, which starts this replica's own engine (build_app picks the shape)."""
        self.args = args
        if local_engine is not None:
            self.engine, self.json_engine = local_engine()
        else:
            self.engine, self.json_engine = RemoteEngine(engine), RemoteEngine(guardrails, adapter_routing=False)
        self.tokenizer = _load_tokenizer(args.tokenizer or args.model)
        self.metrics = IngressMetrics(args.metrics_prefix, args.model_name)
        # GET /metrics: every replica's series (and Serve's own), as Ray exports them (cluster_metrics.py)
        self.cluster_metrics = ClusterMetrics((f"ray_{args.metrics_prefix}_", "ray_serve_"))
        app.state.metrics = self.metrics  # error answers are counted by status too (http_util)
        self.batching = args.batching()
        self.models = ServedModels(args, self.engine)  # the base model and the LoRA adapters
        self._limits: ModelLimits | None = None
        self._num_pending = 0

    def reconfigure(self, config: dict[str, Any]) -> None:
        """user_config: micro-batching knobs and admission limit (BatchingConfig), changed without a
        restart; with `colocate_ingress` also the engine's knobs, which its client takes out first."""
        own = self.engine.reconfigure(dict(config or {}))  # a bad engine knob raises, naming it
        try:
            cfg = BatchingConfig.model_validate(own)
        except ValidationError as e:
            raise ValueError("invalid Ingress user_config: " + describe_validation_error(e)) from None
        self._prepare_batch.set_max_batch_size(cfg.max_batch_size)
        self._prepare_batch.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)
        self.batching = cfg
        logger.info("batching: max_batch_size=%d batch_wait_timeout_s=%s", cfg.max_batch_size,
                    cfg.batch_wait_timeout_s)

    # -- routes ---------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        req, lora = await self._parse(request, CompletionRequest)
        params = _sampling_params(req)
        with self._admit():
            prepared = await self._prepare(PrepJob(max_tokens=req.max_tokens, prompts=req.prompts(),
                                                   adapter=_adapter_key(lora)))
            request_id = f"cmpl-{uuid.uuid4().hex}"
            echo = [t if t is not None else self.tokenizer.decode(ids)
                    for t, ids in zip(prepared.prompt_texts, prepared.prompt_token_ids)] if req.echo else None
            # The engine's prompt logprobs start at the second token: the first one's text comes from here.
            first_tokens = [decode_token(self.tokenizer, ids[0]) for ids in prepared.prompt_token_ids] \
                if req.echo and req.logprobs is not None else None
            builder = CompletionBuilder(request_id, req.model, req.n, len(prepared.prompt_token_ids), req.logprobs,
                                        req.include_usage, echo_texts=echo, echo_first_tokens=first_tokens)
            source = req.structured_source
            output = OutputSpec(param=source) if req.json_mode else None
            return await self._generate(request, request_id, prepared, params, builder, req.stream, output, source,
                                        lora, req.priority)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        req, lora = await self._parse(request, ChatCompletionRequest)
        params = _sampling_params(req)
        output = _output_spec(req, self.args)
        with self._admit():
            prepared = await self._prepare(PrepJob(
                max_tokens=params.max_tokens, messages=req.template_messages(),
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                tools=req.template_tools(), chat_template_kwargs=req.chat_template_kwargs,
                adapter=_adapter_key(lora)))
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            k = (req.top_logprobs or 0) if req.logprobs else None
            # Without a reasoning parser or tools the text is all content: nothing to read per delta.
            reads = output.reasoning_parser is not None or output.tools is not None
            builder = ChatBuilder(request_id, req.model, req.n, 1, k, req.include_usage,
                                  output=output if reads else None, include_reasoning=req.include_reasoning)
            return await self._generate(request, request_id, prepared, params, builder, req.stream,
                                        output if req.json_mode else None, req.structured_source, lora, req.priority)

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> dict:
        check_api_key(request, self.args.api_key)
        return {"object": "list", "data": self.models.cards((await self._model_limits()).max_model_len)}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> dict:
        check_api_key(request, self.args.api_key)
        return self.models.card(model_id, (await self._model_limits()).max_model_len)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        check_api_key(request, self.args.api_key)
        body = await read_body(request, self.args.max_request_body_bytes)
        return PlainTextResponse(await self.models.load(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        check_api_key(request, self.args.api_key)
        body = await read_body(request, self.args.max_request_body_bytes)
        return PlainTextResponse(await self.models.unload(body))

    @app.get("/health")
    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.check_health(), timeout=5.0)
        except Exception as e:  # noqa: BLE001 - any failure to answer is "not healthy"
            return error_response(overloaded(f"The engine is not healthy: {type(e).__name__}",
                                             self.args.retry_after_s))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus(self) -> Response:
        return Response(await self.cluster_metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    # -- request path ---------------------------------------------------------------------
    async def _parse(self, request: Request, model_cls) -> tuple[Any, LoRARequest | None]:
        """The request model, and the LoRA adapter its `model` names (None: the base model; 404: neither)."""
        request.state.arrival = time.monotonic()  # the access log's latency counts from here
        check_api_key(request, self.args.api_key)
        body = await read_body(request, self.args.max_request_body_bytes)
        extra = "ignore" if self.args.unknown_request_fields == "ignore" else None  # None: the models' "forbid"
        try:
            req = model_cls.model_validate_json(body, extra=extra)
        except ValidationError as e:
            raise from_validation_error(e) from None
        # The prefix router sends a session's requests to one engine replica (docs/fleet.md).
        request.state.session = request.headers.get("x-session-id") or req.prompt_cache_key or req.user
        return req, self.models.resolve(req.model)

    @contextlib.contextmanager
    def _admit(self):
        """Shed load (503 + Retry-After) beyond max_pending_requests in flight in this replica."""
        limit = self.batching.max_pending_requests
        if limit is not None and self._num_pending >= limit:
            raise overloaded(f"The server is at capacity ({limit} requests in flight); retry later.",
                             self.args.retry_after_s)
        self._num_pending += 1
        try:
            yield
        finally:
            self._num_pending -= 1

    async def _prepare(self, job: PrepJob) -> Prepared:
        job.submit_time = time.monotonic()
        if self.batching.max_batch_size > 1:
            result = await self._prepare_batch(job)
        else:  # batching off: the same work, for one request, without the queue
            result = (await self._prepare_now([job]))[0]
        if isinstance(result, OpenAIError):
            raise result
        return result

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)  # the live values come from reconfigure()
    async def _prepare_batch(self, jobs: list[PrepJob]) -> list[Prepared | OpenAIError]:
        return await self._prepare_now(jobs)

    async def _prepare_now(self, jobs: list[PrepJob]) -> list[Prepared | OpenAIError]:
        self.metrics.observe_batch([j.submit_time for j in jobs])
        limits = await self._model_limits()
        size = sum(len(p) if isinstance(p, str) else 0 for j in jobs for p in (j.prompts or ()))
        size += sum(len(m.get("content") or "") for j in jobs for m in (j.messages or ()))
        if size < _INLINE_PREP_CHARS:
            results = prepare_batch(self.tokenizer, jobs, limits)
        else:
            results = await asyncio.to_thread(prepare_batch, self.tokenizer, jobs, limits)
        if len(jobs) > 1:  # one routing decision per adapter of the batch: its requests share an engine replica
            batch_ids: dict[str | None, str] = {}
            for job, r in zip(jobs, results):
                if isinstance(r, Prepared):
                    r.batch_id = batch_ids.setdefault(job.adapter, uuid.uuid4().hex)
        return results

    async def _model_limits(self) -> ModelLimits:
        if self._limits is None:
            try:
                info = await self.engine.model_info()
            except Exception as e:  # noqa: BLE001 - no engine to ask: a 503, not a 500
                raise overloaded(f"The engine is unavailable: {type(e).__name__}", self.args.retry_after_s) from e
            self._limits = ModelLimits(max_model_len=info["max_model_len"], vocab_size=info["vocab_size"])
        return self._limits

    async def _generate(self, request: Request, request_id: str, prepared: Prepared, params: SamplingParams,
                        builder: ResponseBuilder, stream: bool, output: OutputSpec | None,
                        param_source: str | None, lora: LoRARequest | None, priority: int = 0) -> Response:
        """`output`: the guardrail's contract (JSON, tool calls), for a request it must check; None: none.
        `lora`: the adapter the request runs with; None: the base model."""
        json_mode = output is not None
        engine = self.json_engine if json_mode else self.engine
        requests = [EngineRequest(f"{request_id}-{i}", ids, params if i == 0 else params.clone(), text, json_mode,
                                  prepared.batch_id, stream=stream, output=output, lora_request=lora,
                                  session=getattr(request.state, "session", None),
                                  priority=priority)
                    for i, (ids, text) in enumerate(zip(prepared.prompt_token_ids, prepared.prompt_texts))]
        items = merge_streams([engine.stream(r) for r in requests])
        info = RequestInfo(request.method, request.url.path, request_id,
                           sum(len(ids) for ids in prepared.prompt_token_ids), request.state.arrival)
        request.state.access_info = info  # for the error answer's line, if the engine refuses (http_util)
        gen = Generation(items, builder, self.metrics.request(json_mode, info), self.args.retry_after_s,
                         param_source)
        try:
            await gen.first()
            if not stream:
                return JSONResponse(await gen.body())
        except BaseException:
            await items.aclose()
            raise
        self._num_pending += 1  # the stream outlives this handler: released when the response ends
        return _SSEResponse(gen, items, self._release_pending)

    def _release_pending(self) -> None:
        self._num_pending -= 1

    # -- the engine in this replica (colocate_ingress) ----------------------------------------
    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s: with the engine here, its health is ours."""
        await self.engine.check_replica_health()

    async def get_stats(self) -> dict[str, Any]:
        return await self.engine.get_stats()

    def __del__(self):
        # Serve's ASGI wrapper calls this after ending the app's lifespan, once the replica has
        # drained (graceful_shutdown_timeout_s); an engine in this process stops with it.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        flush_serve_logs()  # the last access-log lines
