"""The Responses API (POST /v1/responses, GET /v1/responses/{id}), served as a translation of
the chat path, as a proxy would do it: a Responses body becomes a chat body (input items to
messages, flat function tools to chat's, text.format to response_format, max_output_tokens to
max_completion_tokens), which OpenAIServing checks and runs as any chat request (its
validation, chat template, tool-call parsing, structured output and reasoning split); the chat
chunks it produces become the Responses API's output items and typed server-sent events.

Where this differs from OpenAI's: a stream always ends with `response.completed` (its
`status` says "incomplete" when max_output_tokens cut it, as vLLM does), and stored responses
live in memory, the newest MAX_STORED of them.
"""
from __future__ import annotations

import collections
import contextlib
import json
import threading
from typing import AsyncIterator, Awaitable

from .handler import OpenAIServing, unless_disconnected
from .protocol import UNSET, APIError, bad_request, body_field, check_fields
from .response_items import OutputBuilder, ResponseContext

MAX_STORED = 1000
"""Responses kept for previous_response_id (the least recently used goes first)."""

RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort"}
"""Chat's names for the fields a Responses body sent under these names (for error messages)."""

PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "top_k", "min_p",
          "repetition_penalty", "seed", "stop", "ignore_eos", "logit_bias", "chat_template_kwargs")
"""Fields with the same name and meaning on chat."""


class ResponseStore:
    """Stored responses, by id: the response object and the conversation it ended (as chat
    messages, its own output last), for previous_response_id. Bounded; thread-safe (requests
    are prepared on the tokenizing thread and finished on the event loop)."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, tuple[dict, list[dict]]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, messages: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, messages)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            item = self._items.get(rid)
            if item is not None:
                self._items.move_to_end(rid)
            return item


def not_found(rid: str, param: str | None) -> APIError:
    return APIError(404, f"Response with id {rid!r} not found (this server keeps the newest "
                    f"{MAX_STORED} responses, in memory, and none sent with store false).",
                    param=param, code="response_not_found")


# ---- requests in ----------------------------------------------------------------------------
def input_messages(items) -> list[dict]:
    """`input` -> chat messages: a text is one user message; items are messages (text parts
    only), function_call (an assistant's call; consecutive ones join one assistant turn) and
    function_call_output (a tool message). Reasoning items a client sends back are not read
    (chat templates drop earlier thinking)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input", "input: must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad_request("input", f"{where}: must be an object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request("input", f"{where}.role: must be user, system, developer or "
                                  f"assistant (got {role!r})")
            out.append({"role": role, "content": _text(it.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, args = (it.get(k) for k in ("call_id", "name", "arguments"))
            if not all(isinstance(x, str) for x in (call_id, name, args)):
                raise bad_request("input", f"{where}: a function_call needs string call_id, name "
                                  "and arguments")
            try:
                json.loads(args)
            except ValueError:
                raise bad_request("input", f"{where}.arguments: not valid JSON") from None
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = it.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request("input", f"{where}.call_id: must be a string")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(it.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request("input", f"{where}.type: {kind!r} is not supported by this server "
                              "(message, function_call, function_call_output, reasoning)",
                              code="unsupported_parameter")
    return out


def _text(content, where: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("input", f"{where}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise bad_request("input", f"{where}[{j}]: only text parts (input_text, output_text) "
                              f"are supported (got {kind!r})", code="unsupported_parameter")
    return "".join(texts)


def chat_tools(tools) -> list[dict] | None:
    """Responses' flat function tools -> chat's; a built-in tool is refused, naming it."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "tools: must be a list of {'type': 'function', 'name': ...}")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request("tools", f"tools[{i}].type: {kind!r} is not supported by this "
                              "server (function tools only; built-in tools such as web search "
                              "are not served)", code="unsupported_parameter")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}})
    return out


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice          # none, auto, required (chat checks the value)
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice", "tool_choice: {'type': 'function'} needs a 'name'")
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise bad_request("tool_choice", f"tool_choice: must be 'none', 'auto', 'required' or "
                      f"{{'type': 'function', 'name': ...}} (got type {kind!r}; built-in tools "
                      "are not served)", code="unsupported_parameter" if kind else None)


def response_format(text, ignored: list[str]) -> dict | None:
    """`text` -> chat's response_format (text.format's json_schema keeps its own fields one
    level up, where chat nests them under json_schema)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text", "text: must be an object ({'format': {...}})")
    for key in text:
        if key != "format" and text[key] is not None:
            ignored.append(f"text.{key}")        # verbosity: nothing to do with it here
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format", "text.format: must be an object with a 'type'")
    kind = fmt.get("type")
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return {"type": kind}
    if kind == "json_schema":
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if extra:
            raise bad_request("text.format", f"text.format: unknown field {sorted(extra)[0]!r}")
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in fmt.items() if k != "type" and v is not None}}
    raise bad_request("text.format", "text.format: must be {'type': 'text'}, {'type': "
                      "'json_object'} or {'type': 'json_schema', 'name': ..., 'schema': {...}}")


class ResponsesServing:
    """POST /v1/responses and GET /v1/responses/{id} on an OpenAIServing."""

    def __init__(self, serving: OpenAIServing, capacity: int = MAX_STORED):
        self.serving = serving
        self.store = ResponseStore(capacity)

    def retrieve(self, rid: str) -> dict:
        item = self.store.get(rid)
        if item is None:
            raise not_found(rid, None)
        return item[0]

    def prepare(self, body: dict) -> ResponseContext:
        """A Responses body, checked, as the chat request it runs as; every refusal an
        APIError naming the Responses field."""
        serving = self.serving
        ignored = check_fields("responses", body, serving.strict_fields)
        store = body_field(body, "store", (bool,), "true or false")
        stream = body_field(body, "stream", (bool,), "true or false")
        instructions = body_field(body, "instructions", (str,), "a string")
        prev = body_field(body, "previous_response_id", (str,), "a response id")
        if body.get("input") is None:
            raise bad_request("input", "input: required")
        history: list[dict] = []
        if prev is not UNSET:
            item = self.store.get(prev)
            if item is None:
                raise not_found(prev, "previous_response_id")
            history = item[1]
        messages = history + input_messages(body["input"])
        chat: dict = {k: body[k] for k in PASSED if body.get(k) is not None}
        chat["messages"] = ([{"role": "system", "content": instructions}]
                            if instructions is not UNSET else []) + messages
        if stream is True:
            chat["stream"] = True
        if body.get("max_output_tokens") is not None:
            chat["max_completion_tokens"] = body["max_output_tokens"]
        tools = chat_tools(body.get("tools"))
        if tools is not None:
            chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
        fmt = response_format(body.get("text"), ignored)
        if fmt is not None:
            chat["response_format"] = fmt
        reasoning = body.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, dict):
                raise bad_request("reasoning", "reasoning: must be an object ({'effort': ...})")
            if reasoning.get("effort") is not None:
                chat["reasoning_effort"] = reasoning["effort"]
            ignored += [f"reasoning.{k}" for k in reasoning if k != "effort"
                        and reasoning[k] is not None]
        try:
            req = serving.prepare("chat", chat)
        except APIError as e:
            raise renamed(e) from None
        req.ignored = ignored + req.ignored
        req.include_usage = True        # the chunks end with usage, streamed or not
        return ResponseContext(req, body, messages, store is not False, serving.served)

    # ---- running ----------------------------------------------------------------------------
    async def events(self, ctx: ResponseContext) -> AsyncIterator[dict]:
        """The typed events of one response, from response.created to response.completed
        (or an error event if the engine fails)."""
        out = OutputBuilder(ctx)
        yield out.event("response.created", response=ctx.response("in_progress", []))
        yield out.event("response.in_progress", response=ctx.response("in_progress", []))
        async with contextlib.aclosing(self.serving.chunks(ctx.req)) as chunks:
            async for chunk in chunks:
                for ev in out.feed(chunk):
                    yield ev
        if out.error is not None:
            return
        for ev in out.close():
            yield ev
        yield out.event("response.completed", response=self.finished(ctx, out))

    async def reply(self, ctx: ResponseContext, disconnected: Awaitable[None]) -> dict:
        """A non-streamed response (499 if the client goes away first)."""
        async def collect() -> OutputBuilder:
            out = OutputBuilder(ctx)
            async with contextlib.aclosing(self.serving.chunks(ctx.req)) as chunks:
                async for chunk in chunks:
                    out.feed(chunk)
            out.close()
            return out

        out = await unless_disconnected(collect(), disconnected)
        if out.error is not None:
            raise APIError(500, out.error["message"], type="server_error")
        return self.finished(ctx, out)

    def finished(self, ctx: ResponseContext, out: "OutputBuilder") -> dict:
        """The whole response, stored unless store was false."""
        resp = ctx.response("incomplete" if out.finish == "length" else "completed",
                            out.items, out.usage(), out.finish == "length")
        if ctx.store:
            self.store.put(resp, ctx.messages + out.messages())
        return resp


def renamed(e: APIError) -> APIError:
    """A chat refusal, told in the Responses fields' names."""
    for old, new in RENAMED.items():
        if e.param == old:
            e.param = new
            if e.message.startswith(old):
                e.message = new + e.message[len(old):]
    return e
