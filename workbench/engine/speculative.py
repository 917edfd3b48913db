"""Speculative decoding in the step (issue 40): drafts before a step is scheduled, their
verification after it ran.

Before each step, the proposer (spec_decode/) drafts up to k tokens for every running
request whose next step is a decode (Sequence.spec_token_ids; never past its max_tokens or
the model's length); the scheduler feeds them after the decode's token, in the step's token
budget; the runner computes logits at each of those positions as for a prefill chunk on
cached context (so a verify step runs eager, or piecewise where graph_mode 'full' captured
its token bucket: never as a captured decode graph, which feeds one token a request); a
request that got no draft stays a plain decode, and one whose drafts were all rejected
decodes without drafts for the next 2, 4, ... 32 steps (misses in a row), so a proposer that
does not predict a request's text soon stops costing it verify steps. After the step,
SpecDecoding.verify samples every position with the request's own filters and processors
(one SamplingMetadata row per position, its history the drafts before it) and keeps the
accepted drafts and the target's next token (executor/rejection_sampler.py). The scheduler
then keeps the accepted drafts' K/V and gives back the blocks past them
(Scheduler.update_from_output).
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.sequence import SequenceStatus
from ..executor.rejection_sampler import rejection_sample
from ..executor.runner import ModelRunnerOutput
from ..executor.sampler import LogprobsTensors
from ..executor.sampling_metadata import SamplingMetadataBuilder, SamplingRow
from .request import Request


MAX_PAUSE = 32
"""Most steps a request decodes without drafts after its drafts missed (see _pause)."""


class SpecDecoding:
    def __init__(self, proposer, num_speculative_tokens: int, scheduler: Scheduler,
                 disable_by_batch_size: int | None = None, counts=None):
        self.proposer = proposer
        self.counts = counts
        """telemetry.spec_decode (SpecDecodeCounts): propose counts requests asked and
        drafted for there."""
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        """No drafts while this many requests or more run (SpeculativeConfig's)."""
        self.scheduler = scheduler
        self._misses: dict[str, int] = {}
        """Verify steps in a row whose drafts were all rejected, by sequence id."""
        self._known: set[str] = set()
        """Requests drafted for and not freed since (an abort is found out at the next
        propose: the scheduler no longer holds it)."""
        self._pause: dict[str, int] = {}
        """Steps a request still decodes without drafts after such a miss (2^misses, at most
        MAX_PAUSE): a verify costs more than a decode, so a request whose text the proposer
        does not predict stops paying for it, and tries again later."""

    def propose(self) -> None:
        """Draft the next step's tokens of each running request that decodes next."""
        sched, want = self.scheduler, []
        gone = [rid for rid in self._known if rid not in sched.requests]
        if gone:
            self.free(gone)
        if self.disable_by_batch_size and len(sched.running) >= self.disable_by_batch_size:
            return
        for seq in sched.running:
            if (seq.status is not SequenceStatus.RUNNING or seq.num_output_tokens == 0
                    or seq.num_computed_tokens != seq.num_tokens - 1):
                continue
            room = min(self.k, seq.params.max_tokens - seq.num_output_tokens - 1,
                       sched.max_model_len - seq.num_tokens - 1)
            if self._pause.get(seq.request_id):
                self._pause[seq.request_id] -= 1
            elif room > 0:
                want.append((seq, room))
        if not want:
            return
        self._known.update(s.request_id for s, _ in want)
        drafts = self.proposer.propose([(s.request_id, s.token_ids) for s, _ in want])
        for (seq, room), d in zip(want, drafts):
            seq.spec_token_ids = list(d[:room])
        if self.counts is not None:
            self.counts.num_asked += len(want)
            self.counts.num_drafted += sum(1 for s, _ in want if s.spec_token_ids)

    def free(self, seq_ids) -> None:
        """The proposer forgets requests that ended or were preempted."""
        for rid in seq_ids:
            if rid not in self._known:
                continue
            self._known.discard(rid)
            self.proposer.free(rid)
            self._misses.pop(rid, None)
            self._pause.pop(rid, None)

    def verify(self, logits: torch.Tensor, ran: ModelRunnerOutput, reqs: list[Request],
               rows: list[int] | None, sched: SchedulerOutput, builder: SamplingMetadataBuilder,
               shared: torch.Generator, sample: Callable
               ) -> tuple[list[list[int]], LogprobsTensors | None, list[int], dict, dict]:
        """A step with verifies, sampled: each request's kept tokens, the logprobs (of each
        request's tokens from row lp_rows[i] on), lp_rows, and each verified request's
        drafts and accepted count. rows: the runner's request of each of reqs (n > 1
        choices share their prompt's; None: reqs are the runner's). The requests without
        drafts are sampled as in a plain step, by `sample(reqs, logits rows)` (the
        pipeline's), so a seeded one draws the same token whether or not others verify."""
        base = [0, *itertools.accumulate(ran.num_rows)]
        drafts_of = {s.req_id: s.spec_token_ids for s in sched.scheduled}
        at = [e if rows is None else rows[e] for e in range(len(reqs))]
        plain = [e for e, i in enumerate(at) if ran.num_rows[i] == 1]
        ver = [e for e, i in enumerate(at) if ran.num_rows[i] > 1]
        srows, lrows, spans, drafts, greedy, gens = [], [], [], [], [], []
        for e in ver:
            r, i = reqs[e], at[e]
            m, d = ran.num_rows[i], drafts_of[ran.req_ids[i]]
            p, seq = r.seq.params, r.seq
            history = p.has_penalties or p.min_tokens
            spans.append((len(srows), m))
            for j in range(m):
                srows.append(SamplingRow(p, seq.token_ids + d[:j] if history and j else
                                         seq.token_ids, seq.num_prompt_tokens, r.generator))
                lrows.append(base[i] + j)
            drafts.append(d)
            greedy.append(p.greedy)
            gens.append(r.generator)
        md = builder.build(srows, shared=shared, logits_rows=lrows)
        vtok, vlp, accepted = rejection_sample(logits, md, spans, drafts, greedy, gens, shared)
        tokens: list[list[int]] = [[] for _ in reqs]
        lp_rows = [0] * len(reqs)
        plp = None
        if plain:
            out = sample([reqs[e] for e in plain], [base[at[e]] for e in plain])
            plp = out.logprobs
            for row, (e, t) in enumerate(zip(plain, out.token_ids.tolist())):
                tokens[e], lp_rows[e] = [t], row
        verified, acc = {}, {}
        for e, t, (a, _), d, n in zip(ver, vtok, spans, drafts, accepted):
            r = reqs[e]
            tokens[e], lp_rows[e] = t, len(plain) + a
            verified[r.seq_id], acc[r.seq_id] = list(d), n
            self.verified(r, d, n)
        lp = _cat(plp, len(plain), vlp, len(srows))
        return tokens, lp, lp_rows, verified, acc

    def verified(self, r: Request, drafts: list[int], n: int) -> None:
        """Request r's verify accepted the first n of `drafts`: its misses in a row (and the
        pause after a miss) and its metrics (what every device's pipeline calls once per
        verified request: verify here, a modelled device's pipeline with its drawn counts)."""
        miss = self._misses[r.seq_id] = 0 if n else self._misses.get(r.seq_id, 0) + 1
        if miss:
            self._pause[r.seq_id] = min(2 ** miss, MAX_PAUSE)
        r.first.metrics.num_draft_tokens += len(drafts)
        r.first.metrics.num_accepted_tokens += n


def _cat(a: LogprobsTensors | None, na: int, b: LogprobsTensors | None, nb: int
         ) -> LogprobsTensors | None:
    """Two batches' logprobs rows one after the other (a part that asked for none, or fewer
    top tokens, padded: its rows are never read past what they asked)."""
    if a is None and b is None:
        return None
    some = a if a is not None else b
    width = max(t.token_ids.shape[1] for t in (a, b) if t is not None)

    def full(t: LogprobsTensors | None, n: int) -> list[torch.Tensor]:
        if t is None:
            z = some.token_ids.new_zeros((n, width))
            return [z, z.float(), some.ranks.new_ones(n)]
        pad = width - t.token_ids.shape[1]
        return [torch.nn.functional.pad(t.token_ids, (0, pad)),
                torch.nn.functional.pad(t.logprobs, (0, pad)), t.ranks]
    return LogprobsTensors(*(torch.cat([x, y]) for x, y in zip(full(a, na), full(b, nb))))
