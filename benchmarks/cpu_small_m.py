"""A few rows through SmolLM2's linear layers on the CPU: torch's F.linear against the
kernel's small_m_linear (each weight row read once for all M rows) and the batch-1 GEMV, at
M = 1, 2, 4, 5, 8, 16, fp32 and bf16; then the engine-level figure the speed-up of
speculative decoding rests on (issue 40): SmolLM2 fp32 (`quantization=None`), the step time
of a 5-token chunk of one request whose context is cached, against a batch-1 decode step,
with small_m_linear off (before) and on (after), A and B alternating in one run.

Every figure is the minimum over interleaved rounds (each candidate once a round, so that
another process's load hits all alike): the machine is shared.

    flock /tmp/bench.lock python benchmarks/cpu_small_m.py [--rounds 15] [--threads 2]
        [--no-engine]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = ((576, 576), (192, 576), (3072, 576), (576, 1536), (49152, 576))
"""SmolLM2-135M's [N, K]: q and o, k and v, gate_up, down, the LM head."""
ROWS = (1, 2, 4, 5, 8, 16)


def best_of(calls: dict[str, callable], rounds: int) -> dict[str, float]:
    """Name -> ms, the minimum over `rounds` interleaved rounds after one warm-up."""
    best = dict.fromkeys(calls, float("inf"))
    for i in range(rounds + 1):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            if i:
                best[name] = min(best[name], time.perf_counter() - t0)
    return {n: t * 1e3 for n, t in best.items()}


def kernels_table(k, rounds: int) -> None:
    from workbench.platforms.cpu_ops import CpuOps
    ops = CpuOps()
    g = torch.Generator().manual_seed(0)
    print(f"{'dtype':8} {'N x K':>11} {'M':>3} {'F.linear':>9} {'torch path':>10} "
          f"{'small_m':>8} {'gemv M=1':>9} {'F.lin/sm':>8} {'sm/gemv':>8}")
    for dt in (torch.float32, torch.bfloat16):
        for n, kk in SHAPES:
            w = (torch.randn(n, kk, generator=g) * 0.02).to(dt)
            x1 = torch.randn(1, kk, generator=g).to(dt)
            xs = {m: torch.randn(m, kk, generator=g).to(dt) for m in ROWS}
            calls = {"gemv": lambda: k.gemv(x1, w, None)}
            for m, x in xs.items():
                calls[f"F {m}"] = lambda x=x: F.linear(x, w)
                calls[f"torch {m}"] = lambda x=x: ops.batched_linear(x, w)
                if m > 1:
                    calls[f"sm {m}"] = lambda x=x: k.small_m_linear(x, w, None)
            ms = best_of(calls, rounds)
            for m in ROWS:
                sm = ms.get(f"sm {m}", ms["gemv"])
                print(f"{str(dt)[6:]:8} {f'{n}x{kk}':>11} {m:>3} {ms[f'F {m}']:9.3f} "
                      f"{ms[f'torch {m}']:10.3f} {sm:8.3f} {ms['gemv']:9.3f} "
                      f"{ms[f'F {m}'] / sm:8.2f} {sm / ms['gemv']:8.2f}", flush=True)


def engine_steps(rounds: int, chunk: int = 5) -> None:
    """A batch-1 decode step and a `chunk`-token step of one request with cached context
    (a prompt whose first blocks the prefix cache holds: the step computes `chunk` tokens
    against them, as a verify step of `chunk - 1` drafted tokens does; its LM head runs on
    the last row only, a verify step's on all `chunk`), small_m_linear off and on."""
    from workbench import Engine, SamplingParams
    from workbench.platforms import cpu_ops
    e = Engine(model="smollm2", device="cpu", dtype="float32", quantization=None,
               async_scheduling=False)
    try:
        bs = e.info().block_size
        g = torch.Generator().manual_seed(1)
        ctx = torch.randint(100, 40000, (8 * bs,), generator=g).tolist()
        e.generate([ctx], SamplingParams(max_tokens=1, temperature=0))   # cache the context
        measured = dict(cpu_ops.SMALL_M_ROWS or {})
        if not measured:
            cpu_ops.small_m_rows(torch.float32)
            measured = dict(cpu_ops.SMALL_M_ROWS or {})
        print(f"\nsmall_m_linear's measured rows here: {measured}", flush=True)
        settings = {"before": {"float32": 0, "bfloat16": 0},
                    "after": {"float32": 16, "bfloat16": 16}}
        best = {f"{w} {s}": float("inf") for s in settings for w in ("decode", "chunk")}
        for i in range(rounds + 1):
            for s, rows in settings.items():
                cpu_ops.SMALL_M_ROWS = rows
                # the chunk: new tokens after the cached context, one step
                tail = torch.randint(100, 40000, (chunk,), generator=g).tolist()
                e.add_request(ctx + tail, SamplingParams(max_tokens=4, temperature=0,
                                                         ignore_eos=True))
                times = []
                while e.has_unfinished_requests():
                    t0 = time.perf_counter()
                    e.step()
                    times.append(time.perf_counter() - t0)
                if i:
                    best[f"chunk {s}"] = min(best[f"chunk {s}"], times[0])
                    best[f"decode {s}"] = min([best[f"decode {s}"], *times[1:]])
        cpu_ops.SMALL_M_ROWS = measured
        print(f"engine (SmolLM2 fp32, {len(ctx)} cached tokens, min of {rounds} interleaved "
              f"rounds, {torch.get_num_threads()} threads), ms:")
        for s in settings:
            d, c = best[f"decode {s}"] * 1e3, best[f"chunk {s}"] * 1e3
            print(f"  {s:6} decode step {d:7.2f}  {chunk}-token chunk step {c:7.2f}  "
                  f"chunk/decode {c / d:5.2f}")
    finally:
        e.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--no-kernels", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from workbench.platforms import cpu_kernels
    cpu_kernels.ensure_kernel_built(lambda s: print(s, file=sys.stderr))
    k = cpu_kernels.kernels()
    if not (k and hasattr(k, "small_m_linear")):
        print("the kernel (with small_m_linear) is not built here", file=sys.stderr)
        return 1
    print(f"threads {torch.get_num_threads()}; kernel ISA {k.isa()}; ms, the minimum of "
          f"{a.rounds} interleaved rounds; 'torch path': CpuOps.batched_linear")
    with torch.inference_mode():
        if not a.no_kernels:
            kernels_table(k, a.rounds)
    if not a.no_engine:
        engine_steps(a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
