"""A service-level objective and goodput.

An `SLO` puts limits on TTFT and TPOT (and optionally end-to-end latency) at a percentile,
p99 by default. Goodput is DistServe's (Zhong et al., OSDI 2024): the requests per second
that are served within the SLO, a request counting only if its TTFT, its TPOT and (where a
limit is set) its E2E are all within the limits; the fraction of requests that are is the
SLO attainment. `vllm bench serve --goodput` counts the same way. A run *meets* the SLO when
its percentile latencies are within the limits, i.e. when attainment reaches the percentile
(99 % for p99): then its goodput is the rate it served at, less the 1 % the SLO allows.

A request that did not finish (cut off by a trial's time limit) is not served.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..telemetry import percentile
from .workload import RequestRecord, RunResult


def late_percentile(xs, num_unfinished: int, q: float) -> float | None:
    """The q-th percentile (telemetry.percentile's) of xs and `num_unfinished` more values
    that are unbounded (requests that never finished): inf where the percentile reaches
    them."""
    xs = sorted(x for x in xs if x is not None)
    if not num_unfinished:
        return percentile(xs, q)
    n = len(xs) + num_unfinished
    k = (n - 1) * q / 100
    if math.ceil(k) >= len(xs):          # interpolates towards (or lands on) an unbounded one
        return math.inf
    return percentile(xs + [math.inf] * num_unfinished, q)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    """Limit on time to first token, milliseconds."""
    tpot_ms: float
    """Limit on time per output token after the first, milliseconds."""
    e2e_ms: float | None = None
    """Limit on end-to-end latency, milliseconds (None: no limit)."""
    percentile: float = 99.0
    """The percentile the limits hold at (p99)."""

    def __post_init__(self):
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            v = getattr(self, name)
            if v is None and name == "e2e_ms":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}: must be a number of milliseconds > 0 (got {v!r})")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile: must be in (0, 100] (got {self.percentile!r})")

    def served(self, r: RequestRecord) -> bool:
        """Whether one request was served within the limits."""
        if not r.finished or r.ttft is None or r.ttft * 1e3 > self.ttft_ms:
            return False
        if r.tpot is not None and r.tpot * 1e3 > self.tpot_ms:
            return False
        return self.e2e_ms is None or (r.e2e is not None and r.e2e * 1e3 <= self.e2e_ms)

    def measure(self, run: RunResult) -> "Measurement":
        q = self.percentile
        good = sum(self.served(r) for r in run.records)
        n = len(run.records)

        def pct_ms(key: str) -> float | None:
            v = late_percentile([getattr(r, key) for r in run.records if r.finished],
                                n - run.num_finished, q)
            return None if v is None else v * 1e3

        ttft, tpot = pct_ms("ttft"), pct_ms("tpot")
        e2e = pct_ms("e2e")
        meets = (ttft is not None and ttft <= self.ttft_ms
                 and (tpot is None or tpot <= self.tpot_ms)
                 and (self.e2e_ms is None or (e2e is not None and e2e <= self.e2e_ms)))
        d = run.duration
        return Measurement(goodput=good / d if d > 0 else 0.0, attainment=good / n if n else 0.0,
                           throughput=run.throughput, output_throughput=run.output_throughput,
                           ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e, meets_slo=meets,
                           num_requests=n, num_served=good, duration_s=d,
                           headroom=self.headroom(ttft, tpot, e2e))

    def headroom(self, ttft_ms, tpot_ms, e2e_ms) -> float:
        """How far the worst percentile latency is under its limit, as a fraction of the limit
        (1 - latency/limit; negative when over): the tie-break between runs of equal goodput."""
        ratios = [(ttft_ms if ttft_ms is not None else float("inf")) / self.ttft_ms,
                  (tpot_ms or 0.0) / self.tpot_ms]
        if self.e2e_ms is not None:
            ratios.append((e2e_ms if e2e_ms is not None else float("inf")) / self.e2e_ms)
        return 1.0 - max(ratios)

    def describe(self) -> str:
        q = f"p{self.percentile:g}"
        e2e = f", {q} E2E <= {self.e2e_ms:g} ms" if self.e2e_ms is not None else ""
        return f"{q} TTFT <= {self.ttft_ms:g} ms, {q} TPOT <= {self.tpot_ms:g} ms{e2e}"


@dataclass
class Measurement:
    """One trial's figures against the SLO (latencies at the SLO's percentile, ms; None where
    no request gave one; inf where unfinished requests are past the percentile)."""
    goodput: float
    """Requests per second served within the SLO."""
    attainment: float
    """Fraction of the requests served within the SLO."""
    throughput: float
    """Finished requests per second, within the SLO or not."""
    output_throughput: float = 0.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    meets_slo: bool = False
    num_requests: int = 0
    num_served: int = 0
    duration_s: float = 0.0
    headroom: float = 0.0

    @property
    def rank(self) -> tuple[float, float]:
        """Higher is better: goodput, then headroom under the limits."""
        return (self.goodput, self.headroom)

    def to_dict(self) -> dict:
        return asdict(self)
