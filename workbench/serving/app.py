"""`workbench serve`: an OpenAI-compatible HTTP server over one background Engine.

Endpoints
    POST /v1/completions        text or token-id prompt, streamed (SSE) or not
    POST /v1/chat/completions   chat messages through the tokenizer's chat template, with tools
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

from ..config import TOOL_CALL_PARSERS
from ..engine import Engine
from ..core.sampling_params import SamplingParams
from .metrics import EngineMetrics
from .schema import REQUESTS
from ..engine.request import TokenEvent
from .protocol import (UNSET, APIError, bad_request, body_field, chat_logprobs, chat_messages,
                       check_fields, completion_logprobs, completion_prompts, from_value_error,
                       is_template_error, max_token_bytes, read_json, sampling_params_from,
                       structured_error, structured_outputs_from, vllm_prompt_logprobs)
from .tools import (ToolCallParser, ToolChoice, assemble, check_tool_messages, fallback_messages,
                    template_takes_tools, tool_choice_from, valid_calls)

log = logging.getLogger("workbench.server")

IGNORED_FIELDS_HEADER = "X-Workbench-Ignored-Fields"
"""A response header naming the request's fields that this server does not know (and so
ignored); the server's log says it too."""

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
    """One validated request, ready to run: one engine request per prompt (a batched
    completion has several), each with n choices; choice index = prompt index * n + i."""

    def __init__(self, kind: str, rid: str, prompts: list[list[int]], params: SamplingParams,
                 stream: bool, include_usage: bool, continuous_usage: bool,
                 echoes: list[str | None], vllm_prompt_logprobs: bool,
                 tools: ToolChoice | None, ignored: list[str]):
        self.kind, self.rid, self.prompts, self.params = kind, rid, prompts, params
        self.stream, self.include_usage = stream, include_usage
        self.continuous_usage = continuous_usage
        """stream_options.continuous_usage_stats: usage (so far) on every chunk."""
        self.echoes = echoes
        """Completions with echo: each prompt's text, returned before its output."""
        self.vllm_prompt_logprobs = vllm_prompt_logprobs
        """The body asked for vLLM's `prompt_logprobs` field by name."""
        self.tools = tools
        self.ignored = ignored
        """Fields (and message keys) the request sent that this server does not know."""
        self.created = int(time.time())

    def engine_id(self, p: int) -> str:
        return self.rid if len(self.prompts) == 1 else f"{self.rid}-{p}"

    def choices(self) -> list["_Choice"]:
        n = self.params.n
        return [_Choice(i // n, self.tools.parser() if self.tools is not None else None)
                for i in range(len(self.prompts) * n)]


class _Choice:
    """What one choice has produced so far."""

    def __init__(self, prompt: int, parser: ToolCallParser | None):
        self.prompt = prompt
        """Which of the request's prompts it answers."""
        self.texts: list[str] = []
        self.n_out = 0
        self.finish: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list = []
        """(token id, {id: Logprob}) per output token, when asked."""
        self.offset = 0
        """Characters returned so far (completions' text_offset)."""
        self.parser = parser
        """With tools: turns the text into content and tool_call deltas."""
        self.content: list[str] = []
        self.tool_deltas: list[dict] = []

    def parse(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """The content and tool_call deltas of new text (the text itself without tools)."""
        if self.parser is None:
            return text, []
        content, deltas = self.parser.feed(text)
        if final:
            more, rest = self.parser.finish()
            content, deltas = content + more, deltas + rest
        self.content.append(content)
        self.tool_deltas += deltas
        return content, deltas


def request_body(kind: str) -> dict:
    """An endpoint's body for the OpenAPI document, from schema.py's model (the handlers read
    the JSON themselves, so FastAPI does not see the model in their signatures)."""
    schema = REQUESTS[kind].model_json_schema()
    schema["required"] = ["messages"] if kind == "chat" else ["prompt"]
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def create_app(engine: Engine, model_name: str | None = None, api_key: str | None = None,
               allow_missing_model: bool = False, strict_fields: bool = False,
               chat_template: str | None = None, tool_call_parser: str = "hermes") -> FastAPI:
    """The FastAPI app serving `engine` (started on app start-up, shut down on exit).
    `allow_missing_model`: a request without `model` gets the served one (else 400).
    `strict_fields`: a field this server does not know is a 400 (by default it is ignored,
    warned about and named in a response header, as vLLM does). `chat_template`: the
    template text chat requests use unless they send their own (vLLM's --chat-template).
    `tool_call_parser`: how tool_choice auto reads the model's calls (tools.TOOL_CALL_PARSERS)."""
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser: must be one of {', '.join(TOOL_CALL_PARSERS)} "
                         f"(got {tool_call_parser!r})")
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

    def check_model(body: dict, optional: bool = False) -> None:
        m = body.get("model")
        if m is None:
            if allow_missing_model or optional:
                return
            raise bad_request("model", "model: required (this server serves "
                                       f"{served!r}; start it with --allow-missing-model to "
                                       "default to it)")
        if not isinstance(m, str):
            raise bad_request("model", f"model: must be a string (got {m!r})")
        if m != served:
            raise APIError(404, f"The model `{m}` does not exist. This server serves `{served}`.",
                           param="model", code="model_not_found")

    def chat_prompt(body: dict, ignored: list[str],
                    tools: ToolChoice | None) -> tuple[list[dict], dict]:
        """The conversation as the chat template will read it, and the template's controls;
        with tools, they go through the template where it takes them (else the fallback)."""
        messages = chat_messages(body, None if strict_fields else ignored)
        check_tool_messages(messages)
        options = {}
        for name, kinds, what in (("add_generation_prompt", (bool,), "true or false"),
                                  ("continue_final_message", (bool,), "true or false"),
                                  ("chat_template", (str,), "a Jinja template text"),
                                  ("chat_template_kwargs", (dict,), "an object")):
            options[name] = body_field(body, name, kinds, what)
        if options["chat_template"] is UNSET and chat_template is not None:
            options["chat_template"] = chat_template
        template = (options["chat_template"] if options["chat_template"] is not UNSET
                    else getattr(engine.tokenizer, "chat_template", None))
        if template is None:
            raise bad_request("messages", f"messages: model {served!r} has no chat template; "
                                          "use /v1/completions", code="unsupported_model")
        offered = tools.tools if tools is not None and tools.mode != "none" else []
        if template_takes_tools(template):
            if offered:
                options["tools"] = offered
        elif offered or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = fallback_messages(messages, offered)
        return messages, options

    def tokenized(kind: str, prompt, options: dict, rename: dict | None) -> list[int]:
        """engine.tokenize, each refusal a 400 naming the field it is about."""
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
            return engine.tokenize(prompt, **options)
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

    def prepare(kind: str, body: dict) -> _Served:
        ignored = check_fields(kind, body, strict_fields)
        check_model(body)
        stream = body_field(body, "stream", (bool,), "true or false")
        stream = False if stream is UNSET else stream
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise bad_request("stream_options", "stream_options: must be an object")
        if so is not None and not stream:
            raise bad_request("stream_options", "stream_options: only allowed when stream is true")
        include_usage = bool(so and so.get("include_usage"))
        continuous = bool(so and so.get("continuous_usage_stats"))
        if stream and body.get("prompt_logprobs") is not None:
            raise bad_request("prompt_logprobs", "prompt_logprobs: not available when stream is "
                              "true (as vLLM; completions' echo with logprobs streams the "
                              "prompt's logprobs)")
        tools = tool_choice_from(body) if kind == "chat" else None
        so, so_field = structured_outputs_from(body)
        if tools is not None and tools.structured_outputs() is not None:
            if so is not None:
                raise bad_request(so_field, f"{so_field}: cannot be combined with tool_choice "
                                  f"{tools.mode if tools.mode != 'named' else repr(tools.name)}")
            so, so_field = tools.structured_outputs(), "tools"
        # OpenAI's defaults: 16 tokens for completions; chat fills the context.
        params, which = sampling_params_from(body, 16 if kind == "completion" else None, so,
                                             kind, engine.info().generation_defaults)
        explicit = body.get(which) is not None
        try:
            engine.check_params(params)
        except ValueError as e:
            raise (structured_error(so_field, e) if so is not None and str(e).startswith(
                "structured_outputs") else from_value_error(e)) from None
        options = {"truncate_prompt_tokens": params.truncate_prompt_tokens,
                   "add_special_tokens": body_field(body, "add_special_tokens", (bool,),
                                                    "true or false")}
        if kind == "chat":
            messages, chat_options = chat_prompt(body, ignored, tools)
            prompts, rename = [messages], {"prompt": "messages"}
            options.update(chat_options)
        else:
            prompts, rename = completion_prompts(body), None
        options = {k: v for k, v in options.items() if v is not UNSET and v is not None}
        ids = [tokenized(kind, p, options, rename) for p in prompts]
        room = engine.max_model_len - max(len(x) for x in ids)
        if not explicit:    # chat: fill the context; completions: 16, or what still fits
            cap = engine.info().generation_defaults.get("max_tokens")   # the model's own cap
            params.max_tokens = min(room, cap or room if kind == "chat" else params.max_tokens)
            if params.min_tokens > params.max_tokens:
                raise bad_request("min_tokens", f"min_tokens: {params.min_tokens}, but at most "
                                  f"{params.max_tokens} new tokens fit after the prompt")
        elif params.max_tokens > room:
            longest = max(len(x) for x in ids)
            raise bad_request(which, f"{which}: the prompt has {longest} tokens and {which} is "
                              f"{params.max_tokens}, but max_model_len is {engine.max_model_len}; "
                              f"at most {room} new tokens fit", code="context_length_exceeded")
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        echoes: list[str | None] = [None] * len(prompts)
        if kind == "completion" and body.get("echo") is True:
            echoes = [p if isinstance(p, str) else (engine.tokenizer.decode(x) if has_tokenizer
                                                    else "") for p, x in zip(prompts, ids)]
        return _Served(kind, f"{prefix}-{uuid.uuid4().hex}", ids, params, stream, include_usage,
                       continuous, echoes, body.get("prompt_logprobs") is not None, tools, ignored)

    def usage(req: _Served, n_out: int) -> dict:
        n_in = sum(len(x) for x in req.prompts)
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
        if prompt_lps is not None and req.echoes[c.prompt] is not None:
            entries = list(zip(req.prompts[c.prompt], prompt_lps)) + entries
        out, c.offset = completion_logprobs(entries, token_text, c.offset)
        return out

    def chunk(req: _Served, text: str | None, finish: str | None, role: bool = False,
              index: int = 0, logprobs: dict | None = None, tool_calls: list | None = None,
              stop_reason: int | str | None = None, n_out: int | None = None) -> dict:
        if req.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None and (text or not tool_calls):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish}
            obj = "text_completion"
        choice["stop_reason"] = stop_reason
        out = {"id": req.rid, "object": obj, "created": req.created, "model": served,
               "choices": [choice]}
        if req.continuous_usage and n_out is not None:
            out["usage"] = usage(req, n_out)
        elif req.include_usage:
            out["usage"] = None
        return out

    def dumps(obj) -> str:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

    has_tokenizer = engine.tokenizer is not None
    token_bytes = max_token_bytes(engine.tokenizer) if has_tokenizer else None
    max_text_bytes = None if token_bytes is None else engine.max_model_len * token_bytes
    # Tokenizing a long prompt takes seconds: one worker thread does it, never the event loop.
    tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="workbench-tokenize")

    async def events_of(req: _Served) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(prompt index, event) for every engine request of `req`, as they come: all are
        submitted at once, so a batch of prompts runs as one batch. Closing it closes the
        engine streams, which aborts what still runs."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, ids: list[int]) -> None:
            try:
                async with contextlib.aclosing(engine.astream(
                        ids, req.params, request_id=req.engine_id(p))) as agen:
                    async for ev in agen:
                        queue.put_nowait((p, ev))
            except Exception as e:
                queue.put_nowait((p, e))
            finally:
                queue.put_nowait((p, None))

        tasks = [asyncio.ensure_future(pump(p, ids)) for p, ids in enumerate(req.prompts)]
        try:
            running = len(tasks)
            while running:
                p, ev = await queue.get()
                if ev is None:
                    running -= 1
                elif isinstance(ev, Exception):
                    raise ev
                else:
                    yield p, ev
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def sse_events(req: _Served) -> AsyncIterator[str]:
        """The SSE body of one streamed request: each choice's chunks carry its index, and
        each choice ends with its own finish_reason. Closing or cancelling it (a client
        disconnect) closes the engine streams, which aborts the requests."""
        choices = req.choices()
        n = req.params.n
        failed = False
        want_lp = req.params.logprobs is not None

        def n_out() -> int:
            return sum(c.n_out for c in choices)

        events = events_of(req)
        try:
            if req.kind == "chat":
                for i in range(len(choices)):
                    yield dumps(chunk(req, "", None, role=True, index=i, n_out=0))
            elif req.params.prompt_logprobs is None:
                for i, c in enumerate(choices):
                    if req.echoes[c.prompt] is not None:
                        yield dumps(chunk(req, req.echoes[c.prompt], None, index=i, n_out=0))
            async for p, ev in events:
                index = p * n + ev.choice
                c = choices[index]
                if ev.prompt_logprobs is not None and req.echoes[p] is not None:
                    for i in range(p * n, p * n + n):    # the echoed prompt, now scored
                        yield dumps(chunk(req, req.echoes[p], None, index=i, logprobs=logprobs_of(
                            req, choices[i], [], ev.prompt_logprobs), n_out=n_out()))
                if ev.token_id is not None:
                    c.n_out = ev.index
                if ev.finished and ev.finish_reason == "error":
                    failed = True
                    break
                text, calls = c.parse(ev.text, ev.finished)
                entries = [(ev.token_id, ev.logprobs)] if want_lp and ev.token_id is not None else []
                if text or calls or entries or (ev.token_id is not None and not has_tokenizer):
                    yield dumps(chunk(req, text, None, index=index, tool_calls=calls,
                                      logprobs=logprobs_of(req, c, entries) if entries else None,
                                      n_out=n_out()))
                if ev.finished:
                    finish = (req.tools.finish_reason(ev.finish_reason, bool(c.tool_deltas))
                              if req.tools is not None else ev.finish_reason)
                    yield dumps(chunk(req, None if req.kind == "chat" else "", finish,
                                      index=index, stop_reason=ev.stop_reason, n_out=n_out()))
        except Exception:    # not a disconnect (that is a CancelledError): tell the client
            log.exception("stream %s failed", req.rid)
            failed = True
        finally:
            await events.aclose()
        if failed:
            yield dumps(APIError(500, "the engine failed while running this request",
                                 type="server_error").body())
        elif req.include_usage:
            yield dumps({"id": req.rid, "object": chunk(req, "", None)["object"],
                         "created": req.created, "model": served, "choices": [],
                         "usage": usage(req, n_out())})
        yield "[DONE]"

    def chat_message(req: _Served, c: _Choice) -> tuple[dict, str | None]:
        """The reply's message and finish_reason: with tools, the calls the parser found
        (a call cut short, whose arguments do not parse, is given back as text)."""
        text = "".join(c.texts)
        if req.tools is None:
            return {"role": "assistant", "content": text}, c.finish
        calls = assemble(c.tool_deltas)
        content = "".join(c.content)
        if not valid_calls(calls):
            calls, content = [], text
        message = {"role": "assistant", "content": content if content or not calls else None,
                   "tool_calls": calls}
        return message, req.tools.finish_reason(c.finish, bool(calls))

    async def run_to_end(req: _Served, request: Request) -> dict:
        """A non-streamed request; aborted if the client disconnects while it runs."""
        async def collect():
            choices = req.choices()
            prompt_lps: list = [None] * len(req.prompts)
            async with contextlib.aclosing(events_of(req)) as events:
                async for p, ev in events:
                    c = choices[p * req.params.n + ev.choice]
                    c.texts.append(ev.text)
                    c.parse(ev.text, ev.finished)
                    if ev.prompt_logprobs is not None:
                        prompt_lps[p] = ev.prompt_logprobs
                    if ev.token_id is not None:
                        c.n_out = ev.index
                        if req.params.logprobs is not None:
                            c.logprobs.append((ev.token_id, ev.logprobs))
                    if ev.finished:
                        c.finish, c.stop_reason = ev.finish_reason, ev.stop_reason
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
            lp = logprobs_of(req, c, c.logprobs, prompt_lps[c.prompt])
            if req.kind == "chat":
                message, finish = chat_message(req, c)
                out.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": finish, "stop_reason": c.stop_reason})
            else:
                out.append({"index": i, "text": (req.echoes[c.prompt] or "") + "".join(c.texts),
                            "logprobs": lp, "finish_reason": c.finish,
                            "stop_reason": c.stop_reason})
                if req.vllm_prompt_logprobs:
                    out[-1]["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps[c.prompt])
        resp = {"id": req.rid, "object": "chat.completion" if req.kind == "chat" else
                "text_completion", "created": req.created, "model": served, "choices": out,
                "usage": usage(req, sum(c.n_out for c in choices))}
        if req.kind == "chat" and req.vllm_prompt_logprobs:
            resp["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps[0])
        return resp

    def ignored_header(req_ignored: list[str], path: str) -> dict[str, str]:
        """Fields the request sent that this server does not know: one warning line in the
        log, and the names in a response header (ASCII, bounded)."""
        if not req_ignored:
            return {}
        names = ", ".join(req_ignored)
        log.warning("%s: ignored fields this server does not know: %s", path, names)
        shown = names.encode("ascii", "backslashreplace").decode()
        return {IGNORED_FIELDS_HEADER: shown if len(shown) <= 1000 else shown[:997] + "..."}

    async def handle(kind: str, request: Request):
        check_auth(request)
        body = await read_json(request)
        req = await asyncio.get_running_loop().run_in_executor(tokenizing, prepare, kind, body)
        headers = ignored_header(req.ignored, request.url.path)
        if req.stream:
            return EventSourceResponse(sse_events(req), headers={**STREAM_HEADERS, **headers},
                                       sep="\n")
        return JSONResponse(await run_to_end(req, request), headers=headers)

    def tokenize_request(body: dict) -> dict:
        ignored = check_fields("tokenize", body, strict_fields)
        check_model(body, optional=True)
        if not has_tokenizer:
            raise bad_request("prompt", f"prompt: model {served!r} has no tokenizer",
                              code="unsupported_model")
        strs = body_field(body, "return_token_strs", (bool,), "true or false") is True
        add_special = body_field(body, "add_special_tokens", (bool,), "true or false")
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise bad_request("prompt", "prompt: give either prompt (a text) or messages")
        if body.get("messages") is not None:
            tools = tool_choice_from({"tools": body.get("tools")})
            prompt, options = chat_prompt(body, ignored, tools)
            options = {k: v for k, v in options.items() if v is not UNSET}
            rename = {"prompt": "messages"}
        else:
            prompt, options, rename = body["prompt"], {}, None
            if not isinstance(prompt, str):
                raise bad_request("prompt", "prompt: must be a string")
        if add_special is not UNSET:
            options["add_special_tokens"] = add_special
        ids = tokenized("chat" if body.get("messages") is not None else "completion", prompt,
                        {**options, "check_length": False}, rename)
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
               "token_strs": engine.tokenizer.convert_ids_to_tokens(ids) if strs else None}
        return out, ignored

    @app.post("/tokenize", openapi_extra=request_body("tokenize"))
    async def tokenize(request: Request):
        """vLLM's /tokenize: a text or a conversation -> its token ids (and their strings)."""
        check_auth(request)
        body = await read_json(request)
        out, ignored = await asyncio.get_running_loop().run_in_executor(
            tokenizing, tokenize_request, body)
        return JSONResponse(out, headers=ignored_header(ignored, request.url.path))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """vLLM's /tokenizer_info: what a client needs to tokenize as this server does (lm-eval's
        remote tokenizer reads it): the special tokens, the chat template, the context."""
        check_auth(request)
        if not has_tokenizer:
            raise APIError(404, f"model {served!r} has no tokenizer", code="unsupported_model")
        tok = engine.tokenizer
        template = chat_template or getattr(tok, "chat_template", None)
        return {"tokenizer_class": type(tok).__name__, "model_max_length": engine.max_model_len,
                "vocab_size": engine.info().vocab_size, "chat_template": template,
                **{name: getattr(tok, name, None) for name in (
                    "eos_token", "bos_token", "pad_token", "unk_token")},
                "add_bos_token": getattr(tok, "add_bos_token", None)}

    @app.post("/detokenize", openapi_extra=request_body("detokenize"))
    async def detokenize(request: Request):
        """vLLM's /detokenize: token ids -> text."""
        check_auth(request)
        body = await read_json(request)
        ignored = check_fields("detokenize", body, strict_fields)
        check_model(body, optional=True)
        tokens = body.get("tokens")
        if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in tokens)):
            raise bad_request("tokens", "tokens: required, a list of token ids")
        vocab = engine.info().vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request("tokens", f"tokens: token id {bad[0]} is outside the vocabulary "
                              f"[0, {vocab})")
        if not has_tokenizer:
            raise bad_request("tokens", f"tokens: model {served!r} has no tokenizer",
                              code="unsupported_model")
        return JSONResponse({"prompt": engine.tokenizer.decode(tokens)},
                            headers=ignored_header(ignored, request.url.path))

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
          limit_concurrency: int = LIMIT_CONCURRENCY, allow_missing_model: bool = False,
          strict_fields: bool = False, chat_template: str | None = None,
          tool_call_parser: str = "hermes") -> None:
    """Run the server in this thread until SIGINT/SIGTERM (then the engine is shut down)."""
    import uvicorn

    app = create_app(engine, model_name, api_key, allow_missing_model, strict_fields,
                     chat_template, tool_call_parser)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=_h11_with_header_timeout(header_timeout),
                            limit_concurrency=limit_concurrency,
                            timeout_graceful_shutdown=5, timeout_keep_alive=30)
    uvicorn.Server(config).run()
