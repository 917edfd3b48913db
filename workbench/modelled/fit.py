"""Fitting a profile's cost coefficients (cost.py) to measurements.

Two kinds of measurement:

- A real engine's step records (the CPU): each StepEvent gives one step's duration and
  everything its cost depends on, so the coefficients are a non-negative least-squares fit
  of durations on the step's features, each row weighted by 1 / its duration (relative
  error: a 5 ms decode step counts as much as a 500 ms prefill). On the CPU, host and
  device take turns, so launches and host costs add; their per-step parts are one
  intercept (`host_step`).

- Aggregate figures recorded on a device (the H200: TTFT and TPOT percentiles, throughput
  of whole workloads). The workloads are replayed on a modelled engine once to get their
  step sequences: which requests ran in which step is independent of the step times (every
  request is queued at a step boundary: at once, or in a closed loop as earlier ones end), so
  each figure is a function of the coefficients through the per-step features alone. The
  coefficients minimise the figures' squared relative errors (scipy's bounded
  least_squares). `python -m workbench.modelled.fit` does this for the H200 and writes
  calibration.json.
"""
from __future__ import annotations

import numpy as np

from .cost import combine, step_features
from .profiles import Coefficients

CPU_FEATURES = ("host_step", "host_per_request", "host_per_token", "matmul_scale",
                "attention_scale", "launch_prefill_per_layer")


def cpu_design(steps, info, peak_flops: float, bandwidth: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows [1, requests, tokens, linear bound, attention bound, layers if a prompt ran] and
    durations of the steps that fed tokens."""
    rows, y = [], []
    for ev in steps:
        if not ev.tokens_per_request or ev.duration <= 0:
            continue
        f = step_features(ev.tokens_per_request, ev.context_lens, ev.kinds, info, peak_flops,
                          bandwidth)
        rows.append([1.0, f.requests, f.tokens, f.linear, f.attention,
                     info.num_layers if f.prefill else 0.0])
        y.append(ev.duration)
    return np.array(rows, dtype=np.float64), np.array(y, dtype=np.float64)


def fit_cpu_steps(steps, info, peak_flops: float, bandwidth: float
                  ) -> tuple[Coefficients, dict]:
    """Coefficients from a real CPU engine's StepEvents (see the module docstring), and the
    fit's own residuals (median and worst relative error over those steps)."""
    from scipy.optimize import nnls
    X, y = cpu_design(steps, info, peak_flops, bandwidth)
    if len(y) < len(CPU_FEATURES):
        raise ValueError(f"steps: {len(y)} steps that fed tokens; the fit needs at least "
                         f"{len(CPU_FEATURES)}")
    w = 1.0 / y
    coef, _ = nnls(X * w[:, None], y * w)
    rel = np.abs(X @ coef - y) / y
    k = Coefficients(**dict(zip(CPU_FEATURES, map(float, coef))))
    return k, {"steps": int(len(y)), "median_rel_err": float(np.median(rel)),
               "max_rel_err": float(rel.max())}


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
