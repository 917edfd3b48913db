"""Tune for a service-level objective: which configuration serves the most requests per
second within p99 TTFT and TPOT limits, at this traffic, on this device.

    from workbench.tune import SLO, Space, Workload, tune
    result = tune(Workload(num_requests=24, request_rate=2.0), SLO(ttft_ms=2000, tpot_ms=100),
                  Space({"max_num_seqs": (4, 16, 64), "max_num_batched_tokens": (256, 2048)}),
                  base=EngineConfig(model="smollm2", device="cpu"), n_trials=8)
    print(result.format())            # every trial, the winner, its `vllm serve` flags

workload.py (traffic and the driver), slo.py (the SLO, goodput), space.py (knob domains),
search.py (successive halving), result.py (Pareto frontier, export), tuner.py (`tune`),
cli.py (`workbench tune`). docs/tuning.md says how to read the answer.
"""
from __future__ import annotations

from ..utils import lazy_exports

_EXPORTS = {"TuneResult": ".result", "VllmFlags": ".result", "vllm_flags": ".result",
            "Trial": ".search", "successive_halving": ".search", "SLO": ".slo",
            "Measurement": ".slo", "TUNABLE": ".space", "Space": ".space",
            "measure_config": ".tuner", "run_config": ".tuner", "tune": ".tuner",
            "RequestRecord": ".workload", "RunResult": ".workload", "Workload": ".workload",
            "run_workload": ".workload"}
"""Imported when first used, as the package above does (`workbench tune --help` needs no
engine)."""
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
