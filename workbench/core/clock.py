"""Where the engine reads the time: a real one, or a modelled one.

Every timestamp the engine records (a request's arrival, a step's start and duration, each
token's time, so TTFT, TPOT, ITL and e2e) is read from the engine's clock, never from
`time.monotonic()` directly. A real device's engine runs on `WallClock`. A modelled device's
engine (`device="model:<name>"`, workbench/modelled/) runs on a `VirtualClock` that its
model runner advances by each step's modelled time, so its telemetry holds modelled times,
and a run of a thousand modelled steps takes as long as the host's bookkeeping (the
simulator's speed), not as long as the device would have taken.

A `VirtualClock` set to pace (`paced=True`, what a modelled engine stepping in the background
for a UI uses) also sleeps so that modelled time never runs ahead of the wall: its tokens
stream at the modelled device's speed (or slower, where the host cannot keep up; the numbers
stay modelled either way).
"""
from __future__ import annotations

import threading
import time


class Clock:
    """The engine's time source, in seconds (only differences mean anything)."""

    virtual = False
    """Whether its time is modelled (not the wall's)."""

    def now(self) -> float:
        raise NotImplementedError

    def advance(self, seconds: float) -> None:
        """Account `seconds` of (modelled) device time; a wall clock's time passes by itself."""

    def advance_to(self, t: float) -> None:
        """Move to time t where nothing happens before it (an idle engine waiting for an
        arrival); no-op for a wall clock, or when t is not ahead."""


class WallClock(Clock):
    def now(self) -> float:
        return time.monotonic()


class VirtualClock(Clock):
    """Modelled time: starts at the wall's `time.monotonic()` (so timestamps a UI compares
    with its own look sensible) and moves only when advanced."""

    virtual = True

    def __init__(self, start: float | None = None, paced: bool = False):
        self._t = time.monotonic() if start is None else float(start)
        self._lock = threading.Lock()
        self._offset = 0.0
        self._paced = False
        self.paced = paced

    @property
    def paced(self) -> bool:
        """Whether advancing sleeps so that modelled time keeps to the wall's pace."""
        return self._paced

    @paced.setter
    def paced(self, on: bool) -> None:
        with self._lock:
            if on and not self._paced:
                # From here, modelled time t is due at wall time t - offset.
                self._offset = self._t - time.monotonic()
            self._paced = bool(on)

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"seconds: must be >= 0 (got {seconds!r})")
        self.advance_to(self._t + seconds)

    def advance_to(self, t: float) -> None:
        with self._lock:
            if t <= self._t:
                return
            self._t = t
            wait = (t - self._offset) - time.monotonic() if self._paced else 0.0
        if wait > 0:
            time.sleep(wait)
