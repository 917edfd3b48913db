"""The goodput tuner on the real CPU engine: an 8-trial tune, then its winner against the
engine's defaults, head to head on the same workload and SLO in the same run.

    flock /tmp/bench.lock python benchmarks/tune_cpu.py [--model smollm2] [--output FILE]

The SLO and the rate are set from this machine's own speed, measured at the start of the
run (a lone request's TTFT and TPOT), so that the question is the same on a fast or a busy
machine: p99 TTFT within `--ttft-x` times a lone request's, p99 TPOT within `--tpot-x` times
a lone request's, with Poisson arrivals at `--load` times the rate one request at a time
would serve. The defaults are a demo server on a small CPU at its busiest: 48 chat requests
arriving at 2.5 times what one at a time would serve, the first token within 30 times a
lone request's and tokens at 12 times a lone request's TPOT (on a 2-core VM about 10 s and
150 ms: reading speed). Targets (issue 26): the tune finishes in under 10 minutes, and the
winner's goodput beats the defaults' (ratio > 1), each measured twice, alternating.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

from workbench import Engine, EngineConfig, SamplingParams
from workbench.tune import SLO, TUNABLE, Space, Workload, measure_config, tune

PROMPT, OUTPUT = (64, 256), (16, 48)
KNOBS = ("max_num_seqs", "max_num_batched_tokens", "prefill_interval", "enable_chunked_prefill",
         "block_size")
"""The knobs that move TTFT and TPOT on a CPU (no graphs to capture; one model instance)."""


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def lone_request(base: EngineConfig, prompt: tuple[int, int], output: tuple[int, int]
                 ) -> tuple[float, float]:
    """TTFT and TPOT (s) of one mid-sized request alone on the default engine."""
    prompt_len, out = sum(prompt) // 2, sum(output) // 2
    with Engine(base) as e:
        e.generate([[11] * 16], SamplingParams(max_tokens=2, ignore_eos=True))   # warm
        ttfts, tpots = [], []
        for i in range(2):
            m = e.generate([[100 + i] * prompt_len], SamplingParams(max_tokens=out,
                                                                     ignore_eos=True))[0].metrics
            ttfts.append(m.ttft)
            tpots.append(m.tpot)
    return min(ttfts), min(tpots)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--load", type=float, default=2.5,
                    help="arrival rate as a multiple of what one request at a time serves")
    ap.add_argument("--ttft-x", type=float, default=30.0)
    ap.add_argument("--tpot-x", type=float, default=12.0)
    ap.add_argument("--trial-timeout", type=float, default=90.0)
    ap.add_argument("--prompt-len", type=_range, default=PROMPT, help="LO:HI tokens")
    ap.add_argument("--output-len", type=_range, default=OUTPUT, help="LO:HI tokens")
    ap.add_argument("--knobs", default=",".join(KNOBS),
                    help="comma list of knobs to search over their default domains, or 'all'")
    ap.add_argument("--output", default="")
    a = ap.parse_args()
    knobs = TUNABLE if a.knobs == "all" else tuple(k.strip() for k in a.knobs.split(","))

    base = EngineConfig(model=a.model, device="cpu", kv_cache_memory_gb=0.25)
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    ttft1, tpot1 = lone_request(base, a.prompt_len, a.output_len)
    service = ttft1 + (sum(a.output_len) / 2 - 1) * tpot1
    rate = a.load / service
    slo = SLO(ttft_ms=a.ttft_x * ttft1 * 1e3, tpot_ms=a.tpot_x * tpot1 * 1e3)
    workload = Workload(num_requests=a.num_requests, request_rate=round(rate, 3),
                        prompt_len=a.prompt_len, output_len=a.output_len, seed=1)
    print(f"lone request: TTFT {ttft1 * 1e3:.0f} ms, TPOT {tpot1 * 1e3:.1f} ms; "
          f"{workload.describe()}; SLO {slo.describe()}; load average {load0[0]:.1f}",
          flush=True)

    space = Space.default("cpu", knobs=knobs)
    t0 = time.perf_counter()
    result = tune(workload, slo, space, base=base, n_trials=a.trials,
                  trial_time_limit=a.trial_timeout,
                  progress=lambda t, d, n: print(
                      f"  trial {d}/{n} rung {t.rung}: "
                      + (f"goodput {t.measurement.goodput:.3f} req/s" if t.ok
                         else f"failed: {t.error}") + f" ({t.seconds:.0f} s)", flush=True))
    tune_s = time.perf_counter() - t0
    print(result.format(), flush=True)
    print(f"tune: {len(result.trials)} trials in {tune_s:.0f} s (target < 600 s)", flush=True)

    winner = result.winner_config()
    defaults = replace(base)
    heads = {"defaults": [], "winner": []}
    for _ in range(2):                 # alternating, so drift in the machine hits both
        for name, cfg in (("defaults", defaults), ("winner", winner)):
            m = measure_config(cfg, workload, slo, time_limit=a.trial_timeout)
            heads[name].append(m)
            print(f"  {name:8s} goodput {m.goodput:.3f} req/s, attainment {m.attainment:.0%}, "
                  f"p99 TTFT {m.ttft_ms:.0f} ms, p99 TPOT {m.tpot_ms:.1f} ms", flush=True)
    g = {k: statistics.mean(m.goodput for m in v) for k, v in heads.items()}
    ratio = g["winner"] / g["defaults"] if g["defaults"] > 0 else float("inf")
    print(f"goodput: winner {g['winner']:.3f} req/s, defaults {g['defaults']:.3f} req/s: "
          f"winner/defaults = {ratio:.2f}x (target > 1)", flush=True)
    total = time.perf_counter() - t_start
    report = {"model": a.model, "machine": {"cpus": os.cpu_count(), "load_before": load0,
                                            "load_after": os.getloadavg()},
              "lone_request": {"ttft_ms": ttft1 * 1e3, "tpot_ms": tpot1 * 1e3},
              "workload": workload.describe(), "slo": slo.describe(), "argv": sys.argv[1:],
              "tune_seconds": tune_s, "total_seconds": total, "result": result.to_dict(),
              "head_to_head": {k: [m.to_dict() for m in v] for k, v in heads.items()},
              "goodput": g, "ratio": ratio}
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if tune_s < 600 and ratio > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
