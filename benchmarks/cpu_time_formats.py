"""The CPU throughput workload (32 requests, prompts U[16, 256], outputs U[16, 128]) in fp32
and bf16 on one thread, measured in process CPU time as well as wall time: on a machine that
other processes share, CPU time is the figure they cannot inflate (wall-clock ratios then
say more about the load than about the engine).

    python benchmarks/cpu_time_formats.py [float32 bfloat16 ...]
"""
from __future__ import annotations

import json
import sys
import time

import torch


def main(dtypes: list[str]) -> dict:
    torch.set_num_threads(1)
    from workbench import Engine
    from workbench.bench.offline import make_workload, run_engine
    from workbench.platforms.cpu_kernels import ensure_kernel_built
    ensure_kernel_built(lambda s: print(s, file=sys.stderr))
    wl = make_workload(32, (16, 256), (16, 128), 49152, 0)
    out = {}
    for dt in dtypes:
        e = Engine(model="smollm2", device="cpu", dtype=dt, quantization=None)
        try:
            cpu, wall = time.process_time(), time.perf_counter()
            r = run_engine(e, wl)
            out[dt] = dict(cpu_s=round(time.process_time() - cpu, 1),
                           wall_s=round(time.perf_counter() - wall, 1),
                           out_tok_s=r["out_tok_s"], steps=r["steps"])
        finally:
            e.shutdown()
        print(dt, out[dt], file=sys.stderr, flush=True)
    if "float32" in out:
        for dt, r in out.items():
            r["cpu_vs_fp32"] = round(r["cpu_s"] / out["float32"]["cpu_s"], 2)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:] or ["float32", "bfloat16"]), indent=1))
