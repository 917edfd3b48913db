"""`workbench serve`: an OpenAI-compatible HTTP server over one background Engine: the
transport (FastAPI routes, SSE, authentication, disconnects, uvicorn). What each endpoint
does is handler.py's; bodies are read by protocol.py and replies written by responses.py.

Endpoints
    POST /v1/completions        text or token-id prompt (or a batch of them), streamed (SSE) or not
    POST /v1/chat/completions   chat messages through the tokenizer's chat template, with tools
    POST /v1/responses          OpenAI's Responses API, run as chat (responses_api.py)
    GET  /v1/responses/{id}     a stored response
    POST /tokenize              vLLM's: text or messages -> token ids
    POST /detokenize            vLLM's: token ids -> text
    GET  /tokenizer_info        vLLM's: special tokens, chat template, max length
    GET  /v1/models             the one served model
    GET  /health                200 while the engine loop runs, 503 otherwise
    GET  /version               {"version": the workbench's} (as vLLM's /version)
    GET  /metrics               Prometheus text, vLLM's metric names

The engine steps in its own thread (`engine.start()`); every handler is an asyncio task that
reads its tokens from `engine.astream(...)`. When a client goes away, the task is cancelled,
the stream is closed and the engine aborts the request at its next step boundary, which frees
its KV blocks. Every error is answered in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.

Only the serving modules (and the CLI's `serve` command, lazily) import FastAPI, uvicorn,
sse-starlette and prometheus_client, so `import workbench` stays light.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import REASONING_PARSERS, TOOL_CALL_PARSERS
from ..engine import Engine
from .handler import OpenAIServing
from .metrics import EngineMetrics
from .protocol import MAX_BODY_BYTES, APIError, parse_body
from .responses import dumps
from .responses_api import ResponsesServing
from .schema import REQUESTS

log = logging.getLogger("workbench.server")

IGNORED_FIELDS_HEADER = "X-Workbench-Ignored-Fields"
"""A response header naming the request's fields that this server does not know (and so
ignored); the server's log says it too."""

STREAM_HEADERS = {
    # Streams must not be held back by a reverse proxy or a cache on the way.
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def error_response(e: APIError) -> Response:
    # ASCII-escaped JSON: a message quoting a client's text renders whatever it holds.
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers,
                    media_type="application/json")


async def read_json(request: Request) -> dict:
    """The body, at most MAX_BODY_BYTES (413 past that, before any parsing), as a JSON object."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"body: larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise APIError(413, f"body: larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
        chunks.append(chunk)
    return parse_body(b"".join(chunks))


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def ignored_header(names: list[str], path: str) -> dict[str, str]:
    """Fields the request sent that this server does not know: one warning line in the
    log, and the names in a response header (ASCII, bounded)."""
    if not names:
        return {}
    joined = ", ".join(names)
    log.warning("%s: ignored fields this server does not know: %s", path, joined)
    shown = joined.encode("ascii", "backslashreplace").decode()
    return {IGNORED_FIELDS_HEADER: shown if len(shown) <= 1000 else shown[:997] + "..."}


def request_body(kind: str) -> dict:
    """An endpoint's body for the OpenAPI document, from schema.py's model (the handlers read
    the JSON themselves, so FastAPI does not see the model in their signatures)."""
    schema = REQUESTS[kind].model_json_schema()
    schema["required"] = {"chat": ["messages"], "completion": ["prompt"], "responses": ["input"],
                          "detokenize": ["tokens"]}.get(kind, [])
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def create_app(engine: Engine, model_name: str | None = None, api_key: str | None = None,
               allow_missing_model: bool = False, strict_fields: bool = False,
               chat_template: str | None = None, tool_call_parser: str = "hermes",
               reasoning_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (started on app start-up, shut down on exit).
    `allow_missing_model`: a request without `model` gets the served one (else 400).
    `strict_fields`: a field this server does not know is a 400 (by default it is ignored,
    warned about and named in a response header, as vLLM does). `chat_template`: the
    template text chat requests use unless they send their own (vLLM's --chat-template).
    `tool_call_parser`: how tool_choice auto reads the model's calls (TOOL_CALL_PARSERS).
    `reasoning_parser`: how chat replies' thinking is split off (REASONING_PARSERS; None:
    not split)."""
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser: must be one of {', '.join(TOOL_CALL_PARSERS)} "
                         f"(got {tool_call_parser!r})")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS)} "
                         f"(got {reasoning_parser!r})")
    served = model_name or engine.info().config.model
    metrics = EngineMetrics(engine, served)
    serving = OpenAIServing(engine, served, allow_missing_model, strict_fields, chat_template,
                            reasoning_parser)
    responses = ResponsesServing(serving)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            serving.close()
            engine.shutdown()

    import workbench
    app = FastAPI(title="workbench", version=workbench.__version__, lifespan=lifespan,
                  redoc_url=None, openapi_url="/openapi.json", docs_url="/docs")
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        if exc.status == 400:   # the reason, beside the access line (never the body)
            log.info("%s %s: 400 %s", request.method, request.url.path,
                     " ".join(exc.message.split())[:500])
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                       f"{exc.detail}", code=code,
                                       headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal error (the server's log has the details)",
                                       type="server_error"))

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def off_the_loop(fn, *args):
        """Tokenizing work, on the serving's worker thread (never the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(serving.tokenizing, fn, *args)

    async def generate(kind: str, request: Request):
        check_auth(request)
        body = await read_json(request)
        req = await off_the_loop(serving.prepare, kind, body)
        headers = ignored_header(req.ignored, request.url.path)
        if req.stream:
            return EventSourceResponse(serving.stream(req), headers={**STREAM_HEADERS, **headers},
                                       sep="\n")
        return JSONResponse(await serving.reply(req, _wait_for_disconnect(request)),
                            headers=headers)

    @app.post("/v1/completions", openapi_extra=request_body("completion"))
    async def completions(request: Request):
        return await generate("completion", request)

    @app.post("/v1/chat/completions", openapi_extra=request_body("chat"))
    async def chat_completions(request: Request):
        return await generate("chat", request)

    @app.post("/v1/responses", openapi_extra=request_body("responses"))
    async def create_response(request: Request):
        """OpenAI's Responses API, run on the chat path (responses_api.py)."""
        check_auth(request)
        body = await read_json(request)
        ctx = await off_the_loop(responses.prepare, body)
        headers = ignored_header(ctx.req.ignored, request.url.path)
        if ctx.req.stream:
            async def events():
                async for ev in responses.events(ctx):
                    yield {"event": ev["type"], "data": dumps(ev)}
            return EventSourceResponse(events(), headers={**STREAM_HEADERS, **headers}, sep="\n")
        return JSONResponse(await responses.reply(ctx, _wait_for_disconnect(request)),
                            headers=headers)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        """A stored response (store was not false), while the store still holds it."""
        check_auth(request)
        return responses.retrieve(response_id)

    @app.post("/tokenize", openapi_extra=request_body("tokenize"))
    async def tokenize(request: Request):
        """vLLM's /tokenize: a text or a conversation -> its token ids (and their strings)."""
        check_auth(request)
        out, ignored = await off_the_loop(serving.tokenize, await read_json(request))
        return JSONResponse(out, headers=ignored_header(ignored, request.url.path))

    @app.post("/detokenize", openapi_extra=request_body("detokenize"))
    async def detokenize(request: Request):
        """vLLM's /detokenize: token ids -> text."""
        check_auth(request)
        out, ignored = serving.detokenize(await read_json(request))
        return JSONResponse(out, headers=ignored_header(ignored, request.url.path))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """vLLM's /tokenizer_info: special tokens, chat template, max length."""
        check_auth(request)
        return serving.tokenizer_info()

    engine_started = time.time()
    # vLLM's root is the checkpoint's path: where a client (lm-eval's tokenizer=) loads the
    # same tokenizer from.
    root = getattr(engine.tokenizer, "name_or_path", None) or engine.info().config.model

    def model_card() -> dict:
        return {"id": served, "object": "model", "created": int(engine_started),
                "owned_by": "workbench", "root": root,
                "max_model_len": engine.info().max_model_len,
                "generation_defaults": engine.info().generation_defaults}

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_auth(request)
        if model_id != served:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return model_card()

    @app.head("/health", include_in_schema=False)       # load balancers probe with HEAD
    @app.get("/health")
    async def health():
        if not engine.is_running_in_background:    # (False too once its thread has died)
            raise APIError(503, "engine loop is not running", type="server_error",
                           code="unavailable")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": workbench.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


HEADER_TIMEOUT_S = 10.0
"""A connection that has not sent a whole request head this long after connecting (or after
its previous response) is closed: half-sent headers must not hold connections forever."""
LIMIT_CONCURRENCY = 512
"""Connections (or requests in flight) past this many are answered 503 at once."""


def _h11_with_header_timeout(header_timeout: float):
    """uvicorn's h11 protocol plus a header-read timeout, which uvicorn lacks (its keep-alive
    timer stops at the first byte, so a client that sends half a request head and waits keeps
    the connection forever)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout, self._head_timeout)

        def _disarm(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self):
            # Still no complete request head (h11 leaves IDLE once it has one).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_name: str | None = None, log_level: str = "info",
          header_timeout: float = HEADER_TIMEOUT_S,
          limit_concurrency: int = LIMIT_CONCURRENCY, allow_missing_model: bool = False,
          strict_fields: bool = False, chat_template: str | None = None,
          tool_call_parser: str = "hermes", reasoning_parser: str | None = None) -> None:
    """Run the server in this thread until SIGINT/SIGTERM (then the engine is shut down)."""
    import uvicorn

    # The server's own lines (a refusal's reason, ignored fields) at the level asked for,
    # beside uvicorn's access lines.
    wb_log = logging.getLogger("workbench")
    if not wb_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        wb_log.addHandler(handler)
    wb_log.setLevel(log_level.upper())
    app = create_app(engine, model_name, api_key, allow_missing_model, strict_fields,
                     chat_template, tool_call_parser, reasoning_parser)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=_h11_with_header_timeout(header_timeout),
                            limit_concurrency=limit_concurrency,
                            timeout_graceful_shutdown=5, timeout_keep_alive=30)
    uvicorn.Server(config).run()
