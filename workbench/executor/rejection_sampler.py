"""Verifying drafted tokens exactly (vLLM's RejectionSampler; Leviathan et al. 2023, Chen et
al. 2023). A draft comes from a distribution q: one-hot where the proposer picks one token
(n-gram lookup; a draft model for a greedy request), or the draft model's own filtered
distribution, which it drew the token from, for a sampled request (its rows given as
`draft_probs`).

A verify step gives a request m = 1 + d logits rows: row j is the target's distribution p_j
for the token after the decode's token and drafts x_0 .. x_{j-1}. Each p_j is what plain
decoding would sample from at that position: the same filters and processors, with the
drafts before it as history (sampler.target_probs, one SamplingMetadata row per position).
Draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)) (one-hot q: p_j(x_j));
at the first rejection the token is drawn from the residual max(p_j - q_j, 0), renormalised
(one-hot q: p_j without x_j); when every draft is accepted, a bonus token is drawn from p_d.
So each kept token has the target's distribution, whatever was drafted; the nearer q is to
p, the more drafts stay (a greedy draft of a sampled request is kept at p(x) only). A greedy
row's p is one-hot at its argmax: accepted while the drafts equal the argmax, then the
argmax (no randomness, and no dense row: the argmax alone is computed).

Randomness: a sampled request draws 2m - 1 uniforms per step, m - 1 to accept and m to
draw, from its own generator when seeded (in row order, so its tokens depend on nothing
else in the batch) or else from the step's shared one.
"""
from __future__ import annotations

import torch

from .sampler import LogprobsTensors, TargetProbs, _search, compute_logprobs, target_probs
from .sampling_metadata import SamplingMetadata


def accept(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """Which drafts stay: draft x with probability min(1, p(x) / q(x)) (u < 1 uniform; q(x)
    is 1 for a one-hot q, and never 0 for a drawn x)."""
    return u * q_draft < p_draft


def residual(probs: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor,
             q_rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected position draws from: max(p - q, 0) (the draw renormalises it), in
    `probs`' place. Draft rows `rows` (their drafts `drafts`) have a one-hot q: p without
    the draft; rows `q_rows` have q's dense rows `q`."""
    p = probs.index_select(0, q_rows) if len(q_rows) else None       # before the one-hots
    rest = probs.index_put_((rows, drafts), torch.zeros_like(drafts, dtype=probs.dtype))
    if p is not None:
        left = (p - q).clamp_(min=0.0)
        # p <= q everywhere (q is p, but for rounding) leaves nothing: such a row is all but
        # never rejected; where it is, it draws from p.
        rest.index_copy_(0, q_rows, torch.where(left.sum(-1, keepdim=True) > 0, left, p))
    return rest


def rejection_sample(logits: torch.Tensor, md: SamplingMetadata, spans: list[tuple[int, int]],
                     drafts: list[list[int]], greedy: list[bool],
                     generators: list[torch.Generator | None],
                     shared: torch.Generator | None = None,
                     draft_probs: list[torch.Tensor | None] | None = None
                     ) -> tuple[list[list[int]], LogprobsTensors | None, list[int]]:
    """md: one row per position of each request (`spans[i]` = (first row, m) of request
    i, with drafts[i] its m - 1 drafts; draft_probs[i]: the [m - 1, vocab] distributions
    they were drawn from, None: one-hot). Returns each request's kept tokens (accepted
    drafts, then the target's own), the logprobs of md's rows (row first + j: request i's
    j-th kept token) when a row asks, and how many drafts each request had accepted."""
    t = target_probs(logits, md)
    top = t.top.tolist() if t.top is not None else None
    n = t.raw.shape[0]
    # A greedy request keeps its drafts while they are the argmax, then the argmax.
    tokens: list[list[int]] = []
    for (a, m), x, g in zip(spans, drafts, greedy):
        out = []
        if g:
            for j, tok in enumerate(x):
                if tok != top[a + j]:
                    break
                out.append(tok)
            out.append(top[a + len(out)])
        tokens.append(out)
    if t.rows is not None:
        _sample_drawn(t, spans, drafts, greedy, generators, shared, draft_probs, tokens)
    num_accepted = [len(out) - 1 for out in tokens]
    lp = None
    if md.max_num_logprobs is not None:
        ids = [0] * n
        for (a, _), out in zip(spans, tokens):
            ids[a:a + len(out)] = out
        lp = compute_logprobs(t.raw, torch.tensor(ids, device=t.raw.device),
                              md.max_num_logprobs)
    return tokens, lp, num_accepted


def _sample_drawn(t: TargetProbs, spans, drafts, greedy, generators, shared, draft_probs,
                  tokens: list[list[int]]) -> None:
    """The sampled requests' kept tokens, into `tokens` (their rows are t.rows, in order)."""
    probs = t.probs
    dev = probs.device
    local = {row: i for i, row in enumerate(t.rows.tolist())}   # md row -> row of probs
    u_accept = torch.full((len(local),), 0.5, device=dev)
    u_draw = torch.full((len(local),), 0.5, device=dev)
    d_rows, d_ids, q_rows, qs = [], [], [], []
    for (a, m), x, g, gen, q in zip(spans, drafts, greedy, generators,
                                    draft_probs or [None] * len(spans)):
        if g:
            continue
        b = local[a]                       # a request's rows draw together, in order
        u = torch.rand(2 * m - 1, device=dev, generator=gen if gen is not None else shared)
        u_accept[b:b + m - 1] = u[:m - 1]
        u_draw[b:b + m] = u[m - 1:]
        d_rows += range(b, b + len(x))
        d_ids += x
        if q is not None:
            q_rows += range(b, b + q.shape[0])
            qs.append(q)
    kept, rest = [], probs
    if d_rows:
        r = torch.tensor(d_rows, device=dev)
        tok = torch.tensor(d_ids, device=dev)
        p_at = probs[r, tok]
        q_at = torch.ones_like(p_at)
        qr = torch.tensor(q_rows, dtype=torch.long, device=dev)
        q = torch.cat(qs).to(probs) if qs else probs[:0]
        if qs:
            at = torch.searchsorted(r, qr)                   # those rows among the draft rows
            q_at.index_copy_(0, at, q.gather(1, tok.index_select(0, at)[:, None])[:, 0])
        kept = accept(u_accept[r], p_at, q_at).tolist()
        rest = residual(probs, r, tok, qr, q)
    cum = rest.cumsum(-1)
    own = _search(cum, cum[:, -1], u_draw).tolist()
    at = 0
    for (a, m), x, g, out in zip(spans, drafts, greedy, tokens):
        if g:
            continue
        b = local[a]
        for j, tok in enumerate(x):
            if not kept[at + j]:
                break
            out.append(tok)
        at += len(x)
        out.append(own[b + len(out)])
