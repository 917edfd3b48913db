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


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
                        ) -> torch.Tensor:
    """Structured output's step in the sampler: the logits with the tokens a grammar does not
    allow set to -inf. `bitmask` is [len(rows), ceil(vocab / 32)] int32 on the host (bit j of
    word w allows token 32 * w + j), one row per constrained logits row in `rows`. It is copied
    once and unpacked on the logits' device: one small copy and a few batched ops per step."""
    n, vocab = logits.shape
    bits = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if rows != list(range(n)):
        every = torch.ones(n, vocab, dtype=torch.bool, device=logits.device)
        every[torch.tensor(rows, device=logits.device)] = allowed
        allowed = every
    return logits.masked_fill(~allowed, float("-inf"))
