"""A first start's decode speed while the CPU kernel builds beside it, with the detached build
lowered as it is (`cpu_kernels.below_me`: its nice value and its session's) and as it was
before (a nice value only, which counts for nothing against other sessions where the kernel
schedules sessions as groups).

Each run gets a fresh kernel cache (the converted smollm2 linked in from the default cache,
so only the kernel builds), starts an fp32 engine, which serves in plain torch while the
build runs, and times 48-token greedy requests at batch 1 until the build is done (at most
six). The two rules alternate, `--rounds` times each, each in a fresh process.

    python benchmarks/first_start_build.py [--rounds 2] [--output out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(rule: str) -> dict:
    from workbench.cache import cache_root
    cache = Path(tempfile.mkdtemp(prefix="first-start-"))
    try:
        for d in cache_root().iterdir():
            if d.name.startswith("smollm2"):
                os.symlink(d, cache / d.name)
        os.environ["WORKBENCH_CACHE"] = str(cache)
        from workbench.platforms import cpu_kernels as cpu
        if rule == "nice only":
            def nice_only(by: int = 10):
                def lower() -> None:
                    with contextlib.suppress(OSError):
                        os.nice(by)
                return lower
            cpu.below_me = nice_only
        from workbench import Engine, SamplingParams
        t0 = time.perf_counter()
        engine = Engine(model="smollm2", device="cpu", quantization=None)
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        ms = []
        while cpu.kernel_is_building() and len(ms) < 6:
            t = time.perf_counter()
            out = engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], params)[0]
            ms.append(round((time.perf_counter() - t) / len(out.token_ids) * 1e3, 1))
        cpu.wait_for_kernel(900)
        return dict(rule=rule, ms_per_token=ms, build_s=round(time.perf_counter() - t0, 1))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one)))
        return 0
    rows = []
    for r in range(a.rounds):
        for rule in (("below_me", "nice only") if r % 2 == 0 else ("nice only", "below_me")):
            p = subprocess.run([sys.executable, __file__, "--one", rule], capture_output=True,
                               text=True, cwd=ROOT)
            if p.returncode != 0:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(p.stdout.splitlines()[-1]))
            print(f"{rows[-1]['rule']:>10}: ms a token while it builds {rows[-1]['ms_per_token']}, "
                  f"build done after {rows[-1]['build_s']} s", flush=True)
    if a.output:
        Path(a.output).write_text(json.dumps(dict(load=os.getloadavg(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
