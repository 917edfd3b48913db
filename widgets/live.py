"""Feeding panels from a source on the kernel's own asyncio loop, at a bounded rate.

The engine steps in its background thread and only appends to the source's buffers. A Pump
task on the kernel's loop (the loop ipykernel and Voila run cells and widget callbacks on)
polls the source at most `hz` times a second and hands each panel one Update. Widgets are
therefore only ever touched from the kernel's thread, never `display`ed from another one
(which Voila would not show), and the comm traffic is bounded by the tick rate whatever the
token rate.

    live = Live(engine, TokenStreamPanel(), BatchTimeline())
    live                                  # display it
    await live.generate(["Hello", "Hi"], SamplingParams(max_tokens=64))
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterable

import ipywidgets as w
import traitlets

from workbench import SamplingParams

from .kv_map import KVBlockMap
from .sources import LocalSource, RemoteSource, Update, as_source
from .style import esc, notices_html
from .summary import SummaryPanel


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop running in this thread (the kernel's, in Jupyter), or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Pump:
    """Polls `source` and updates `panels` at most `hz` times a second (`kv_hz` for the block
    map, which is the heaviest to draw). Start it from the kernel's loop; or call `tick()`."""

    def __init__(self, source: LocalSource | RemoteSource, panels: Iterable, hz: float = 20.0,
                 kv_hz: float = 4.0):
        if not 0 < hz <= 60:
            raise ValueError(f"hz: must be in (0, 60] (got {hz})")
        self.source = source
        self.panels = list(panels)
        self.hz, self.kv_hz = hz, kv_hz
        self.ticks = 0
        self._last_kv = 0.0
        self._task: asyncio.Task | None = None
        self.on_tick: list = []
        """Callables run after each tick with its Update (for extra views)."""
        label = getattr(source, "modelled", "")
        for p in self.panels:        # a modelled engine's times say so on every panel
            if hasattr(p, "set_modelled"):
                p.set_modelled(label)

    def tick(self) -> Update:
        """Poll the source once and hand the Update to every panel. A panel that raises is
        logged and named in the Update's errors (the page's error log shows it); the panels
        after it still get the Update, so one broken view never starves another."""
        u = self.source.poll()
        prefix = self.source.prefix_cache_stats()
        for p in self.panels:
            try:
                self._feed(p, u, prefix)
            except Exception as e:
                logging.getLogger("workbench.widgets").exception("panel update failed: %s", e)
                u.errors.append((type(p).__name__, f"the panel's update failed: "
                                                   f"{type(e).__name__}: {e}"))
        for f in self.on_tick:
            f(u)
        self.ticks += 1
        return u

    def _feed(self, p, u: Update, prefix) -> None:
        if isinstance(p, KVBlockMap):
            now = time.monotonic()
            if now - self._last_kv >= 1 / self.kv_hz or u.finished:
                self._last_kv = now
                p.show(self.source.kv_blocks())
        elif isinstance(p, SummaryPanel):
            p.update(u, prefix)
        else:
            p.update(u)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> bool:
        """Run on the current thread's asyncio loop; False (and nothing started) if none runs."""
        if self.running:
            return True
        if running_loop() is None:
            return False
        self._task = asyncio.ensure_future(self._run())
        return True

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        period = 1.0 / self.hz
        while True:
            t0 = time.monotonic()
            try:
                self.tick()
            except Exception as e:   # the source or an on_tick view: the loop goes on
                logging.getLogger("workbench.widgets").exception("pump tick failed: %s", e)
            await asyncio.sleep(max(period - (time.monotonic() - t0), 0.001))

    async def wait(self, timeout: float | None = None) -> bool:
        """Until every request sent through the source has finished (True) or timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.source.num_pending:
            if end is not None and time.monotonic() > end:
                return False
            if not self.running:
                self.tick()
            await asyncio.sleep(1.0 / self.hz)
        self.tick()
        return True


class ErrorLog(w.HTML):
    """The distinct errors of a source, each once with how often it came and from whom
    (newest last, the last `keep` kept), so that a repeating error never hides another."""

    num_errors = traitlets.Int(0, help="Errors received, repeats included.")

    def __init__(self, keep: int = 8, **kw):
        super().__init__(**kw)
        self.keep = keep
        self.entries: dict[str, list] = {}
        """message -> [count, [who, ...]] in order of last arrival."""

    def add(self, errors: list[tuple[str, str]]) -> None:
        if not errors:
            return
        for who, message in errors:
            count, whos = self.entries.pop(message, [0, []])
            if who not in whos:
                whos.append(who)
            self.entries[message] = [count + 1, whos]
            self.num_errors += 1
        for old in list(self.entries)[:-self.keep]:
            del self.entries[old]
        rows = []
        for message, (count, whos) in self.entries.items():
            shown = ", ".join(whos[-3:]) + (f" +{len(whos) - 3}" if len(whos) > 3 else "")
            times = f" <b>×{count}</b>" if count > 1 else ""
            rows.append(f"<div>{esc(message)}{times} <span class=\"muted\">({esc(shown)})</span></div>")
        self.value = f'<div class="wb"><div class="error">{"".join(rows)}</div></div>'

    def clear(self) -> None:
        self.entries.clear()
        self.num_errors = 0
        self.value = ""


def prompts_and_params(prompts: Any, params) -> list[tuple[Any, SamplingParams]]:
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], (int, dict))):
        prompts = [prompts]
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
    return list(zip(prompts, params))


class Live(w.VBox):
    """Panels fed by one engine or server. Displays them stacked; `generate` sends prompts
    and waits (in the kernel's loop, so the panels move while it waits)."""

    def __init__(self, engine_or_source, *panels, hz: float = 20.0):
        self.source = as_source(engine_or_source)
        self.panels = list(panels)
        for p in self.panels:
            if hasattr(p, "set_resolution"):
                p.set_resolution(self.source.resolution)
            if isinstance(p, KVBlockMap) and isinstance(self.source, RemoteSource):
                p.unavailable(self.source.kv_note())
        self.pump = Pump(self.source, self.panels, hz)
        self.errors = ErrorLog()
        self.notices = w.HTML()
        self.pump.on_tick.append(self._show)
        super().__init__([self.notices, *self.panels, self.errors])
        self._show(Update())
        self.pump.start()

    def _show(self, u: Update) -> None:
        self.errors.add(u.errors)
        html = notices_html(self.source.notices)   # a server may lose its /metrics later
        if html != self.notices.value:
            self.notices.value = html

    def submit(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
               ) -> list[str]:
        """Send prompts (each is validated before any is sent); returns their request ids."""
        pairs = prompts_and_params(prompts, params)
        for _, p in pairs:
            p.validate()
        if isinstance(self.source, LocalSource):
            for prompt, _ in pairs:
                self.source.engine.tokenize(prompt)
        return [self.source.submit(prompt, p) for prompt, p in pairs]

    async def generate(self, prompts, params=None, timeout: float | None = None) -> list[str]:
        rids = self.submit(prompts, params)
        self.pump.start()
        await self.pump.wait(timeout)
        return rids

    def close(self) -> None:
        self.pump.stop()
        self.source.close()
