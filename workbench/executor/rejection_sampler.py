"""Verifying drafted tokens exactly (vLLM's RejectionSampler; Leviathan et al. 2023, Chen et
al. 2023), for drafts whose distribution q is one-hot (n-gram lookup and a greedy draft
model both propose one token per position).

A verify step gives a request m = 1 + d logits rows: row j is the target's distribution p_j
for the token after the decode's token and drafts x_0 .. x_{j-1}. Each p_j is what plain
decoding would sample from at that position: the same filters and processors, with the
drafts before it as history (sampler.target_probs, one SamplingMetadata row per position).
Draft x_j is accepted with probability p_j(x_j) (q one-hot: min(1, p/q) = p(x)); at the
first rejection the token is drawn from p_j with x_j removed and renormalised (the residual
max(p - q, 0)); when every draft is accepted, a bonus token is drawn from p_d. So each
kept token has the target's distribution, whatever was drafted. A greedy row's p is one-hot
at its argmax: accepted while the drafts equal the argmax, then the argmax (no randomness).

Randomness: a sampled request draws 2m - 1 uniforms per step, m - 1 to accept and m to
draw, from its own generator when seeded (in row order, so its tokens depend on nothing
else in the batch) or else from the step's shared one.
"""
from __future__ import annotations

import torch

from .sampler import LogprobsTensors, _search, compute_logprobs, target_probs
from .sampling_metadata import SamplingMetadata


def accept(u: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """Which drafts stay: a one-hot q accepts draft x with probability p(x) (min(1, p/q))."""
    return u < p_draft


def residual(probs: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """What a rejected position draws from: max(p - q, 0), with q one-hot at the draft: p
    without the draft (the draw renormalises it)."""
    return probs.index_put((rows, drafts), torch.zeros_like(drafts, dtype=probs.dtype))


def rejection_sample(logits: torch.Tensor, md: SamplingMetadata, spans: list[tuple[int, int]],
                     drafts: list[list[int]], greedy: list[bool],
                     generators: list[torch.Generator | None],
                     shared: torch.Generator | None = None
                     ) -> tuple[list[list[int]], LogprobsTensors | None, list[int]]:
    """md: one row per position of each request (`spans[i]` = (first row, m) of request
    i, with drafts[i] its m - 1 drafts). Returns each request's kept tokens (accepted
    drafts, then the target's own), the logprobs of md's rows (row first + j: request i's
    j-th kept token) when a row asks, and how many drafts each request had accepted."""
    probs, raw = target_probs(logits, md)
    dev = probs.device
    n = probs.shape[0]
    u_accept = torch.full((n,), 0.5, device=dev)
    u_draw = torch.full((n,), 0.5, device=dev)
    for (a, m), g, gen in zip(spans, greedy, generators):
        if g:
            continue
        u = torch.rand(2 * m - 1, device=dev, generator=gen if gen is not None else shared)
        u_accept[a:a + m - 1] = u[:m - 1]
        u_draw[a:a + m] = u[m - 1:]
    d_rows = [a + j for (a, _), x in zip(spans, drafts) for j in range(len(x))]
    d_ids = [t for x in drafts for t in x]
    rest, kept = probs, []
    if d_rows:
        r = torch.tensor(d_rows, device=dev)
        t = torch.tensor(d_ids, device=dev)
        kept = accept(u_accept[r], probs[r, t]).tolist()
        rest = residual(probs, r, t)
    cum = rest.cumsum(-1)
    own = _search(cum, cum[:, -1], u_draw).tolist()
    tokens, num_accepted, at = [], [], 0
    for (a, m), x in zip(spans, drafts):
        out = []
        for j, tok in enumerate(x):
            if not kept[at + j]:
                break
            out.append(tok)
        at += len(x)
        num_accepted.append(len(out))
        out.append(own[a + len(out)])
        tokens.append(out)
    lp = None
    if md.max_num_logprobs is not None:
        ids = [0] * n
        for (a, _), out in zip(spans, tokens):
            ids[a:a + len(out)] = out
        lp = compute_logprobs(raw, torch.tensor(ids, device=dev), md.max_num_logprobs)
    return tokens, lp, num_accepted
