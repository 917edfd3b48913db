"""The Responses API's output (serving/responses_api.py serves the requests): one response's
envelope (`ResponseContext`, with the request fields a response repeats) and its output items
built from the chat chunks a request produces, with the typed server-sent events that build
them (`OutputBuilder`)."""
from __future__ import annotations

import json
import time
import uuid

from .responses import ServedRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
