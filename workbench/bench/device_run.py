"""What the device scripts share (benchmarks/gpu.py, benchmarks/npu.py): a call on a lent
machine is scarce, so it runs every part in one go, each part's figures come back as soon as
the part ends, and a part that fails costs only itself.

- `DeviceRun`: the call's results, one JSON line per part (printed, and appended to
  DIR/<script>.jsonl at once, so a call cut short still returns what finished), the two
  ways of guarding a part, the device's timer and the closing table.
- The workloads both scripts run: W1's shape, prompts drawn as gpu_anchor.py draws them
  (the HF peers' script, so both sides run the same requests), batch 1's prompt.
- The bf16 rule: our error against an fp32 reference, within twice HF bf16's own.
"""
from __future__ import annotations

import json
import random
import sys
import time
import traceback
from functools import cached_property
from pathlib import Path


class DeviceRun:
    """One call of a device script: `name` names its JSON lines file, `device` the platform
    its timer synchronizes (built at the first timing, so a script whose device is missing
    still runs the parts that say so)."""

    def __init__(self, name: str, device: str):
        self.name, self.device = name, device
        self.results: dict[str, dict] = {}
        """Each part's line by its name, in the order they ended."""
        self.path: Path | None = None
        """Where the lines are appended (set by `write_to`); None: printed only."""

    def write_to(self, folder: str | Path | None) -> None:
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.path = Path(folder) / f"{self.name}.jsonl"

    def emit(self, part: str, **kw) -> None:
        """One part's line: kept for the table, printed, and appended to the file now."""
        self.results[part] = kw
        line = json.dumps({"part": part, **kw}, default=str)
        print(line, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def get(self, part: str, *keys):
        """results[part][k1][k2]...; None where any of it is missing."""
        v = self.results.get(part, {})
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    # ---- guarding a part: whatever it raises, the call goes on ---------------------------
    def guarded(self, part: str, fn, *a) -> None:
        """Run `fn(*a)`, a part that emits its own lines as it measures (gpu.py's): one
        that raises adds a line `<part>_error` with the error (the lines it emitted before
        stay), its traceback goes to stderr, and the part's seconds to stdout."""
        seconds, error, tb = _attempt(fn, *a)
        if error is not None:
            self.emit(part + "_error", error=error)
            print(tb, end="", file=sys.stderr, flush=True)
        print(f"# {part}: {seconds:.1f} s", flush=True)

    def checked(self, part: str, fn, *a) -> None:
        """Run `fn(out, *a)`, a part that fills the dict `out` (npu.py's), and emit `out` as
        the part's one line: ok when it ran and every check it lists in out['checks'] holds
        ('a.b' reads out['a']['b']), `failed` naming those that did not; a part that raised
        keeps what it measured before, with the error and the traceback's end."""
        out: dict = {}
        seconds, error, tb = _attempt(fn, out, *a)
        checks = out.pop("checks", [])
        failed = [] if error is not None else [k for k in checks if not _holds(out, k)]
        if error is not None:
            out.update(error=error, traceback=tb[-2000:])
        out["seconds"] = round(seconds, 1)
        self.emit(part, **{"ok": error is None and not failed,
                           **({"failed": failed} if failed else {}),
                           **{k: v for k, v in out.items() if k != "ok"}})

    # ---- timing ----------------------------------------------------------------------------
    @cached_property
    def platform(self):
        from ..platforms import get_platform
        return get_platform(self.device)

    def sync(self) -> None:
        """Wait for the device's queued work (before and after a wall-clock measurement)."""
        self.platform.synchronize()

    def timed(self, fn, reps: int) -> float:
        """Seconds one call of `fn` takes on the device: the roofline's measurement
        (Platform.best_time, which also says how it differs from the in-graph timer)."""
        return self.platform.best_time(fn, reps)

    # ---- the closing table -----------------------------------------------------------------
    @staticmethod
    def print_table(rows: list[tuple[str, object]], width: int) -> None:
        """Figure names padded to `width`, then their values: the summary a person reads
        after the JSON lines."""
        print("\n" + "\n".join(f"{k:<{width}} {v}" for k, v in rows), flush=True)


def _attempt(fn, *a) -> tuple[float, str | None, str | None]:
    """Call fn(*a): (seconds it took, the error in a line or None, the traceback's end)."""
    t = time.perf_counter()
    try:
        fn(*a)
        return time.perf_counter() - t, None, None
    except Exception as e:
        return (time.perf_counter() - t, f"{type(e).__name__}: {e}"[:800],
                traceback.format_exc(limit=6))


def _holds(out: dict, key: str) -> bool:
    """'a.b' looks up out['a']['b']."""
    for name in key.split("."):
        out = out.get(name) if isinstance(out, dict) else None
    return bool(out)


# ---- the workloads -----------------------------------------------------------------------------
def w1_shape(small: bool, toy: int = 16) -> tuple[int, int, int, int]:
    """W1, the platform issue's throughput workload: (requests, shortest prompt, longest
    prompt, new tokens), 256 requests of prompts uniform in [100, 1024] tokens and 512 new
    tokens each; `small`: `toy` requests of prompts in [100, 200] and `toy` new tokens."""
    return (toy, 100, 200, toy) if small else (256, 100, 1024, 512)


def anchor_workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Exactly gpu_anchor.py's draw: per request a length uniform in [lo, hi], then its token
    ids (10 up to vocab), from random.Random(seed)."""
    r = random.Random(seed)
    return [[r.randrange(10, vocab) for _ in range(r.randint(lo, hi))] for _ in range(n)]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` token ids each (10 up to vocab), from random.Random(seed)."""
    r = random.Random(seed)
    return [[r.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def b1_prompt(vocab: int) -> list[int]:
    """Batch 1's prompt, as every batch-1 figure so far was measured: 128 tokens of one id,
    the first draw of random.Random(2) (the scripts drew each id from a new Random(2)).
    Decode's cost depends on the context's length, not on which ids fill it."""
    return [random.Random(2).randrange(10, vocab)] * 128


# ---- the bf16 rule -----------------------------------------------------------------------------
def rel_err(x, ref) -> float:
    """|x - ref| / |ref| (2-norms), x brought to ref's device."""
    return float((x.to(ref.device) - ref).norm() / ref.norm())


def within_bf16_error(ours: float, hf_bf16: float, floor: float = 2e-2) -> bool:
    """Our bf16 error against fp32 is fine when within twice HF bf16's own on the same
    thing, or under `floor` (a tiny random model can leave HF's error near zero)."""
    return ours <= max(2 * hf_bf16, floor)
