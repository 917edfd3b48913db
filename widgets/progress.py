"""BuildProgress: a live bar while an engine is built (model conversion, weights, KV pool).

The engine is built in a worker thread; the bar moves on the kernel's asyncio loop. What it
shows comes from the `workbench` logger: a record with a `progress` extra, `(stage, done,
total)`, sets the stage and the fraction (the GGUF conversion reports each tensor), and any
other INFO-or-louder record names the stage. Between reports the bar creeps towards the time
the last build took. While it listens, those records go to the bar and not to stderr (in
Voila, stderr would land on the page as text).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import ipywidgets as w

from .style import esc


class _Listener(logging.Handler):
    """Keeps the newest stage and fraction; records arrive from the build thread."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.stage: str = ""
        self.fraction: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", None)
        if progress is not None:
            stage, done, total = progress
            self.stage, self.fraction = stage, done / max(total, 1)
            if done >= total:           # what follows a loader's last tensor, until it says
                self.stage, self.fraction = "building the engine (KV pool, kernels)", None
        elif record.levelno >= logging.INFO:
            self.stage, self.fraction = record.getMessage(), None


class BuildProgress(w.VBox):
    """`await progress.run(build, expected_s=...)` runs `build()` in a worker thread and
    returns its result (or raises its exception) while the bar moves; hidden when idle."""

    def __init__(self, **kw):
        self.bar = w.FloatProgress(value=0, min=0, max=1, bar_style="info",
                                   layout=w.Layout(width="98%"))
        self.label = w.HTML()
        super().__init__([self.label, self.bar], **kw)
        self.layout.display = "none"
        self.last_stage = ""
        """The stage shown last (for tests: what the loader reported)."""

    def show(self, what: str, fraction: float, elapsed: float) -> None:
        self.layout.display = None
        self.bar.value = fraction
        self.label.value = (f'<div class="wb muted">{esc(what)} · {elapsed:.1f} s</div>')

    def hide(self) -> None:
        self.layout.display = "none"

    async def run(self, build: Callable, title: str, expected_s: float = 10.0):
        listener = _Listener()
        logger = logging.getLogger("workbench")
        level, propagate = logger.level, logger.propagate
        logger.addHandler(listener)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        t0 = time.monotonic()
        shown = 0.0
        fut = asyncio.get_running_loop().run_in_executor(None, build)
        try:
            while not fut.done():
                el = time.monotonic() - t0
                guess = el / (el + max(expected_s, 0.5))      # creeps, never reaches the end
                stage = listener.stage
                if stage:
                    self.last_stage = stage
                fraction = listener.fraction if listener.fraction is not None else guess
                shown = max(shown, fraction) if listener.fraction is None else fraction
                self.show(f"{title}: {stage}" if stage else title, max(0.02, shown), el)
                await asyncio.wait([fut], timeout=0.1)
            return fut.result()
        finally:
            logger.removeHandler(listener)
            logger.setLevel(level)
            logger.propagate = propagate
            self.hide()

