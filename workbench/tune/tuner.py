"""`tune()`: successive halving over engine configurations, each measured on the workload.

Each trial builds an engine from the base config with the trial's knobs, warms it up with one
short request (the first forward of a fresh engine pays one-off costs), runs the workload's
first `budget` requests under the trial's time limit, measures goodput against the SLO and
closes the engine, so that trials run one at a time with the device to themselves.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from ..config import EngineConfig
from ..core.sampling_params import SamplingParams
from ..engine import Engine
from .result import TuneResult
from .search import Trial, successive_halving
from .slo import SLO, Measurement
from .space import Space
from .workload import RunResult, Workload, run_workload


def run_config(config: EngineConfig, workload: Workload, time_limit: float | None = None,
               should_stop: Callable[[], bool] | None = None, warmup: bool = True) -> RunResult:
    """Build an engine from `config`, run `workload` on it, close it."""
    with Engine(config) as engine:
        if warmup:
            engine.generate([[11] * 8], SamplingParams(max_tokens=2, ignore_eos=True))
        return run_workload(engine, workload, time_limit, should_stop)


def warm_process(config: EngineConfig, workload: Workload, n: int = 4) -> None:
    """Run `n` of the workload's requests on `config`, recording nothing: the process's
    first engine pays for what later ones find ready (kernels loaded, the first prompt
    shapes' kernels planned; seconds on the CPU), which would otherwise fall on whichever
    trial runs first, the defaults'."""
    run_config(config, workload.with_requests(min(n, workload.num_requests)))


def measure_config(config: EngineConfig, workload: Workload, slo: SLO,
                   time_limit: float | None = None, warmup: bool = True) -> Measurement:
    """`config`'s goodput and latencies on `workload` against `slo`."""
    return slo.measure(run_config(config, workload, time_limit, warmup=warmup))


def tune(workload: Workload, slo: SLO, space: Space | None = None, *,
         base: EngineConfig | None = None, n_trials: int = 8, eta: int = 3,
         trial_time_limit: float | None = 120.0, seed: int = 0,
         progress: Callable[[Trial, int, int], None] | None = None,
         should_stop: Callable[[], bool] | None = None, warmup: bool = True) -> TuneResult:
    """Search `space` (default: Space.default on the base config's device) for the
    configuration with the most goodput on `workload` under `slo`. The base config's own
    values of the knobs are always among the first rung's points (what the winner must
    beat). The last rung runs the whole workload; earlier rungs run 1/eta of it per rung
    back (at least one request). Each trial is cut at `trial_time_limit` seconds. With
    `warmup`, the base config first runs a few of the workload's requests unrecorded (see
    warm_process)."""
    if not isinstance(workload, Workload):
        raise ValueError(f"workload: must be a Workload (got {type(workload).__name__})")
    if not isinstance(slo, SLO):
        raise ValueError(f"slo: must be an SLO (got {type(slo).__name__})")
    if trial_time_limit is not None and not trial_time_limit > 0:
        raise ValueError(f"trial_time_limit: must be > 0 seconds or None "
                         f"(got {trial_time_limit!r})")
    base = base or EngineConfig()
    space = space or Space.default(base.device)
    points = space.sample(n_trials, base, seed=seed)
    seen: dict = {}

    def evaluate(knobs: dict, budget: int) -> Measurement:
        run = run_config(replace(base, **knobs), workload.with_requests(budget),
                         trial_time_limit, should_stop)
        seen.setdefault("run", run)
        return slo.measure(run)

    t0 = time.perf_counter()
    if warmup:
        warm_process(base, workload)
    outcome = successive_halving(points, evaluate, n_trials=n_trials, eta=eta,
                                 max_budget=workload.num_requests, progress=progress,
                                 should_stop=should_stop)
    run = seen.get("run")
    notes = [n for n in run.notices if n.startswith("modelled device:")] if run else []
    return TuneResult(outcome, workload, slo, space, base, run.device if run else base.device,
                      time.perf_counter() - t0, notes,
                      modelled=run.modelled if run else None)
