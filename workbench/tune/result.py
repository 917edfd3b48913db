"""A tuning run's result: every trial's goodput, the Pareto frontier, the winner exported.

The winner is exported twice: as an EngineConfig (the base config with the winning knobs),
and as the `vllm serve` flags that ask vLLM for the same thing (vLLM-Ascend's where the
device is an NPU), with the knobs vLLM has no flag for named (`VllmFlags.unmapped`):
prefill_interval and waiting_timeout_ms are MindIE/ATB scheduling knobs, and vLLM's
scheduler always preempts the newest running request.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace

from ..config import EngineConfig
from .search import SearchOutcome, Trial
from .slo import SLO
from .space import Space
from .workload import Workload

LATENCIES = {"ttft_ms": "p99 TTFT (ms)", "tpot_ms": "p99 TPOT (ms)"}


@dataclass
class VllmFlags:
    """`vllm serve` flags for a configuration, and what has no flag there."""
    flags: list[str]
    unmapped: dict[str, str] = field(default_factory=dict)
    """Knob -> why vLLM has no equivalent (the knob's value is not the default)."""
    ascend: bool = False

    def command(self, model: str = "MODEL") -> str:
        return shlex.join(["vllm", "serve", model, *self.flags])


_GRAPH_MODES_CUDA = {"decode": "FULL_DECODE_ONLY", "full": "FULL_AND_PIECEWISE"}
# The NPU's 'full' runs every step piecewise, decode included (config.EngineConfig.graph_mode).
_GRAPH_MODES_NPU = {"decode": "FULL_DECODE_ONLY", "full": "PIECEWISE"}


def vllm_flags(knobs: dict, device: str = "cuda") -> VllmFlags:
    """The flags for `knobs` (EngineConfig names) on `device` ('npu': vLLM-Ascend's)."""
    ascend = device == "npu"
    flags: list[str] = []
    unmapped: dict[str, str] = {}
    for name, v in knobs.items():
        if name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
                    "gpu_memory_utilization", "seed") and v is not None:
            flags += [f"--{name.replace('_', '-')}", str(v)]
        elif name == "num_kv_blocks" and v is not None:
            flags += ["--num-gpu-blocks-override", str(v)]
        elif name == "dtype" and v not in (None, "auto"):
            flags += ["--dtype", v]
        elif name in ("enable_chunked_prefill", "enable_prefix_caching"):
            flags.append(f"--{'' if v else 'no-'}{name.replace('_', '-')}")
        elif name == "async_scheduling" and v:
            flags.append("--async-scheduling")
        elif name == "graph_mode" and v is not None:
            if v == "eager":
                flags.append("--enforce-eager")
            else:
                mode = (_GRAPH_MODES_NPU if ascend else _GRAPH_MODES_CUDA)[v]
                flags += ["--compilation-config", json.dumps({"cudagraph_mode": mode})]
        elif name == "preemption_mode":
            if v != "newest":
                unmapped[name] = ("vLLM's scheduler always preempts the newest running "
                                  "request; it has no choice of victim")
        elif name == "prefill_interval":
            if v != 1:
                unmapped[name] = ("MindIE/ATB's prefill interval; vLLM admits prefills "
                                  "every step")
        elif name == "waiting_timeout_ms":
            if v:
                unmapped[name] = ("MindIE/ATB's batch waiting time; vLLM schedules a "
                                  "waiting request at the next step")
        elif name == "pa_shape_list" and v is not None and ascend:
            flags += ["--additional-config", json.dumps({"pa_shape_list": list(v)})]
        elif name == "cudagraph_capture_sizes" and v is not None:
            flags += ["--compilation-config",
                      json.dumps({"cudagraph_capture_sizes": list(v)})]
        elif name == "speculative_config":
            if v is not None:
                flags += ["--speculative-config", json.dumps(v)]
        elif v != getattr(EngineConfig(), name, None):
            unmapped[name] = "no vLLM flag for this workbench knob"
    return VllmFlags(flags, unmapped, ascend)


def dominates(a: Trial, b: Trial, latency: str) -> bool:
    """a is at least as good as b in throughput and the latency, and better in one."""
    ma, mb = a.measurement, b.measurement
    la, lb = getattr(ma, latency), getattr(mb, latency)
    la = float("inf") if la is None else la
    lb = float("inf") if lb is None else lb
    return (ma.throughput >= mb.throughput and la <= lb
            and (ma.throughput > mb.throughput or la < lb))


@dataclass
class TuneResult:
    outcome: SearchOutcome
    workload: Workload
    slo: SLO
    space: Space
    base: EngineConfig
    device: str = ""
    """Where the trials ran, in words (EngineInfo.device_name, or the modelled profile)."""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    """What the reader must know beside the figures: on a modelled device, that every time
    is modelled and the profile's measured error, or that it is uncalibrated."""
    modelled: dict | None = None
    """EngineInfo.modelled of the trials' engines (None: a real device)."""

    @property
    def flags_device(self) -> str:
        """Whose `vllm serve` flags the winner is exported as: the device's, or on a modelled
        device the kind of device it models ('cuda' or 'npu')."""
        if self.modelled is not None:
            return self.modelled.get("kind", "cuda")
        return self.base.device
    @property
    def trials(self) -> list[Trial]:
        return self.outcome.trials

    @property
    def stopped(self) -> bool:
        return self.outcome.stopped

    @property
    def winner(self) -> Trial | None:
        return self.outcome.best()

    def final_trials(self) -> list[Trial]:
        """Each configuration's measured trial at the furthest rung it reached."""
        last: dict[tuple, Trial] = {}
        for t in self.trials:
            if t.ok:
                last[tuple(sorted(t.knobs.items()))] = t
        return list(last.values())

    def pareto(self, latency: str = "ttft_ms") -> list[Trial]:
        """The configurations no other beats in both throughput and `latency` (its p99),
        by throughput."""
        if latency not in LATENCIES:
            raise ValueError(f"latency: must be one of {tuple(LATENCIES)} (got {latency!r})")
        pts = self.final_trials()
        front = [t for t in pts if not any(dominates(o, t, latency) for o in pts if o is not t)]
        return sorted(front, key=lambda t: t.measurement.throughput)

    def winner_config(self) -> EngineConfig:
        w = self.winner
        if w is None:
            raise ValueError("result: no trial was measured, so there is no winner")
        return replace(self.base, **w.knobs)

    def winner_flags(self) -> VllmFlags:
        w = self.winner
        if w is None:
            raise ValueError("result: no trial was measured, so there is no winner")
        return vllm_flags(w.knobs, self.flags_device)

    def to_dict(self) -> dict:
        w = self.winner
        d = {"device": self.device, "modelled": self.modelled, "workload": self.workload.describe(),
             "slo": self.slo.describe(), "space": {k: list(v) for k, v in self.space.knobs.items()},
             "plan": self.outcome.plan, "budgets": self.outcome.budgets,
             "stopped": self.stopped, "seconds": self.seconds, "notes": self.notes,
             "trials": [t.to_dict() for t in self.trials],
             "winner": w.to_dict() if w else None}
        if w is not None:
            f = self.winner_flags()
            d["vllm_serve"] = f.command(self.base.model)
            d["vllm_unmapped"] = f.unmapped
        return d

    def format(self) -> str:
        """The trials as a table, then the winner and its flags."""
        lines = [f"tuned on {self.device}: {self.workload.describe()}",
                 f"SLO: {self.slo.describe()}; {len(self.trials)} trials in {self.seconds:.1f} s"
                 f"{' (stopped early)' if self.stopped else ''}", *self.notes,
                 f"{'#':>3} {'rung':>4} {'reqs':>5} {'goodput':>8} {'attain':>6} {'req/s':>7} "
                 f"{'p99 TTFT':>9} {'p99 TPOT':>9}  knobs"]
        for t in self.trials:
            knobs = " ".join(f"{k}={v}" for k, v in t.knobs.items())
            if not t.ok:
                lines.append(f"{t.number:>3} {t.rung:>4} {t.budget:>5}   failed: {t.error}  "
                             f"[{knobs}]")
                continue
            m = t.measurement
            lines.append(f"{t.number:>3} {t.rung:>4} {t.budget:>5} {m.goodput:>8.3f} "
                         f"{m.attainment:>6.0%} {m.throughput:>7.3f} {_ms(m.ttft_ms):>9} "
                         f"{_ms(m.tpot_ms):>9}  {knobs}")
        w = self.winner
        if w is None:
            lines.append("no trial was measured: no winner")
            return "\n".join(lines)
        flags = self.winner_flags()
        lines += ["", f"winner: trial {w.number}, goodput {w.measurement.goodput:.3f} req/s "
                      f"({'meets' if w.measurement.meets_slo else 'misses'} the SLO)",
                  "  EngineConfig(" + ", ".join(f"{k}={v!r}" for k, v in w.knobs.items()) + ")",
                  f"  {'vLLM-Ascend' if flags.ascend else 'vLLM'}: "
                  f"{flags.command(self.base.model)}"]
        for k, why in flags.unmapped.items():
            lines.append(f"  no vLLM equivalent: {k}={w.knobs[k]!r} ({why})")
        return "\n".join(lines)


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return "inf" if x == float("inf") else f"{x:.0f}ms" if x >= 10 else f"{x:.1f}ms"
