"""The sampling step, for the lesson in notebook 02: a prompt's next-token distribution as the
engine computes it, what temperature, top-k, min-p and top-p keep of it (the sampler's rules,
worked in float64 on the distribution's head), and draws from the real engine to hold the two
together.

The head is the engine's own top-20 raw log-probabilities (`SamplingParams.logprobs`, OpenAI's
cap), which hold nearly all the mass for a prompt with a likely continuation. The lesson samples
with `top_k=HEAD` added, so the engine draws from exactly the tokens shown and the kept sets
computed here are the engine's: the same order (temperature; top-k and min-p; then top-p over
the mass they keep; the most likely token always stays), the same renormalisation."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.sampling_params import MAX_LOGPROBS, SamplingParams

HEAD = MAX_LOGPROBS
"""Tokens of the distribution the lesson shows and samples from (top_k=HEAD)."""


@dataclass
class NextToken:
    """The most likely next tokens of a prompt, most likely first."""
    token_ids: list[int]
    texts: list[str]
    probs: list[float]
    """Their raw probabilities (softmax of the logits at temperature 1, no filter)."""

    @property
    def head_mass(self) -> float:
        """How much of the whole vocabulary's probability these tokens hold."""
        return sum(self.probs)


def next_token(engine, prompt, k: int = HEAD) -> NextToken:
    """The engine's raw distribution of the token after `prompt`: its top `k` tokens."""
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=k))[0]
    ranked = sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: -kv[1].logprob)[:k]
    return NextToken([t for t, _ in ranked], [lp.decoded_token or "" for _, lp in ranked],
                     [math.exp(lp.logprob) for _, lp in ranked])


def kept(dist: NextToken, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
         min_p: float = 0.0) -> list[float]:
    """The probability each of `dist`'s tokens is drawn with under these settings (0 for the
    ones the filters drop), renormalised over what they keep: the sampler's rules on the
    head alone (sampling with top_k <= len(dist.probs)). Temperature 0 is greedy."""
    n = len(dist.probs)
    if temperature == 0:
        return [1.0] + [0.0] * (n - 1)
    # p_i^(1/T), scaled so the top token's is 1 (what the sampler computes from the logits).
    w = [math.exp((math.log(p) - math.log(dist.probs[0])) / temperature) for p in dist.probs]
    k = top_k if 0 < top_k < n else n
    w = [x if i < k and x >= min_p else 0.0 for i, x in enumerate(w)]   # min-p: against the top's
    mass = sum(w)
    if top_p < 1.0:                    # the smallest prefix whose mass reaches top_p of the kept
        seen = 0.0
        for i, x in enumerate(w):
            if seen >= top_p * mass:
                w[i] = 0.0
            seen += x
    total = sum(w)
    return [x / total for x in w]


def draws(engine, prompt, params: SamplingParams, n: int = 20, seed: int = 0) -> list[int]:
    """The first token of `n` requests for `prompt` with `params` (plus top_k=HEAD, so the
    engine draws from the head shown), seeded seed, seed + 1, ...: one batch."""
    from dataclasses import replace
    k = HEAD if not 0 < params.top_k < HEAD else params.top_k
    ps = [replace(params, max_tokens=1, top_k=k, seed=seed + i) for i in range(n)]
    return [o.token_ids[0] for o in engine.generate([prompt] * n, ps)]
