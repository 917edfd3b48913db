"""Token selection from one step's logits, as one batched pipeline over the step's rows, a
function of (logits, SamplingMetadata) (sampling_metadata.py builds the metadata, and makes
every host-to-device copy the sampler needs):

    logits rows -> a grammar's mask (only rows that have one)
                -> logprobs of that distribution (only if a row asks)
                -> logits processors (logit_bias, min_tokens, penalties; only rows that use them)
                -> greedy argmax, or temperature / top-k / min-p / top-p and a draw

Logprobs are taken before any processing, as vLLM returns them by default. All of it runs on
the logits' device for the whole batch: the host sees token ids (and logprobs when asked),
never a row of logits, so a sampled step can run ahead like a greedy one (async scheduling).

The draw is an inverse-CDF draw with one uniform number per row: the kept tokens' cumulative
mass, searched at u times the kept mass. Unseeded rows take their numbers from one generator
on the device (the engine's, seeded by EngineConfig.seed); a seeded request has a generator
of its own on the device, and its row depends on nothing but its own logits and that
generator, so the same seed gives the same tokens whatever else shares the batch.

Top-k and top-p need the row's most likely tokens in order. Sorting a whole vocabulary per
row is the expensive part (a [32, 49152] sort costs more than a decode step on a small CPU),
so the kept set is looked for among the row's top CANDIDATES tokens first (torch.topk); a row
whose top-k or nucleus reaches past them looks again among more, and is sorted in full only
past the last of them. That needs a look at the rows on
the host, free on the CPU; on an accelerator it would stall the async pipeline, so there the
whole batch is sorted (topk of the vocabulary), or only its top max(top_k) where every row
has a top-k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..core.sequence import Logprob
from .sampling_metadata import DrawInputs, Filters, Penalties, Processors, SamplingMetadata

CANDIDATES = (256, 4096)
"""How many of a row's best tokens its top-k / top-p is looked for among, in turn, before the
whole vocabulary is sorted, where a host check is free (the CPU). Here a [32, 49152] topk
costs 2.6 ms at 256 and 8.7 ms at 4096, a full sort 50 ms."""
_BELOW_ONE = 1.0 - 2.0 ** -23
"""u * mass stays strictly below the mass, so the search never lands past the last kept
token (a zero-probability token never moves the cumulative sum, so it is never found)."""


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor
    """[N] long, on the logits' device."""
    logprobs: "LogprobsTensors | None" = None
    """For every row when any row asked for logprobs, else None."""

    def scattered(self, rows: torch.Tensor, n: int) -> "SamplerOutput":
        """This output's rows placed at `rows` of an n-row output (the others: token 0,
        logprob 0, rank 1)."""
        def put(t: torch.Tensor, fill) -> torch.Tensor:
            return torch.full((n, *t.shape[1:]), fill, dtype=t.dtype,
                              device=t.device).index_copy_(0, rows, t)
        lp = self.logprobs
        return SamplerOutput(put(self.token_ids, 0), None if lp is None else LogprobsTensors(
            put(lp.token_ids, 0), put(lp.logprobs, 0.0), put(lp.ranks, 1)))


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


def _processed(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The metadata's rows of `logits`, a grammar's mask applied (what logprobs are taken
    from), and those after the logits processors (what is drawn from)."""
    if md.logits_rows is not None:
        logits = logits.index_select(0, md.logits_rows)
    elif logits.shape[0] != md.num_rows:
        logits = logits[:md.num_rows]
    if md.bitmask is not None:
        logits = apply_token_bitmask(logits, md.bitmask, md.bitmask_rows)
    raw = logits
    if md.processors is not None:
        logits = apply_processors(logits, md.processors)
    return raw, logits


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """logits: [>= N, vocab] fp32 (rows past the metadata's are not read unless
    md.logits_rows names them); md: the step's SamplingMetadata, N rows. Returns each row's
    token, and logprobs when any row asks for them."""
    raw, logits = _processed(logits, md)
    draw = md.draw
    if draw is None:
        ids = logits.argmax(dim=-1)
    elif draw.rows is None:
        ids = _draw(logits, draw)
    else:
        ids = logits.argmax(dim=-1)
        ids.index_copy_(0, draw.rows, _draw(logits.index_select(0, draw.rows), draw))
    k = md.max_num_logprobs
    return SamplerOutput(ids, None if k is None else compute_logprobs(raw, ids, k))


def host_reads_are_free(device: torch.device) -> bool:
    """Whether the sampler may look at a value on the host mid-step: on the CPU it costs
    nothing; on an accelerator it would wait for the device (and stall async scheduling)."""
    return device.type == "cpu"


def _host_index(rows: list[int]) -> torch.Tensor:
    """An index made on the host, for rows picked by looking at values on the host: only
    where host reads are free (the CPU), so the host is the device."""
    return torch.tensor(rows, dtype=torch.long)


def _select(t: torch.Tensor, rows: list[int], idx: torch.Tensor) -> torch.Tensor:
    """t's rows `rows` (their index tensor idx); t itself where that is every row."""
    return t if len(rows) == t.shape[0] else t.index_select(0, idx)


def _uniforms(draw: DrawInputs, n: int, device) -> torch.Tensor:
    """One U[0, 1) number per drawing row: the unseeded rows' in one call from the shared
    generator, a seeded row's from its own."""
    gens, shared = draw.generators, draw.shared
    own = [i for i, g in enumerate(gens) if g is not None]
    if not own:
        return torch.rand(n, device=device, generator=shared)
    u = torch.empty(n, device=device)
    if draw.unseeded is not None:
        u.index_copy_(0, draw.unseeded, torch.rand(draw.unseeded.shape[0], device=device,
                                                   generator=shared))
    for i in own:
        u[i:i + 1] = torch.rand(1, device=device, generator=gens[i])
    return u


def _draw(logits: torch.Tensor, draw: DrawInputs) -> torch.Tensor:
    """A random token per row (every row draws): rows with top-k or top-p among their best
    tokens, the others from their whole (min-p filtered) distribution."""
    n = logits.shape[0]
    u = _uniforms(draw, n, logits.device)
    if draw.full is None:
        return _draw_truncated(logits, draw.truncated, u)
    if draw.truncated is None:
        return _draw_full(logits, draw.full, u)
    ids = torch.empty(n, dtype=torch.long, device=logits.device)
    for f, fn in ((draw.truncated, _draw_truncated), (draw.full, _draw_full)):
        ids.index_copy_(0, f.rows, fn(logits.index_select(0, f.rows), f, u[f.rows]))
    return ids


def _search(cum: torch.Tensor, mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first column whose cumulative mass exceeds u * mass."""
    v = (u * mass * _BELOW_ONE)[:, None]
    return torch.searchsorted(cum, v.contiguous(), right=True)[:, 0].clamp_(max=cum.shape[1] - 1)


def _full_probs(logits, f: Filters) -> torch.Tensor:
    """Rows without top-k / top-p: the whole vocabulary at the row's temperature, min-p
    filtered (not renormalised)."""
    probs = torch.softmax(logits / f.temperature[:, None], dim=-1)
    if f.min_p is not None:
        probs = probs.masked_fill(probs < f.min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    return probs


def _draw_full(logits, f: Filters, u) -> torch.Tensor:
    cum = _full_probs(logits, f).cumsum(-1)
    return _search(cum, cum[:, -1], u)


def _draw_truncated(logits, f: Filters, u) -> torch.Tensor:
    """Rows with top-k and/or top-p (vLLM's order: min-p and top-k, then top-p on what they
    keep; top-k and min-p commute): a token each, drawn by u among the kept ones."""
    def draw(t: _Truncated, u) -> torch.Tensor:
        nucleus = t.cum.gather(1, (t.kept - 1)[:, None])[:, 0]
        return t.order.gather(1, _search(t.cum, nucleus, u)[:, None])[:, 0]
    return _over_candidates(logits, f, draw, u)


def _truncated_probs(logits, f: Filters) -> torch.Tensor:
    """Rows with top-k and/or top-p: their kept tokens' probabilities (normalised), dense
    [N, vocab] (0 elsewhere), found as _draw_truncated finds them (a whole-vocabulary sort
    for a verify step's 5 rows of a 49 152-token vocabulary took 10 ms on a Zen 5, twice a
    draft model's pass)."""
    def dense(t: _Truncated) -> torch.Tensor:
        width = t.probs.shape[1]
        p = t.probs.masked_fill(torch.arange(width, device=t.probs.device) >= t.kept[:, None],
                                0.0).float()
        p /= p.sum(-1, keepdim=True)          # normalised among the candidates, not after
        return torch.zeros(t.order.shape[0], logits.shape[1], dtype=torch.float32,
                           device=p.device).scatter_(1, t.order, p)
    return _over_candidates(logits, f, dense)


def _over_candidates(logits, f: Filters, finish, *per_row, candidates: int | None = None):
    """finish(_truncate's result, *per_row) for each row, the filters applied among its best
    `candidates` tokens (default: the first of CANDIDATES on the CPU, the whole vocabulary
    elsewhere); rows whose kept set may reach past them (a top-k wider than them, a nucleus
    they do not complete) are done again among the next number of CANDIDATES, the last time
    over the whole vocabulary. per_row: tensors with a row each, selected with the rows."""
    n, vocab = logits.shape
    if candidates is None:
        candidates = CANDIDATES[0] if host_reads_are_free(logits.device) else vocab
    t = _truncate(logits, f, candidates)
    out = finish(t, *per_row)
    width = t.order.shape[1]
    redo = [i for i, k in enumerate(f.top_k) if k > width]
    if t.tails:
        short = (t.cum[:, -1] < t.thr).tolist()
        redo = [i for i in redo if f.top_k[i] < vocab or short[i]]
    if redo:
        idx = _host_index(redo)
        again = _over_candidates(_select(logits, redo, idx), f.select(redo), finish,
                                 *(_select(r, redo, idx) for r in per_row),
                                 candidates=next((c for c in CANDIDATES if c > width), vocab))
        out = again if len(redo) == n else out.index_copy_(0, idx, again)
    return out


class _Truncated(NamedTuple):
    """_truncate's result, row by row: the candidates' ids best first (order), their
    unnormalised probabilities with top-k and min-p applied (probs) and its cumulative sum
    (cum), the top-p threshold (thr), how many of them the nucleus keeps (kept), and the rows
    whose top-p mass counted the tokens past the candidates (tails)."""
    order: torch.Tensor
    probs: torch.Tensor
    cum: torch.Tensor
    thr: torch.Tensor
    kept: torch.Tensor
    tails: list[int]


def _truncate(logits, f: Filters, candidates: int) -> _Truncated:
    """The top-k / min-p / top-p filter among each row's best `candidates` tokens."""
    n, vocab = logits.shape
    dev = logits.device
    k_of, temp, min_p = f.top_k, f.temperature, f.min_p
    has_p = [p < 1.0 for p in f.top_p]
    # Every row inside its own top-k: its top max(top_k) is all it needs.
    width = min(vocab, max(k_of) if not any(has_p) or all(k <= candidates for k in k_of)
                else candidates)
    vals, order = logits.topk(width, dim=-1)          # sorted, best first (temperature keeps order)
    # Unnormalized probabilities, the top token's 1: p_j = exp((l_j - l_0) / T).
    probs = ((vals - vals[:, :1]) / temp[:, None]).exp_()
    col = torch.arange(width, device=dev)
    drop = col >= f.top_k_t[:, None]
    if min_p is not None:
        drop |= probs < min_p[:, None]
    probs.masked_fill_(drop, 0.0)
    cum = probs.cumsum(-1)
    mass = cum[:, -1].clone()
    # Top-p against the mass of every token min-p and top-k keep; for a row whose top-k is not
    # within the candidates, that includes the tokens beyond them.
    tails = [i for i in range(n) if has_p[i] and k_of[i] == vocab and width < vocab]
    if tails:
        idx = _host_index(tails)
        # exp((l - l_0) / T) as l * (1 / T) - l_0 / T: one pass writes it, exp_ in place
        # (a [160, 49152] verify step's rows: each pass and fresh buffer costs ~2 ms here).
        inv = 1.0 / _select(temp, tails, idx)[:, None]
        rest = torch.addcmul(-_select(vals, tails, idx)[:, :1] * inv,
                             _select(logits, tails, idx), inv).exp_()
        if min_p is not None:
            rest.masked_fill_(rest < _select(min_p, tails, idx)[:, None], 0.0)
        mass = rest.sum(-1) if len(tails) == n else mass.index_copy_(0, idx, rest.sum(-1))
    p_col = f.top_p_t
    thr = torch.where(p_col < 1.0, p_col * mass, torch.full_like(mass, float("inf")))
    # Kept: the smallest prefix whose mass reaches thr (the top token always stays).
    kept = ((cum - probs) < thr[:, None]).sum(-1)
    return _Truncated(order, probs, cum, thr, kept, tails)


class TargetProbs(NamedTuple):
    """target_probs' result: every row's argmax after the processors (`top`: a greedy row's
    token; None where every row draws), the rows that draw (`rows`, None: none do) and their distributions (`probs`,
    [len(rows), vocab] fp32, row i of it row rows[i]'s), and the logits logprobs are taken
    from (`raw`, as `sample`'s)."""
    top: torch.Tensor | None
    rows: torch.Tensor | None
    probs: torch.Tensor | None
    raw: torch.Tensor


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> TargetProbs:
    """What `sample` draws each row from, as numbers: a greedy row's argmax, and a drawn
    row's distribution after everything `sample` applies (the grammar's mask, the
    processors, temperature, min-p, top-k, top-p) as dense probabilities over the whole
    vocabulary, by the same filters as `sample`'s draw: what the rejection sampler
    (rejection_sampler.py) accepts drafts against, and a draft model draws from. Greedy rows
    get no dense row (a batch of 32 greedy verifies: 160 rows of a 49 152-token vocabulary,
    zeroed, scattered and summed, took 15 ms on a Zen 5 against 2 ms for their argmax)."""
    raw, logits = _processed(logits, md)
    draw = md.draw
    # every row's argmax where any row is greedy (none where every row draws)
    top = logits.argmax(-1) if draw is None or draw.rows is not None else None
    if draw is None:
        return TargetProbs(top, None, None, raw)
    rows = torch.arange(logits.shape[0], device=logits.device) if draw.rows is None \
        else draw.rows
    sub = logits if draw.rows is None else logits.index_select(0, rows)
    dense = None                   # one filter's rows: its result; both: put together here
    for f in (draw.truncated, draw.full):
        if f is None:
            continue
        part = sub if f.rows is None else sub.index_select(0, f.rows)
        if f is draw.full:
            p = _full_probs(part, f).float()
            p /= p.sum(-1, keepdim=True)
        else:
            p = _truncated_probs(part, f)
        if f.rows is None:
            dense = p
        else:
            if dense is None:
                dense = torch.zeros(sub.shape, dtype=torch.float32, device=logits.device)
            dense.index_copy_(0, f.rows, p)
    return TargetProbs(top, rows, dense, raw)


def apply_processors(logits: torch.Tensor, procs: Processors) -> torch.Tensor:
    """logit_bias, min_tokens and the three penalties (vLLM's definitions), on a copy: the
    [N, V] work batched on the device, from the few ids the metadata names."""
    logits = logits.clone()
    if procs.bias is not None:
        rows, cols, vals = procs.bias
        logits.index_put_((rows, cols), vals.to(logits.dtype), accumulate=True)
    if procs.banned is not None:
        logits[procs.banned] = float("-inf")
    if procs.penalties is not None:
        _apply_penalties(logits, procs.penalties)
    return logits


def _apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    """The penalties touch only the tokens a row has seen, so they are gathered, changed and
    scattered back ([rows, tokens seen], never [rows, vocab])."""
    sub = logits if pen.rows is None else logits.index_select(0, pen.rows)   # (a copy already)
    if pen.seen is not None:
        # Prompt and output tokens, each divided (positive) or multiplied (negative) once.
        v = sub.gather(1, pen.seen)
        rep = pen.repetition.to(sub.dtype)
        sub.scatter_(1, pen.seen, torch.where(v > 0, v / rep, v * rep))
    if pen.first is not None:
        # frequency once per occurrence, presence once per distinct token: added in place.
        out = pen.output_token_ids
        delta = -(pen.frequency.to(sub.dtype) + pen.presence.to(sub.dtype) * pen.first) * (out >= 0)
        sub.scatter_add_(1, out.clamp(min=0), delta.to(sub.dtype))
    if pen.rows is not None:
        logits.index_copy_(0, pen.rows, sub)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """Structured output's step in the sampler: the logits with the tokens a grammar does not
    allow set to -inf. `bitmask` is [G, ceil(vocab / 32)] int32 on the logits' device (bit j
    of word w allows token 32 * w + j), one row per constrained logits row in `rows` (None:
    every row, in order); it is unpacked on the device in a few batched ops."""
    n, vocab = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if rows is not None:
        every = torch.ones(n, vocab, dtype=torch.bool, device=logits.device)
        every[rows] = allowed
        allowed = every
    return logits.masked_fill(~allowed, float("-inf"))
