"""Continuous batching: which requests run in the next step, and how many tokens each feeds.

One step has a token budget (`max_num_batched_tokens`). Running requests are served first, in
arrival order: a decoding request feeds one token, a request still prefilling feeds the next
chunk of its prompt. What budget is left admits waiting requests (FIFO: a request that does not
fit stops the queue, so nobody is overtaken). When the KV pool runs out, a running request is
preempted by recompute: its blocks are freed and it goes back to the head of the queue, to be
prefilled again (prompt + what it had generated) when blocks free up.

Speculative decoding: a decoding request with drafts (Sequence.spec_token_ids) feeds them
after its token, within the budget and only where the pool has room without a preemption;
update_from_output then keeps the accepted ones' K/V and gives back whole blocks past them.

Pure Python over token counts and block ids, so it is unit-tested without a model.
"""
from __future__ import annotations

import time
from collections import deque

from .block_manager import BlockManager, PrefixHit
from ..config import EngineConfig
from .sequence import Sequence, SequenceStatus
from .sched_output import (CachedRequestData, EngineCoreOutput, NewRequestData,  # noqa: F401
                           ScheduledRequest, SchedulerOutput)


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
        self._verifying: set[str] = set()
        """Requests whose step verified drafts and whose tokens are not taken in yet: their
        computed count moves past the accepted drafts, and blocks past them go back, in
        update_from_output."""
        self._shrunk: dict[str, int] = {}
        """Requests that gave blocks back since the runner was last sent their table: how
        many of the ids it holds stay."""

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
            # A decode's drafts, if the budget and the pool have room for them: never a
            # preemption for a draft.
            drafts = seq.spec_token_ids[:budget - 1] if seq.num_uncomputed_tokens == 1 else []
            seq.spec_token_ids = []
            if drafts and self._allocate(seq, n + len(drafts)):
                self._scheduled(out, seq, n + len(drafts), drafts=drafts)
                budget -= n + len(drafts)
                continue
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

    def _scheduled(self, out: SchedulerOutput, seq: Sequence, n: int, ahead: bool = False,
                   drafts: list[int] = ()) -> None:
        """seq feeds n tokens this step (its drafts the last of them): its row, and what the
        runner must be told (all of it, or what changed since it last ran). ahead: scheduled
        before the token it feeds reached the host (async scheduling), so it samples and
        decodes by construction."""
        start, d = seq.num_computed_tokens, len(drafts)
        will_sample = ahead or start + n - d == seq.num_tokens
        is_decode = ahead or (n == 1 + d and will_sample and seq.num_output_tokens > 0)
        rid = seq.request_id
        out.scheduled.append(ScheduledRequest(rid, n, start, will_sample, is_decode,
                                              list(drafts)))
        sent = self._sent.get(rid)
        if sent is None:
            out.new_reqs.append(NewRequestData(rid, list(seq.token_ids), seq.num_prompt_tokens,
                                               list(seq.block_table), start,
                                               seq.params.prompt_logprobs))
        else:
            out.cached_reqs.append(CachedRequestData(rid, seq.token_ids[sent[0]:],
                                                     seq.block_table[sent[1]:], start,
                                                     self._shrunk.pop(rid, None)))
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
        self._verifying.discard(seq.request_id)
        self._shrunk.pop(seq.request_id, None)
        self.block_manager.free(seq.block_table)
        seq.block_table, seq.block_hashes, seq.spec_token_ids = [], [], []
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
            if not s.is_decode or s.spec_token_ids or not may_run_ahead(seq):
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
        them). A verify counts only its decode's token so far: its drafts' K/V is valid only
        where they are accepted, so no block holding one enters the prefix cache here."""
        for s in out.scheduled:
            seq = self.requests.get(s.req_id)
            if seq is None:
                continue                    # ended while its step was in flight: blocks freed
            seq.num_computed_tokens = s.start + s.num_new_tokens - len(s.spec_token_ids)
            if s.spec_token_ids:
                self._verifying.add(s.req_id)
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
            if seq.request_id in self._verifying and not seq.is_finished:
                self._verified(seq)
            outs.append(EngineCoreOutput(new, reason))
        return outs

    def _verified(self, seq: Sequence) -> None:
        """After a verify step: the accepted drafts' K/V counts as computed (every token
        but the newest, which the next step feeds), their full blocks enter the prefix
        cache, and whole blocks past the new length (holding only rejected drafts' K/V) go
        back to the pool."""
        self._verifying.discard(seq.request_id)
        bm = self.block_manager
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.block_hashes.extend(bm.cache_full_blocks(
            seq.token_ids, seq.block_table, seq.block_hashes, seq.num_computed_tokens))
        keep = bm.blocks_needed(seq.num_tokens)
        if len(seq.block_table) > keep:
            bm.free(seq.block_table[keep:])
            del seq.block_table[keep:]
            sent = self._sent.get(seq.request_id)
            if sent is not None and sent[1] > keep:
                self._sent[seq.request_id] = (sent[0], keep)
                self._shrunk[seq.request_id] = min(keep, self._shrunk.get(seq.request_id, keep))

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
