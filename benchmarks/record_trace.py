"""Record the small trace that ships in docs/traces/ (what `workbench dashboard --replay` and
`Stepper.replay` play with no model loaded): the dashboard's eight example prompts as chat
turns on smollm2, on the CPU, with the dashboard's engine settings.

    python benchmarks/record_trace.py [OUT]
"""
from __future__ import annotations

import sys
from pathlib import Path

from workbench import Engine, EngineConfig, SamplingParams
from workbench.trace import record

ROOT = Path(__file__).resolve().parents[1]


def main(out: str = str(ROOT / "docs" / "traces" / "smollm2-cpu.trace.json.gz")) -> None:
    sys.path.insert(0, str(ROOT))
    from widgets.dashboard import DASHBOARD_DEFAULTS, EXAMPLE_PROMPTS
    engine = Engine(EngineConfig(model="smollm2", device="cpu", seed=0, **DASHBOARD_DEFAULTS))
    prompts = [[{"role": "user", "content": line}] for line in EXAMPLE_PROMPTS.splitlines()]
    # Replies of different lengths: the decode batch shrinks from 8 to 1 along the run.
    params = [SamplingParams(max_tokens=12 + 6 * i, temperature=0.7, seed=i)
              for i in range(len(prompts))]
    trace = record(engine, prompts, params)
    path = trace.save(out)
    print(f"{path}: {len(trace.frames)} steps, {trace.duration:.1f} s recorded, "
          f"{path.stat().st_size / 1024:.0f} KiB")
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
