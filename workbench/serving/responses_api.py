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
import time
import uuid
from typing import AsyncIterator, Awaitable

from .handler import OpenAIServing, unless_disconnected
from .protocol import UNSET, APIError, bad_request, body_field, check_fields
from .responses import ServedRequest

MAX_STORED = 1000
"""Responses kept for previous_response_id (the least recently used goes first)."""

RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort"}
"""Chat's names for the fields a Responses body sent under these names (for error messages)."""

PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "top_k", "min_p",
          "repetition_penalty", "seed", "stop", "ignore_eos", "logit_bias", "chat_template_kwargs")
"""Fields with the same name and meaning on chat."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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


class ResponseContext:
    """One Responses request: the chat request it runs as, and what its response repeats."""

    def __init__(self, req: ServedRequest, body: dict, messages: list[dict], store: bool,
                 model: str):
        self.req, self.messages, self.store, self.model = req, messages, store, model
        """messages: the conversation so far (without instructions), for the store."""
        self.id = new_id("resp")
        self.created = int(time.time())
        text = body.get("text") if isinstance(body.get("text"), dict) else {}
        self.echo = {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
            "tools": body.get("tools") or [],
            "text": {"format": text.get("format") or {"type": "text"}},
            "reasoning": body.get("reasoning"), "metadata": body.get("metadata"),
            "store": store, "truncation": "disabled", "background": False,
            "user": body.get("user")}

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: bool = False) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": output, "usage": usage,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                **self.echo}


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


# ---- chat chunks -> output items and typed events -------------------------------------------
class OutputBuilder:
    """Turns one choice's chat chunks into the Responses API's output items, in the order the
    model wrote them (a reasoning item, a message, function calls), and the typed events that
    build them. Whitespace between the thinking and the calls is not made a message."""

    def __init__(self, ctx: ResponseContext):
        self.ctx = ctx
        self.items: list[dict] = []
        self.open: dict | None = None
        """The item being written."""
        self.held = ""
        """Content that is only whitespace so far (sent once more content follows)."""
        self.calls: dict[int, dict] = {}
        """Chat's tool call index -> its function_call item."""
        self.seq = 0
        self.finish: str | None = None
        self.chat_usage: dict | None = None
        self.error: dict | None = None

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def feed(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            self.error = chunk["error"]
            return [self.event("error", code=self.error.get("code") or "server_error",
                               message=self.error["message"], param=self.error.get("param"))]
        if chunk.get("usage"):
            self.chat_usage = chunk["usage"]
        evs: list[dict] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                evs += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                evs += self._content(delta["content"])
            for call in delta.get("tool_calls") or ():
                evs += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return evs

    def _start(self, item: dict, kind: str) -> list[dict]:
        evs = self._close_open() if self.open is not None and self.open["type"] != kind else []
        if self.open is None:
            self.open = item
            self.items.append(item)
            empty = {"reasoning": {"content": []},
                     "message": {"content": [], "status": "in_progress"},
                     "function_call": {"arguments": "", "status": "in_progress"}}[kind]
            evs.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item={**item, **empty}))
            if item["type"] == "message":
                evs.append(self.event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.items) - 1, content_index=0,
                                      part=_text_part("")))
        return evs

    def _reasoning(self, text: str) -> list[dict]:
        evs = self._start({"type": "reasoning", "id": new_id("rs"), "summary": [],
                           "content": [{"type": "reasoning_text", "text": ""}]}, "reasoning")
        self.open["content"][0]["text"] += text
        return evs + [self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                 output_index=len(self.items) - 1, content_index=0, delta=text)]

    def _content(self, text: str, force: bool = False) -> list[dict]:
        if not force and not (self.open is not None and self.open["type"] == "message"):
            if not (self.held + text).strip():
                self.held += text
                return []
            text, self.held = self.held + text, ""
        evs = self._start({"type": "message", "id": new_id("msg"), "role": "assistant",
                           "status": "completed", "content": [_text_part("")]}, "message")
        self.open["content"][0]["text"] += text
        return evs + [self.event("response.output_text.delta", item_id=self.open["id"],
                                 output_index=len(self.items) - 1, content_index=0, delta=text,
                                 logprobs=[])]

    def _call(self, delta: dict) -> list[dict]:
        evs: list[dict] = []
        fn = delta.get("function") or {}
        item = self.calls.get(delta["index"])
        if item is None:
            if self.open is not None:
                evs += self._close_open()
            self.held = ""
            item = {"type": "function_call", "id": new_id("fc"), "call_id": delta.get("id"),
                    "name": fn.get("name", ""), "arguments": "", "status": "completed"}
            self.calls[delta["index"]] = item
            evs += self._start(item, "function_call")
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            evs.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.items.index(item), delta=fn["arguments"]))
        return evs

    def _close_open(self) -> list[dict]:
        item, self.open = self.open, None
        i = self.items.index(item)
        evs = []
        if item["type"] == "reasoning":
            evs.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=i, content_index=0,
                                  text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            evs.append(self.event("response.output_text.done", item_id=item["id"], output_index=i,
                                  content_index=0, text=part["text"], logprobs=[]))
            evs.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=i, content_index=0, part=part))
        else:
            evs.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=i, name=item["name"],
                                  arguments=item["arguments"]))
        evs.append(self.event("response.output_item.done", output_index=i, item=item))
        return evs

    def close(self) -> list[dict]:
        """The end: whitespace-only content with no call after it is the answer after all."""
        self.check_calls()
        evs = []
        if self.held and not self.calls:
            held, self.held = self.held, ""
            evs += self._content(held, force=True)
        if self.open is not None:
            evs += self._close_open()
        return evs

    def usage(self) -> dict | None:
        u = self.chat_usage
        if u is None:
            return None
        details = u.get("completion_tokens_details") or {}
        return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)}}

    def check_calls(self) -> None:
        """A call cut short (max_output_tokens), whose arguments are not a JSON object, is
        marked incomplete (and left out of the conversation that is stored)."""
        for item in self.calls.values():
            try:
                ok = isinstance(json.loads(item["arguments"]), dict)
            except ValueError:
                ok = False
            if not ok:
                item["status"] = "incomplete"

    def messages(self) -> list[dict]:
        """The output as the chat messages that continue the conversation."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call" and i["status"] == "completed"]
        msg: dict = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        return [msg]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
