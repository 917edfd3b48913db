"""Speculative decoding on a modelled device (issue 40): everything but the proposer's tokens
and the target's verdict is the real engine's (engine/speculative.py's SpecDecoding drafts
before each step, with its room, its pause after a miss and disable_by_batch_size; the
scheduler counts the drafts in the step's budget and allocates and gives back their KV; the
pipeline hands out the kept tokens and records them in telemetry).

What a modelled device cannot know is how many drafts the target would accept: its tokens
are random. So it takes that from a real run of the same proposer on the workload
(SpeculativeConfig.acceptance, made by `acceptance_of` here from a real engine that ran the
workload, or from a trace of one) and
draws each verify's accepted count from it:

- The rate measured is vLLM's: accepted drafts / drafted ones, alpha.
- A verify of d drafts accepts them in order, each (while the ones before it were accepted)
  with the same probability b_d, the b for which the expected share accepted,
  (b + b^2 + ... + b^d) / d, is alpha. So over many verifies, whatever their lengths, the
  share of drafted tokens accepted converges to the measured alpha, and within one verify
  the accepted run is geometric (as where each token agrees with the target independently).
- Draws come from the runner's seeded generator (EngineConfig.seed): the same engine seed
  and requests draw the same acceptances.

The proposer (ModelledProposer) drafts random tokens (never EOS) when SpecDecoding asks,
as often and as many as the real run's did where it counted them: a draft for a request
asked with the measured share (num_drafted / num_asked: an n-gram lookup that finds no
earlier occurrence drafts nothing, and the request decodes plainly), of the measured mean
length (num_draft_tokens / num_drafts, its two neighbouring integers mixed to that mean, at
most k). Where they were not counted (a trace's steps do not hold num_asked), a draft of k
for every request asked, and the engine's notice says so.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np


@lru_cache(maxsize=None)
def position_rate(alpha: float, d: int) -> float:
    """b with (b + b^2 + ... + b^d) / d = alpha (bisection: the left side grows with b)."""
    if alpha <= 0 or alpha >= 1:
        return min(max(alpha, 0.0), 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        b = (lo + hi) / 2
        if sum(b ** j for j in range(1, d + 1)) / d < alpha:
            lo = b
        else:
            hi = b
    return (lo + hi) / 2


def draw_accepted(rng: np.random.Generator, alpha: float, d: int) -> int:
    """How many of d drafts the target accepts (its first ones), drawn as described above."""
    b = position_rate(alpha, d)
    n = 0
    while n < d and rng.random() < b:
        n += 1
    return n


class ModelledProposer:
    """Drafts as the module's docstring says (a Proposer, spec_decode/__init__.py): with
    probability `share` (None: always), `length` tokens on average (None: k), drawn by
    `tokens(n)` (the modelled runner's: random, never an EOS id) from `rng` (its seeded
    generator). Its drafts are picked, never drawn."""

    draws = False
    longest_catch_up = 0

    def __init__(self, k: int, tokens: Callable[[int], list[int]], rng: np.random.Generator,
                 share: float | None = None, length: float | None = None):
        self.k = k
        self.tokens = tokens
        self.rng = rng
        self.share = share
        self.length = None if length is None else min(max(length, 1.0), float(k))
        self.draft_probs: dict = {}

    def propose(self, reqs: list[tuple[str, list[int]]], rows=None,
                shared=None) -> list[list[int]]:
        out = []
        for _ in reqs:
            if self.share is not None and self.rng.random() >= self.share:
                out.append([])
                continue
            n = self.k
            if self.length is not None:
                lo = int(self.length)
                n = lo + (self.rng.random() < self.length - lo)
            out.append(self.tokens(n))
        return out

    def free(self, req_id: str) -> None:
        """Nothing is kept per request."""


# ---- measuring it ------------------------------------------------------------------------------
def acceptance_of(run, source: str | None = None) -> dict:
    """The acceptance a real run measured, as SpeculativeConfig's `acceptance` takes it: `run`
    is a real Engine (its telemetry's spec_decode totals), a recorded Trace (its steps'
    drafts and accepted counts) or a telemetry.spec_decode figure (SpecDecodeCounts, or its
    dict). `source` says where it came from (the default names the engine or the trace)."""
    info = None
    if hasattr(run, "frames"):                       # a Trace
        steps = [f.step for f in run.frames]
        counts = {"num_draft_tokens": sum(s.num_draft_tokens for s in steps),
                  "num_accepted_tokens": sum(s.num_accepted_tokens for s in steps),
                  "num_drafts": sum(len(s.drafts) for s in steps)}
        info, what = run.info, f"a recorded trace of {len(run.requests)} requests"
    else:
        if hasattr(run, "telemetry"):                # an Engine
            what = f"a real run of {run.telemetry.num_requests} requests"
            info, run = run.info(), run.telemetry.spec_decode
        else:
            what = "telemetry.spec_decode"
        get = run.get if isinstance(run, dict) else lambda k: getattr(run, k, None)
        counts = {k: get(k) for k in ("num_draft_tokens", "num_accepted_tokens", "num_drafts",
                                      "num_asked", "num_drafted")}
    n = counts["num_draft_tokens"]
    if info is not None:
        if info.modelled:
            raise ValueError("acceptance_of: this run is on a modelled device, whose "
                             "acceptance is the one it was given; measure on a real device")
        if source is None:
            sc = info.config.speculative_config or {}
            source = (f"{what}: {info.model} on {info.device_name}, speculative_config "
                      + ", ".join(f"{k}={v}" for k, v in sc.items() if k != "acceptance"))
    if not n:
        raise ValueError("acceptance_of: the run drafted no tokens (speculative decoding off, "
                         "or no request decoded past its first token), so it measured no "
                         "acceptance")
    out = {k: int(v) for k, v in counts.items() if v is not None}
    if not out.get("num_asked"):
        out.pop("num_asked", None), out.pop("num_drafted", None)
    return {**out, "source": source or what}
