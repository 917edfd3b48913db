"""Record the trace that ships in docs/traces/ (what `workbench dashboard --replay` and
`Stepper.replay` play with no model loaded), and refuse to save one that does not show the
engine's real speed.

    python benchmarks/record_trace.py [--out FILE] [--factor 2] [--repeats 5] [--attempts 3]

What it records: the dashboard's eight example prompts as chat turns on smollm2, on the CPU,
with the dashboard's engine settings; replies of different lengths (max_tokens 12 + 6 i,
sampled with seed i), so the decode batch shrinks from 8 to 1 along the run.

How it checks, before saving anything:
- the machine is quiet: its 1-minute load average is at most --max-load (default: half its
  cores), since a busy machine slows the calibration and the recording alike;
- the C++ CPU kernel is built (or its build waited for), so every step runs what a user's
  engine runs once it is built;
- `calibrate` runs the same workload --repeats times and takes each kind of step's median (the
  prefill of the eight prompts, a decode at each batch size from 8 to 1); then the recording,
  each of whose steps must take within --factor of its kind's median, either way;
- its batch-1 TPOT (`Trace.batch1_tpot()`) is within --tpot-factor (2) of what `workbench bench
  --num-requests 0` measures on the same engine right after (kept in the trace, and what
  tests/test_trace_recording.py holds the shipped trace to).
A recording that fails says which steps were off, and another calibration and recording follow,
up to --attempts; then it gives up with exit status 1, having saved nothing. A saved trace keeps
what it was checked against (`Trace.calibration`) and names no local path (`Trace.model_sha256`
identifies the weights).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from widgets.dashboard import DASHBOARD_DEFAULTS, EXAMPLE_PROMPTS  # noqa: E402
from workbench import Engine, EngineConfig, SamplingParams  # noqa: E402
from workbench.bench import offline  # noqa: E402
from workbench.trace import calibrate, check_steps, record  # noqa: E402

SHIPPED = ROOT / "docs" / "traces" / "smollm2-cpu.trace.json.gz"


def workload(n: int | None = None) -> tuple[list, list[SamplingParams]]:
    """The first n (default all) of the dashboard's example prompts, and their parameters."""
    lines = EXAMPLE_PROMPTS.splitlines()[:n]
    prompts = [[{"role": "user", "content": line}] for line in lines]
    params = [SamplingParams(max_tokens=12 + 6 * i, temperature=0.7, seed=i)
              for i in range(len(prompts))]
    return prompts, params


def bench_batch1_tpot(engine: Engine) -> float:
    """Batch-1 TPOT (s) as `workbench bench --num-requests 0` measures it: its prompt and
    length (the defaults of bench.offline.run), on this engine."""
    import inspect
    bench = {k: p.default for k, p in inspect.signature(offline.run).parameters.items()}
    prompt = offline.make_workload(1, (bench["b1_prompt"],) * 2, (1, 1),
                                   engine.info().vocab_size, bench["seed"] + 1).prompts[0]
    return offline.run_engine_b1(engine, prompt, bench["b1_new"])["tpot_ms"] / 1e3


def check_tpot(trace, cal, engine: Engine, factor: float) -> list[str]:
    """The trace's batch-1 TPOT against `workbench bench --num-requests 0`'s on the same engine
    (kept in `cal`): within `factor` either way, or one line saying why not."""
    cal.bench_batch1_tpot_s = bench = bench_batch1_tpot(engine)
    b1 = trace.batch1_tpot()
    if b1 is None:
        return ["no request decoded alone for two steps: no batch-1 TPOT to check"]
    if not 1 / factor <= b1[0] / bench <= factor:
        return [f"batch-1 TPOT {b1[0] * 1e3:.1f} ms, {b1[0] / bench:.2f}x the {bench * 1e3:.1f} "
                f"ms `workbench bench --num-requests 0` measures on this engine"]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(SHIPPED), help="where to save it (default: the shipped "
                                                        "trace, docs/traces/smollm2-cpu.trace.json.gz)")
    ap.add_argument("--factor", type=float, default=2.0,
                    help="each recorded step within this factor of its kind's calibration "
                         "median, either way (default 2)")
    ap.add_argument("--tpot-factor", type=float, default=2.0,
                    help="batch-1 TPOT within this factor of workbench bench's, either way "
                         "(default 2, what the test suite holds the shipped trace to)")
    ap.add_argument("--repeats", type=int, default=5, help="calibration runs (default 5)")
    ap.add_argument("--attempts", type=int, default=3,
                    help="calibrations and recordings to try before giving up (default 3)")
    ap.add_argument("--max-load", type=float, default=(os.cpu_count() or 2) / 2,
                    help="refuse to start above this 1-minute load average (default: half "
                         "the cores)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="record only the first N prompts (a quick check of this script; the "
                         "shipped trace has all eight)")
    a = ap.parse_args(argv)
    if not (a.factor > 1 and a.tpot_factor > 1) or a.repeats < 1 or a.attempts < 1:
        ap.error("--factor and --tpot-factor must be > 1, --repeats and --attempts >= 1")
    if a.num_prompts is not None and a.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")
    load = list(os.getloadavg())
    if load[0] > a.max_load:
        print(f"refused: the machine is busy (1-minute load average {load[0]:.2f} > --max-load "
              f"{a.max_load:g}); a trace recorded now would show other work, not the engine. "
              f"Nothing saved.", file=sys.stderr)
        return 1
    from workbench.platforms.cpu_kernels import load_cpu_kernels
    if load_cpu_kernels() is None:                 # waits for a build under way elsewhere
        print("note: no C++ CPU kernel (no compiler?): recording the plain-torch path",
              file=sys.stderr)
    engine = Engine(EngineConfig(model="smollm2", device="cpu", seed=0, **DASHBOARD_DEFAULTS))
    prompts, params = workload(a.num_prompts)
    try:
        for attempt in range(1, a.attempts + 1):
            samples = calibrate(engine, prompts, params, a.repeats)
            engine.reset_prefix_cache()
            trace = record(engine, prompts, params)
            cal, off = check_steps(trace, samples, a.factor, a.repeats, load)
            if not off:        # then what the test suite will hold it to, on this machine
                off = check_tpot(trace, cal, engine, a.tpot_factor)
            if not off:
                break
            print(f"attempt {attempt}/{a.attempts}: not representative (each step within "
                  f"{a.factor:g}x of its kind's calibration median, and the batch-1 TPOT within "
                  f"{a.tpot_factor:g}x of workbench bench's, expected):\n  " + "\n  ".join(off),
                  file=sys.stderr)
        else:
            print(f"refused: no representative recording in {a.attempts} attempts (is the "
                  f"machine busy?). Nothing saved.", file=sys.stderr)
            return 1
    finally:
        engine.close()
    trace.calibration = cal
    path = trace.save(a.out)
    pre = sum(f.step.duration for f in trace.frames if f.step.phase == "prefill")
    b1 = trace.batch1_tpot()
    print(f"{path}: {len(trace.frames)} steps in {trace.duration:.2f} s, each within "
          f"{cal.min_ratio:.2f}-{cal.max_ratio:.2f}x of the calibration ({a.repeats} runs); "
          f"prefill {pre * 1e3:.0f} ms, batch-1 TPOT {b1[0] * 1e3:.1f} ms (workbench bench: "
          f"{cal.bench_batch1_tpot_s * 1e3:.1f} ms); {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
