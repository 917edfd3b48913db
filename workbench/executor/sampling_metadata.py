"""SamplingMetadata (vLLM v1's name): one step's sampling inputs as a batch, built once per
step from the step's rows by SamplingMetadataBuilder.build, the one place that reads
sampling parameters and token histories. The sampler (sampler.py) is a function of
(logits, SamplingMetadata): it reads no request, sequence or scheduler object, and copies
nothing from the host.

Rows. Each row of the metadata picks one token from one row of the logits (`logits_rows`;
by default row i reads logits row i). A row is a SamplingRow: parameters, the tokens seen so
far, a generator; the builder does not care whose. So the n choices of one prompt are n rows
reading one logits row, and a request verified at several positions in one step (speculative
decoding, issue 40) is one row per position, each with its own logits row and its history
up to that position (the drafts before it appended); a seeded request's positions then draw
from its generator in row order, so its draws still depend on nothing else in the batch.

Copies. Every tensor of the metadata that comes from the host is written into the builder's
staging buffers (executor/staging.py) and reaches the device in one copy per build; on the
CPU they are the host buffers themselves. A build whose rows are all greedy and plain copies
nothing. The builder does its host work (and raises for a bad value) before any generator
moves, so a failed build leaves every generator as it was.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.sampling_params import SamplingParams
from .staging import NUMPY_DTYPES, StagingBuffers


@dataclass(slots=True)
class SamplingRow:
    """What one row samples with, as the engine gives it."""
    params: SamplingParams
    token_ids: Sequence[int]
    """The prompt, then the output so far (read only for penalties and min_tokens)."""
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    """A seeded request's own generator on the device; None: the step's shared one."""


STAND_IN = SamplingRow(SamplingParams(temperature=0.0), (), 0)
"""A greedy row with nothing to apply: what takes a failed request's place when its step is
sampled again without it (the other rows' tokens are then those they get without it)."""


@dataclass(slots=True)
class Filters:
    """One group of drawing rows' parameters: temperature, min-p, top-k, top-p."""
    rows: torch.Tensor | None
    """[G] their positions among the drawing rows; None: all of them."""
    temperature: torch.Tensor
    """[G] fp32."""
    min_p: torch.Tensor | None
    """[G] fp32; None when no row of the group has a min-p."""
    top_k: list[int]
    """Each row's k in [1, vocab] (vocab: none), on the host: the candidate search reads it."""
    top_p: list[float]
    top_k_t: torch.Tensor | None = None
    """[G] long: top_k on the device (the truncated group only)."""
    top_p_t: torch.Tensor | None = None
    """[G] fp32: top_p on the device (the truncated group only)."""

    def select(self, rows: list[int]) -> "Filters":
        """These rows of the group. Only where host reads are free (the CPU): the index is
        made on the host, which is the device there."""
        if len(rows) == len(self.top_k):
            return self
        idx = torch.tensor(rows, dtype=torch.long)
        pick = lambda t: None if t is None else t.index_select(0, idx)  # noqa: E731
        return Filters(None, pick(self.temperature), pick(self.min_p),
                       [self.top_k[i] for i in rows], [self.top_p[i] for i in rows],
                       pick(self.top_k_t), pick(self.top_p_t))


@dataclass(slots=True)
class DrawInputs:
    """The rows that draw (not greedy)."""
    rows: torch.Tensor | None
    """[R] their rows in the batch; None: every row draws."""
    truncated: Filters | None
    """The drawing rows with top-k or top-p (drawn among their best tokens)."""
    full: Filters | None
    """The others (drawn from the whole, min-p filtered, distribution)."""
    generators: list[torch.Generator | None]
    """[R] each drawing row's own generator, or None."""
    unseeded: torch.Tensor | None
    """Positions among the drawing rows of those without a generator, when some have one."""
    shared: torch.Generator | None
    """What the unseeded rows draw from (None: torch's default generator of the device)."""


@dataclass(slots=True)
class Penalties:
    """Repetition, frequency and presence penalties (vLLM's definitions)."""
    rows: torch.Tensor | None
    """[P] the rows with penalties; None: every row."""
    output_token_ids: torch.Tensor
    """[P, W] long, padded with -1 (a step run ahead: its pending token last)."""
    seen: torch.Tensor | None
    """[P, prompt W + W] prompt and output ids, pads replaced by the row's first prompt id
    (penalising an id twice writes the same value); None when no row has a repetition
    penalty."""
    first: torch.Tensor | None
    """[P, W] bool: where output_token_ids holds a token's first occurrence; None when no row
    has a frequency or presence penalty."""
    repetition: torch.Tensor
    """[P, 1] fp32, and the two below."""
    frequency: torch.Tensor
    presence: torch.Tensor


@dataclass(slots=True)
class Processors:
    """What changes the logits before the draw (vLLM's logits processors)."""
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """(rows, token ids, values): logit_bias, added."""
    banned: tuple[torch.Tensor, torch.Tensor] | None
    """(rows, token ids) set to -inf: stop tokens before min_tokens."""
    penalties: Penalties | None


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    logits_rows: torch.Tensor | None
    """[N] the logits row each row reads; None: row i reads row i (of the first N)."""
    bitmask: torch.Tensor | None
    """[G, ceil(vocab / 32)] int32: a grammar's allowed tokens (bit j of word w: token
    32 w + j), one row per constrained row."""
    bitmask_rows: torch.Tensor | None
    """[G] the constrained rows; None: every row, in order."""
    processors: Processors | None
    """None: no row has logit_bias, penalties or a min_tokens still to reach."""
    draw: DrawInputs | None
    """None: every row is greedy."""
    max_num_logprobs: int | None
    """The most logprobs any row asks for; None: no row asks."""


def truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0


class _Pack:
    """Host arrays collected for one build, then written into the staging and copied once."""

    def __init__(self):
        self.arrays: list[tuple[np.ndarray, torch.dtype]] = []

    def add(self, values, dtype: torch.dtype = torch.long) -> int:
        self.arrays.append((np.asarray(values, dtype=NUMPY_DTYPES[dtype]), dtype))
        return len(self.arrays) - 1

    def commit(self, staging: StagingBuffers) -> list[torch.Tensor]:
        if not self.arrays:
            return []
        views = staging.fill([a.size for a, _ in self.arrays], [t for _, t in self.arrays])
        for v, (a, _) in zip(views, self.arrays):
            v[:] = a.reshape(-1)
        tensors, _ = staging.commit()
        return [t.view(a.shape) for t, (a, _) in zip(tensors, self.arrays)]


def _padded(lists: list[Sequence[int]], pad: int = -1) -> np.ndarray:
    out = np.full((len(lists), max((len(x) for x in lists), default=0) or 1), pad,
                  dtype=np.int64)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return out


def _first_occurrences(lists: list[Sequence[int]], width: int) -> np.ndarray:
    """Per row, whether each position holds the first occurrence of its token (pads False)."""
    out = np.zeros((len(lists), width), dtype=np.bool_)
    for i, x in enumerate(lists):
        seen: set[int] = set()
        for j, t in enumerate(x):
            if t not in seen:
                seen.add(t)
                out[i, j] = True
    return out


class SamplingMetadataBuilder:
    """Builds each step's SamplingMetadata, through staging buffers of its own."""

    def __init__(self, platform, vocab_size: int, eos_token_ids=frozenset()):
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        """Banned with the stop tokens while a row is short of its min_tokens."""
        self.staging = StagingBuffers(platform, 4096)

    def build(self, rows: list[SamplingRow], *, shared: torch.Generator | None = None,
              logits_rows: list[int] | None = None, bitmask: torch.Tensor | None = None,
              bitmask_rows: list[int] = (), pending_ids: torch.Tensor | None = None
              ) -> SamplingMetadata:
        """rows: one per token to pick. shared: what unseeded rows draw from. logits_rows:
        the logits row of each (None: row i reads row i). bitmask: [len(bitmask_rows),
        words] int32 on the host, the grammar's mask of the rows `bitmask_rows`.
        pending_ids: [N] on the device, each row's token of the step before, not yet in its
        history (a step run ahead): the processors count it as output."""
        n = len(rows)
        params = [r.params for r in rows]
        pack = _Pack()
        at_rows = None if logits_rows is None else pack.add(logits_rows)
        at_mask = at_mask_rows = None
        if bitmask is not None:
            at_mask = pack.add(bitmask.numpy(), torch.int32)
            if list(bitmask_rows) != list(range(n)):
                at_mask_rows = pack.add(bitmask_rows)
        procs = self._processors(rows, params, pack, pending_ids is not None)
        draw = self._draw(rows, params, pack)
        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        dev = pack.commit(self.staging)
        get = lambda i: None if i is None else dev[i]  # noqa: E731
        return SamplingMetadata(n, get(at_rows), get(at_mask), get(at_mask_rows),
                                procs and procs(dev, pending_ids), draw and draw(dev, shared), k)

    def _processors(self, rows, params, pack: _Pack, pending: bool):
        """The processors' host arrays into `pack`; returns how to make Processors of the
        copied tensors, or None when no row has any."""
        vocab = self.vocab_size
        bias, ban = ([], [], []), ([], [])
        for i, (r, p) in enumerate(zip(rows, params)):
            if p.logit_bias:
                for t, b in p.logit_bias.items():
                    if t < vocab:
                        bias[0].append(i), bias[1].append(t), bias[2].append(float(b))
            if p.min_tokens and len(r.token_ids) - r.num_prompt_tokens + pending < p.min_tokens:
                for t in set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids):
                    if t < vocab:
                        ban[0].append(i), ban[1].append(t)
        pen = [i for i, p in enumerate(params) if p.has_penalties]
        if not (bias[0] or ban[0] or pen):
            return None
        at_bias = (pack.add(bias[0]), pack.add(bias[1]), pack.add(bias[2], torch.float32)) \
            if bias[0] else None
        at_ban = (pack.add(ban[0]), pack.add(ban[1])) if ban[0] else None
        make_pen = self._penalties([rows[i] for i in pen], pen, len(rows), pack) if pen else None

        def make(dev, pending_ids) -> Processors:
            return Processors(at_bias and tuple(dev[a] for a in at_bias),
                              at_ban and tuple(dev[a] for a in at_ban),
                              make_pen(dev, pending_ids) if make_pen else None)
        return make

    @staticmethod
    def _penalties(rows: list[SamplingRow], pen: list[int], n: int, pack: _Pack):
        ps = [r.params for r in rows]
        outs = [r.token_ids[r.num_prompt_tokens:] for r in rows]
        at_rows = None if len(pen) == n else pack.add(pen)
        at_out = pack.add(_padded(outs))
        width = pack.arrays[at_out][0].shape[1]
        at_prompt = (pack.add(_padded([r.token_ids[:r.num_prompt_tokens] for r in rows]))
                     if any(p.repetition_penalty != 1 for p in ps) else None)
        at_first = (pack.add(_first_occurrences(outs, width), torch.bool)
                    if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in ps)
                    else None)
        at_cols = [pack.add([[getattr(p, name)] for p in ps], torch.float32) for name in
                   ("repetition_penalty", "frequency_penalty", "presence_penalty")]

        def make(dev, pending_ids) -> Penalties:
            idx = None if at_rows is None else dev[at_rows]
            out, first = dev[at_out], None if at_first is None else dev[at_first]
            if pending_ids is not None:
                pend = pending_ids if idx is None else pending_ids.index_select(0, idx)
                if first is not None:
                    first = torch.cat([first, ~(out == pend[:, None]).any(1, keepdim=True)], 1)
                out = torch.cat([out, pend[:, None]], 1)
            seen = None
            if at_prompt is not None:
                seen = torch.cat([dev[at_prompt], out], 1)
                seen = torch.where(seen >= 0, seen, seen[:, :1])
            return Penalties(idx, out, seen, first, *(dev[a] for a in at_cols))
        return make

    def _draw(self, rows, params, pack: _Pack):
        """The drawing rows' host arrays into `pack`; returns how to make DrawInputs of the
        copied tensors, or None when every row is greedy."""
        n, vocab = len(rows), self.vocab_size
        random = [i for i, p in enumerate(params) if not p.greedy]
        if not random:
            return None
        at_rows = None if len(random) == n else pack.add(random)
        rp = [params[i] for i in random]
        gens = [rows[i].generator for i in random]
        trunc = [j for j, p in enumerate(rp) if truncates(p, vocab)]
        in_trunc = set(trunc)
        full = [j for j in range(len(rp)) if j not in in_trunc]
        groups = []
        for members, truncated in ((trunc, True), (full, False)):
            if not members:
                groups.append(None)
                continue
            g = [rp[j] for j in members]
            at = dict(rows=None if len(members) == len(rp) else pack.add(members),
                      temperature=pack.add([p.temperature for p in g], torch.float32),
                      min_p=(pack.add([p.min_p for p in g], torch.float32)
                             if any(p.min_p > 0 for p in g) else None))
            top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in g]
            top_p = [p.top_p for p in g]
            if truncated:
                at.update(top_k_t=pack.add(top_k), top_p_t=pack.add(top_p, torch.float32))
            groups.append((at, top_k, top_p))
        own = [j for j, g in enumerate(gens) if g is not None]
        at_unseeded = (pack.add([j for j, g in enumerate(gens) if g is None])
                       if own and len(own) < len(gens) else None)

        def make(dev, shared) -> DrawInputs:
            made = [None if g is None else Filters(
                top_k=g[1], top_p=g[2],
                **{k: None if a is None else dev[a] for k, a in g[0].items()})
                for g in groups]
            return DrawInputs(None if at_rows is None else dev[at_rows], *made, gens,
                              None if at_unseeded is None else dev[at_unseeded], shared)
        return make


def sampling_metadata(rows: list[SamplingRow], vocab_size: int, platform=None,
                      eos_token_ids=frozenset(), **kw) -> SamplingMetadata:
    """One batch's metadata from a builder made for it (tests, one-off measurements); the
    engine keeps one builder (StepPipeline.sampling). platform: the CPU's when None."""
    if platform is None:
        from ..platforms.cpu import CpuPlatform
        platform = CpuPlatform()
    return SamplingMetadataBuilder(platform, vocab_size, eos_token_ids).build(rows, **kw)
