"""Token selection from one step's logits: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

import torch

from ..core.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [N, vocab] fp32, one row per request that samples this step.

    Greedy rows are one vectorised argmax. Random rows are drawn one by one from each
    request's own generator, so a seeded request gets the same tokens whatever else shares
    its batch.
    """
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row.float().cpu()   # CPU generators: same draws on every device
    row = (row - row.max()) / p.temperature   # shifted first: a small temperature cannot overflow
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the top token always stays).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
