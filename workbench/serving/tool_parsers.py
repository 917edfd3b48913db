"""The model's text turned into OpenAI's `tool_calls` (vLLM's tool parsers): one parser per
`tool_choice` (serving/tools.py says how each runs), each taking the text as it streams and
giving content and tool-call deltas; `assemble` puts the deltas together into the
non-streamed reply, so a stream and a reply cannot disagree."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
"""Hermes' call block, written by Hermes, Qwen2.5/Qwen3 and SmolLM3."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Call:
    index: int
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    arguments: str = ""
    sent: int = -1
    """Characters of `arguments` already streamed; -1: the call's head is not sent yet."""


class ToolCallParser:
    """A choice's text in, OpenAI's deltas out: `feed(text)` and then `finish()` each return
    (content text, tool_call deltas). The same deltas, put together (`assemble`), are the
    non-streamed reply, so a stream and a reply cannot disagree."""

    def __init__(self):
        self.calls: list[_Call] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict]]:
        return "", []

    def _deltas(self) -> list[dict]:
        """What each call has that was not sent yet: its head (id, name) once, then the new
        part of its arguments."""
        out = []
        for c in self.calls:
            if c.name is None:
                continue
            if c.sent < 0:
                out.append({"index": c.index, "id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}})
            elif len(c.arguments) > c.sent:
                out.append({"index": c.index, "function": {"arguments": c.arguments[c.sent:]}})
            c.sent = len(c.arguments)
        return out


class TextParser(ToolCallParser):
    """tool_choice none: text stays text."""

    def feed(self, text):
        return text, []


class NamedCallParser(ToolCallParser):
    """tool_choice names a function: the whole output is its arguments."""

    def __init__(self, name: str):
        super().__init__()
        self.calls.append(_Call(0, name=name))

    def feed(self, text):
        self.calls[0].arguments += text
        return "", self._deltas()


class RequiredCallParser(ToolCallParser):
    """tool_choice required: the output is a JSON array of {"name", "arguments"} objects (the
    grammar sees to that). A scanner follows the JSON as it comes, character by character, so
    each call's arguments stream as they are written."""

    def __init__(self):
        super().__init__()
        self.text = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.token_start = 0          # where the string being read at depth 2 began
        self.key: str | None = None   # the key whose value is being read, at depth 2
        self.expect = "key"           # at depth 2: key, colon, value, comma
        self.value_start = -1         # where the current depth-2 value began

    def feed(self, text):
        start = len(self.text)
        self.text += text
        for pos in range(start, len(self.text)):
            self._char(pos, self.text[pos])
        call = self.calls[-1] if self.calls else None
        if (call is not None and self.key == "arguments" and self.expect == "value"
                and self.value_start >= 0):
            call.arguments = self.text[self.value_start:]   # the value so far
        return "", self._deltas()

    def _char(self, pos: int, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 2:
                    self._string_end(pos)
            return
        if ch.isspace():
            return
        if self.depth == 2 and self.expect == "value" and self.value_start < 0:
            self.value_start = pos
        if ch == '"':
            self.in_string = True
            self.token_start = pos
        elif ch in "{[":
            self.depth += 1
            if self.depth == 2:
                self.calls.append(_Call(len(self.calls)))
                self.expect, self.key, self.value_start = "key", None, -1
        elif ch in "}]":
            if self.depth == 3 and ch == "}" or self.depth == 2:
                self._value_end(pos + 1 if self.depth == 3 else pos)
            self.depth -= 1
        elif ch == ":" and self.depth == 2:
            self.expect = "value"
        elif ch == "," and self.depth == 2:
            self._value_end(pos)
            self.expect = "key"

    def _string_end(self, pos: int) -> None:
        s = json.loads(self.text[self.token_start:pos + 1])
        if self.expect == "key":
            self.key, self.expect, self.value_start = s, "colon", -1
        elif self.key == "name" and self.expect == "value":
            self.calls[-1].name = s
            self.expect = "comma"

    def _value_end(self, end: int) -> None:
        if self.key == "arguments" and self.value_start >= 0 and self.expect == "value":
            self.calls[-1].arguments = self.text[self.value_start:end].rstrip()
            self.expect = "comma"
        self.key = None if self.expect == "comma" else self.key


class HermesCallParser(ToolCallParser):
    """tool_choice auto, `hermes`: text, with calls in <tool_call>...</tool_call> blocks. Text
    that may be the start of a block is held back until it is known not to be one."""

    def __init__(self):
        super().__init__()
        self.pending = ""
        self.in_block = False

    def feed(self, text):
        self.pending += text
        content = []
        while True:
            if not self.in_block:
                at = self.pending.find(CALL_OPEN)
                if at < 0:
                    keep = _partial_suffix(self.pending, CALL_OPEN)
                    content.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content.append(self.pending[:at])
                self.pending, self.in_block = self.pending[at + len(CALL_OPEN):], True
            else:
                at = self.pending.find(CALL_CLOSE)
                if at < 0:
                    break
                block, self.pending = self.pending[:at], self.pending[at + len(CALL_CLOSE):]
                self.in_block = False
                if not self._call(block):
                    content.append(CALL_OPEN + block + CALL_CLOSE)
        return "".join(content), self._deltas()

    def finish(self):
        """The text still held: a block the model did not close is a call if its JSON is one
        (a model may stop right after the object), else text."""
        rest, self.pending = self.pending, ""
        if self.in_block:
            self.in_block = False
            if self._call(rest):
                return "", self._deltas()
            rest = CALL_OPEN + rest
        return rest, []

    def _call(self, block: str) -> bool:
        try:
            obj = json.loads(block)
        except ValueError:
            return False
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return False
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            return False
        self.calls.append(_Call(len(self.calls), name=obj["name"],
                                arguments=json.dumps(args, ensure_ascii=False)))
        return True


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def assemble(deltas: list[dict]) -> list[dict]:
    """tool_call deltas -> the message's tool_calls, as a client puts a stream together."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "type": "function",
                                          "function": {"name": "", "arguments": ""}})
        if "id" in d:
            c["id"] = d["id"]
        fn = d.get("function", {})
        c["function"]["name"] += fn.get("name", "")
        c["function"]["arguments"] += fn.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def valid_calls(calls: list[dict]) -> bool:
    """Every call's arguments are a JSON object (a call cut short by max_tokens is not)."""
    for c in calls:
        try:
            if not isinstance(json.loads(c["function"]["arguments"]), dict):
                return False
        except ValueError:
            return False
    return True
