"""What logprobs cost: decode throughput of a 64-request batch with and without top-5
logprobs (issue 12's target: at most 10 % of decode throughput on the CPU).

    PYTHONPATH=. python benchmarks/logprobs_cost.py [--rounds 3] [--out docs/logprobs-cpu.json]

Both variants run on one engine, interleaved round by round, with the same prompts; only
decode-phase steps count (the prefill is the same work in both). This machine's speed drifts
by tens of percent from one run to the next, so the run also times the logprobs work itself
inside the steps of a logprobs run (the batched log_softmax/top-k/ranks, and building each
token's {id: Logprob}) and reports it as a share of those same steps' time: that share does
not drift with the machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time

import torch

from workbench import Engine, SamplingParams
from workbench.executor import sampler


def timed_share(engine: Engine, prompts, params) -> tuple[float, float]:
    """Seconds of decode steps and, within them, of logprobs work, for one run."""
    spent = [0.0]

    def timing(f):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper
    saved = sampler.compute_logprobs, sampler.LogprobsTensors.row
    sampler.compute_logprobs = timing(saved[0])
    sampler.LogprobsTensors.row = timing(saved[1])
    try:
        engine.telemetry.clear()
        engine.generate(prompts, params)
    finally:
        sampler.compute_logprobs, sampler.LogprobsTensors.row = saved
    steps, _ = engine.telemetry.snapshot()
    dec = [s for s in steps if s.phase == "decode"]
    # Logprobs work in the prefill step (its one sampled row each) is left in: an upper bound.
    return sum(s.duration for s in dec), spent[0]


def decode_rate(engine: Engine, prompts, params) -> tuple[float, int]:
    engine.telemetry.clear()
    engine.generate(prompts, params)
    steps, _ = engine.telemetry.snapshot()
    dec = [s for s in steps if s.phase == "decode"]
    return sum(s.num_decode_tokens for s in dec) / sum(s.duration for s in dec), len(dec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    engine = Engine(model=a.model, device="cpu", max_num_seqs=a.requests)
    r = random.Random(0)
    vocab = engine.info().vocab_size
    prompts = [[r.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    base = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True, logprobs=a.top)
    engine.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0))   # warm-up
    rows = []
    for i in range(a.rounds):
        for name, p in (("plain", base), (f"logprobs={a.top}", with_lp)):
            rate, n = decode_rate(engine, prompts, p)
            rows.append({"round": i, "variant": name, "decode_tok_s": rate, "decode_steps": n})
            print(f"round {i} {name:12s} {rate:8.1f} decode tok/s over {n} steps", flush=True)
    dec_s, lp_s = timed_share(engine, prompts, with_lp)
    share = lp_s / dec_s
    print(f"logprobs work inside a logprobs run: {1e3 * lp_s:.0f} ms of {dec_s:.1f} s of decode "
          f"steps = {100 * share:.1f} %")
    plain = sum(x["decode_tok_s"] for x in rows if x["variant"] == "plain") / a.rounds
    lp = sum(x["decode_tok_s"] for x in rows if x["variant"] != "plain") / a.rounds
    cost = 1 - lp / plain
    print(f"mean: plain {plain:.1f}, logprobs {lp:.1f} decode tok/s; cost {100 * cost:.1f} %")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
                       "torch": torch.__version__, "args": vars(a), "rounds": rows,
                       "plain_tok_s": plain, "logprobs_tok_s": lp, "cost": cost,
                       "logprobs_work_s": lp_s, "decode_steps_s": dec_s, "work_share": share},
                      f, indent=1)


if __name__ == "__main__":
    main()
