"""SummaryPanel: TTFT / TPOT percentiles, throughput, preemptions, prefix-cache hits."""
from __future__ import annotations

import time
from collections import deque

import ipywidgets as w
import traitlets

from .sources import RequestRecord, Update
from workbench.telemetry import percentile

from .style import css_widget, modelled_html, ms, stat

RATE_WINDOW = 3.0


def _is_token(ev) -> bool:
    """An event that brought a token: the engine's carry token_id; a server's are text chunks
    (counted while a request streams; its record's count replaces them when it ends)."""
    if hasattr(ev, "token_id"):
        return ev.token_id is not None
    return bool(ev.text)


class SummaryPanel(w.VBox):
    num_finished = traitlets.Int(0)
    num_preemptions = traitlets.Int(0)
    output_tokens = traitlets.Int(0)

    def __init__(self, **kw):
        self.records: list[RequestRecord] = []
        self._streaming: dict[str, int] = {}   # tokens counted so far of requests not yet ended
        self._ended: set[str] = set()
        self._recent: deque[tuple[float, int]] = deque()   # (time, new tokens) for the live rate
        self._first: float | None = None
        self._last: float | None = None
        self.prefix_cache: tuple[int, int] | None = None
        self.modelled = ""
        """What its times are when the engine is a modelled one ('' for a real device)."""
        self.view = w.HTML()
        super().__init__([css_widget(), self.view], **kw)
        self._render()

    def clear(self) -> None:
        self.records.clear()
        self._streaming.clear()
        self._ended.clear()
        self._recent.clear()
        self._first = self._last = None
        self.num_finished = self.num_preemptions = self.output_tokens = 0
        self._render()

    def update(self, u: Update, prefix_cache: tuple[int, int] | None = None) -> None:
        changed = prefix_cache != self.prefix_cache
        self.prefix_cache = prefix_cache
        for _, t, _ in u.submitted:
            self._first = t if self._first is None else min(self._first, t)
        new = 0
        for ev in u.events:
            if _is_token(ev):
                new += 1
                self._last = ev.time
                if ev.request_id not in self._ended:
                    self._streaming[ev.request_id] = self._streaming.get(ev.request_id, 0) + 1
        decaying = bool(self._recent)     # the live rate falls back to 0 after a run
        if new:
            self._recent.append((time.monotonic(), new))
        self.records.extend(u.finished)
        for r in u.finished:               # an ended request counts as its record says
            self._streaming.pop(r.request_id, None)
            self._ended.add(r.request_id)
        self.output_tokens = sum(r.output_tokens for r in self.records) + sum(self._streaming.values())
        self.num_preemptions += sum(s.num_preempted for s in u.steps)
        self.num_finished = len(self.records)
        if new or decaying or u.finished or u.submitted or changed or \
                any(s.num_preempted for s in u.steps):
            self._render()

    def rate(self) -> float:
        """Output tokens per second over the last few seconds."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW

    def figures(self) -> dict:
        """The numbers shown, as a dict (seconds and tokens/s)."""
        ttft = [r.ttft for r in self.records]
        tpot = [r.tpot for r in self.records]
        span = (self._last - self._first) if self._first is not None and self._last else None
        return {"finished": self.num_finished,
                "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
                "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
                "output_tokens": self.output_tokens,
                "throughput": self.output_tokens / span if span else None,
                "live_rate": self.rate(), "preemptions": self.num_preemptions}

    def _render(self) -> None:
        f = self.figures()
        tput = f"{f['throughput']:.1f}" if f["throughput"] else "—"
        cells = [stat(str(f["finished"]), "requests done"),
                 stat(ms(f["ttft_p50"]), "TTFT p50"), stat(ms(f["ttft_p99"]), "TTFT p99"),
                 stat(ms(f["tpot_p50"], 1), "TPOT p50"), stat(ms(f["tpot_p99"], 1), "TPOT p99"),
                 stat(tput, "output tok/s (run)"), stat(f"{f['live_rate']:.1f}", "tok/s (last 3 s)"),
                 stat(str(f["preemptions"]), "preemptions")]
        if self.prefix_cache is not None:
            hits, queries = self.prefix_cache
            cells.append(stat(f"{hits / queries:.0%}" if queries else "—", "prefix-cache hits"))
        self.view.value = (modelled_html(self.modelled)
                           + f'<div class="wb"><div class="stats">{"".join(cells)}</div></div>')

    def set_modelled(self, label: str) -> None:
        """Label every figure as modelled ('' : a real device's)."""
        self.modelled = label
        self._render()
