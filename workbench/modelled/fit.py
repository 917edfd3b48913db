"""Fitting a profile's cost coefficients (cost.py) to measurements.

Two kinds of measurement:

- A real engine's step records (the CPU): each StepEvent gives one step's duration and
  everything its cost depends on. On the CPU every term of cost.combine adds, so a step's
  modelled time is linear in the coefficients: the fit is a non-negative least-squares
  solve (exact, no start point), in relative error (a 30 ms decode step counts as much as a
  500 ms prefill). The per-step intercept is the weights' read (`weight_scale`: their bytes
  are the same every step, so host_step stays 0), a token's host cost is not told apart
  from its matmuls (host_per_token stays 0), nor a request's from its rows (cost.py says
  which terms were tried and left out).

- Aggregate figures recorded on a device (the H200: TTFT and TPOT percentiles, throughput
  of whole workloads). The workloads are replayed on a modelled engine once to get their
  step sequences: which requests ran in which step is independent of the step times (every
  request is queued at a step boundary: at once, or in a closed loop as earlier ones end), so
  each figure is a function of the coefficients through the per-step features alone. The
  coefficients minimise the figures' squared relative errors (scipy's bounded
  least_squares). `benchmarks/modelled_accuracy.py --h200-fit` does this for the H200 and writes
  calibration.json.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .cost import combine, step_features
from .profiles import Coefficients

CPU_PARAMS = ("weight_scale", "matmul_scale", "attention_scale", "rows_log2")
"""What the CPU fit moves; every other coefficient is 0 there."""


def fit_cpu_steps(steps, info, peak_flops: float, bandwidth: float
                  ) -> tuple[Coefficients, dict]:
    """Coefficients from a real CPU engine's StepEvents (see the module docstring), and the
    fit's own residuals (median and worst relative error over those steps)."""
    from scipy.optimize import nnls
    feats, y = [], []
    for ev in steps:
        if ev.tokens_per_request and ev.duration > 0:
            feats.append(step_features(ev.tokens_per_request, ev.context_lens, ev.kinds, info,
                                       peak_flops, bandwidth))
            y.append(ev.duration)
    y = np.array(y)
    if len(y) < len(CPU_PARAMS):
        raise ValueError(f"steps: {len(y)} steps that fed tokens; the fit needs at least "
                         f"{len(CPU_PARAMS)}")
    n = info.num_layers
    zero = Coefficients(**{f: 0.0 for f in Coefficients.__dataclass_fields__})

    def seconds(k: Coefficients) -> np.ndarray:
        return np.array([combine(k, f, None, n, False, False).seconds for f in feats])
    # Column j: each step's time with coefficient j at 1 and the rest at 0 (the form is linear).
    a = np.stack([seconds(replace(zero, **{p: 1.0})) for p in CPU_PARAMS], axis=1)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)        # columns of like size for nnls
    x, _ = nnls(a / scale / y[:, None], np.ones(len(y)))
    k = replace(zero, **dict(zip(CPU_PARAMS, map(float, x / scale))))
    err = np.abs(seconds(k) / y - 1)
    return k, {"steps": int(len(y)), "median_rel_err": float(np.median(err)),
               "max_rel_err": float(err.max())}


# ---- aggregate figures through step sequences ---------------------------------------------------
H200_PARAMS = ("launch_eager_per_layer", "launch_prefill_per_layer", "launch_graph",
               "host_step", "host_per_request", "matmul_scale", "attention_scale",
               "attention_per_context_token")
"""What the GPU fit moves; host_per_token stays 0 there (the step's inputs are prepared
vectorised: a prompt's cost is its matmuls')."""


class StepTrace:
    """One workload's step sequence as a modelled engine ran it: per step its features and
    graph kind, and per request the steps of its arrival, first token and last token, so
    that any coefficients give the run's times without running it again."""

    def __init__(self, steps, records, info, peak_flops: float, bandwidth: float,
                 async_scheduling: bool):
        self.info = info
        self.async_scheduling = async_scheduling
        self.behind_host = (info.modelled or {}).get("kind", "cpu") != "cpu"
        self.features = [step_features(ev.tokens_per_request, ev.context_lens, ev.kinds, info,
                                       peak_flops, bandwidth) if ev.tokens_per_request
                         else None for ev in steps]
        self.kinds = [ev.graph_kind for ev in steps]
        starts = np.array([ev.start for ev in steps])
        ends = starts + np.array([ev.duration for ev in steps])

        def step_ending_at(t: float) -> int:     # the step whose end stamped time t
            return int(np.argmin(np.abs(ends - t)))

        def step_starting_at(t: float) -> int:   # the first step starting at or after t
            return int(np.searchsorted(starts, t - 1e-12))
        self.requests = []
        for m in records:
            if not m.token_times:
                continue
            self.requests.append((step_starting_at(m.arrival_time),
                                  step_ending_at(m.token_times[0]),
                                  step_ending_at(m.token_times[-1]), len(m.token_times)))

    def durations(self, k: Coefficients) -> np.ndarray:
        n = self.info.num_layers
        return np.array([0.0 if f is None else
                         combine(k, f, kind, n, self.async_scheduling, self.behind_host).seconds
                         for f, kind in zip(self.features, self.kinds)])

    def figures(self, k: Coefficients) -> dict:
        """TTFT p50/p99 and TPOT p50 (ms), output tok/s and seconds, as the benchmarks
        compute them, for these coefficients."""
        from ..telemetry import percentile
        d = self.durations(k)
        end = np.cumsum(d)
        start = end - d
        ttft = [end[f] - start[a] for a, f, _, _ in self.requests]
        tpot = [(end[l] - end[f]) / (n - 1) for _, f, l, n in self.requests if n > 1]
        seconds = float(end[-1] - start[min(a for a, _, _, _ in self.requests)])
        tokens = sum(n for *_, n in self.requests)
        return {"ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
                "tpot_p50_ms": percentile(tpot, 50) * 1e3 if tpot else None,
                "out_tok_s": tokens / seconds, "seconds": seconds}


def fit_figures(traces: list[tuple[StepTrace, dict]], starts: list[Coefficients],
                params: tuple[str, ...] = H200_PARAMS) -> tuple[Coefficients, float]:
    """Coefficients whose replayed figures come closest (squared relative error) to the
    recorded ones: traces pairs a StepTrace with {figure name: recorded value}. Several
    starts, the best kept: the max() terms of cost.py leave flat directions (a compute term
    under the launches' has no gradient), where one start can stall. Returns them and the
    worst relative error left."""
    best = None
    for start in starts:
        k, cost, worst = _fit_from(traces, start, params)
        if best is None or cost < best[1]:
            best = (k, cost, worst)
    return best[0], best[2]


def _fit_from(traces, start: Coefficients, params) -> tuple[Coefficients, float, float]:
    from scipy.optimize import least_squares
    base = start.as_dict()
    x0 = np.array([max(base[p], 1e-9) for p in params])
    scale = x0.copy()

    def coeffs(x) -> Coefficients:
        return Coefficients(**{**base, **dict(zip(params, map(float, x * scale)))})

    def residuals(x) -> np.ndarray:
        k = coeffs(x)
        out = []
        for trace, want in traces:
            got = trace.figures(k)
            out += [(got[name] - v) / v for name, v in want.items()]
        return np.array(out)
    res = least_squares(residuals, np.ones_like(x0), bounds=(0, np.inf), method="trf",
                        x_scale="jac", max_nfev=400)
    r = residuals(res.x)
    return coeffs(res.x), float(r @ r), float(np.abs(r).max())
