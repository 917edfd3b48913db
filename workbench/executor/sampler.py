"""Token selection from one step's logits, as one batched pipeline over the step's rows:

    raw logits -> logprobs of the raw distribution (only if a row asks)
               -> logits processors (logit_bias, min_tokens, penalties; only rows that use them)
               -> greedy argmax, or temperature / top-k / top-p / min-p and a draw

Logprobs are taken before any processing, as vLLM returns them by default. Everything up to
the draw runs on the logits' device over the whole batch; a random row is drawn from its own
CPU generator, so a seeded request gets the same tokens whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.sampling_params import SamplingParams
from ..core.sequence import Logprob, Sequence


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor
    """[N] long, on the logits' device."""
    logprobs: "LogprobsTensors | None" = None
    """For every row when any row asked for logprobs, else None."""


@dataclass(slots=True)
class LogprobsTensors:
    """Column 0 is the token the row picked (or the prompt's next token); columns 1..k its
    top-k alternatives, best first."""
    token_ids: torch.Tensor
    """[N, 1 + k] long."""
    logprobs: torch.Tensor
    """[N, 1 + k] fp32."""
    ranks: torch.Tensor
    """[N] long: rank of column 0 in its row's distribution (1 = the most likely)."""

    def to_host(self, non_blocking: bool = False) -> "LogprobsTensors":
        return LogprobsTensors(*(t.to("cpu", non_blocking=non_blocking)
                                 for t in (self.token_ids, self.logprobs, self.ranks)))

    def row(self, i: int, k: int, token_text) -> dict[int, Logprob]:
        """Row i (of host tensors) as {token id: Logprob}: column 0 (the chosen token) first,
        then the top k. token_text(id) gives each Logprob.decoded_token."""
        ids = self.token_ids[i, :k + 1].tolist()
        vals = self.logprobs[i, :k + 1].tolist()
        out = {ids[0]: Logprob(vals[0], int(self.ranks[i]), token_text(ids[0]))}
        for rank, (t, v) in enumerate(zip(ids[1:], vals[1:]), start=1):
            if t not in out:
                out[t] = Logprob(v, rank, token_text(t))
        return out


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Log-softmax of `logits` [N, V]: each row's value at `token_ids` [N], its rank, and the
    row's top-k. One batched pass; no loop over rows."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, token_ids[:, None])
    top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
    # A row whose token is its top one has rank 1; the counting pass over the vocabulary is
    # skipped where no row needs it (a greedy batch), on the CPU only: elsewhere the test
    # would wait for the device (and async scheduling keeps these on the device).
    below = picked[:, 0] < top_vals[:, 0]
    if logits.device.type != "cpu" or bool(below.any()):
        ranks = torch.where(below, (lp > picked).sum(-1) + 1, 1)
    else:
        ranks = torch.ones_like(token_ids)
    return LogprobsTensors(torch.cat([token_ids[:, None], top_ids[:, :k]], 1),
                           torch.cat([picked, top_vals[:, :k]], 1), ranks)


def sample(logits: torch.Tensor, seqs: list[Sequence], generators: list[torch.Generator | None],
           eos_token_ids: frozenset[int] | set[int] = frozenset()) -> SamplerOutput:
    """logits: [N, vocab] fp32, one row per sequence that samples this step (a row may be
    repeated for the n choices of one prompt). `seqs` give each row's params and history
    (penalties and min_tokens read it). Logprobs come back when any row asks for them."""
    raw = logits
    params = [s.params for s in seqs]
    if any(p.needs_processing for p in params):
        logits = apply_processors(logits, seqs, eos_token_ids)
    ids = logits.argmax(dim=-1)
    if not all(p.greedy for p in params):
        drawn = ids.tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                drawn[i] = _sample_row(logits[i], p, generators[i])
        ids = torch.tensor(drawn, dtype=torch.long).to(logits.device)
    k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    return SamplerOutput(ids, None if k is None else compute_logprobs(raw, ids, k))


def apply_processors(logits: torch.Tensor, seqs: list[Sequence],
                     eos_token_ids: frozenset[int] | set[int]) -> torch.Tensor:
    """logit_bias, min_tokens and the three penalties (vLLM's definitions), on a copy. The
    host only gathers the few ids involved; the [N, V] work is batched on the device."""
    logits = logits.clone()
    dev, vocab = logits.device, logits.shape[-1]
    rows, cols, vals = [], [], []
    ban_rows, ban_cols = [], []
    for i, s in enumerate(seqs):
        p = s.params
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if t < vocab:
                    rows.append(i), cols.append(t), vals.append(float(b))
        if s.num_output_tokens < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            for t in stops:
                if t < vocab:
                    ban_rows.append(i), ban_cols.append(t)
    if rows:
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, device=dev, dtype=logits.dtype), accumulate=True)
    if ban_rows:
        logits[torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)] = float("-inf")

    pen = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if pen:
        _apply_penalties(logits, [seqs[i] for i in pen], torch.tensor(pen, device=dev))
    return logits


def _padded(lists: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0) or 1
    out = torch.full((len(lists), width), pad, dtype=torch.long)
    for i, x in enumerate(lists):
        out[i, :len(x)] = torch.tensor(x, dtype=torch.long)
    return out


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: torch.Tensor) -> None:
    dev, vocab = logits.device, logits.shape[-1]
    n = len(seqs)
    # Token counts of each row's output, and which tokens its prompt holds; the pad id is
    # one past the vocabulary and is cut off.
    out_ids = _padded([s.output_token_ids for s in seqs], vocab).to(dev)
    counts = torch.zeros(n, vocab + 1, device=dev).scatter_add_(
        1, out_ids, torch.ones_like(out_ids, dtype=torch.float))[:, :vocab]
    f = lambda name: torch.tensor([getattr(s.params, name) for s in seqs],   # noqa: E731
                                  device=dev, dtype=logits.dtype)[:, None]
    sub = logits.index_select(0, rows)
    rep = f("repetition_penalty")
    if (rep != 1).any():
        prompt_ids = _padded([s.prompt_token_ids for s in seqs], vocab).to(dev)
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev).scatter_(
            1, prompt_ids, True)[:, :vocab] | (counts > 0)
        rep = rep.expand_as(sub)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - f("frequency_penalty") * counts - f("presence_penalty") * (counts > 0).float()
    logits.index_copy_(0, rows, sub)


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row.float().cpu()   # CPU generators: same draws on every device
    row = (row - row.max()) / p.temperature   # shifted first: a small temperature cannot overflow
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the top token always stays).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p * sorted_probs.sum()
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
