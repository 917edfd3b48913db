"""`workbench tune`: the command's arguments and its run (workbench/cli.py registers it).

    workbench tune --model smollm2 --device cpu --request-rate 2 --num-requests 24 \\
        --ttft-ms 2000 --tpot-ms 100 --knob max_num_seqs=4,16,64 --knob block_size --trials 8
"""
from __future__ import annotations

import argparse
import json
import sys

from ..config import TUNABLE, EngineConfig


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI integers, got {text!r}") from None


def add_parser(sub, engine_args, engine_kwargs) -> argparse.ArgumentParser:
    """Register `workbench tune` under `sub` (workbench/cli.py's subparsers): the engine's
    arguments (`engine_args`, which make the base config the search starts from; read back
    with `engine_kwargs`), then the workload, the SLO and the search."""
    p = sub.add_parser("tune", help="search the engine's knobs for the most goodput under a "
                                    "p99 TTFT/TPOT objective (successive halving)")
    engine_args(p)
    add_arguments(p)
    p.set_defaults(func=lambda a: run(a, engine_kwargs(a)))
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tune-specific arguments."""
    w = p.add_argument_group("workload")
    how = w.add_mutually_exclusive_group()
    how.add_argument("--request-rate", type=float, default=None,
                     help="open loop: Poisson arrivals, requests/s")
    how.add_argument("--concurrency", type=int, default=None,
                     help="closed loop: requests in flight (default 8 when no rate is given)")
    w.add_argument("--num-requests", type=int, default=24,
                   help="requests in the last rung's run (earlier rungs run fewer)")
    w.add_argument("--input-len", type=_range, default=(32, 256), help="prompt tokens LO:HI")
    w.add_argument("--output-len", type=_range, default=(16, 128), help="output tokens LO:HI")
    w.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens every prompt starts with (what prefix caching can serve)")
    w.add_argument("--trace", default=None, metavar="FILE",
                   help="take prompt and output lengths from a recorded trace's requests")
    s = p.add_argument_group("service-level objective (p99)")
    s.add_argument("--ttft-ms", type=float, required=True)
    s.add_argument("--tpot-ms", type=float, required=True)
    s.add_argument("--e2e-ms", type=float, default=None)
    t = p.add_argument_group("search")
    t.add_argument("--knob", action="append", default=None, metavar="NAME[=V1,V2,...]",
                   help="a knob to search and its values (repeat; a bare name takes its "
                        f"default domain; default: all of {', '.join(TUNABLE)})")
    t.add_argument("--trials", type=int, default=8)
    t.add_argument("--eta", type=int, default=3, help="successive halving keeps 1/eta per rung")
    t.add_argument("--trial-timeout", type=float, default=120.0, metavar="S",
                   help="cut a trial after S seconds (what is unfinished is not served)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--output", default="", help="write the result as JSON here")


def run(a, engine_kwargs: dict) -> int:
    from .search import Trial
    from .slo import SLO
    from .space import Space
    from .tuner import tune
    from .workload import Workload
    base = EngineConfig(model=a.model or "smollm2", **engine_kwargs)
    concurrency = a.concurrency if a.request_rate is not None or a.concurrency else 8
    if a.request_rate is not None:
        concurrency = None
    if a.trace:
        workload = Workload.from_trace(a.trace, request_rate=a.request_rate,
                                       concurrency=concurrency, num_requests=a.num_requests,
                                       seed=a.seed)
    else:
        workload = Workload(num_requests=a.num_requests, request_rate=a.request_rate,
                            concurrency=concurrency, prompt_len=a.input_len,
                            output_len=a.output_len, shared_prefix_len=a.shared_prefix,
                            seed=a.seed)
    slo = SLO(ttft_ms=a.ttft_ms, tpot_ms=a.tpot_ms, e2e_ms=a.e2e_ms)
    space = Space.parse(a.knob, base.device) if a.knob else Space.default(base.device)

    def progress(trial: Trial, done: int, total: int) -> None:
        what = (f"goodput {trial.measurement.goodput:.3f} req/s" if trial.ok
                else f"failed: {trial.error}")
        print(f"[{done}/{total}] rung {trial.rung}, {trial.budget} requests: {what} "
              f"({trial.seconds:.1f} s)", file=sys.stderr, flush=True)

    print(f"tuning {base.model} for {slo.describe()} on {workload.describe()}",
          file=sys.stderr, flush=True)
    result = tune(workload, slo, space, base=base, n_trials=a.trials, eta=a.eta,
                  trial_time_limit=a.trial_timeout, seed=a.seed, progress=progress)
    print(result.format())
    if a.output:
        with open(a.output, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0 if result.winner is not None else 1
