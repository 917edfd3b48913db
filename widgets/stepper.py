"""Stepper: drive the engine one scheduler step at a time and see what it chose.

Add requests, press Step: the panel shows the step's phase, what each request did (a whole
prefill, a prompt chunk, a decode, or being preempted), the token it got, its block table,
and the step's time; the KV block map below shows the pool after the step. The same calls
work from code (`add`, `step`, `run`), which is how the teaching notebook uses it.

The Stepper steps the engine in the kernel's thread, so the engine must not be running in
the background. `Stepper.replay(FILE)` steps through a recorded trace instead (no model is
loaded): Step shows the next recorded step, Play runs them at the recorded pace times `speed`.

Where the engine hands out logprobs (`SamplingParams(logprobs=k)`), each sampled token shows
its top candidates with their probabilities.

With speculative decoding (`speculative_config`), a request whose step verified drafted
tokens ('verify') shows what was drafted: the drafts the target model accepted, the ones it
rejected (struck through: cut, their KV given back) and the token the target chose itself
after the accepted ones; the step's header counts drafted and accepted tokens.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import ipywidgets as w
import traitlets

from workbench import Engine, SamplingParams
from workbench.trace import Trace

from .kv_map import KVBlockMap
from .replay import load_trace
from .sources import describe_engine
from .style import CSS, css_widget, esc, modelled_html, modelled_label


@dataclass
class RequestRow:
    request_id: str
    action: str
    """'prefill', 'chunk', 'decode', 'preempted', 'waiting' or 'finished'."""
    num_tokens: int
    """Tokens this request fed the model in the step."""
    token_id: int | None
    token: str
    """The sampled token as text ('' if none)."""
    block_table: list[int]
    progress: str
    """e.g. '37/37 prompt, 5 out'."""
    text: str = ""
    finish_reason: str | None = None
    candidates: list[tuple[str, float]] = field(default_factory=list)
    """The top candidates for the sampled token, (text, probability), most likely first;
    empty where the request asked for no logprobs."""
    token_ids: list[int] = field(default_factory=list)
    """Every token the step handed it, in order (several after a verify: the accepted
    drafts, then the target's own token, which is token_id)."""
    drafts: list[int] = field(default_factory=list)
    """Speculative decoding: the tokens drafted for it and verified in this step."""
    draft_texts: list[str] = field(default_factory=list)
    accepted: int = 0
    """How many of `drafts` the target accepted (the first ones; the rest were rejected)."""

    @property
    def rejected(self) -> list[int]:
        return self.drafts[self.accepted:]


@dataclass
class StepRecord:
    step: int
    phase: str
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    rows: list[RequestRow] = field(default_factory=list)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    graph_size: int | None = None
    """The captured size replayed (decode batch or token bucket), or None when eager."""
    graph_label: str = "eager"
    """StepEvent.graph_label: eager, a whole-step graph, or piecewise graphs."""
    num_draft_tokens: int = 0
    """Speculative decoding: tokens drafted for the step's verifies, and how many were kept."""
    num_accepted_tokens: int = 0

    def row(self, request_id: str) -> RequestRow:
        return next(r for r in self.rows if r.request_id == request_id)


TOP_K = 5
"""Candidates shown per sampled token."""
_ASKS_LOGPROBS = "logprobs" in {f.name for f in fields(SamplingParams)}


def top_candidates(ev, k: int = TOP_K) -> list[tuple[str, float]]:
    """(text, probability) of a token event's top-k logprobs, most likely first ([] if none)."""
    lps = getattr(ev, "logprobs", None) or {}
    ranked = sorted(lps.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))[:k]
    return [(lp.decoded_token if lp.decoded_token is not None else f"#{tid}",
             math.exp(lp.logprob)) for tid, lp in ranked]


class Stepper(w.VBox):
    num_steps = traitlets.Int(0)

    def __init__(self, engine: Engine | None = None, max_history: int = 12, *,
                 trace: Trace | str | Path | None = None, **engine_kwargs):
        if trace is not None:
            if engine is not None or engine_kwargs:
                raise ValueError("trace: a replay needs no engine; pass one or the other")
            self.trace, self._frame = load_trace(trace), 0
        else:
            self.trace = None
            if engine is None:
                engine = Engine(**engine_kwargs)
            elif engine_kwargs:
                raise ValueError("pass an engine or engine settings, not both")
            if engine.is_running_in_background:
                raise ValueError("engine: the Stepper steps the engine itself; pass one that is "
                                 "not running in the background (no engine.start())")
        self.engine = engine
        self.max_history = max_history
        self.history: list[StepRecord] = []
        self.texts: dict[str, str] = {}
        self.prompt = w.Text(value="The three primary colours are", description="prompt",
                             layout=w.Layout(flex="1 1 auto"))
        self.max_tokens = w.BoundedIntText(value=8, min=1, max=4096, description="max tokens",
                                           layout=w.Layout(width="170px"))
        self.add_button = w.Button(description="Add request", icon="plus")
        self.step_button = w.Button(description="Step", icon="step-forward", button_style="primary")
        self.run_button = w.Button(description="Run to the end", icon="fast-forward")
        self.add_button.on_click(lambda _: self._guard(lambda: self.add(self.prompt.value,
                                                                        self.max_tokens.value)))
        self.step_button.on_click(lambda _: self._guard(self.step))
        self.run_button.on_click(lambda _: self._guard(lambda: self.run(
            speed=self.speed.value if self.trace is not None else None)))
        self.message = w.HTML()
        self.view = w.HTML()
        self.history_view = w.HTML()
        self.kv = KVBlockMap(columns=32, title="KV blocks after the step")
        self.speed = w.BoundedFloatText(value=1.0, min=0.01, max=1000, step=0.5,
                                        description="speed ×", layout=w.Layout(width="150px"))
        top = [w.HBox([self.prompt, self.max_tokens, self.add_button])]
        buttons = [self.step_button, self.run_button]
        if self.trace is not None:
            self.run_button.description, self.run_button.icon = "Play", "play"
            top = [w.HTML('<div class="wb"><h3>Replay <span class="muted">· ' + esc(" · ".join(
                f"{k} {v}" for k, v in describe_engine(self.trace.info).items()))
                + ' · no model loaded'
                '</span></h3></div>')]
            buttons.append(self.speed)
        info = self.trace.info if self.trace is not None else self.engine.info()
        label = modelled_label(info)
        self.modelled = label
        """'' for a real device; else what this stepper's times are (modelled)."""
        if label:
            top.insert(0, w.HTML(modelled_html(f"{label} · tokens are random")))
        super().__init__([css_widget(), *top, w.HBox(buttons),
                          self.message, self.view, self.kv, self.history_view])
        self._render()

    @classmethod
    def replay(cls, trace: Trace | str | Path, max_history: int = 12) -> "Stepper":
        """A Stepper over a recorded trace (workbench.trace): no model is loaded."""
        return cls(trace=trace, max_history=max_history)

    # ---- actions --------------------------------------------------------------------------
    def _guard(self, action) -> None:
        try:
            self.message.value = ""
            action()
        except ValueError as e:
            self.message.value = f'<div class="wb"><div class="error">{esc(str(e))}</div></div>'

    def add(self, prompt, max_tokens: int = 8, temperature: float = 0.0, **params) -> str:
        """Queue a request; it is admitted at the next step. Returns its id. Its tokens show
        their top candidates (logprobs=5) unless `logprobs` says otherwise."""
        if self.trace is not None:
            raise ValueError("a replay plays recorded requests; it cannot add new ones")
        if _ASKS_LOGPROBS:
            params.setdefault("logprobs", TOP_K)
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, **params)
        rid = self.engine.add_request(prompt, sp)
        self.texts[rid] = ""
        self._render()
        return rid

    def step(self) -> StepRecord:
        """Run one scheduler step (or play the next recorded one) and show what happened."""
        if self.trace is not None:
            frames = self.trace.frames
            if self._frame >= len(frames):
                raise ValueError("the replay is over: every recorded step has been shown")
            before = {s.request_id: s for s in frames[self._frame - 1].states} \
                if self._frame else {}
            f = frames[self._frame]
            self._frame += 1
            handed = f.tokens
            ev, after, tok = f.step, {s.request_id: s for s in f.states}, None
        else:
            e = self.engine
            before = {s.request_id: s for s in e.request_states()}
            handed = e.step()
            ev = e.telemetry.steps[-1]
            after = {s.request_id: s for s in e.request_states()}
            tok = e.tokenizer
        handed_to: dict[str, list] = {}          # a verify hands a request several tokens
        for t in handed:
            handed_to.setdefault(t.request_id, []).append(t)
        drafts_of, accepted_of = getattr(ev, "drafts", {}), getattr(ev, "accepted", {})
        rec = StepRecord(ev.step, ev.phase, ev.duration, ev.num_prefill_tokens,
                         ev.num_decode_tokens, kv_blocks_used=ev.kv_blocks_used,
                         kv_blocks_total=ev.kv_blocks_used + ev.kv_blocks_free,
                         graph_size=ev.graph_size if ev.graph else None,
                         graph_label=ev.graph_label,
                         num_draft_tokens=sum(map(len, drafts_of.values())),
                         num_accepted_tokens=sum(accepted_of.values()))

        def text_of(token_id: int, t=None) -> str:
            if tok is not None:
                return tok.decode([token_id])
            return t.text if t is not None else f"#{token_id}"
        for rid in dict.fromkeys([*before, *after]):
            st = after.get(rid) or before[rid]
            mine = handed_to.get(rid, [])
            t = mine[-1] if mine else None
            self.texts[rid] = self.texts.get(rid, "") + "".join(x.text for x in mine)
            if rid in ev.preempted:
                action = "preempted"
            elif rid in ev.kinds:
                action = ev.kinds[rid]
            elif rid not in after:
                action = "finished"
            else:
                action = "waiting"
            token_id = t.token_id if t is not None else None
            piece = text_of(token_id, t) if token_id is not None else ""
            drafts = list(drafts_of.get(rid, ()))
            n_acc = accepted_of.get(rid, 0)
            # an accepted draft's text is the token event's; a rejected one has none
            draft_texts = [text_of(d, mine[j] if j < n_acc and j < len(mine) else None)
                           for j, d in enumerate(drafts)]
            out = st.num_output_tokens + (len(mine) if rid not in after else 0)
            rec.rows.append(RequestRow(
                rid, action, ev.tokens_per_request.get(rid, 0), token_id, piece,
                list(st.block_table) if rid in after else [],
                f"{min(st.num_computed_tokens, st.num_prompt_tokens)}/{st.num_prompt_tokens} "
                f"prompt, {out} out", self.texts.get(rid, ""),
                t.finish_reason if t is not None and t.finished else None,
                top_candidates(t) if t is not None else [],
                [x.token_id for x in mine], drafts, draft_texts, n_acc))
        self.history.append(rec)
        del self.history[:-self.max_history]
        self.num_steps += 1
        self._render(rec)
        return rec

    def has_more(self) -> bool:
        """Whether a step is left: an unfinished request, or a recorded step not yet shown."""
        if self.trace is not None:
            return self._frame < len(self.trace.frames)
        return self.engine.has_unfinished_requests()

    def run(self, max_steps: int = 10_000, speed: float | None = None) -> list[StepRecord]:
        """Step until no request is left (or max_steps); returns the steps' records. A replay
        with `speed` waits between steps as recorded (speed 2: twice as fast); without it,
        and live, steps follow each other at once."""
        if speed is not None and not 0 < speed <= 1000:
            raise ValueError(f"speed: must be in (0, 1000] (got {speed})")
        recs: list[StepRecord] = []
        t0, base = time.monotonic(), None
        while self.has_more() and len(recs) < max_steps:
            if speed is not None and self.trace is not None:
                f = self.trace.frames[self._frame]
                base = f.step.start if base is None else base
                time.sleep(max(0.0, (f.time - base) / speed - (time.monotonic() - t0)))
            recs.append(self.step())
        return recs

    def _states(self):
        if self.trace is not None:
            return self.trace.frames[self._frame - 1].states if self._frame else []
        return self.engine.request_states()

    def _kv_blocks(self):
        if self.trace is None:
            return self.engine.kv_blocks()
        return next((f.kv for f in reversed(self.trace.frames[:self._frame]) if f.kv), None)

    def snapshot(self, history: bool = True):
        """What the Stepper shows now (the step, the KV blocks after it and, with `history`,
        the recent steps) as static HTML: a notebook section keeps the step it talks about
        after later cells have moved the live Stepper on, and a saved notebook keeps it
        without widget state."""
        from IPython.display import HTML
        return HTML(CSS + self.view.value + self.kv.view.value
                    + (self.history_view.value if history else ""))

    def close(self) -> None:
        """Close the Stepper's widgets with it (panels, buttons, the block map), not only
        its box: a notebook section that keeps only its snapshots leaves no live widget
        behind (JupyterLab then saves none of their state)."""
        def widgets_in(box):
            for child in getattr(box, "children", ()):
                yield from widgets_in(child)
                yield child
        for child in list(widgets_in(self)):
            child.close()
        super().close()

    # ---- drawing --------------------------------------------------------------------------
    def _render(self, rec: StepRecord | None = None) -> None:
        if rec is None:
            states = self._states()
            body = "".join(f"<tr><td>{esc(s.request_id)}</td><td><span class='badge b-waiting'>"
                           f"{esc(s.status)}</span></td><td>{s.num_prompt_tokens}</td></tr>"
                           for s in states)
            self.view.value = ('<div class="wb"><h3>Requests <span class="muted">· press Step '
                               'to run the scheduler once</span></h3><table class="steps">'
                               '<tr><th>request</th><th>state</th><th>prompt tokens</th></tr>'
                               f'{body}</table></div>' if states else
                               '<div class="wb muted">Add a request, then press Step.</div>')
        else:
            rows = "".join(self._row(r) for r in rec.rows)
            self.view.value = (
                f'<div class="wb"><h3>Step {rec.step} <span class="badge b-{esc(rec.phase)}">'
                f'{esc(rec.phase)}</span> <span class="muted">'
                f'{esc(rec.graph_label)} · '
                f'{rec.duration * 1e3:.1f} ms · '
                f'{rec.num_prefill_tokens} prefill + {rec.num_decode_tokens} decode tokens · '
                + (f'{rec.num_draft_tokens} drafted, {rec.num_accepted_tokens} accepted · '
                   if rec.num_draft_tokens else '') +
                f'KV {rec.kv_blocks_used}/{rec.kv_blocks_total} blocks</span></h3>'
                '<table class="steps"><tr><th>request</th><th>scheduler chose</th><th>fed</th>'
                '<th>token out</th><th>block table</th><th>progress</th><th>text so far</th></tr>'
                f'{rows}</table></div>')
        self.kv.show(self._kv_blocks())
        spec = any(r.num_draft_tokens for r in self.history)    # a column only where it says something
        hist = "".join(f"<tr><td>{r.step}</td><td><span class='badge b-{esc(r.phase)}'>"
                       f"{esc(r.phase)}</span></td><td>{r.num_prefill_tokens}</td>"
                       f"<td>{r.num_decode_tokens}</td><td>{r.duration * 1e3:.1f}</td>"
                       + (f"<td>{r.num_accepted_tokens}/{r.num_draft_tokens}</td>" if spec else "")
                       + "</tr>" for r in reversed(self.history))
        self.history_view.value = ('<div class="wb"><h3>Recent steps</h3><table class="steps"><tr>'
                          '<th>step</th><th>phase</th><th>prefill tok</th><th>decode tok</th>'
                          '<th>ms</th>' + ('<th>accepted/drafted</th>' if spec else '')
                          + f'</tr>{hist}</table></div>' if hist else "")

    @staticmethod
    def _row(r: RequestRow) -> str:
        badge = {"preempted": "preempt", "finished": "stop", "waiting": "waiting"}.get(r.action,
                                                                                     r.action)
        label = r.action + (f" ({r.finish_reason})" if r.finish_reason else "")
        token = (f"{esc(repr(r.token))} <span class='muted'>#{r.token_id}</span>"
                 if r.token_id is not None else "<span class='muted'>—</span>")
        if r.drafts:      # drafted: kept (green), rejected (struck through), then the target's own
            kept = "".join(f"<span class='draft-accepted' style='background:#d8f0d8' "
                           f"title='drafted, accepted'>{esc(repr(x))}</span> "
                           for x in r.draft_texts[:r.accepted])
            cut = "".join(f"<s class='draft-rejected' style='color:#999' "
                          f"title='drafted, rejected'>{esc(repr(x))}</s> "
                          for x in r.draft_texts[r.accepted:])
            token = (f"<div class='muted'>drafted {len(r.drafts)}, accepted {r.accepted}, "
                     f"rejected {len(r.rejected)}</div>{kept}{cut}"
                     f"<span title='the target model&#39;s own token'>→ {token}</span>")
        if r.candidates:
            token += "<div class='muted cands'>" + " · ".join(
                f"{esc(repr(text))} {p:.0%}" for text, p in r.candidates) + "</div>"
        table = esc(str(r.block_table)) if r.block_table else "<span class='muted'>none</span>"
        text = esc(r.text[-80:])
        return (f"<tr><td>{esc(r.request_id)}</td><td><span class='badge b-{badge}'>{esc(label)}"
                f"</span></td><td>{r.num_tokens}</td><td class='mono'>{token}</td>"
                f"<td class='mono'>{table}</td><td>{esc(r.progress)}</td>"
                f"<td class='mono'>{text}</td></tr>")
