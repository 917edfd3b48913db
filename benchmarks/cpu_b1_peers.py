"""Issue 23's two batch-1 targets, measured so that the machine's drift hits both sides: our
engine in bf16 (as 'auto' stores it here, bf16c, and plain), gguf-a8 and gguf against llama.cpp (llama-cpp-python) on a BF16 copy of the
shipped GGUF and on the shipped Q4_1 file as is, one after the other in rounds, in one
process, each round the same 128-token prompt and 128 new tokens; the median of the rounds
is each one's figure.

    flock /tmp/bench.lock python benchmarks/cpu_b1_peers.py [--rounds 3] [--output FILE]

Targets: bf16 weights' TPOT (bf16c: the same numbers, 12.3 bits a weight) <= 0.9x llama.cpp
BF16's; the shipped file's weights (gguf-a8, the same
Q4_1/Q8_0 bytes with 8-bit activations) <= 1.0x llama.cpp's on that file. `workbench bench
--formats` measures each format once (and quality, and throughput); this is the repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from workbench import Engine
from workbench.bench.formats import FORMATS, llama_cpp_b1, llama_cpp_bf16_copy
from workbench.bench.offline import make_workload, run_engine_b1
from workbench.platforms.cpu_kernels import ensure_kernel_built

OURS = ("bf16c", "bf16", "gguf-a8", "gguf")
PEERS = {"bf16c": "llama.cpp BF16", "bf16": "llama.cpp BF16", "gguf-a8": "llama.cpp Q4_1",
         "gguf": "llama.cpp Q4_1"}
TARGETS = {"bf16c": 0.9, "gguf-a8": 1.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--output", default="")
    a = ap.parse_args()
    ensure_kernel_built(lambda s: print(s, file=sys.stderr))
    load0 = os.getloadavg()
    engines = {n: Engine(model="smollm2", device="cpu", **FORMATS[n]) for n in OURS}
    try:
        info = engines["gguf"].info()
        prompt = make_workload(1, (128, 128), (1, 1), info.vocab_size, 1).prompts[0]
        files = {"llama.cpp BF16": llama_cpp_bf16_copy(info.gguf_path, info.model_path),
                 "llama.cpp Q4_1": info.gguf_path}
        threads = torch.get_num_threads()
        for e in engines.values():
            run_engine_b1(e, prompt, 16)                                # warm
        runs: dict[str, list[float]] = {k: [] for k in (*OURS, *files)}
        for r in range(a.rounds):
            for name in ("bf16c", "bf16", "llama.cpp BF16", "gguf-a8", "gguf", "llama.cpp Q4_1"):
                m = (run_engine_b1(engines[name], prompt, a.new_tokens) if name in engines
                     else llama_cpp_b1(files[name], prompt, a.new_tokens, threads))
                runs[name].append(m["tpot_ms"])
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()),
                  flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    median = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {n: median[n] / median[PEERS[n]] for n in OURS}
    print("median TPOT ms: " + ", ".join(f"{k} {v:.2f}" for k, v in median.items()))
    for n, r in ratios.items():
        goal = f" (target <= {TARGETS[n]})" if n in TARGETS else ""
        print(f"{n} / {PEERS[n]}: {r:.2f}{goal}")
    report = {"threads": threads, "rounds": a.rounds, "new_tokens": a.new_tokens,
              "load_before": load0, "load_after": os.getloadavg(), "tpot_ms_runs": runs,
              "tpot_ms_median": median, "ratios": ratios, "targets": TARGETS}
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(ratios[n] <= t for n, t in TARGETS.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
