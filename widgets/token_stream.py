"""TokenStreamPanel: several requests streaming side by side, with live TTFT / TPOT / tokens.

All cards live in one HTML widget that is rewritten at most once per UI tick, so the number
of comm messages depends on the tick rate (~20 Hz), never on how fast tokens come.
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as w
import traitlets

from .sources import Update
from .style import css_widget, esc, ms

DONE = ("stop", "length", "abort", "error")


@dataclass
class StreamState:
    request_id: str
    submitted: float
    label: str = ""
    text: str = ""
    num_tokens: int = 0
    first: float | None = None
    last: float | None = None
    status: str = "waiting"
    """'waiting', 'streaming', or the finish reason: 'stop', 'length', 'abort', 'error'."""

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.submitted

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.num_tokens < 2:
            return None
        return (self.last - self.first) / (self.num_tokens - 1)

    def add(self, ev) -> None:
        if ev.text:
            self.text += ev.text
        if ev.index and ev.index > self.num_tokens:
            if self.first is None:
                self.first = ev.time
            self.last = ev.time
            self.num_tokens = ev.index
        stats = getattr(ev, "stats", None)     # a server's final event: its token count
        if stats is not None:
            self.num_tokens = stats.num_tokens
        if ev.finished:
            self.status = ev.finish_reason or "stop"
        elif self.status == "waiting" and self.first is not None:
            self.status = "streaming"


class TokenStreamPanel(w.VBox):
    """Live text of each request. Feed it with `update(source.poll())`, or let `Live` or the
    `Dashboard` do it. `streams` holds each request's state (text, tokens, TTFT, TPOT)."""

    num_requests = traitlets.Int(0, help="Requests shown since the last clear().")
    num_tokens = traitlets.Int(0, help="Output tokens received, all requests together.")
    num_finished = traitlets.Int(0)
    renders = traitlets.Int(0, help="How many times the cards were redrawn.")

    def __init__(self, max_cards: int = 16, title: str = "Token streams", **kw):
        self.max_cards = max_cards
        self.title = title
        self.streams: dict[str, StreamState] = {}
        self.view = w.HTML(self._html())
        super().__init__([css_widget(), self.view], **kw)

    def clear(self) -> None:
        self.streams.clear()
        self.num_requests = self.num_tokens = self.num_finished = 0
        self._render()

    def update(self, u: Update) -> None:
        if not (u.submitted or u.events):
            return
        for rid, t, label in u.submitted:
            self.streams[rid] = StreamState(rid, t, label)
        for ev in u.events:
            st = self.streams.get(ev.request_id)
            if st is None:   # a request someone else sent to the same engine
                st = self.streams[ev.request_id] = StreamState(ev.request_id, ev.time)
            st.add(ev)
        self.num_requests = len(self.streams)
        self.num_tokens = sum(s.num_tokens for s in self.streams.values())
        self.num_finished = sum(s.status in DONE for s in self.streams.values())
        self._render()

    def _render(self) -> None:
        self.view.value = self._html()
        self.renders += 1

    def _html(self) -> str:
        streams = list(self.streams.values())
        live = sum(s.status == "streaming" for s in streams)
        waiting = sum(s.status == "waiting" for s in streams)
        head = (f'<h3>{esc(self.title)} <span class="muted">· {len(streams)} requests · '
                f'{live} streaming · {waiting} waiting · {self.num_finished} done · '
                f'{self.num_tokens} tokens</span></h3>')
        if not streams:
            return f'<div class="wb">{head}<div class="muted">No requests yet.</div></div>'
        # Running ones first (newest last among them), then the most recently finished.
        active = [s for s in streams if s.status not in DONE]
        done = [s for s in streams if s.status in DONE]
        shown = (active + done[::-1])[:self.max_cards]
        more = len(streams) - len(shown)
        cards = "".join(self._card(s) for s in shown)
        tail = f'<div class="muted">… and {more} more</div>' if more > 0 else ""
        return f'<div class="wb">{head}<div class="cards">{cards}</div>{tail}</div>'

    @staticmethod
    def _card(s: StreamState) -> str:
        return (f'<div class="card"><div class="hd"><b>{esc(s.request_id)}</b>'
                f'<span class="badge b-{esc(s.status)}">{esc(s.status)}</span></div>'
                f'<div class="prompt" title="{esc(s.label)}">{esc(s.label)}</div>'
                f'<div class="txt"><div>{esc(s.text)}</div></div>'
                f'<div class="st">TTFT {ms(s.ttft)} · TPOT '
                f'{ms(s.tpot, 1 if (s.tpot or 0) < 0.1 else 0)} · {s.num_tokens} tok</div></div>')
