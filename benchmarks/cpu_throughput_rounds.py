"""Issue 23's throughput target, measured so that the machine's drift hits every format alike:
the CPU throughput workload (32 requests, prompts U[16, 256], outputs U[16, 128], EOS
ignored) through the engine in fp32 and in each faster format, one after the other in rounds,
in one process. Each round's ratio is against that round's fp32 run; the median of the
rounds' ratios is each format's figure (single runs here move by 20-40 %).

    flock /tmp/bench.lock python benchmarks/cpu_throughput_rounds.py [--rounds 3]
        [--formats bf16,int8-a8,gguf-a8] [--sampled] [--output FILE]

It prints the CPU's ISA flags, the ISA the kernel was built for and what `auto` chose first
(`--formats auto,...` measures the default too). Other ISAs on this machine:
`WORKBENCH_CPU_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ...` and others (see cpu_b1_peers.py).

Target: >= 2x fp32's output tokens per second at equal or better quality (quality per format:
`workbench bench --formats`, docs/benchmarks.md). `--sampled`: temperature 0.7, top_p 0.9
instead of greedy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from workbench import Engine
from workbench.bench.formats import FORMATS
from workbench.bench.offline import make_workload, run_engine
from workbench.platforms.cpu import describe
from workbench.platforms.cpu_kernels import ensure_kernel_built

KNOBS = {"auto": dict(dtype="float32", quantization="auto"), **FORMATS}

TARGET = 2.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="bf16,int8-a8,gguf-a8")
    ap.add_argument("--sampled", action="store_true")
    ap.add_argument("--output", default="")
    a = ap.parse_args()
    names = ["fp32", *(f for f in a.formats.split(",") if f and f != "fp32")]
    unknown = [n for n in names if n not in KNOBS]
    if unknown:
        ap.error(f"--formats: unknown format {unknown[0]!r} (one of {', '.join(KNOBS)})")
    sampling = dict(temperature=0.7, top_p=0.9) if a.sampled else None
    ensure_kernel_built(lambda s: print(s, file=sys.stderr))
    load0 = os.getloadavg()
    engines = {n: Engine(model="smollm2", device="cpu", **KNOBS[n]) for n in names}
    cpu = describe()
    cpu["chosen"] = {n: [e.info().quantization, e.info().quantization_choice]
                     for n, e in engines.items()}
    for k, v in cpu.items():
        print(f"{k}: {v}", flush=True)
    try:
        wl = make_workload(32, (16, 256), (16, 128), engines["fp32"].info().vocab_size, 0)
        runs: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names:
                runs[n].append(run_engine(engines[n], wl, sampling=sampling)["out_tok_s"])
            print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in runs.items()),
                  flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    ratios = {n: statistics.median(x / f for x, f in zip(runs[n], runs["fp32"]))
              for n in names if n != "fp32"}
    report = dict(cpu=cpu, workload="32 requests, prompts U[16, 256], outputs U[16, 128]",
                  sampling=sampling or "greedy", rounds=a.rounds, out_tok_s=runs,
                  median_out_tok_s={n: statistics.median(v) for n, v in runs.items()},
                  ratio_vs_fp32_median_of_rounds=ratios, target=TARGET,
                  load_average_before=load0, load_average_after=os.getloadavg())
    print(f"\nmedian of {a.rounds} rounds' ratios to fp32 (target >= {TARGET}x), "
          f"{'sampled (t 0.7, top_p 0.9)' if sampling else 'greedy'}:")
    for n, x in ratios.items():
        print(f"  {n}: {x:.2f}x ({'met' if x >= TARGET else 'NOT met'}); tok/s per round "
              f"{', '.join(f'{v:.1f}' for v in runs[n])} vs fp32 "
              f"{', '.join(f'{v:.1f}' for v in runs['fp32'])}")
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
