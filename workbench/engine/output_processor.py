"""Sampled token ids in, TokenEvents out (vLLM's OutputProcessor).

For each request of a step: append its token, check what ends it (a stop token or EOS, a stop
string in the detokenized text, its grammar, max_tokens, max_model_len), keep its logprobs and
prompt logprobs rows, hand the text that became final to its listener, and, when it ends, free
its blocks and record its RequestMetrics. It also holds every request from `add` to its end:
the registry the engine core's add, abort and read API look in.
"""
from __future__ import annotations

import logging
import threading

import torch

from ..core.clock import Clock, WallClock
from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.sequence import Logprob
from ..executor.sampler import LogprobsTensors, compute_logprobs
from ..telemetry import Telemetry
from .request import Request, TokenEvent

log = logging.getLogger("workbench")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int,
                 scheduler: Scheduler, telemetry: Telemetry, clock: Clock | None = None):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        """Frees (Scheduler.finish) what ends, and starts forked choices."""
        self.telemetry = telemetry
        self.clock = clock if clock is not None else WallClock()
        self._requests: dict[str, Request] = {}
        """Every request from `add` to its end, by sequence id (a first choice stays until
        its last choice ends, so an abort finds it)."""
        self._lock = threading.Lock()     # guards _requests (added to from other threads)
        self._token_texts: dict[int, str] = {}
        """Each token's text on its own (for Logprob.decoded_token)."""

    # ---- the registry ---------------------------------------------------------------------
    def add(self, reqs: list[Request]) -> None:
        """Hold new requests; a request id in use (or twice in reqs) is a ValueError and adds
        none of them."""
        with self._lock:
            dup = [r.seq.request_id for r in reqs if r.seq.request_id in self._requests]
            if dup or len({r.seq.request_id for r in reqs}) < len(reqs):
                raise ValueError(f"request_id: {dup[0] if dup else 'duplicate'} is already in use")
            for r in reqs:
                self._requests[r.seq.request_id] = r

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def requests_of(self, request_ids: list[str]) -> list[Request]:
        """The Request of each id, in order (the stepping thread alone removes requests, so
        it reads without the lock)."""
        reqs = self._requests
        return [reqs[rid] for rid in request_ids]

    def requests(self) -> list[Request]:
        """Every request held now, in arrival order."""
        with self._lock:
            return list(self._requests.values())

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests)

    # ---- one step's output ----------------------------------------------------------------
    def note_scheduled(self, sched: SchedulerOutput, now: float) -> None:
        """What the scheduler did to each request, into its metrics."""
        for rid in sched.preempted:
            self._requests[rid].metrics.num_preemptions += 1
        for s in sched.scheduled:
            r = self._requests[s.req_id]
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
                r.metrics.cached_tokens = r.seq.num_cached_tokens

    def process(self, reqs: list[Request], token_ids: list[int],
                logprobs: LogprobsTensors | None, now: float) -> tuple[list[TokenEvent], list[str]]:
        """Hand out one step's tokens (row i of `logprobs`, on the host, is reqs[i]'s).
        Returns the events and the sequences that ended. A request that ended while its step
        was in flight (aborted, or finished by the step before) drops its token; one whose
        listener raised is aborted."""
        events: list[TokenEvent] = []
        finished: list[str] = []
        broken: list[str] = []
        for i, (r, tok) in enumerate(zip(reqs, token_ids)):
            if r.seq.is_finished:
                continue
            try:
                out = self._process_one(r, i, tok, logprobs, now)
            except Exception:   # its detokenizer, stop strings, grammar or logprobs
                log.exception("%s: handing out its token failed; that request alone fails",
                              r.seq.request_id)
                if not r.seq.is_finished:
                    self.end(r, "error", now)
                finished.append(r.seq.request_id)
                continue
            if out is None:
                finished.append(r.seq.request_id)
                continue
            ev, delivered = out
            events.append(ev)
            if ev.finished:
                finished.append(r.seq.request_id)
            elif not delivered:
                broken.append(r.request_id)
        for rid in broken:
            self.abort(rid, now)
        return events, finished

    def _process_one(self, r: Request, i: int, tok: int, logprobs: LogprobsTensors | None,
                     now: float) -> tuple[TokenEvent, bool] | None:
        """One request's token of the step (row i): its event and whether its listener took
        it; None when the request only scored its prompt (it ends without a token)."""
        if r.seq.params.max_tokens == 0:    # prompt scoring only: no token
            self.scheduler.finish(r.seq, "length")
            self._end(r, now)
            return None
        if r.parent is not None and not r.parent.forked:
            started = r.parent.fork(self.scheduler)
            with self._lock:
                for c in started:
                    self._requests[c.seq.request_id] = c
        lp = None
        if r.logprobs is not None:
            lp = logprobs.row(i, r.seq.params.logprobs, self.decode_token)
            r.logprobs.append(lp)
        return self._append_token(r, tok, now, lp)

    def _append_token(self, r: Request, tok: int, now: float,
                      logprobs: dict[int, Logprob] | None) -> tuple[TokenEvent, bool]:
        """One token: its stop checks and its event, delivered; and whether the listener
        took it (False: it raised)."""
        seq, p, m = r.seq, r.seq.params, r.metrics
        seq.token_ids.append(tok)
        m.output_tokens += 1
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            reason = "stop"
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
            if p.include_stop_str_in_output:
                r.detok.add(tok)
        elif (matched := r.detok.add(tok, seq.num_output_tokens >= p.min_tokens)) is not None:
            reason, seq.stop_reason = "stop", matched
        elif r.grammar is not None and not r.grammar.consume_token(tok):
            log.error("%s: the grammar refused token %d: %s", seq.request_id, tok,
                      r.grammar.get_error())
            reason = "error"
        elif r.grammar is not None and r.grammar.is_stopped():
            reason = "stop"      # the grammar is complete and allows nothing more
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        ev = TokenEvent(r.request_id, tok, r.detok.take(final=reason is not None),
                        seq.num_output_tokens, now, reason is not None, reason, logprobs,
                        r.choice, r.prompt_logprobs if seq.num_output_tokens == 1 else None,
                        seq.stop_reason)
        all_ended = reason is not None and self._end(r, now, deliver=False)
        delivered = self._deliver(r, ev)
        if all_ended:
            r.first.done.set()
        return ev, delivered

    def add_prompt_logprobs(self, spans, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens from the rows of a prefill (see ModelRunner.prepare):
        the row at position p scores prompt token p + 1. One batched pass for the step.
        spans: (request id, first position, count)."""
        reqs = [(self._requests[rid], first, count) for rid, first, count in spans]
        targets = [t for r, first, count in reqs
                   for t in r.seq.prompt_token_ids[first + 1:first + 1 + count]]
        k = max(r.seq.params.prompt_logprobs for r, _, _ in reqs)
        lp = compute_logprobs(logits, torch.tensor(targets, device=logits.device), k).to_host()
        row = 0
        for r, first, count in reqs:
            if r.prompt_logprobs is not None:
                for p in range(first + 1, first + 1 + count):
                    if r.prompt_logprobs[p] is None:    # (a recompute scores it again)
                        r.prompt_logprobs[p] = lp.row(row + p - first - 1,
                                                      r.seq.params.prompt_logprobs,
                                                      self.decode_token)
            row += count

    def decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---- ending requests ------------------------------------------------------------------
    def abort(self, request_id: str, now: float | None = None, reason: str = "abort") -> None:
        """End a request now (each of its started choices; a choice's own id ends just it),
        freeing its blocks and telling its listener."""
        r = self._requests.get(request_id)
        if r is None:
            return
        now = self.clock.now() if now is None else now
        for c in (r.parent.started() if r.parent is not None and r is r.first else [r]):
            if not c.seq.is_finished:
                self.end(c, reason, now)

    def end(self, r: Request, reason: str, now: float) -> None:
        """End one choice from outside its tokens (an abort, a failed step): free its blocks
        and deliver a final event, with any text still held back."""
        self.scheduler.finish(r.seq, reason)
        self._end(r, now)

    def _end(self, r: Request, now: float, deliver: bool = True) -> bool:
        """Book-keeping for a choice that ended (finished, stopped or aborted): the request
        is let go of and recorded when its last choice ends. Returns whether it has."""
        first = r.first
        ended = r.parent.end(r) if r.parent is not None else [r]
        all_ended = r.parent is None or r.parent.num_unfinished == 0
        with self._lock:   # the first choice stays findable (abort) until the last ends
            if r is not first:
                self._requests.pop(r.seq.request_id, None)
            if all_ended:
                self._requests.pop(first.seq.request_id, None)
        if all_ended:
            m = first.metrics
            m.finished_time = now
            m.finish_reason = first.seq.finish_reason
            m.num_preemptions = sum(c.seq.num_preemptions for c in first.choices)
            m.output_tokens = sum(c.seq.num_output_tokens for c in first.choices)
            self.telemetry.add_request(m)
        if deliver:   # an abort: tell the listener, with any text still held back
            for c in ended:
                self._deliver(c, TokenEvent(
                    c.request_id, None, c.detok.take(final=True), c.seq.num_output_tokens, now,
                    True, c.seq.finish_reason, None, c.choice,
                    c.prompt_logprobs if c.seq.num_output_tokens == 0 else None))
            if all_ended:
                first.done.set()
        return all_ended

    @staticmethod
    def _deliver(r: Request, ev: TokenEvent) -> bool:
        """Hand an event to the request's listener; False if it raised (say, its asyncio
        loop has closed): it loses its request, never the engine or the other requests."""
        if r.listener is None:
            return True
        try:
            r.listener(ev)
        except Exception:
            log.exception("listener of %s raised; aborting that request", r.seq.request_id)
            r.listener = None
            return False
        return True
