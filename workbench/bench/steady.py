"""Measurements a busy machine cannot turn into a wrong lesson. A notebook that times the engine
on a laptop shares it with a browser, an IDE, a video call; one timing per point can show the
opposite of the truth. So the lessons measure like this:

- each point several times, the points interleaved (a burst of other work lands on all of them
  alike, not on one), keeping every run: `Runs` gives min, median and the spread;
- the machine checked before and after (`MachineCheck`): its load average, and one small fixed
  piece of work timed twice, which takes the same time on a quiet machine;
- the relation a lesson states checked on the figures just measured (`Relation`), and a
  sentence saying what they show: the claim, the figures that contradict it, or that the
  machine was too busy to tell.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

BUSY_LOAD = 0.75
"""Where other processes' CPU time cannot be read: a 1-minute load average over this many
runnable processes per core is a busy machine."""
BUSY_OTHERS = 0.25
"""Other processes using this fraction of the machine's cores while a measurement ran: busy.
(Not the load average where /proc says more: it counts the measurement's own threads, so a
lesson timing the engine on 2 cores would call every machine busy after its first minute.)"""
BUSY_PROBE = 1.5
"""The fixed probe taking this many times longer after than before (or the reverse): busy."""
NOISY_SPREAD = 1.5
"""Runs of one point this far apart (max over min) are noise, not a measurement."""


@dataclass
class Runs:
    """Every run of one measured point, in seconds (or any unit: the caller's)."""
    values: list[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> float:
        """max / min: 1.0 for runs that agree."""
        return self.max / self.min if self.min > 0 else float("inf")


def probe_ms() -> float:
    """A small fixed piece of work (a 256x256 float32 matmul, 20 times), best of 3, in ms: the
    same on a quiet machine whenever it runs."""
    import torch
    g = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=g)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(20):
            a @ a
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process, all its
    threads), from /proc/stat and os.times(); None where there is no /proc/stat."""
    try:
        first = open("/proc/stat").readline().split()
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in first[1:9])
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    t = os.times()
    return busy, t.user + t.system


def load_average() -> float:
    """The 1-minute load average (0 where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


@dataclass
class MachineCheck:
    """The machine before and after a measurement."""
    cores: int
    load: tuple[float, float]
    """1-minute load average before and after."""
    probe: tuple[float, float]
    """`probe_ms()` before and after."""
    others: float | None = None
    """The cores other processes kept busy while it measured, as a fraction of all of them
    (None where that cannot be read)."""

    @property
    def busy(self) -> bool:
        a, b = self.probe
        loaded = (self.others > BUSY_OTHERS if self.others is not None
                  else max(self.load) > BUSY_LOAD * self.cores)
        return loaded or max(a, b) > BUSY_PROBE * min(a, b)

    def describe(self) -> str:
        others = ("" if self.others is None else
                  f"other processes used {self.others:.0%} of the machine while it measured; ")
        return (f"{others}load average {self.load[0]:.1f} then {self.load[1]:.1f} on "
                f"{self.cores} cores; the same small step took {self.probe[0]:.1f} then "
                f"{self.probe[1]:.1f} ms")


def checked(measure: Callable[[], object]) -> tuple[object, MachineCheck]:
    """Run `measure()` between two looks at the machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    load0, probe0 = load_average(), probe_ms()
    t0, cpu0 = time.monotonic(), cpu_seconds()
    result = measure()
    t1, cpu1 = time.monotonic(), cpu_seconds()
    probe1, load1 = probe_ms(), load_average()
    others = None
    if cpu0 is not None and cpu1 is not None and t1 > t0:
        # The machine's busy CPU time less this process's: what everything else ran meanwhile
        # (on all cores of the machine, so a share of them all, capped at what ours can use).
        other = (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])
        total = os.cpu_count() or cores
        others = min(1.0, max(0.0, other / ((t1 - t0) * total)))
    return result, MachineCheck(cores, (load0, load1), (probe0, probe1), others)


def interleaved(points: list, run: Callable[[object], object], repeats: int = 3) -> list[list]:
    """`run(point)` for every point, `repeats` rounds, the order reversed every other round
    (so a slow spell lands on every point alike): each point's results, in the points' order."""
    out: list[list] = [[] for _ in points]
    order = list(range(len(points)))
    for r in range(repeats):
        for i in (order if r % 2 == 0 else order[::-1]):
            out[i].append(run(points[i]))
    return out


@dataclass
class Relation:
    """What a lesson claims about its figures, and the check of it on them."""
    claim: str
    """The lesson's sentence, e.g. "decode's time per token falls with batch size"."""
    holds: bool
    shown: str
    """The figures that show it or not, in words."""


def verdict(relations: list[Relation], machine: MachineCheck, runs: list[Runs]) -> str:
    """The sentence to print beside a chart: the claims where the figures show them and the
    machine was quiet; otherwise what went wrong, so nobody learns the wrong thing."""
    noisy = max((r.spread for r in runs if r.values), default=1.0)
    if machine.busy or noisy > NOISY_SPREAD:
        why = [machine.describe()] if machine.busy else []
        if noisy > NOISY_SPREAD:
            why.append(f"repeated runs of one point differed by up to {noisy:.1f}x")
        return ("This machine was busy (" + "; ".join(why) + "): the figures below are not the "
                "engine's, and may show anything. Close what else is running and run the cell "
                "again.")
    lines = []
    for rel in relations:
        lines.append(f"{rel.claim[0].upper()}{rel.claim[1:]}: {rel.shown}." if rel.holds else
                     f"The lesson says {rel.claim}, but these figures do not show it: "
                     f"{rel.shown}. Run the cell again; if it persists, this device differs.")
    return " ".join(lines)
