"""The goodput tuner on a modelled H200 (`device="model:h200"`): 30 trials, then the winner
against the engine's defaults on the same workload and SLO.

    flock /tmp/bench.lock python benchmarks/tune_modelled.py [--output FILE]

Every trial runs the real scheduler, block pool and prefix cache with each step's time from
the H200 profile's cost model, on the engine's virtual clock: a trial of hundreds of
requests takes as long as the host's bookkeeping. Target (issue 26): 30 trials in under a
minute on this 2-core machine. The figures are modelled: the profile's measured error (or
that it is uncalibrated) is printed with them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from workbench import EngineConfig
from workbench.tune import SLO, Space, Workload, measure_config, tune


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--rate", type=float, default=80.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--ttft-ms", type=float, default=200.0)
    ap.add_argument("--tpot-ms", type=float, default=15.0)
    ap.add_argument("--output", default="")
    a = ap.parse_args()

    base = EngineConfig(model=a.model, device=f"model:{a.profile}")
    workload = Workload(num_requests=a.num_requests, request_rate=a.rate,
                        prompt_len=(128, 1024), output_len=(64, 256), seed=1)
    slo = SLO(ttft_ms=a.ttft_ms, tpot_ms=a.tpot_ms)
    t0 = time.perf_counter()
    result = tune(workload, slo, Space.default(base.device), base=base, n_trials=a.trials)
    tune_s = time.perf_counter() - t0
    print(result.format(), flush=True)
    print(f"tune: {len(result.trials)} trials in {tune_s:.1f} s (target < 60 s)", flush=True)
    winner = measure_config(result.winner_config(), workload, slo)
    defaults = measure_config(base, workload, slo)
    for name, m in (("defaults", defaults), ("winner", winner)):
        print(f"  {name:8s} goodput {m.goodput:.2f} req/s, attainment {m.attainment:.0%}, "
              f"p99 TTFT {m.ttft_ms:.0f} ms, p99 TPOT {m.tpot_ms:.1f} ms (modelled)")
    ratio = winner.goodput / defaults.goodput if defaults.goodput > 0 else float("inf")
    print(f"goodput: winner/defaults = {ratio:.2f}x (modelled)", flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"tune_seconds": tune_s, "result": result.to_dict(),
                       "defaults": defaults.to_dict(), "winner": winner.to_dict(),
                       "ratio": ratio}, f, indent=1)
    return 0 if tune_s < 60 and len(result.trials) == a.trials else 1


if __name__ == "__main__":
    sys.exit(main())
