"""What the OpenAI endpoints do, apart from the transport (vLLM's OpenAIServing): a checked
body becomes engine requests (`prepare`), their events become responses (`stream` for SSE,
`reply` for a whole one), and the tokenizer endpoints answer. Requests are read by
protocol.py and tools.py, responses written by responses.py; app.py puts this on HTTP.

Tokenizing a long prompt takes seconds, so `prepare` and `tokenize` are meant to run in
`self.tokenizing`, one worker thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import uuid
from typing import AsyncIterator, Awaitable

from ..engine import Engine
from ..engine.request import Request, TokenEvent
from .protocol import (UNSET, APIError, bad_request, body_field, chat_messages, check_fields,
                       completion_prompts, from_value_error, is_template_error, max_token_bytes,
                       resolve_max_tokens, sampling_params_from)
from .reasoning import reasoning_parser as reasoning_parser_cls
from .structured import structured_error, structured_outputs_from
from .responses import ResponseWriter, ServedRequest, dumps
from .tools import (ToolChoice, check_tool_messages, fallback_messages, template_takes_tools,
                    tool_choice_from)

log = logging.getLogger("workbench.server")

ENGINE_FAILED = "the engine failed while running this request"


async def unless_disconnected(work: Awaitable, disconnected: Awaitable[None]):
    """`work`'s result; if `disconnected` completes first (the client went away), `work` is
    cancelled (closing its engine streams aborts the requests) and this raises a 499."""
    work = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected)
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, gone):
            if not t.done():
                t.cancel()
    if not work.done() or work.cancelled():
        await asyncio.wait({work})      # let the engine stream close (it aborts the request)
        raise APIError(499, "client closed the request", code="client_closed_request")
    return work.result()


class OpenAIServing:
    def __init__(self, engine: Engine, served: str, allow_missing_model: bool = False,
                 strict_fields: bool = False, chat_template: str | None = None,
                 reasoning_parser: str | None = None):
        self.engine, self.served = engine, served
        self.allow_missing_model = allow_missing_model
        self.strict_fields = strict_fields
        self.chat_template = chat_template
        """The server's template (--chat-template) for chat requests that send none."""
        self.reasoning = reasoning_parser and reasoning_parser_cls(reasoning_parser)
        """--reasoning-parser: splits chat replies' thinking off (None: no split)."""
        tok = engine.tokenizer
        self.has_tokenizer = tok is not None
        self.max_model_len = engine.info().max_model_len
        self.token_bytes = max_token_bytes(tok) if tok is not None else None
        self.max_text_bytes = (None if self.token_bytes is None
                               else self.max_model_len * self.token_bytes)
        self.writer = ResponseWriter(served, self.token_text)
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="workbench-tokenize")

    def close(self) -> None:
        self.tokenizing.shutdown(wait=False, cancel_futures=True)

    def token_text(self, t: int) -> str:
        return self.engine.tokenizer.decode([t]) if self.has_tokenizer else f"token_id:{t}"

    # ---- requests in ----------------------------------------------------------------------
    def check_model(self, body: dict, optional: bool = False) -> None:
        m = body.get("model")
        if m is None:
            if self.allow_missing_model or optional:
                return
            raise bad_request("model", "model: required (this server serves "
                                       f"{self.served!r}; start it with --allow-missing-model "
                                       "to default to it)")
        if not isinstance(m, str):
            raise bad_request("model", f"model: must be a string (got {m!r})")
        if m != self.served:
            raise APIError(404, f"The model `{m}` does not exist. This server serves "
                           f"`{self.served}`.", param="model", code="model_not_found")

    def chat_prompt(self, body: dict, ignored: list[str],
                    tools: ToolChoice | None) -> tuple[list[dict], dict]:
        """The conversation as the chat template will read it, and the template's controls;
        with tools, they go through the template where it takes them (else the fallback)."""
        messages = chat_messages(body, None if self.strict_fields else ignored)
        check_tool_messages(messages)
        options = {}
        for name, kinds, what in (("add_generation_prompt", (bool,), "true or false"),
                                  ("continue_final_message", (bool,), "true or false"),
                                  ("chat_template", (str,), "a Jinja template text"),
                                  ("chat_template_kwargs", (dict,), "an object")):
            options[name] = body_field(body, name, kinds, what)
        effort = body_field(body, "reasoning_effort", (str,), "a string (low, medium, high...)")
        if effort is not UNSET:     # a template variable, as vLLM passes it
            kwargs = options["chat_template_kwargs"]
            options["chat_template_kwargs"] = {"reasoning_effort": effort,
                                               **({} if kwargs is UNSET else kwargs)}
        if options["chat_template"] is UNSET and self.chat_template is not None:
            options["chat_template"] = self.chat_template
        template = (options["chat_template"] if options["chat_template"] is not UNSET
                    else getattr(self.engine.tokenizer, "chat_template", None))
        if template is None:
            raise bad_request("messages", f"messages: model {self.served!r} has no chat "
                                          "template; use /v1/completions", code="unsupported_model")
        offered = tools.tools if tools is not None and tools.mode != "none" else []
        if template_takes_tools(template):
            if offered:
                options["tools"] = offered
        elif offered or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = fallback_messages(messages, offered)
        return messages, {k: v for k, v in options.items() if v is not UNSET}

    def tokenized(self, kind: str, prompt, options: dict, rename: dict | None) -> list[int]:
        """engine.tokenize, each refusal a 400 naming the field it is about."""
        field = "messages" if kind == "chat" else "prompt"
        if self.max_text_bytes is not None:
            texts = ([json.dumps(m, ensure_ascii=False) for m in prompt] if kind == "chat"
                     else [prompt] if isinstance(prompt, str) else [])
            size = sum(len(t.encode()) for t in texts)
            if size > self.max_text_bytes:
                raise bad_request(field, f"{field}: {size} bytes of text cannot fit in "
                                  f"max_model_len ({self.max_model_len} tokens; no token "
                                  f"of this tokenizer is longer than {self.token_bytes} bytes)",
                                  code="context_length_exceeded")
        try:
            return self.engine.tokenize(prompt, **options)
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
                raise bad_request("messages", "messages: the chat template refused them: "
                                  f"{e.message}") from None
            raise bad_request(field, f"{field}: could not be tokenized") from None

    def prepare(self, kind: str, body: dict) -> ServedRequest:
        """A completions ("completion") or chat body, checked field by field, as engine
        requests ready to run; every refusal is an APIError before anything is queued."""
        engine = self.engine
        ignored = check_fields(kind, body, self.strict_fields)
        self.check_model(body)
        stream = body_field(body, "stream", (bool,), "true or false")
        stream = False if stream is UNSET else stream
        stream_options = body.get("stream_options")
        if stream_options is not None and not isinstance(stream_options, dict):
            raise bad_request("stream_options", "stream_options: must be an object")
        if stream_options is not None and not stream:
            raise bad_request("stream_options", "stream_options: only allowed when stream is true")
        stream_options = stream_options or {}
        if stream and body.get("prompt_logprobs") is not None:
            raise bad_request("prompt_logprobs", "prompt_logprobs: not available when stream is "
                              "true (as vLLM; completions' echo with logprobs streams the "
                              "prompt's logprobs)")
        tools = tool_choice_from(body) if kind == "chat" else None
        structured, structured_field = structured_outputs_from(body)
        if tools is not None and tools.structured_outputs() is not None:
            if structured is not None:
                raise bad_request(structured_field, f"{structured_field}: cannot be combined "
                                  "with tool_choice " + (tools.mode if tools.mode != "named"
                                                         else repr(tools.name)))
            structured, structured_field = tools.structured_outputs(), "tools"
        defaults = engine.info().generation_defaults
        params, which = sampling_params_from(body, kind, structured, defaults)
        options = {"truncate_prompt_tokens": params.truncate_prompt_tokens,
                   "add_special_tokens": body_field(body, "add_special_tokens", (bool,),
                                                    "true or false")}
        if kind == "chat":
            messages, chat_options = self.chat_prompt(body, ignored, tools)
            prompts, rename = [messages], {"prompt": "messages"}
            options.update(chat_options)
        else:
            prompts, rename = completion_prompts(body), None
        options = {k: v for k, v in options.items() if v is not UNSET and v is not None}
        ids = [self.tokenized(kind, p, options, rename) for p in prompts]
        resolve_max_tokens(params, which, kind, defaults.get("max_tokens"),
                           max(len(x) for x in ids), self.max_model_len)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        try:    # the params checked against the engine and the grammar compiled, once each
            requests = [engine.make_request(p, params, f"{rid}-{i}" if len(prompts) > 1 else rid,
                                            prompt_token_ids=x)
                        for i, (p, x) in enumerate(zip(prompts, ids))]
        except ValueError as e:
            raise (structured_error(structured_field, e) if structured is not None and str(
                e).startswith("structured_outputs") else from_value_error(e)) from None
        echoes: list[str | None] = [None] * len(prompts)
        if kind == "completion" and body.get("echo") is True:
            echoes = [p if isinstance(p, str) else (engine.tokenizer.decode(x) if self.has_tokenizer
                                                    else "") for p, x in zip(prompts, ids)]
        return ServedRequest(kind, rid, requests, params, stream,
                             bool(stream_options.get("include_usage")),
                             bool(stream_options.get("continuous_usage_stats")), echoes,
                             body.get("prompt_logprobs") is not None, tools, ignored,
                             # a grammar decides the whole output: no thinking to split off
                             self.reasoning if kind == "chat" and structured is None else None)

    # ---- running ----------------------------------------------------------------------------
    async def events_of(self, req: ServedRequest) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(prompt index, event) for every engine request of `req`, as they come: all are
        submitted at once, so a batch of prompts runs as one batch. Closing it closes the
        engine streams, which aborts what still runs."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, request: Request) -> None:
            try:
                async with contextlib.aclosing(self.engine.astream(request)) as agen:
                    async for ev in agen:
                        queue.put_nowait((p, ev))
            except Exception as e:
                queue.put_nowait((p, e))
            finally:
                queue.put_nowait((p, None))

        tasks = [asyncio.ensure_future(pump(p, r)) for p, r in enumerate(req.requests)]
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

    async def stream(self, req: ServedRequest) -> AsyncIterator[str]:
        """The SSE data of one streamed request: its chunks, then [DONE]."""
        async with contextlib.aclosing(self.chunks(req)) as chunks:
            async for chunk in chunks:
                yield dumps(chunk)
        yield "[DONE]"

    async def chunks(self, req: ServedRequest) -> AsyncIterator[dict]:
        """The chunks of one streamed request: each choice's chunks carry its index, and
        each choice ends with its own finish_reason; an engine failure ends it with an error
        object ({"error": ...}). Closing or cancelling it (a client disconnect) closes the
        engine streams, which aborts the requests."""
        w, choices, n = self.writer, req.choices(), req.params.n
        failed = False
        want_lp = req.params.logprobs is not None

        def n_out() -> int:
            return sum(c.n_out for c in choices)

        events = self.events_of(req)
        try:
            if req.kind == "chat":
                for i in range(len(choices)):
                    yield w.chunk(req, "", None, role=True, index=i, n_out=0)
            elif req.params.prompt_logprobs is None:
                for i, c in enumerate(choices):
                    if req.echoes[c.prompt] is not None:
                        yield w.chunk(req, req.echoes[c.prompt], None, index=i, n_out=0)
            async for p, ev in events:
                index = p * n + ev.choice
                c = choices[index]
                if ev.prompt_logprobs is not None and req.echoes[p] is not None:
                    for i in range(p * n, p * n + n):    # the echoed prompt, now scored
                        yield w.chunk(req, req.echoes[p], None, index=i, n_out=n_out(),
                                      logprobs=w.logprobs(req, choices[i], [],
                                                          ev.prompt_logprobs))
                if ev.token_id is not None:
                    c.n_out = ev.index
                if ev.finished and ev.finish_reason == "error":
                    failed = True
                    break
                thought, text, calls = c.parse(ev.text, ev.finished)
                entries = [(ev.token_id, ev.logprobs)] if want_lp and ev.token_id is not None else []
                if (thought or text or calls or entries
                        or (ev.token_id is not None and not self.has_tokenizer)):
                    yield w.chunk(req, text, None, index=index, tool_calls=calls,
                                  reasoning=thought, n_out=n_out(),
                                  logprobs=w.logprobs(req, c, entries) if entries else None)
                if ev.finished:
                    yield w.chunk(req, None if req.kind == "chat" else "",
                                  w.finish_reason(req, c, ev.finish_reason), index=index,
                                  stop_reason=ev.stop_reason, n_out=n_out())
        except Exception:    # not a disconnect (that is a CancelledError): tell the client
            log.exception("stream %s failed", req.rid)
            failed = True
        finally:
            await events.aclose()
        if failed:
            yield APIError(500, ENGINE_FAILED, type="server_error").body()
        elif req.include_usage:
            yield w.usage_chunk(req, choices)

    async def reply(self, req: ServedRequest, disconnected: Awaitable[None]) -> dict:
        """A non-streamed request's whole reply; aborted (499) if `disconnected` completes
        first (the client went away)."""
        async def collect():
            choices = req.choices()
            prompt_lps: list = [None] * len(req.prompts)
            async with contextlib.aclosing(self.events_of(req)) as events:
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

        choices, prompt_lps = await unless_disconnected(collect(), disconnected)
        if any(c.finish == "error" for c in choices):
            raise APIError(500, ENGINE_FAILED, type="server_error")
        return self.writer.reply(req, choices, prompt_lps)

    # ---- the tokenizer endpoints (vLLM's) -------------------------------------------------
    def _need_tokenizer(self, param: str) -> None:
        if not self.has_tokenizer:
            raise bad_request(param, f"{param}: model {self.served!r} has no tokenizer",
                              code="unsupported_model")

    def tokenize(self, body: dict) -> tuple[dict, list[str]]:
        """/tokenize: a text or a conversation -> its token ids (and their strings), however
        long; and the fields ignored."""
        ignored = check_fields("tokenize", body, self.strict_fields)
        self.check_model(body, optional=True)
        self._need_tokenizer("prompt")
        strs = body_field(body, "return_token_strs", (bool,), "true or false") is True
        add_special = body_field(body, "add_special_tokens", (bool,), "true or false")
        chat = body.get("messages") is not None
        if (body.get("prompt") is None) != chat:
            raise bad_request("prompt", "prompt: give either prompt (a text) or messages")
        if chat:
            tools = tool_choice_from({"tools": body.get("tools")})
            prompt, options = self.chat_prompt(body, ignored, tools)
            rename = {"prompt": "messages"}
        else:
            prompt, options, rename = body["prompt"], {}, None
            if not isinstance(prompt, str):
                raise bad_request("prompt", "prompt: must be a string")
        if add_special is not UNSET:
            options["add_special_tokens"] = add_special
        ids = self.tokenized("chat" if chat else "completion", prompt,
                             {**options, "check_length": False}, rename)
        tok = self.engine.tokenizer
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if strs else None}, ignored

    def detokenize(self, body: dict) -> tuple[dict, list[str]]:
        """/detokenize: token ids -> text; and the fields ignored."""
        ignored = check_fields("detokenize", body, self.strict_fields)
        self.check_model(body, optional=True)
        tokens = body.get("tokens")
        if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in tokens)):
            raise bad_request("tokens", "tokens: required, a list of token ids")
        vocab = self.engine.info().vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request("tokens", f"tokens: token id {bad[0]} is outside the vocabulary "
                              f"[0, {vocab})")
        self._need_tokenizer("tokens")
        return {"prompt": self.engine.tokenizer.decode(tokens)}, ignored

    def tokenizer_info(self) -> dict:
        """/tokenizer_info: what a client needs to tokenize as this server does (lm-eval's
        remote tokenizer reads it): the special tokens, the chat template, the context."""
        if not self.has_tokenizer:
            raise APIError(404, f"model {self.served!r} has no tokenizer", code="unsupported_model")
        tok = self.engine.tokenizer
        return {"tokenizer_class": type(tok).__name__,
                "model_max_length": self.max_model_len,
                "vocab_size": self.engine.info().vocab_size,
                "chat_template": self.chat_template or getattr(tok, "chat_template", None),
                **{name: getattr(tok, name, None) for name in (
                    "eos_token", "bos_token", "pad_token", "unk_token")},
                "add_bos_token": getattr(tok, "add_bos_token", None)}
