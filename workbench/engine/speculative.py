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
does not predict a request's text soon stops costing it verify steps. And where a step's
extra rows cost more than the drafts are worth (a large batch, a CPU whose few-row steps are
bound by arithmetic), the step drafts fewer or none: `adaptive` below. After the step,
SpecDecoding.verify samples every position with the request's own filters and processors
(one SamplingMetadata row per position, its history the drafts before it) and keeps the
accepted drafts and the target's next token (executor/rejection_sampler.py). The scheduler
then keeps the accepted drafts' K/V and gives back the blocks past them
(Scheduler.update_from_output).
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Callable

import torch

from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.sequence import SequenceStatus
from ..executor.rejection_sampler import rejection_sample
from ..executor.runner import ModelRunnerOutput
from ..executor.sampler import LogprobsTensors
from ..executor.sampling_metadata import SamplingMetadataBuilder, SamplingRow
from ..spec_decode import Proposer
from .request import Request


MAX_PAUSE = 32
"""Most steps a request decodes without drafts after its drafts missed (see _pause)."""
MARGIN = 1.05
"""A step drafts only where its drafts promise this much more tokens per second than the plain
step (budget): a verify priced at break-even by its least recent figures loses in a busy
moment (prompt lookup at batch 32 on a Zen 5, priced at +3 %: 0.90-1.13x in runs minutes
apart)."""


class DraftOdds:
    """How likely a request's next drafts are to be kept, from recent verifies: its first
    draft's chance, and the chance that a draft after a kept one is kept too (a prompt lookup
    that starts copying mostly goes on), each the request's own recent rate counted with the
    engine's as WEIGHT tries (a sampled request keeps a picked draft's later tokens far less
    often than a greedy one: 0.5 against 0.99 for SmolLM2's gguf-a8 self-draft at
    temperature 0.7 before its drafts were drawn; prompt lookup's still are picked). Rates
    are kept as (kept, tried) and fade:
    the engine's recent ones by 1 - DECAY a step toward what this engine's proposer has
    kept in the long run (`seen`: every verify, each forgotten by 1 - SEEN_DECAY a verify,
    from a prior of a half) or a half, whichever is more, a request's toward nothing by
    1 - OWN_DECAY. So where drafting stopped (a large batch, where rows cost a decode, or a
    run of misses), it is tried again: a draft model kept nine times in ten comes back at
    those odds, and at a half at least, so that a few early misses (a grounded reply's first
    words, before it copies) do not keep a prompt lookup from ever drafting again."""
    DECAY = 0.97
    OWN_DECAY = 0.9
    SEEN_DECAY = 0.999
    WEIGHT = 2.0
    PRIOR = (1.0, 2.0)

    def __init__(self):
        self.first = list(self.PRIOR)
        self.then = list(self.PRIOR)
        self.seen = {"first": list(self.PRIOR), "then": list(self.PRIOR)}
        self.own: dict[str, dict[str, list[float]]] = {}
        """A request's own (kept, tried), "first" and "then", as `seen`'s."""

    def step(self, rids) -> None:
        """A step drafts (or might) for `rids`: the rates fade."""
        for rate, seen in ((self.first, self.seen["first"]), (self.then, self.seen["then"])):
            p = max(self.PRIOR[0] / self.PRIOR[1], seen[0] / seen[1])
            rate[0] = rate[0] * self.DECAY + self.PRIOR[1] * p * (1 - self.DECAY)
            rate[1] = rate[1] * self.DECAY + self.PRIOR[1] * (1 - self.DECAY)
        for rid in rids:
            for rate in self.own.get(rid, {}).values():
                rate[0] *= self.OWN_DECAY
                rate[1] *= self.OWN_DECAY

    def verified(self, rid: str, num_drafts: int, n: int) -> None:
        """Request rid's verify kept n of its num_drafts drafts."""
        own = self.own.setdefault(rid, {"first": [0.0, 0.0], "then": [0.0, 0.0]})
        for seen in self.seen.values():
            seen[0] *= self.SEEN_DECAY
            seen[1] *= self.SEEN_DECAY
        for rate in (self.first, own["first"], self.seen["first"]):
            rate[0] += n > 0
            rate[1] += 1
        if n:
            for rate in (self.then, own["then"], self.seen["then"]):
                rate[0] += n - 1
                rate[1] += min(n, num_drafts - 1)

    def values(self, rid: str, room: int) -> list[float]:
        """The expected worth in tokens of each of rid's next `room` drafts (the j-th is kept
        only if all before it are)."""
        own = self.own.get(rid, {"first": (0.0, 0.0), "then": (0.0, 0.0)})
        (kept, tried), (kept_on, tried_on) = own["first"], own["then"]
        first = (kept + self.WEIGHT * self.first[0] / self.first[1]) / (tried + self.WEIGHT)
        then = (kept_on + self.WEIGHT * self.then[0] / self.then[1]) / (tried_on + self.WEIGHT)
        return [first * then ** j for j in range(room)]

    def forget(self, rid: str) -> None:
        self.own.pop(rid, None)


class StepCosts:
    """What a step costs by its rows, as this engine measured it: the durations of recent
    steps of one kind by their token count (the least of the last few at each count, and
    never the kind's first step, which pays one-off costs, so a slow step does not stick;
    each forgotten after HORIZON steps, so a cost that changed is measured again)."""
    KEEP = 8
    HORIZON = 4096

    def __init__(self):
        self._by_rows: dict[int, deque[tuple[int, float]]] = {}
        self._step = 0

    def observe(self, rows: int, seconds: float) -> None:
        self._step += 1
        if self._step == 1:
            return
        self._by_rows.setdefault(rows, deque(maxlen=self.KEEP)).append((self._step, seconds))

    def table(self) -> dict[int, float]:
        """Row count -> seconds: each count's least recent duration."""
        out = {}
        for r, seen in list(self._by_rows.items()):
            recent = [t for s, t in seen if self._step - s <= self.HORIZON]
            if recent:
                out[r] = min(recent)
            else:
                del self._by_rows[r]
        return out


class Curve:
    """A step's cost by its rows from a measured table (row count -> seconds, each count no
    dearer than any larger one: a slower few-row figure is noise): its own figure; between
    two measured counts, on the line through them; past the largest, on the line
    through it and the measured count nearest half of it (a wide base: one row's difference
    is noise), never falling; below the smallest, or past a single measured count, that
    count's figure (an optimistic guess: the step is tried, and then it is measured); None
    where nothing is measured."""

    def __init__(self, table: dict[int, float]):
        self.rows = sorted(table)
        # Never dearer with fewer rows: a count measured dearer than a larger one (a slow
        # step among few samples) takes the larger one's figure.
        self.secs = list(itertools.accumulate(reversed([table[r] for r in self.rows]), min))[::-1]
        table = dict(zip(self.rows, self.secs))
        self.slope = 0.0
        if len(self.rows) > 1:
            top = self.rows[-1]
            base = min(self.rows[:-1], key=lambda r: abs(r - top / 2))
            self.slope = max(0.0, (self.secs[-1] - table[base]) / (top - base))

    def at(self, rows: int) -> float | None:
        if not self.rows:
            return None
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.secs[i]
        if i == 0:
            return self.secs[0]
        if i == len(self.rows):
            return self.secs[-1] + self.slope * (rows - self.rows[-1])
        lo, hi = self.rows[i - 1], self.rows[i]
        return self.secs[i - 1] + (self.secs[i] - self.secs[i - 1]) * (rows - lo) / (hi - lo)


class SpecDecoding:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, scheduler: Scheduler,
                 disable_by_batch_size: int | None = None, counts=None,
                 adaptive: bool = True):
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
        self.adaptive = adaptive
        """Draft only as many tokens a step as pay for their rows (SpeculativeConfig's):
        each draft is worth what it is expected to add (DraftOdds: from the acceptance of
        recent verifies), and a step of r rows costs what StepCosts measured; the step
        takes the number of drafts, best first, that gives the most tokens per second:
        none where extra rows cost as much as a decode (a CPU at batch 32), all k where
        they are nearly free. False: every request that decodes gets k (vLLM's way)."""
        self.costs = {False: StepCosts(), True: StepCosts()}
        """Plain decode steps' and verify steps' costs, apart: where a decode replays a
        captured graph and a verify runs eager (CUDA without graph_mode 'full'), a verify
        costs more than its rows alone say."""
        self.odds = DraftOdds()
        self._q: dict[str, torch.Tensor] = {}
        """The next step's drawn drafts' distributions ([drafts, vocab]) by sequence id (the
        draft model's, for sampled requests): the rejection sampler's q."""
        self._unpriced = False
        """The next step's cost says nothing of a verify's: the draft model's catch-up fed a
        prefill (a new request's prompt, the tokens since a pause). Left out of the step
        costs, where it would stand for a verify of its row count (a batch of 32 new
        requests: 19.5 s as a 160-row verify on a Zen 5, everything past 5 rows looked dear)."""

    def propose(self, sampling: Callable | None = None,
                shared: torch.Generator | None = None) -> None:
        """Draft the next step's tokens of each running request that decodes next.
        sampling(seq): a sampled sequence's SamplingRow (its generator), for a proposer that
        draws a sampled request's drafts (draft_probs: the draft model); shared: what rows
        without a generator draw from."""
        sched, want = self.scheduler, []
        self._q.clear()
        gone = [rid for rid in self._known if rid not in sched.requests]
        if gone:
            self.free(gone)
        if self.disable_by_batch_size and len(sched.running) >= self.disable_by_batch_size:
            return
        for seq in sched.running:
            if (seq.status is not SequenceStatus.RUNNING or seq.num_output_tokens == 0
                    or seq.num_computed_tokens != seq.num_tokens - 1):
                continue
            room = self._room(seq)
            if self._pause.get(seq.request_id):
                self._pause[seq.request_id] -= 1
            elif room > 0:
                want.append((seq, room))
        if not want:
            return
        if self.adaptive:
            self.odds.step([s.request_id for s, _ in want])
            decoding = sum(1 for seq in sched.running if seq.status is SequenceStatus.RUNNING
                           and seq.num_computed_tokens == seq.num_tokens - 1)
            cut = self.budget(decoding, [self.odds.values(s.request_id, room)
                                         for s, room in want])
            want = [(s, n) for (s, _), n in zip(want, cut) if n]
            if not want:
                return
        self._known.update(s.request_id for s, _ in want)
        reqs = [(s.request_id, s.token_ids) for s, _ in want]
        rows = None
        if sampling is not None and self.proposer.draws:
            rows = [None if s.params.greedy else sampling(s) for s, _ in want]
        drafts = self.proposer.propose(reqs, rows, shared)
        self._q.update(self.proposer.draft_probs)
        self._unpriced = self.proposer.longest_catch_up > self.k + 1
        for (seq, room), d in zip(want, drafts):
            seq.spec_token_ids = list(d[:room])
        if self.counts is not None:
            self.counts.num_asked += len(want)
            self.counts.num_drafted += sum(1 for s, _ in want if s.spec_token_ids)

    def _room(self, seq, in_flight: int = 0) -> int:
        """The most drafts seq may take at its next step (k; never past its max_tokens or
        the model's length), `in_flight` of its tokens not yet in it."""
        return min(self.k, seq.params.max_tokens - seq.num_output_tokens - 1 - in_flight,
                   self.scheduler.max_model_len - seq.num_tokens - 1 - in_flight)

    def budget(self, decoding: int, values: list[list[float]]) -> list[int]:
        """How many drafts each request that may draft gets (`values`: the worth of each of
        its possible drafts, DraftOdds') in a step of `decoding` decode rows: the drafts,
        most valuable first, up to the count that makes the most tokens per second of the
        step by StepCosts' figures, where that beats the plain step by MARGIN: none until a
        plain step's cost is known (the first two plain steps measure it), all where no
        verify step's is (the first two verifies)."""
        base = Curve(self.costs[False].table()).at(decoding)
        if base is None:
            return [0] * len(values)
        table = self.costs[True].table()
        if table and decoding < min(table):
            # Fewer rows than any verify measured: on the line from a plain step (a verify
            # of no drafts) to the fewest measured, not flat at that count's cost: where
            # rows cost (a draft model's passes, a CPU's arithmetic), fewer drafts cost
            # less, and are tried, and then measured.
            table[decoding] = base
        verify = Curve(table)
        order = sorted(((v, i) for i, vs in enumerate(values) for v in vs),
                       key=lambda vi: -vi[0])
        largest = verify.rows[-1] if verify.rows else 0
        best, best_n, gain = decoding / base, 0, 0.0
        for n, (v, _) in enumerate(order, 1):
            gain += v
            # A verify is never cheaper than the plain step it extends.
            rate = (decoding + gain) / max(verify.at(decoding + n) or base, base)
            if rate > best:
                best, best_n = rate, n
            elif rate < 0.8 * best and decoding + n > largest:
                # Past every measured count, the cost is a line that only grows while the
                # drafts' worth falls: no later count wins it back (searching on there let a
                # batch of 32 draft on a line from batch-1 verifies: 0.83x). Within the
                # measured counts the search goes on: a draft model's first draft costs a
                # pass and a catch-up (one draft 40 ms against a plain step's 16 on a Zen 5,
                # four drafts 50 ms), so a loss at one draft says nothing of four.
                break
        if best < MARGIN * decoding / base:
            best_n = 0
        out = [0] * len(values)
        for _, i in order[:best_n]:
            out[i] += 1
        return out

    def would_draft(self) -> bool:
        """Whether the next step would draft for any request, by the budget (asked before a
        step would be launched ahead, whose inputs are still on the device: the proposer
        cannot read them, so such a step never drafts; async scheduling runs only while
        this says no). Counts as a step for DraftOdds' fading, so that a while later the
        budget tries drafting again."""
        if not self.adaptive:
            return True
        sched, rooms, rids = self.scheduler, [], []
        if self.disable_by_batch_size and len(sched.running) >= self.disable_by_batch_size:
            return False
        for seq in sched.running:
            if seq.status is SequenceStatus.RUNNING and seq.num_output_tokens \
                    and not self._pause.get(seq.request_id):
                room = self._room(seq, in_flight=1)
                if room > 0:
                    rooms.append(room)
                    rids.append(seq.request_id)
        if not rooms:
            return False
        self.odds.step(rids)
        return any(self.budget(len(sched.running), [self.odds.values(r, n)
                                                    for r, n in zip(rids, rooms)]))

    def observe(self, rows: int, verify: bool, seconds: float) -> None:
        """A step whose every token was a decode or a verify row (`verify`: some were
        drafts) took `seconds` (a verify whose draft caught up a prefill is left out)."""
        unpriced, self._unpriced = self._unpriced, False
        if not (verify and unpriced):
            self.costs[verify].observe(rows, seconds)

    def free(self, seq_ids) -> None:
        """The proposer forgets requests that ended or were preempted."""
        for rid in seq_ids:
            if rid not in self._known:
                continue
            self._known.discard(rid)
            self.proposer.free(rid)
            self._misses.pop(rid, None)
            self._pause.pop(rid, None)
            self.odds.forget(rid)

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
        srows, lrows, spans, drafts, greedy, gens, qs = [], [], [], [], [], [], []
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
            q = self._q.pop(ran.req_ids[i], None)
            qs.append(None if q is None else q[:len(d)])
        md = builder.build(srows, shared=shared, logits_rows=lrows)
        vtok, vlp, accepted = rejection_sample(logits, md, spans, drafts, greedy, gens, shared,
                                               qs)
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
        self.odds.verified(r.seq_id, len(drafts), n)
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
