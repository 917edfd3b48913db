"""TokenStreamPanel: several requests streaming side by side, with live TTFT / TPOT / tokens.

All cards live in one HTML widget that is rewritten at most once per UI tick, so the number
of comm messages depends on the tick rate (~20 Hz), never on how fast tokens come. Cards keep
the order requests were sent in (a finished one stays where it was).

Where the engine streams log-probabilities (`TokenEvent.logprobs`: token id -> Logprob with
`logprob`, `rank`, `decoded_token`, the sampled token always among them; asked for with
`SamplingParams(logprobs=k)`), each token is shaded by how unlikely it was (darker = the
model was less sure) and its hover text lists the top alternatives with their
probabilities. Events without them (a remote server, an engine not asked) show plain text.

Where the engine decodes speculatively (`EngineConfig.speculative_config`), its events say
which tokens were drafts the target accepted (`TokenEvent.draft`) and, on the token the target
chose itself at a verify step, which drafts it rejected (`TokenEvent.rejected`): accepted
drafts are underlined green, the target's own token at a verify step double-underlined blue,
and a legend line says so once any request speculated. The rejected drafts are named in that
token's hover text, and drawn faint and struck through before it with the panel's "show
rejected drafts" toggle. Plain decode steps' tokens are left unmarked.

A reasoning model's thinking (the `<think>` block Qwen3 opens its reply with; from a server
with a reasoning parser, its reasoning_content, which the remote client hands on in the same
tags) is shown dimmed and in italics, apart from the answer, without the tags.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import ipywidgets as w
import traitlets

from workbench.serving.reasoning import THINK_CLOSE, THINK_OPEN

from .sources import Update
from .style import css_widget, esc, modelled_html, ms

DONE = ("stop", "length", "abort", "error")
SHADED_TOKENS = 400
"""Tokens per card drawn as shaded spans (the card shows the last few lines; older text is
kept plain so a long reply does not grow every redraw)."""


@dataclass(slots=True)
class Piece:
    """Text one token made final, with what the model thought of it."""
    text: str
    prob: float
    """Probability of the sampled token."""
    alternatives: list[tuple[str, float]]
    """The top candidates (text, probability), most likely first, the sampled one included
    ([]: the event carried no logprobs)."""
    spec: str = ""
    """Speculative decoding: 'draft' (an accepted draft), 'own' (the target's own token at a
    verify step), '' (neither: a plain step's token)."""
    rejected: list[str] = field(default_factory=list)
    """With spec 'own': the drafts the target rejected in its place (their text)."""


def piece_of(ev) -> Piece | None:
    """A piece from an event that carries logprobs (shaded) or speculative decoding's marks,
    else None."""
    rejected = getattr(ev, "rejected", None)
    spec = "draft" if getattr(ev, "draft", False) else "own" if rejected is not None else ""
    lps = getattr(ev, "logprobs", None)
    if not lps or ev.token_id is None or ev.token_id not in lps:
        return Piece(ev.text, 1.0, [], spec, list(rejected or [])) if spec else None
    ranked = sorted(lps.values(), key=lambda lp: -lp.logprob)
    return Piece(ev.text, math.exp(lps[ev.token_id].logprob),
                 [(lp.decoded_token or "", math.exp(lp.logprob)) for lp in ranked], spec,
                 list(rejected or []))


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
    pieces: list[Piece] = field(default_factory=list)
    """The text token by token, from the first event that carried probabilities or
    speculative decoding's marks on."""
    plain: int = 0
    """Characters of `text` before the first shaded piece."""

    speculated: bool = False
    """Whether any of its tokens came from a verify step (speculative decoding)."""

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.submitted

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.num_tokens < 2:
            return None
        return (self.last - self.first) / (self.num_tokens - 1)

    def add(self, ev) -> None:
        piece = piece_of(ev)
        if piece is not None:
            if not self.pieces:
                self.plain = len(self.text)
            self.pieces.append(piece)
            self.speculated |= bool(piece.spec)
        elif ev.text and self.pieces:     # text with no probability or mark (a final flush)
            self.pieces.append(Piece(ev.text, 1.0, []))
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
        self.show_rejected = w.Checkbox(
            value=False, indent=False, description="show rejected drafts",
            tooltip="speculative decoding: draw the drafts the target rejected, faint and "
            "struck through, before the token it chose instead (hover that token to see them "
            "without this)", layout=w.Layout(display="none", width="auto"))
        """Shown once a request speculated."""
        self.view = w.HTML(self._html())
        self.show_rejected.observe(lambda _: self._render(), names="value")
        super().__init__([css_widget(), self.show_rejected, self.view], **kw)

    def clear(self) -> None:
        self.streams.clear()
        self.num_requests = self.num_tokens = self.num_finished = 0
        self.show_rejected.layout.display = "none"
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
        if any(s.speculated for s in self.streams.values()):
            self.show_rejected.layout.display = ""
        self._render()

    def set_modelled(self, label: str) -> None:
        """Head the streams as a modelled run's: random tokens, modelled times."""
        self.modelled = label
        self._render()

    def _render(self) -> None:
        self.view.value = self._html()
        self.renders += 1

    def _html(self) -> str:
        streams = list(self.streams.values())
        live = sum(s.status == "streaming" for s in streams)
        waiting = sum(s.status == "waiting" for s in streams)
        # One line at 1440 px: the states no request is in are left out.
        counts = [f"{len(streams)} requests", *(f"{n} {what}" for n, what in (
            (live, "streaming"), (waiting, "waiting"), (self.num_finished, "done")) if n),
            f"{self.num_tokens} tokens"]
        head = (f'<h3 class="one-line">{esc(self.title)} <span class="muted">· '
                f'{" · ".join(counts)}</span></h3>')
        label = getattr(self, "modelled", "")
        if label:
            head += modelled_html(f"{label} · tokens are random")
        if not streams:
            return f'<div class="wb">{head}<div class="muted">No requests yet.</div></div>'
        # In the order sent; past max_cards the oldest finished ones make room first.
        shown = streams
        if len(streams) > self.max_cards:
            done = [s for s in streams if s.status in DONE][:len(streams) - self.max_cards]
            shown = [s for s in streams if s not in done][-self.max_cards:]
        more = len(streams) - len(shown)
        rejected = self.show_rejected.value
        cards = "".join(self._card(s, rejected) for s in shown)
        tail = f'<div class="muted">… and {more} more</div>' if more > 0 else ""
        if any(s.speculated for s in shown):
            head += SPEC_LEGEND
        return f'<div class="wb">{head}<div class="cards">{cards}</div>{tail}</div>'

    @staticmethod
    def _card(s: StreamState, rejected: bool = False) -> str:
        return (f'<div class="card"><div class="hd"><b>{esc(s.request_id)}</b>'
                f'<span class="badge b-{esc(s.status)}">{esc(s.status)}</span></div>'
                f'<div class="prompt" title="{esc(s.label)}">{esc(s.label)}</div>'
                f'<div class="txt"><div>{_text_html(s, rejected)}</div></div>'
                f'<div class="st"><span>TTFT {ms(s.ttft)}</span><span>TPOT '
                f'{ms(s.tpot, 1 if (s.tpot or 0) < 0.1 else 0)}</span>'
                f'<span>{s.num_tokens} tok</span></div></div>')


def thinking_regions(text: str) -> list[tuple[int, int, str]]:
    """(start, end, kind) over `text`: "think" for a reasoning model's thinking (a block the
    text opens with `<think>`, as Qwen3 writes it, up to `</think>` or the end so far), "tag"
    for the tags themselves, "text" for the rest."""
    if not text.lstrip().startswith(THINK_OPEN):
        return [(0, len(text), "text")]
    t0 = text.index(THINK_OPEN)
    a = t0 + len(THINK_OPEN)
    b = text.find(THINK_CLOSE, a)
    b, c = (len(text), len(text)) if b < 0 else (b, b + len(THINK_CLOSE))
    return [(0, t0, "text"), (t0, a, "tag"), (a, b, "think"), (b, c, "tag"),
            (c, len(text), "text")]


SPEC_LEGEND = ('<div class="legend spec"><span class="acc">accepted draft</span>'
               '<span class="own">chosen by the target at a verify step</span>'
               '<span class="rej">rejected draft</span><span class="muted">(speculative '
               'decoding; unmarked: plain decode steps)</span></div>')
"""The marks' key, under the panel's title once a request speculated."""


def _text_html(s: StreamState, rejected: bool = False) -> str:
    """The card's text: the thinking dimmed (its tags not shown), then the answer; its last
    SHADED_TOKENS tokens shaded by probability (with logprobs) and marked as accepted drafts
    or the target's own at a verify step (speculative decoding), with the rejected drafts
    before the latter when `rejected`."""
    regions = thinking_regions(s.text)
    if not s.pieces:
        return _spans(s.text, 0, regions)
    head = s.pieces[:-SHADED_TOKENS]
    plain = s.text[:s.plain] + "".join(p.text for p in head)
    out, at = [_spans(plain, 0, regions)], len(plain)
    for p in s.pieces[len(head):]:
        out.append(_piece_html(p, at, regions, rejected))
        at += len(p.text)
    return "".join(out)


def _parts(text: str, at: int, regions) -> list[tuple[str, str]]:
    """(kind, part) of `text`, which starts at character `at` of the card's text."""
    end = at + len(text)
    return [(kind, text[max(a, at) - at:min(b, end) - at]) for a, b, kind in regions
            if a < end and b > at and kind != "tag"]


def _spans(text: str, at: int, regions) -> str:
    return "".join(f'<span class="think">{esc(part)}</span>' if kind == "think" else esc(part)
                   for kind, part in _parts(text, at, regions))


SPEC_CLASS = {"draft": "acc", "own": "own"}
SPEC_TIP = {"draft": "accepted draft (proposed, then verified by the target)",
            "own": "chosen by the target at a verify step"}


def _piece_html(p: Piece, at: int, regions, rejected: bool = False) -> str:
    """One token's span: shaded by its probability, marked by speculative decoding, with its
    hover text; after the rejected drafts it replaced (faint, struck through) when
    `rejected`."""
    rej = (f'<span class="rej" title="rejected draft">{esc("".join(p.rejected))}</span>'
           if rejected and p.rejected else "")
    if not (p.alternatives or p.spec):
        return rej + _spans(p.text, at, regions)
    parts = _parts(p.text, at, regions)
    if not parts:
        return rej
    text = "".join(part for _, part in parts)
    cls = " ".join(["tk", *(["think"] if parts[0][0] == "think" else []),
                    *([SPEC_CLASS[p.spec]] if p.spec else [])])
    tip = []
    if p.spec:
        tip.append(SPEC_TIP[p.spec])
        if p.spec == "own":
            tip.append("rejected drafts: " + " ".join(map(repr, p.rejected)) if p.rejected
                       else "every draft accepted (this is the bonus token)")
    style = ""
    if p.alternatives:
        tip += [f"p = {p.prob:.2f}", *(f"{t!r}  {q:.2f}" for t, q in p.alternatives)]
        style = f' style="background: rgba(242, 142, 43, {0.75 * (1 - p.prob):.2f})"'
    return (f'{rej}<span class="{cls}"{style} title="{esc(chr(10).join(tip))}">'
            f'{esc(text)}</span>')
