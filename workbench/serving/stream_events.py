"""What a streamed answer from an OpenAI-compatible server turns into on the client side
(client.py's RemoteEngine reads with these): server-sent events parsed line by line, each JSON
chunk (completions, chat, or the Responses API's typed events) turned into a token event with
the client's arrival time, and the request's summary on the last one; the errors a server
answers, as one exception type that names the field."""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator

from ..telemetry import time_per_output_token
from .reasoning import THINK_CLOSE, THINK_OPEN


class RemoteError(RuntimeError):
    """An error answered by the server (HTTP status, or an error event inside a stream).
    `where` names the operation when there is no status (default: inside a stream)."""

    def __init__(self, status: int | None, message: str, param: str | None = None,
                 code: str | None = None, body: Any = None, where: str = "stream"):
        super().__init__(f"{status if status is not None else where}: {message}")
        self.status, self.message, self.param, self.code, self.body = status, message, param, code, body


@dataclass
class RemoteStats:
    """Client-side timings of one request (seconds)."""
    request_id: str
    start: float
    """time.monotonic() when the request was sent."""
    text: str = ""
    finish_reason: str | None = None
    ttft: float | None = None
    """Request sent -> first chunk with text."""
    e2e: float | None = None
    """Request sent -> end of the stream."""
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive text chunks."""
    num_chunks: int = 0
    prompt_tokens: int | None = None
    """From the server's usage report, when it sent one."""
    completion_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        """Output tokens: the server's usage count when it reported one, else the text chunks.
        Every count of a remote request's tokens (bench, panels) is this one."""
        return self.completion_tokens if self.completion_tokens is not None else self.num_chunks

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (num_tokens - 1): the stream's end is its last token's arrival."""
        return time_per_output_token(self.ttft, self.e2e, self.num_tokens)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"], d["num_tokens"] = self.tpot, self.num_tokens
        return d


@dataclass
class RemoteTokenEvent:
    request_id: str
    text: str
    """Text of this chunk ('' on the final event)."""
    index: int
    """Text chunks so far (1 for the first)."""
    time: float
    """time.monotonic() at arrival."""
    since_start: float
    """Seconds since the request was sent (the first event's is the TTFT)."""
    gap: float | None
    """Seconds since the previous text chunk; None for the first."""
    finished: bool = False
    finish_reason: str | None = None
    stats: RemoteStats | None = None
    """Only on the final event: the request's summary."""


# ---- SSE ------------------------------------------------------------------------------------
class SSEParser:
    """Server-sent events, one line at a time: `feed` returns an event's data when the blank
    line that ends it arrives (comments and fields other than data are skipped); `end`
    returns an event the stream closed without ending."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if line == "":
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        if line.startswith("data:"):
            v = line[5:]
            self._data.append(v[1:] if v.startswith(" ") else v)
        return None

    def end(self) -> str | None:
        return self.feed("")


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The data of each SSE event in a stream of lines."""
    parser = SSEParser()
    for line in itertools.chain(lines, [""]):   # lazily: events go out as they arrive
        data = parser.feed(line)
        if data is not None:
            yield data


def _error(status: int, text: str) -> RemoteError:
    """The RemoteError for an error response: OpenAI's `{"error": {...}}`, FastAPI's
    `{"detail": ...}`, or the text itself."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return RemoteError(status, str(err.get("message")), err.get("param"), err.get("code"), body)
    if isinstance(err, str):
        return RemoteError(status, err, body=body)
    detail = body.get("detail") if isinstance(body, dict) else None
    if detail:
        return RemoteError(status, detail if isinstance(detail, str) else json.dumps(detail), body=body)
    return RemoteError(status, text[:500] or f"HTTP {status}", body=body)


class _Tracker:
    """Turns the JSON chunks of one stream into RemoteTokenEvents."""

    def __init__(self, start: float):
        self.stats = RemoteStats("", start)
        self.last: float | None = None
        self.texts: list[str] = []
        self.thinking = False
        """Inside reasoning text (a reasoning parser's reasoning_content, or the Responses
        API's reasoning deltas), which is handed on between <think> tags, as the model
        wrote it."""

    def feed(self, data: str) -> RemoteTokenEvent | None:
        now = time.monotonic()
        obj = json.loads(data)
        if isinstance(obj, dict) and isinstance(obj.get("type"), str):
            return self._typed(obj, now)
        if isinstance(obj, dict) and obj.get("error"):
            err = obj["error"]
            if isinstance(err, dict):
                raise RemoteError(None, str(err.get("message")), err.get("param"), err.get("code"), obj)
            raise RemoteError(None, str(err), body=obj)
        st = self.stats
        st.request_id = st.request_id or obj.get("id", "")
        if obj.get("usage"):
            st.prompt_tokens = obj["usage"].get("prompt_tokens")
            st.completion_tokens = obj["usage"].get("completion_tokens")
        text = ""
        for choice in obj.get("choices") or []:
            if choice.get("finish_reason"):
                st.finish_reason = choice["finish_reason"]
            if "delta" in choice:
                d = choice["delta"]
                text += self._tagged(d.get("reasoning_content") or d.get("reasoning") or "",
                                     d.get("content") or "")
            else:
                text += choice.get("text") or ""
        return self._text(text, now)

    def _typed(self, obj: dict, now: float) -> RemoteTokenEvent | None:
        """One of the Responses API's typed events."""
        st, kind = self.stats, obj["type"]
        if kind == "error":
            raise RemoteError(None, str(obj.get("message")), obj.get("param"), obj.get("code"), obj)
        resp = obj.get("response") if isinstance(obj.get("response"), dict) else None
        if resp is not None:
            st.request_id = st.request_id or resp.get("id", "")
            if kind in ("response.completed", "response.incomplete", "response.failed"):
                usage = resp.get("usage") or {}
                st.prompt_tokens = usage.get("input_tokens")
                st.completion_tokens = usage.get("output_tokens")
                st.finish_reason = {"completed": "stop", "incomplete": "length"}.get(
                    resp.get("status"), resp.get("status"))
        delta = obj.get("delta") if isinstance(obj.get("delta"), str) else ""
        if kind == "response.reasoning_text.delta":
            return self._text(self._tagged(delta, ""), now)
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            return self._text(self._tagged("", delta), now)
        return None

    def _tagged(self, reasoning: str, content: str) -> str:
        out = ""
        if reasoning:
            out += ("" if self.thinking else THINK_OPEN) + reasoning
            self.thinking = True
        if content:
            out += (THINK_CLOSE if self.thinking else "") + content
            self.thinking = False
        return out

    def _text(self, text: str, now: float) -> RemoteTokenEvent | None:
        st = self.stats
        if not text:
            return None
        st.num_chunks += 1
        gap = None if self.last is None else now - self.last
        if gap is None:
            st.ttft = now - st.start
        else:
            st.itl.append(gap)
        self.last = now
        self.texts.append(text)
        return RemoteTokenEvent(st.request_id, text, st.num_chunks, now, now - st.start, gap)

    def final(self) -> RemoteTokenEvent:
        now = time.monotonic()
        st = self.stats
        st.e2e = now - st.start
        st.text = "".join(self.texts)
        return RemoteTokenEvent(st.request_id, "", st.num_chunks, now, st.e2e, None, True,
                                st.finish_reason, st)
