"""`workbench serve`: an OpenAI-compatible HTTP server over one background Engine.

Endpoints
    POST /v1/completions        text or token-id prompt, streamed (SSE) or not
    POST /v1/chat/completions   chat messages through the tokenizer's chat template
    GET  /v1/models             the one served model
    GET  /health                200 while the engine loop runs, 503 otherwise
    GET  /version               {"version": the workbench's} (as vLLM's /version)
    GET  /metrics               Prometheus text, vLLM's metric names

The engine steps in its own thread (`engine.start()`); every handler is an asyncio task that
reads its tokens from `engine.astream(...)`. When a client goes away, the task is cancelled,
the stream is closed and the engine aborts the request at its next step boundary, which frees
its KV blocks. Every error is answered in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.

Only this module (and the CLI's `serve` command, lazily) imports FastAPI, uvicorn,
sse-starlette and prometheus_client, so `import workbench` stays light.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine
from ..core.sampling_params import SamplingParams
from .metrics import EngineMetrics
from .schema import REQUESTS
from .protocol import (UNSET, APIError, bad_request, body_field, chat_logprobs, chat_messages,
                       check_fields, completion_logprobs, completion_prompt, from_value_error,
                       is_template_error, max_token_bytes, read_json, sampling_params_from,
                       structured_error, structured_outputs_from, vllm_prompt_logprobs)

log = logging.getLogger("workbench.server")

STREAM_HEADERS = {
    # Streams must not be held back by a reverse proxy or a cache on the way.
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


# ---- the app --------------------------------------------------------------------------------
async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Served:
    """One validated request, ready to run."""

    def __init__(self, kind: str, rid: str, prompt_ids: list[int], params: SamplingParams,
                 stream: bool, include_usage: bool, echo: str | None = None,
                 vllm_prompt_logprobs: bool = False):
        self.kind, self.rid, self.prompt_ids, self.params = kind, rid, prompt_ids, params
        self.stream, self.include_usage = stream, include_usage
        self.echo = echo
        """Completions with echo: the prompt's text, returned before the output."""
        self.vllm_prompt_logprobs = vllm_prompt_logprobs
        """The body asked for vLLM's `prompt_logprobs` field by name."""
        self.created = int(time.time())


class _Choice:
    """What one of a request's n choices has produced so far."""

    def __init__(self):
        self.texts: list[str] = []
        self.n_out = 0
        self.finish: str | None = None
        self.logprobs: list = []
        """(token id, {id: Logprob}) per output token, when asked."""
        self.offset = 0
        """Characters returned so far (completions' text_offset)."""


def request_body(kind: str) -> dict:
    """An endpoint's body for the OpenAPI document, from schema.py's model (the handlers read
    the JSON themselves, so FastAPI does not see the model in their signatures)."""
    schema = REQUESTS[kind].model_json_schema()
    schema["required"] = ["messages"] if kind == "chat" else ["prompt"]
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def create_app(engine: Engine, model_name: str | None = None, api_key: str | None = None,
               allow_missing_model: bool = False) -> FastAPI:
    """The FastAPI app serving `engine` (started on app start-up, shut down on exit).
    `allow_missing_model`: a request without `model` gets the served one (else 400)."""
    served = model_name or engine.config.model
    metrics = EngineMetrics(engine, served)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            tokenizing.shutdown(wait=False, cancel_futures=True)
            engine.shutdown()

    import workbench
    app = FastAPI(title="workbench", version=workbench.__version__, lifespan=lifespan,
                  redoc_url=None, openapi_url="/openapi.json", docs_url="/docs")
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, "internal error (the server's log has the details)",
                        type="server_error").response()

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

    def check_model(body: dict) -> None:
        m = body.get("model")
        if m is None:
            if allow_missing_model:
                return
            raise bad_request("model", "model: required (this server serves "
                                       f"{served!r}; start it with --allow-missing-model to "
                                       "default to it)")
        if not isinstance(m, str):
            raise bad_request("model", f"model: must be a string (got {m!r})")
        if m != served:
            raise APIError(404, f"The model `{m}` does not exist. This server serves `{served}`.",
                           param="model", code="model_not_found")

    def prepare(kind: str, body: dict) -> _Served:
        check_fields(kind, body)
        check_model(body)
        stream = body_field(body, "stream", (bool,), "true or false")
        stream = False if stream is UNSET else stream
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise bad_request("stream_options", "stream_options: must be an object")
        include_usage = bool(so and so.get("include_usage"))
        if so is not None and not stream:
            raise bad_request("stream_options", "stream_options: only allowed when stream is true")
        # OpenAI's defaults: 16 tokens for completions; chat fills the context.
        so, so_field = structured_outputs_from(body)
        params, which = sampling_params_from(body, 16 if kind == "completion" else None, so,
                                             kind, engine.info().generation_defaults)
        explicit = body.get(which) is not None
        options = {"truncate_prompt_tokens": params.truncate_prompt_tokens,
                   "add_special_tokens": body_field(body, "add_special_tokens", (bool,),
                                                    "true or false")}
        if kind == "chat":
            prompt, rename = chat_messages(body), {"prompt": "messages"}
            for name, kinds, what in (("add_generation_prompt", (bool,), "true or false"),
                                      ("continue_final_message", (bool,), "true or false"),
                                      ("chat_template", (str,), "a Jinja template text"),
                                      ("chat_template_kwargs", (dict,), "an object")):
                options[name] = body_field(body, name, kinds, what)
            if (options["chat_template"] is UNSET
                    and getattr(engine.tokenizer, "chat_template", None) is None):
                raise bad_request("messages", f"messages: model {served!r} has no chat template; "
                                              "use /v1/completions", code="unsupported_model")
        else:
            prompt, rename = completion_prompt(body), None
        options = {k: v for k, v in options.items() if v is not UNSET and v is not None}
        if so is not None:
            try:
                engine.check_params(params)
            except ValueError as e:
                raise structured_error(so_field, e) from None
        field = "messages" if kind == "chat" else "prompt"
        if max_text_bytes is not None:
            texts = ([json.dumps(m, ensure_ascii=False) for m in prompt] if kind == "chat"
                     else [prompt] if isinstance(prompt, str) else [])
            size = sum(len(t.encode()) for t in texts)
            if size > max_text_bytes:
                raise bad_request(field, f"{field}: {size} bytes of text cannot fit in max_model_len "
                                  f"({engine.max_model_len} tokens; no token of this tokenizer "
                                  f"is longer than {token_bytes} bytes)",
                           code="context_length_exceeded")
        try:
            ids = engine.tokenize(prompt, **options)
        except ValueError as e:
            err = from_value_error(e, rename)
            if err.param is None:   # e.g. a tokenizer without a chat template
                err = bad_request(field, f"{field}: {e}")
            if "max_model_len" in err.message:
                err.code = "context_length_exceeded"
            raise err from None
        except Exception as e:
            log.warning("%s could not be tokenized: %s: %s", field, type(e).__name__, e)
            if kind == "chat" and is_template_error(e):
                # The chat template refused the conversation with a message of its own.
                raise bad_request("messages", f"messages: the chat template refused them: {e.message}") from None
            raise bad_request(field, f"{field}: could not be tokenized") from None
        room = engine.max_model_len - len(ids)
        if not explicit:    # chat: fill the context; completions: 16, or what still fits
            cap = engine.info().generation_defaults.get("max_tokens")   # the model's own cap
            params.max_tokens = min(room, cap or room if kind == "chat" else params.max_tokens)
        elif params.max_tokens > room:
            raise bad_request(which, f"{which}: the prompt has {len(ids)} tokens and {which} is "
                              f"{params.max_tokens}, but max_model_len is {engine.max_model_len}; "
                              f"at most {room} new tokens fit", code="context_length_exceeded")
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        echo = None
        if kind == "completion" and body.get("echo") is True:
            echo = prompt if isinstance(prompt, str) else (
                engine.tokenizer.decode(ids) if has_tokenizer else "")
        return _Served(kind, f"{prefix}-{uuid.uuid4().hex}", ids, params, stream, include_usage,
                       echo, body.get("prompt_logprobs") is not None)

    def usage(req: _Served, n_out: int) -> dict:
        n_in = len(req.prompt_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def token_text(t: int) -> str:
        return engine.tokenizer.decode([t]) if has_tokenizer else f"token_id:{t}"

    def logprobs_of(req: _Served, c: _Choice, entries: list, prompt_lps=None) -> dict | None:
        """The choice's `logprobs` for `entries` (output tokens), with the echoed prompt's
        tokens first when there are prompt logprobs to show."""
        if req.params.logprobs is None:
            return None
        if req.kind == "chat":
            return {"content": chat_logprobs(entries, token_text, req.params.logprobs)}
        if prompt_lps is not None and req.echo is not None:
            entries = list(zip(req.prompt_ids, prompt_lps)) + entries
        out, c.offset = completion_logprobs(entries, token_text, c.offset)
        return out

    def chunk(req: _Served, text: str | None, finish: str | None, role: bool = False,
              index: int = 0, logprobs: dict | None = None) -> dict:
        if req.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
            obj = "text_completion"
        out = {"id": req.rid, "object": obj, "created": req.created, "model": served,
               "choices": [choice]}
        if req.include_usage:
            out["usage"] = None
        return out

    def dumps(obj) -> str:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

    has_tokenizer = engine.tokenizer is not None
    token_bytes = max_token_bytes(engine.tokenizer) if has_tokenizer else None
    max_text_bytes = None if token_bytes is None else engine.max_model_len * token_bytes
    # Tokenizing a long prompt takes seconds: one worker thread does it, never the event loop.
    tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="workbench-tokenize")

    async def sse_events(req: _Served) -> AsyncIterator[str]:
        """The SSE body of one streamed request: each choice's chunks carry its index, and
        each choice ends with its own finish_reason. Closing or cancelling it (a client
        disconnect) closes the engine stream, which aborts the request."""
        agen = engine.astream(req.prompt_ids, req.params, request_id=req.rid)
        choices = [_Choice() for _ in range(req.params.n)]
        failed = False
        want_lp = req.params.logprobs is not None
        try:
            if req.kind == "chat":
                for i in range(req.params.n):
                    yield dumps(chunk(req, "", None, role=True, index=i))
            elif req.echo is not None and req.params.prompt_logprobs is None:
                for i in range(req.params.n):
                    yield dumps(chunk(req, req.echo, None, index=i))
            async for ev in agen:
                c = choices[ev.choice]
                if ev.prompt_logprobs is not None and req.echo is not None:
                    for i, ci in enumerate(choices):    # the echoed prompt, now scored
                        yield dumps(chunk(req, req.echo, None, index=i, logprobs=logprobs_of(
                            req, ci, [], ev.prompt_logprobs)))
                if ev.token_id is not None:
                    c.n_out = ev.index
                entries = [(ev.token_id, ev.logprobs)] if want_lp and ev.token_id is not None else []
                if ev.text or entries or (ev.token_id is not None and not has_tokenizer):
                    yield dumps(chunk(req, ev.text, None, index=ev.choice,
                                      logprobs=logprobs_of(req, c, entries) if entries else None))
                if ev.finished:
                    if ev.finish_reason == "error":
                        failed = True
                        break
                    yield dumps(chunk(req, None if req.kind == "chat" else "", ev.finish_reason,
                                      index=ev.choice))
        except Exception:    # not a disconnect (that is a CancelledError): tell the client
            log.exception("stream %s failed", req.rid)
            failed = True
        finally:
            await agen.aclose()
        if failed:
            yield dumps(APIError(500, "the engine failed while running this request",
                                 type="server_error").body())
        elif req.include_usage:
            yield dumps({"id": req.rid, "object": chunk(req, "", None)["object"],
                         "created": req.created, "model": served, "choices": [],
                         "usage": usage(req, sum(c.n_out for c in choices))})
        yield "[DONE]"

    async def run_to_end(req: _Served, request: Request) -> dict:
        """A non-streamed request; aborted if the client disconnects while it runs."""
        async def collect():
            choices = [_Choice() for _ in range(req.params.n)]
            prompt_lps = None
            async with contextlib.aclosing(engine.astream(req.prompt_ids, req.params,
                                                          request_id=req.rid)) as agen:
                async for ev in agen:
                    c = choices[ev.choice]
                    c.texts.append(ev.text)
                    if ev.prompt_logprobs is not None:
                        prompt_lps = ev.prompt_logprobs
                    if ev.token_id is not None:
                        c.n_out = ev.index
                        if req.params.logprobs is not None:
                            c.logprobs.append((ev.token_id, ev.logprobs))
                    if ev.finished:
                        c.finish = ev.finish_reason
            return choices, prompt_lps

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, gone):
                if not t.done():
                    t.cancel()
        if not work.done() or work.cancelled():
            await asyncio.wait({work})      # let the engine stream close (it aborts the request)
            raise APIError(499, "client closed the request", code="client_closed_request")
        choices, prompt_lps = work.result()
        if any(c.finish == "error" for c in choices):
            raise APIError(500, "the engine failed while running this request", type="server_error")
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.texts)
            lp = logprobs_of(req, c, c.logprobs, prompt_lps)
            if req.kind == "chat":
                out.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": lp, "finish_reason": c.finish})
            else:
                out.append({"index": i, "text": (req.echo or "") + text, "logprobs": lp,
                            "finish_reason": c.finish})
                if req.vllm_prompt_logprobs:
                    out[-1]["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps)
        resp = {"id": req.rid, "object": "chat.completion" if req.kind == "chat" else
                "text_completion", "created": req.created, "model": served, "choices": out,
                "usage": usage(req, sum(c.n_out for c in choices))}
        if req.kind == "chat" and req.vllm_prompt_logprobs:
            resp["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps)
        return resp

    async def handle(kind: str, request: Request):
        check_auth(request)
        body = await read_json(request)
        req = await asyncio.get_running_loop().run_in_executor(tokenizing, prepare, kind, body)
        if req.stream:
            return EventSourceResponse(sse_events(req), headers=STREAM_HEADERS, sep="\n")
        return JSONResponse(await run_to_end(req, request))

    @app.post("/v1/completions", openapi_extra=request_body("completion"))
    async def completions(request: Request):
        return await handle("completion", request)

    @app.post("/v1/chat/completions", openapi_extra=request_body("chat"))
    async def chat_completions(request: Request):
        return await handle("chat", request)

    def model_card() -> dict:
        return {"id": served, "object": "model", "created": int(engine_started), "owned_by": "workbench",
                "root": engine.config.model, "max_model_len": engine.max_model_len,
                "generation_defaults": engine.info().generation_defaults}

    engine_started = time.time()

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
        # is_running_in_background stays True if the step thread died; ask the thread too.
        thread = getattr(engine, "_thread", None)
        alive = thread.is_alive() if thread is not None else engine.is_running_in_background
        if not (engine.is_running_in_background and alive):
            raise APIError(503, "engine loop is not running", type="server_error",
                           code="unavailable")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from .. import __version__
        return {"version": __version__}

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
          limit_concurrency: int = LIMIT_CONCURRENCY, allow_missing_model: bool = False) -> None:
    """Run the server in this thread until SIGINT/SIGTERM (then the engine is shut down)."""
    import uvicorn

    app = create_app(engine, model_name, api_key, allow_missing_model)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=_h11_with_header_timeout(header_timeout),
                            limit_concurrency=limit_concurrency,
                            timeout_graceful_shutdown=5, timeout_keep_alive=30)
    uvicorn.Server(config).run()
