"""Continuous batching: which requests run in the next step, and how many tokens each feeds.

One step has a token budget (`max_num_batched_tokens`). Running requests are served first, in
arrival order: a decoding request feeds one token, a request still prefilling feeds the next
chunk of its prompt. What budget is left admits waiting requests (FIFO: a request that does not
fit stops the queue, so nobody is overtaken). When the KV pool runs out, a running request is
preempted by recompute: its blocks are freed and it goes back to the head of the queue, to be
prefilled again (prompt + what it had generated) when blocks free up.

Pure Python over token counts and block ids, so it is unit-tested without a model.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, PrefixHit
from ..config import EngineConfig
from .sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step, as data: which request, how many tokens it feeds from
    which position, and whether the step samples its next token."""
    req_id: str
    num_new_tokens: int
    start: int
    """Position of the first token fed (== num_computed_tokens before the step): the tokens
    it already has in the KV cache, which its attention reads besides its new ones."""
    will_sample: bool
    """Whether this step reaches the end of the request's known tokens, so its last logits
    give the next token (a mid-prompt chunk does not)."""
    is_decode: bool
    """One new token after at least one output token: a decode, not a (re)prefill."""


@dataclass(slots=True)
class NewRequestData:
    """A request the model runner does not hold yet (just admitted, forked, or back from a
    preemption): everything it needs to compute it (vLLM's NewRequestData)."""
    req_id: str
    token_ids: list[int]
    """Every token known so far: the prompt, then (a request resumed after a preemption, a
    forked choice) the outputs it had."""
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs: int | None
    """Top prompt logprobs asked for (the runner computes logits for prompt positions)."""


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since it last ran (vLLM's
    CachedRequestData, one per request)."""
    req_id: str
    new_token_ids: list[int]
    """Tokens that became known since (the token sampled by its last step); empty for a
    step scheduled before that token reached the host (async scheduling)."""
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step as the scheduler decided it, in data only: the model runner keeps its own
    copy of each request's tokens and blocks and applies these changes to it, so nothing
    here is a live object of the scheduler's."""
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """The step's requests, running ones first, in scheduling order."""
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests the runner held that have ended or been preempted since the last step: it
    forgets them."""
    preempted: list[str] = field(default_factory=list)
    """Requests preempted by this step (their blocks freed; they wait to be recomputed)."""
    num_cached_tokens: int = 0
    """Prompt tokens of newly admitted requests served from the prefix cache."""

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def phase(self) -> str:
        p, d = self.num_prefill_tokens, self.num_decode_tokens
        return "mixed" if p and d else "prefill" if p else "decode" if d else "idle"

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's part of a step's result once the scheduler has taken it in (vLLM's
    EngineCoreOutput): the tokens it kept and whether the request ended by the stop rule."""
    new_token_ids: list[int]
    """The tokens appended to the request: what the step sampled for it, up to and including
    one that stops it (several where a step proposes several); none for a request that only
    scored its prompt."""
    finish_reason: str | None = None
    """'stop' (a stop token or EOS), 'length' (max_tokens or max_model_len), or None: it goes
    on. The output processor may still end it on a stop string or its grammar."""


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: set[int] | frozenset[int] = frozenset()):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        """The model's end-of-sequence ids (a request with ignore_eos runs past them)."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        """Every sequence waiting or running, by request id."""
        self.num_preemptions = 0
        self._arrivals = 0
        self._steps_since_prefill = 0
        self._sent: dict[str, tuple[int, int]] = {}
        """Requests the model runner holds: how many of their tokens and block ids it has
        been sent (the next step sends only what came after)."""
        self._gone: list[str] = []
        """Requests the runner holds that ended or were preempted since the last step."""

    # ---- queue ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival_index = self._arrivals
        self._arrivals += 1
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start another choice of parent's prompt on parent's KV blocks (see
        BlockManager.fork); it runs next to its parent, or waits at the head of the queue
        when the running batch is full."""
        assert not child.block_table and child.token_ids[:parent.num_prompt_tokens] == \
            parent.token_ids[:parent.num_prompt_tokens]
        bs = self.block_manager.block_size
        n = min(parent.num_computed_tokens // bs, child.num_tokens // bs, len(parent.block_table))
        child.block_table = self.block_manager.fork(parent.block_table[:n])
        child.block_hashes = parent.block_hashes[:n]
        child.num_computed_tokens = n * bs
        child.arrival_index = parent.arrival_index
        self.requests[child.request_id] = child
        if len(self.running) < self.config.max_num_seqs:
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            child.status = SequenceStatus.WAITING
            self.waiting.appendleft(child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take seq out of the queues (finished or aborted) and free its blocks; the one way
        a request ends. A request that has ended already only takes the new reason (a stop
        string found in the text of the token that reached max_tokens is a 'stop', as in
        vLLM)."""
        if seq.status is SequenceStatus.FINISHED:
            seq.finish_reason = reason
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._free(seq)
        self.requests.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- one step -------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        bm = self.block_manager

        # 1. Running requests, oldest first.
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed_tokens, budget)
            while not self._allocate(seq, n):
                victim = self._pick_victim(queue, seq)
                self._preempt(victim, out)
                if victim is seq:
                    break
                queue.remove(victim)
            else:
                self._scheduled(out, seq, n)
                budget -= n
        # (Without chunked prefill a running request never has a partial prompt left, so the
        # min() above only ever trims when chunking is on.)

        # 2. Waiting requests, if this step may admit prefills.
        if not out.preempted and self._may_admit(now, out):
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                hit = self._match_prefix(seq) if not seq.block_table else None
                n = seq.num_uncomputed_tokens - (len(hit.block_ids) * bm.block_size if hit else 0)
                if n > budget:
                    if not chunked:
                        break
                    n = budget
                if not self._allocate(seq, n, hit):
                    break
                self.waiting.popleft()
                queried = hit.num_queried if hit is not None else 0
                bm.count_lookup(queried, seq.num_cached_tokens // bm.block_size)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.num_cached_tokens += seq.num_cached_tokens
                self._scheduled(out, seq, n)
                budget -= n
        if any(not s.is_decode for s in out.scheduled):
            self._steps_since_prefill = 0
        else:
            self._steps_since_prefill += 1
        return self._flush(out)

    def _scheduled(self, out: SchedulerOutput, seq: Sequence, n: int, ahead: bool = False) -> None:
        """seq feeds n tokens this step: its row, and what the runner must be told (all of
        it, or what changed since it last ran). ahead: scheduled before the token it feeds
        reached the host (async scheduling), so it samples and decodes by construction."""
        start = seq.num_computed_tokens
        will_sample = ahead or start + n == seq.num_tokens
        is_decode = ahead or (n == 1 and will_sample and seq.num_output_tokens > 0)
        rid = seq.request_id
        out.scheduled.append(ScheduledRequest(rid, n, start, will_sample, is_decode))
        sent = self._sent.get(rid)
        if sent is None:
            out.new_reqs.append(NewRequestData(rid, list(seq.token_ids), seq.num_prompt_tokens,
                                               list(seq.block_table), start,
                                               seq.params.prompt_logprobs))
        else:
            out.cached_reqs.append(CachedRequestData(rid, seq.token_ids[sent[0]:],
                                                     seq.block_table[sent[1]:], start))
        self._sent[rid] = (seq.num_tokens, len(seq.block_table))

    def _flush(self, out: SchedulerOutput) -> SchedulerOutput:
        """Tell the runner which requests it held are gone (ended or preempted since). An
        empty step reaches no runner, so the news waits for the next one."""
        if out.scheduled:
            out.finished_req_ids, self._gone = self._gone, []
        return out

    def _may_admit(self, now: float, out: SchedulerOutput) -> bool:
        cfg = self.config
        if not self.waiting:
            return False
        decoding = any(s.is_decode for s in out.scheduled)
        # Prefill interval: while requests decode, let new prompts in only every N-th step.
        if decoding and self._steps_since_prefill + 1 < cfg.prefill_interval:
            return False
        # Batch waiting time: hold a young queue back while the batch could still grow.
        if cfg.waiting_timeout_ms > 0:
            room = cfg.max_num_seqs - len(self.running)
            oldest_wait_ms = (now - self.waiting[0].arrival_time) * 1e3
            if len(self.waiting) < room and oldest_wait_ms < cfg.waiting_timeout_ms:
                return False
        return True

    def next_wakeup(self, now: float | None = None) -> float | None:
        """Seconds until a held-back queue becomes admissible (for an idle engine loop)."""
        if not self.waiting or self.config.waiting_timeout_ms <= 0:
            return None
        now = time.monotonic() if now is None else now
        left = self.config.waiting_timeout_ms / 1e3 - (now - self.waiting[0].arrival_time)
        return max(left, 0.0)

    # ---- the sequence's side of the block pool ---------------------------------------------
    def _match_prefix(self, seq: Sequence) -> PrefixHit | None:
        """The cached blocks of an unallocated sequence's longest cached prefix (a lookup:
        nothing changes until _allocate commits it); None where it must compute them all."""
        if seq.params.prompt_logprobs is not None:
            return None    # prompt logprobs need the logits of every prompt position
        return self.block_manager.match_prefix(seq.token_ids, seq.prefix_hashes)

    def _allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grow seq's block table to hold its computed tokens (with `hit`, a prefix hit it
        starts on, computed too) + num_new_tokens; False, changing nothing, if the pool is
        too full."""
        cached = hit.block_ids if hit is not None else []
        computed = seq.num_computed_tokens + len(cached) * self.block_manager.block_size
        new = self.block_manager.allocate_slots(len(seq.block_table), computed + num_new_tokens,
                                                cached)
        if new is None:
            return False
        if hit is not None:
            seq.block_table, seq.block_hashes = list(cached), list(hit.block_hashes)
            seq.num_computed_tokens = seq.num_cached_tokens = computed
        seq.block_table.extend(new)
        return True

    def _free(self, seq: Sequence) -> None:
        if self._sent.pop(seq.request_id, None) is not None:
            self._gone.append(seq.request_id)
        self.block_manager.free(seq.block_table)
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed_tokens = 0

    def _pick_victim(self, candidates: list[Sequence], current: Sequence) -> Sequence:
        pool = candidates + [current]
        mode = self.config.preemption_mode
        if mode == "oldest":
            return min(pool, key=lambda s: s.arrival_index)
        if mode == "largest":
            return max(pool, key=lambda s: (len(s.block_table), s.arrival_index))
        return max(pool, key=lambda s: s.arrival_index)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.request_id)

    def schedule_next_decode(self, prev: SchedulerOutput, may_run_ahead
                             ) -> tuple[list[int], SchedulerOutput] | None:
        """Async scheduling: the decode step after `prev` (a pure decode step whose sampled
        tokens are not known yet, but whose computed-token counts are already advanced),
        assuming each of its requests gets one more token. Returns the rows of `prev` that
        continue (their sampled ids are this step's input ids) and the step, or None when it
        must wait for prev's tokens: requests are waiting to be admitted, one may not run
        ahead (may_run_ahead(seq) is False), or the pool is full. A request whose token from
        `prev` is its last by length is left out; one that ends by EOS is only found out
        afterwards, and its row in this step is computed and dropped. Waiting requests are
        admitted one step late when a request ends (the running batch was full before)."""
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return None
        in_prev = {s.req_id for s in prev.scheduled}
        if any(seq.request_id not in in_prev for seq in self.running):
            return None                              # a request joined (a forked choice)
        rows, seqs = [], []
        for i, s in enumerate(prev.scheduled):
            seq = self.requests.get(s.req_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            if not s.is_decode or not may_run_ahead(seq):
                return None
            if self.reaches_length(seq, seq.num_tokens + 1):   # with prev's token: its last
                continue
            if not self._allocate(seq, 1):
                return None                          # a preemption is the sync path's job
            rows.append(i)
            seqs.append(seq)
        if not rows:
            return None
        out = SchedulerOutput()
        for seq in seqs:          # (only now: a step given up above tells the runner nothing)
            self._scheduled(out, seq, 1, ahead=True)
        self._steps_since_prefill += 1
        return rows, self._flush(out)

    # ---- after the model ran --------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and register newly full blocks for prefix caching
        (the step has run; its tokens may not be on the host yet: update_from_output takes
        them)."""
        for s in out.scheduled:
            seq = self.requests.get(s.req_id)
            if seq is None:
                continue                    # ended while its step was in flight: blocks freed
            seq.num_computed_tokens = s.start + s.num_new_tokens
            seq.block_hashes.extend(self.block_manager.cache_full_blocks(
                seq.token_ids, seq.block_table, seq.block_hashes, seq.num_computed_tokens))

    def update_from_output(self, seqs: list[Sequence], sampled: list[list[int]]
                           ) -> list[EngineCoreOutput | None]:
        """Take a step's sampled tokens in (vLLM v1's update_from_output): append each
        sequence's tokens, one at a time, stopping at the first that ends it (check_stop),
        and finish the sequences that end. One row per sequence that sampled, in the step's
        sampling order (an n > 1 request's choices each have theirs). A row whose sequence
        ended while its step was in flight (aborted, or ended by the step before under
        async scheduling) comes back None: its tokens are dropped."""
        outs: list[EngineCoreOutput | None] = []
        for seq, tokens in zip(seqs, sampled):
            if seq.is_finished:
                outs.append(None)
                continue
            if seq.params.max_tokens == 0:          # prompt scoring only: no token
                self.finish(seq, "length")
                outs.append(EngineCoreOutput([], "length"))
                continue
            new, reason = [], None
            for tok in tokens:
                seq.token_ids.append(tok)
                new.append(tok)
                if (reason := self.check_stop(seq)) is not None:
                    self.finish(seq, reason)
                    break
            outs.append(EngineCoreOutput(new, reason))
        return outs

    def check_stop(self, seq: Sequence) -> str | None:
        """Whether seq's newest token ends it by the stop rule (vLLM's check_stop): 'stop'
        for a stop token (kept as its stop_reason) or EOS, 'length' once it has max_tokens
        outputs or max_model_len tokens, else None. Stop strings and grammars are the text's
        and the output processor's (it reports them through finish)."""
        tok, p = seq.token_ids[-1], seq.params
        if tok in p.stop_token_ids:
            seq.stop_reason = tok
            return "stop"
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop"
        return "length" if self.reaches_length(seq, seq.num_tokens) else None

    def reaches_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether seq, at num_tokens tokens, has reached max_tokens or max_model_len."""
        return (num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens
                or num_tokens >= self.max_model_len)
