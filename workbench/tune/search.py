"""Successive halving (Jamieson & Talwalkar, AISTATS 2016; Hyperband's inner loop).

Rung 0 measures n configurations on a small budget (a few requests of the workload); the best
1/eta of them go on to rung 1 at eta times the budget, and so on, so that most of the time
goes to the configurations that look best instead of a full grid. `plan(n_trials, eta)` picks
the largest rung 0 whose rungs fit in n_trials trials: 8 trials at eta 3 is 6 configurations
then the best 2 at three times the budget; 30 is 21, 7 and 2.

Each trial calls `evaluate(knobs, budget)`, which returns a slo.Measurement. A trial that
raises (a configuration the device refuses: too little memory for its KV pool, a block size
its attention cannot page) is recorded with its error, ranks below every measured one, and
the search goes on. `progress(trial, done, total)` is called after each trial;
`should_stop()` before each, and a stop keeps what was measured (the winner is the best of
the furthest rung reached).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .slo import Measurement


@dataclass
class Trial:
    number: int
    """1, 2, … in the order run: what progress reports as `done` for it."""
    knobs: dict
    rung: int
    budget: int
    """Requests of the workload this trial ran (the search's unit of budget)."""
    measurement: Measurement | None = None
    error: str | None = None
    """Why it failed (the exception's type and message), None where it was measured."""
    seconds: float = 0.0
    """Wall-clock time the trial took (building its engine included)."""

    @property
    def ok(self) -> bool:
        return self.measurement is not None

    @property
    def rank(self) -> tuple:
        """Higher is better; failed trials below every measured one."""
        return (1, *self.measurement.rank) if self.ok else (0,)

    def to_dict(self) -> dict:
        return {"number": self.number, "knobs": dict(self.knobs), "rung": self.rung,
                "budget": self.budget, "error": self.error, "seconds": self.seconds,
                "measurement": self.measurement.to_dict() if self.ok else None}


@dataclass
class SearchOutcome:
    trials: list[Trial] = field(default_factory=list)
    stopped: bool = False
    """should_stop() ended the search before its plan was done."""
    plan: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)

    def best(self) -> Trial | None:
        """The best measured trial of the furthest rung that measured any."""
        ok = [t for t in self.trials if t.ok]
        if not ok:
            return None
        top = max(t.rung for t in ok)
        return max((t for t in ok if t.rung == top), key=lambda t: t.rank)


def plan(n_trials: int, eta: int) -> list[int]:
    """Configurations per rung: n0, n0 // eta, ... while at least one, the largest n0 whose
    rungs sum to at most n_trials (a rung of one is not run: it would decide nothing)."""
    if not isinstance(n_trials, int) or n_trials < 1:
        raise ValueError(f"n_trials: must be an integer >= 1 (got {n_trials!r})")
    if not isinstance(eta, int) or eta < 2:
        raise ValueError(f"eta: must be an integer >= 2 (got {eta!r})")

    def rungs(n0: int) -> list[int]:
        out = [n0]
        while out[-1] // eta >= 2:
            out.append(out[-1] // eta)
        return out

    best = [1]
    for n0 in range(1, n_trials + 1):
        r = rungs(n0)
        if sum(r) <= n_trials:
            best = r
    return best


def budgets(num_rungs: int, eta: int, max_budget: int, min_budget: int = 1) -> list[int]:
    """Per-rung budgets growing by eta up to max_budget (the last rung's)."""
    if not isinstance(max_budget, int) or max_budget < 1:
        raise ValueError(f"max_budget: must be an integer >= 1 (got {max_budget!r})")
    return [max(min_budget, max_budget // eta ** (num_rungs - 1 - i)) for i in range(num_rungs)]


def successive_halving(points: list[dict], evaluate: Callable[[dict, int], Measurement], *,
                       n_trials: int, eta: int = 3, max_budget: int, min_budget: int = 1,
                       progress: Callable[[Trial, int, int], None] | None = None,
                       should_stop: Callable[[], bool] | None = None) -> SearchOutcome:
    """Run the search over `points` (rung 0 takes the first plan[0] of them: put the ones to
    keep first, e.g. the defaults)."""
    counts = plan(n_trials, eta)
    if not points:
        raise ValueError("space: gave no point to try")
    counts[0] = min(counts[0], len(points))
    counts = [counts[0]] + [min(c, counts[0]) for c in counts[1:]]
    buds = budgets(len(counts), eta, max_budget, min_budget)
    out = SearchOutcome(plan=counts, budgets=buds)
    total = sum(counts)
    current = list(points[:counts[0]])
    for rung, (count, budget) in enumerate(zip(counts, buds)):
        this_rung = []
        for knobs in current[:count]:
            if should_stop is not None and should_stop():
                out.stopped = True
                return out
            trial = Trial(len(out.trials) + 1, dict(knobs), rung, budget)
            t0 = time.perf_counter()
            try:
                trial.measurement = evaluate(dict(knobs), budget)
            except Exception as e:      # the device refused it: recorded, and the search goes on
                trial.error = f"{type(e).__name__}: {e}"
            trial.seconds = time.perf_counter() - t0
            out.trials.append(trial)
            this_rung.append(trial)
            if progress is not None:
                progress(trial, len(out.trials), total)
        if rung + 1 < len(counts):
            survivors = sorted((t for t in this_rung if t.ok), key=lambda t: t.rank, reverse=True)
            current = [t.knobs for t in survivors[:counts[rung + 1]]]
            if not current:
                break
    return out
