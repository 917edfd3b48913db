"""Playing a recorded trace (workbench.trace) back through the panels, with no model loaded.

`ReplaySource` has the shape of the other sources (see widgets.sources): the dashboard's pump
polls it and gets, at each tick, the steps, tokens and finished requests whose recorded time
has come, at real speed or `speed` times faster. Times handed to the panels keep the recorded
gaps (a TTFT shows as recorded whatever the speed).

    Dashboard(replay="docs/traces/smollm2-cpu.trace.json.gz")     # `workbench dashboard --replay`
    Stepper.replay("…trace.json.gz")                               # step by step

The Dashboard plays it when a browser first shows the page (`autoplay=False`, `--paused`:
when Play is pressed), never earlier: plotly figures miss what is sent before they are shown.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from workbench.trace import Trace

from .sources import RequestRecord, Update, describe_engine
from .style import modelled_label

SHIPPED_TRACE = Path(__file__).resolve().parents[1] / "docs" / "traces" / "smollm2-cpu.trace.json.gz"
"""A small recorded run that ships with the repository (8 requests on smollm2, CPU)."""


def load_trace(trace: Trace | str | Path) -> Trace:
    return trace if isinstance(trace, Trace) else Trace.load(trace)


class ReplaySource:
    """A recorded trace, released frame by frame as the playback clock reaches it."""

    resolution = "step"
    config = None
    """No engine: the knobs do not apply."""

    def __init__(self, trace: Trace | str | Path, speed: float = 1.0, autoplay: bool = True):
        self.trace = load_trace(trace)
        if not self.trace.frames:
            raise ValueError("trace: it has no steps to replay")
        self.set_speed(speed)
        self.restart()
        self.playing = autoplay
        """False until `play()`: nothing is released before (a page shows its widgets first,
        and plotly figures miss what changed before they were displayed)."""

    def set_speed(self, speed: float) -> None:
        if not 0 < speed <= 1000:
            raise ValueError(f"speed: must be in (0, 1000] times real time (got {speed})")
        if hasattr(self, "_t0"):                 # keep the position when the speed changes
            pos = self.position
            self._t0 = time.monotonic() - pos / speed
        self.speed = speed

    def play(self) -> None:
        """Start playing from the start (the panels should be cleared first)."""
        self.restart()
        self.playing = True

    def restart(self) -> None:
        """Rewind to the start (the panels should be cleared first)."""
        self._t0 = time.monotonic()
        self._origin = self._t0                  # recorded time 0 on this machine's clock
        self._next = 0
        self._next_request = 0
        self._submitted = False
        self._pending = set(self.trace.prompts)

    @property
    def position(self) -> float:
        """Recorded seconds played so far."""
        return (time.monotonic() - self._t0) * self.speed if self.playing else 0.0

    @property
    def done(self) -> bool:
        return self._next >= len(self.trace.frames)

    @property
    def notices(self) -> list[str]:
        return list(self.trace.notices)

    def describe(self) -> dict[str, str]:
        return {**describe_engine(self.trace.info), "speed": f"{self.speed:g}×"}

    @property
    def modelled(self) -> str:
        """'' for a trace of a real device; else what its times are (a modelled run's)."""
        return modelled_label(self.trace.info)

    def submit(self, prompt, params) -> str:
        raise ValueError("a replay plays a recorded trace back; it takes no new requests "
                         "(start `workbench dashboard` without --replay to run a model)")

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def abort_all(self) -> None:
        raise ValueError("a replay cannot abort its recorded requests")

    def poll(self) -> Update:
        u = Update()
        o = self._origin
        if not self.playing:
            return u
        if not self._submitted:
            self._submitted = True
            arrivals = {m.request_id: m.arrival_time for m in self.trace.requests}
            u.submitted = [(rid, o + arrivals.get(rid, 0.0), label)
                           for rid, label in self.trace.prompts.items()]
        pos, frames = self.position, self.trace.frames
        while self._next < len(frames) and frames[self._next].time <= pos:
            f = frames[self._next]
            self._next += 1
            u.steps.append(_shift(f.step, "start", o))
            for t in f.tokens:
                u.events.append(_shift(t, "time", o))
                if t.finished:
                    self._pending.discard(t.request_id)
        reqs = self.trace.requests
        while (self._next_request < len(reqs)
               and (reqs[self._next_request].finished_time or 0.0) <= pos):
            m = reqs[self._next_request]
            self._next_request += 1
            u.finished.append(RequestRecord(m.request_id, m.ttft, m.tpot, m.e2e, m.output_tokens,
                                            m.finish_reason, m.num_preemptions,
                                            o + (m.finished_time or 0.0)))
        if self.done:
            self._pending.clear()
        return u

    def kv_blocks(self):
        """The KV pool after the last step played (None before the first)."""
        for f in reversed(self.trace.frames[:self._next]):
            if f.kv is not None:
                return f.kv
        return None

    def prefix_cache_stats(self) -> None:
        return None

    def close(self) -> None:
        self._next = len(self.trace.frames)
        self._pending.clear()


def _shift(obj, name: str, by: float):
    """A copy of a recorded event with its time moved onto this machine's clock."""
    return replace(obj, **{name: getattr(obj, name) + by})
