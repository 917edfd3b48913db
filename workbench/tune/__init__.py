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
from .result import TuneResult, VllmFlags, vllm_flags
from .search import Trial, successive_halving
from .slo import SLO, Measurement
from .space import TUNABLE, Space
from .tuner import measure_config, run_config, tune
from .workload import RequestRecord, RunResult, Workload, run_workload

__all__ = ["SLO", "Measurement", "Space", "TUNABLE", "Trial", "TuneResult", "VllmFlags",
           "Workload", "RequestRecord", "RunResult", "measure_config", "run_config",
           "run_workload", "successive_halving", "tune", "vllm_flags"]
