"""Token selection from one step's logits, as one batched pipeline over the step's rows:

    raw logits -> logprobs of the raw distribution (only if a row asks)
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

import torch

from ..core.sampling_params import SamplingParams
from ..core.sequence import Logprob, Sequence

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


def sample(logits: torch.Tensor, seqs: list[Sequence], generators: list[torch.Generator | None],
           eos_token_ids: frozenset[int] | set[int] = frozenset(), *,
           shared: torch.Generator | None = None,
           pending_ids: torch.Tensor | None = None) -> SamplerOutput:
    """logits: [N, vocab] fp32, one row per sequence that samples this step (a row may be
    repeated for the n choices of one prompt). `seqs` give each row's params and history
    (penalties and min_tokens read it); `generators[i]` is row i's own generator (a seeded
    request) or None: it draws from `shared` (None: torch's default generator of the
    device). pending_ids: [N] on the device, each row's token of the step before, not yet in
    its Sequence (a step run ahead); the processors count it as output. Logprobs come back
    when any row asks for them."""
    raw = logits
    params = [s.params for s in seqs]
    if any(p.needs_processing for p in params):
        logits = apply_processors(logits, seqs, eos_token_ids, pending_ids)
    random = [i for i, p in enumerate(params) if not p.greedy]
    if not random:
        ids = logits.argmax(dim=-1)
    elif len(random) == len(params):
        ids = _draw(logits, params, generators, shared)
    else:
        ids = logits.argmax(dim=-1)
        rows = _index(random, logits.device)
        ids.index_copy_(0, rows, _draw(logits.index_select(0, rows), [params[i] for i in random],
                                       [generators[i] for i in random], shared))
    k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    return SamplerOutput(ids, None if k is None else compute_logprobs(raw, ids, k))


def host_reads_are_free(device: torch.device) -> bool:
    """Whether the sampler may look at a value on the host mid-step: on the CPU it costs
    nothing; on an accelerator it would wait for the device (and stall async scheduling)."""
    return device.type == "cpu"


def _index(rows: list[int], device) -> torch.Tensor:
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def _select(t: torch.Tensor, rows: list[int], idx: torch.Tensor) -> torch.Tensor:
    """t's rows `rows` (their index tensor idx); t itself where that is every row."""
    return t if len(rows) == t.shape[0] else t.index_select(0, idx)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the device: pinned first, since an
    asynchronous copy from pageable memory may read it after it is freed (and a synchronous
    one would wait for the step in flight)."""
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _uniforms(params: list[SamplingParams], generators: list[torch.Generator | None],
              shared: torch.Generator | None, device) -> torch.Tensor:
    """One U[0, 1) number per row: the unseeded rows' in one call from the shared generator,
    a seeded row's from its own."""
    n = len(params)
    own = [i for i, g in enumerate(generators) if g is not None]
    if not own:
        return torch.rand(n, device=device, generator=shared)
    u = torch.empty(n, device=device)
    rest = [i for i, g in enumerate(generators) if g is None]
    if rest:
        u.index_copy_(0, _index(rest, device), torch.rand(len(rest), device=device,
                                                          generator=shared))
    for i in own:
        u[i:i + 1] = torch.rand(1, device=device, generator=generators[i])
    return u


def _column(params: list[SamplingParams], name: str, device, dtype=torch.float32) -> torch.Tensor:
    return to_device(torch.tensor([getattr(p, name) for p in params], dtype=dtype), device)


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0


def _draw(logits: torch.Tensor, params: list[SamplingParams],
          generators: list[torch.Generator | None], shared: torch.Generator | None) -> torch.Tensor:
    """A random token per row (every row samples): rows with top-k or top-p among their best
    tokens, the others from their whole (min-p filtered) distribution."""
    n, vocab = logits.shape
    dev = logits.device
    temp = _column(params, "temperature", dev)
    min_p = _column(params, "min_p", dev) if any(p.min_p > 0 for p in params) else None
    u = _uniforms(params, generators, shared, dev)      # last: a bad parameter moves no generator
    trunc = [i for i, p in enumerate(params) if _truncates(p, vocab)]
    if len(trunc) == n:
        return _draw_truncated(logits, temp, u, min_p, [p.top_k for p in params],
                               [p.top_p for p in params])
    if not trunc:
        return _draw_full(logits, temp, u, min_p)
    ids = torch.empty(n, dtype=torch.long, device=dev)
    in_trunc = set(trunc)
    full = [i for i in range(n) if i not in in_trunc]
    for rows, fn in ((trunc, _draw_truncated), (full, _draw_full)):
        idx = _index(rows, dev)
        extra = (([params[i].top_k for i in rows], [params[i].top_p for i in rows])
                 if fn is _draw_truncated else ())
        ids.index_copy_(0, idx, fn(logits.index_select(0, idx), temp[idx], u[idx],
                                   None if min_p is None else min_p[idx], *extra))
    return ids


def _search(cum: torch.Tensor, mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first column whose cumulative mass exceeds u * mass."""
    v = (u * mass * _BELOW_ONE)[:, None]
    return torch.searchsorted(cum, v.contiguous(), right=True)[:, 0].clamp_(max=cum.shape[1] - 1)


def _draw_full(logits, temp, u, min_p) -> torch.Tensor:
    """Rows without top-k / top-p: the whole vocabulary at the row's temperature, min-p
    filtered."""
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    cum = probs.cumsum(-1)
    return _search(cum, cum[:, -1], u)


def _draw_truncated(logits, temp, u, min_p, top_k: list[int], top_p: list[float],
                    candidates: int | None = None) -> torch.Tensor:
    """Rows with top-k and/or top-p (vLLM's order: min-p and top-k, then top-p on what they
    keep; top-k and min-p commute). Looks among the top `candidates` tokens (default: the
    first of CANDIDATES on the CPU, the whole vocabulary elsewhere); a row whose kept set
    reaches past them is drawn again among the next number of CANDIDATES, the last time over
    the whole vocabulary."""
    n, vocab = logits.shape
    dev = logits.device
    if candidates is None:
        candidates = CANDIDATES[0] if host_reads_are_free(dev) else vocab
    k_of = [k if 0 < k < vocab else vocab for k in top_k]
    has_p = [p < 1.0 for p in top_p]
    # Every row inside its own top-k: its top max(top_k) is all it needs.
    width = min(vocab, max(k_of) if not any(has_p) or all(k <= candidates for k in k_of)
                else candidates)
    vals, order = logits.topk(width, dim=-1)          # sorted, best first (temperature keeps order)
    # Unnormalized probabilities, the top token's 1: p_j = exp((l_j - l_0) / T).
    probs = ((vals - vals[:, :1]) / temp[:, None]).exp_()
    col = torch.arange(width, device=dev)
    drop = col >= to_device(torch.tensor(k_of), dev)[:, None]
    if min_p is not None:
        drop |= probs < min_p[:, None]
    probs.masked_fill_(drop, 0.0)
    cum = probs.cumsum(-1)
    mass = cum[:, -1].clone()
    # Top-p against the mass of every token min-p and top-k keep; for a row whose top-k is not
    # within the candidates, that includes the tokens beyond them.
    tails = [i for i in range(n) if has_p[i] and k_of[i] == vocab and width < vocab]
    if tails:
        idx = _index(tails, dev)
        rest = ((_select(logits, tails, idx) - _select(vals, tails, idx)[:, :1])
                / _select(temp, tails, idx)[:, None]).exp_()
        if min_p is not None:
            rest.masked_fill_(rest < _select(min_p, tails, idx)[:, None], 0.0)
        mass = rest.sum(-1) if len(tails) == n else mass.index_copy_(0, idx, rest.sum(-1))
    p_col = to_device(torch.tensor(top_p, dtype=torch.float32), dev)
    thr = torch.where(p_col < 1.0, p_col * mass, torch.full_like(mass, float("inf")))
    # Kept: the smallest prefix whose mass reaches thr (the top token always stays).
    kept = ((cum - probs) < thr[:, None]).sum(-1)
    nucleus = cum.gather(1, (kept - 1)[:, None])[:, 0]
    ids = order.gather(1, _search(cum, nucleus, u)[:, None])[:, 0]
    # Rows whose kept set may reach past the candidates, drawn again among more: a top-k
    # wider than them, or a nucleus they do not complete.
    redo = [i for i in range(n) if k_of[i] > width]
    if tails:
        short = (cum[:, -1] < thr).tolist()
        redo = [i for i in redo if k_of[i] < vocab or short[i]]
    if redo:
        idx = _index(redo, dev)
        again = _draw_truncated(
            _select(logits, redo, idx), _select(temp, redo, idx), _select(u, redo, idx),
            None if min_p is None else _select(min_p, redo, idx), [top_k[i] for i in redo],
            [top_p[i] for i in redo],
            candidates=next((c for c in CANDIDATES if c > width), vocab))
        ids = again if len(redo) == n else ids.index_copy_(0, idx, again)
    return ids


def apply_processors(logits: torch.Tensor, seqs: list[Sequence],
                     eos_token_ids: frozenset[int] | set[int],
                     pending_ids: torch.Tensor | None = None) -> torch.Tensor:
    """logit_bias, min_tokens and the three penalties (vLLM's definitions), on a copy. The
    host only gathers the few ids involved; the [N, V] work is batched on the device.
    pending_ids (see sample): one more output token per row, still on the device."""
    logits = logits.clone()
    dev, vocab = logits.device, logits.shape[-1]
    pending = int(pending_ids is not None)
    rows, cols, vals = [], [], []
    ban_rows, ban_cols = [], []
    for i, s in enumerate(seqs):
        p = s.params
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if t < vocab:
                    rows.append(i), cols.append(t), vals.append(float(b))
        if s.num_output_tokens + pending < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            for t in stops:
                if t < vocab:
                    ban_rows.append(i), ban_cols.append(t)
    if rows:
        logits.index_put_((_index(rows, dev), _index(cols, dev)),
                          to_device(torch.tensor(vals, dtype=logits.dtype), dev), accumulate=True)
    if ban_rows:
        logits[_index(ban_rows, dev), _index(ban_cols, dev)] = float("-inf")

    pen = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if pen:
        _apply_penalties(logits, [seqs[i] for i in pen], _index(pen, dev),
                         None if pending_ids is None else pending_ids[_index(pen, dev)])
    return logits


def _padded(lists: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0) or 1
    out = torch.full((len(lists), width), pad, dtype=torch.long)
    for i, x in enumerate(lists):
        out[i, :len(x)] = torch.tensor(x, dtype=torch.long)
    return out


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: torch.Tensor,
                     pending_ids: torch.Tensor | None) -> None:
    """The penalties touch only the tokens a row has seen, so they are gathered, changed and
    scattered back ([rows, tokens seen], never [rows, vocab]). A row's output is its
    Sequence's tokens and, in a step run ahead, its pending token."""
    dev = logits.device
    params = [s.params for s in seqs]
    col = lambda name: _column(params, name, dev, logits.dtype)[:, None]  # noqa: E731
    every = len(seqs) == logits.shape[0]
    sub = logits if every else logits.index_select(0, rows)     # (logits is a copy already)
    out = to_device(_padded([s.output_token_ids for s in seqs], -1), dev)
    if pending_ids is not None:
        out = torch.cat([out, pending_ids[:, None]], 1)
    if any(p.repetition_penalty != 1 for p in params):
        # Prompt and output tokens, each divided (positive) or multiplied (negative) once:
        # a repeated id or a pad (the row's first prompt token) writes the same new value.
        seen = torch.cat([to_device(_padded([s.prompt_token_ids for s in seqs], -1), dev), out], 1)
        seen = torch.where(seen >= 0, seen, seen[:, :1])
        v = sub.gather(1, seen)
        rep = col("repetition_penalty")
        sub.scatter_(1, seen, torch.where(v > 0, v / rep, v * rep))
    if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
        # frequency once per occurrence, presence once per distinct token: added in place.
        first = to_device(torch.tensor(_first_occurrences([s.output_token_ids for s in seqs],
                                                          out.shape[1]), dtype=torch.bool), dev)
        if pending_ids is not None:
            first[:, -1] = ~(out[:, :-1] == pending_ids[:, None]).any(1)
        real = out >= 0
        delta = -(col("frequency_penalty") + col("presence_penalty") * first) * real
        sub.scatter_add_(1, out.clamp(min=0), delta.to(sub.dtype))
    if not every:
        logits.index_copy_(0, rows, sub)


def _first_occurrences(lists: list[list[int]], width: int) -> list[list[bool]]:
    """Per row, whether each position holds the first occurrence of its token (pads False)."""
    rows = []
    for x in lists:
        seen: set[int] = set()
        row = [False] * width
        for j, t in enumerate(x):
            if t not in seen:
                seen.add(t)
                row[j] = True
        rows.append(row)
    return rows


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
                        ) -> torch.Tensor:
    """Structured output's step in the sampler: the logits with the tokens a grammar does not
    allow set to -inf. `bitmask` is [len(rows), ceil(vocab / 32)] int32 on the host (bit j of
    word w allows token 32 * w + j), one row per constrained logits row in `rows`. It is copied
    once and unpacked on the logits' device: one small copy and a few batched ops per step."""
    n, vocab = logits.shape
    bits = to_device(bitmask, logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if rows != list(range(n)):
        every = torch.ones(n, vocab, dtype=torch.bool, device=logits.device)
        every[torch.tensor(rows, device=logits.device)] = allowed
        allowed = every
    return logits.masked_fill(~allowed, float("-inf"))
