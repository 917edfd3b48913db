"""Sampled token ids in, TokenEvents out (vLLM's OutputProcessor).

The scheduler has already taken the step's tokens in (Scheduler.update_from_output: appended
them, applied the stop rule: stop tokens, EOS, max_tokens, max_model_len, and finished what
stopped). For each request of the step the output processor then detokenizes, checks what
only the text or the grammar can end (a stop string, a grammar refusal or completion) and
reports such an end back through one call (`finish`, the scheduler's), keeps the logprobs and
prompt logprobs rows, hands the text that became final to its listener, and, when a request
ends, records its RequestMetrics. It also holds every request from `add` to its end: the
registry the engine core's add, abort and read API look in.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from ..core.clock import Clock, WallClock
from ..core.scheduler import EngineCoreOutput, SchedulerOutput
from ..core.sequence import Logprob, Sequence
from ..executor.sampler import LogprobsTensors, compute_logprobs
from ..telemetry import Telemetry
from .request import Request, RequestRegistry, TokenEvent

log = logging.getLogger("workbench")


class OutputProcessor:
    def __init__(self, tokenizer, requests: RequestRegistry,
                 finish: Callable[[Sequence, str], None], telemetry: Telemetry,
                 clock: Clock | None = None):
        self.tokenizer = tokenizer
        self.requests = requests
        """The engine's requests by sequence id (it lets go of the ones that end)."""
        self.finish = finish
        """Scheduler.finish: how a request the output processor ends (a stop string, its
        grammar, an abort, an error) is reported to the one place that finishes requests."""
        self.telemetry = telemetry
        self.clock = clock if clock is not None else WallClock()
        self._token_texts: dict[int, str] = {}
        """Each token's text on its own (for Logprob.decoded_token)."""

    # ---- one step's output ----------------------------------------------------------------
    def note_scheduled(self, sched: SchedulerOutput, now: float) -> None:
        """What the scheduler did to each request, into its metrics."""
        for rid in sched.preempted:
            self.requests.get(rid).metrics.num_preemptions += 1
        for s in sched.scheduled:
            r = self.requests.get(s.req_id)
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
                r.metrics.cached_tokens = r.seq.num_cached_tokens

    def process(self, reqs: list[Request], outs: list[EngineCoreOutput | None],
                logprobs: LogprobsTensors | None, now: float, lp_rows: list[int] | None = None,
                drafts: dict[str, list[int]] | None = None,
                accepted: dict[str, int] | None = None) -> tuple[list[TokenEvent], list[str]]:
        """Hand out one step's tokens as the scheduler took them in (Scheduler.
        update_from_output: outs[i] is reqs[i]'s, and row i of `logprobs`, on the host; with
        several tokens a request, its j-th token's row is lp_rows[i] + j). drafts, accepted:
        a verify step's, by sequence id (speculative decoding; its events say which tokens
        were accepted drafts and what the target rejected: TokenEvent.draft, rejected).
        Returns the events and the sequences that ended. A request that ended while its step
        was in flight (None) drops its token; one whose listener raised is aborted."""
        events: list[TokenEvent] = []
        finished: list[str] = []
        broken: list[str] = []
        for i, (r, out) in enumerate(zip(reqs, outs)):
            if out is None:
                continue
            try:
                verify = (drafts[r.seq_id], accepted[r.seq_id]) \
                    if drafts and r.seq_id in drafts else None
                evs, delivered = self._process_one(r, i if lp_rows is None else lp_rows[i], out,
                                                   logprobs, now, verify)
            except Exception:   # its detokenizer, stop strings, grammar or logprobs
                log.exception("%s: handing out its token failed; that request alone fails",
                              r.seq.request_id)
                self.end(r, "error", now)
                finished.append(r.seq.request_id)
                continue
            events += evs
            if r.seq.is_finished:
                finished.append(r.seq.request_id)
            elif not delivered:
                broken.append(r.request_id)
        for rid in broken:
            self.abort(rid, now)
        return events, finished

    def _process_one(self, r: Request, i: int, out: EngineCoreOutput,
                     logprobs: LogprobsTensors | None, now: float,
                     verify: tuple[list[int], int] | None = None
                     ) -> tuple[list[TokenEvent], bool]:
        """One request's tokens of the step (logprobs from row i on; verify: its drafts and
        how many were accepted, at a verify step): their events and whether its listener
        took them all. A request that only scored its prompt ends with
        no token. A text stop (a stop string, the grammar) inside the step's tokens ends the
        request there: the tokens after it are taken back out of its sequence (their K/V
        went with its blocks when it finished), as if they had never been sampled."""
        if not out.new_token_ids:           # prompt scoring only (max_tokens 0)
            self._end(r, now)
            return [], True
        events, delivered = [], True
        last = len(out.new_token_ids) - 1
        r.first.metrics.num_token_steps += 1
        for j, tok in enumerate(out.new_token_ids):
            lp = None
            if r.logprobs is not None:
                lp = logprobs.row(i + j, r.seq.params.logprobs, self.decode_token)
                r.logprobs.append(lp)
            draft, rejected = False, None
            if verify is not None:            # the accepted drafts, then the target's own
                d, n = verify
                draft = j < n
                if j == n:
                    rejected = [self.decode_token(t) or "" for t in d[n:]]
            ev, ok = self._append_token(r, tok, now, lp, out.finish_reason if j == last else None,
                                        r.seq.num_output_tokens - last + j, last - j,
                                        draft, rejected)
            events.append(ev)
            delivered &= ok
            if ev.finished:
                break
        return events, delivered

    def _append_token(self, r: Request, tok: int, now: float,
                      logprobs: dict[int, Logprob] | None, reason: str | None,
                      index: int, after: int = 0, draft: bool = False,
                      rejected: list[str] | None = None) -> tuple[TokenEvent, bool]:
        """One token the scheduler appended (its index-th output), with the scheduler's
        verdict on it (`reason`): the text's own stops (a stop string, the grammar), its
        event, delivered; and whether the listener took it (False: it raised). A text stop
        ends the request through finish, the one call back to the scheduler; `after` tokens
        of the same step follow this one in the sequence, taken back out if it ends here."""
        seq, p, m = r.seq, r.seq.params, r.metrics
        m.output_tokens += 1
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        ended = reason
        if reason == "stop":               # a stop token or EOS: its text only if asked
            if p.include_stop_str_in_output:
                r.detok.add(tok)
        elif (matched := r.detok.add(tok, index >= p.min_tokens)) is not None:
            ended, seq.stop_reason = "stop", matched
        elif r.grammar is not None and not r.grammar.consume_token(tok):
            log.error("%s: the grammar refused token %d: %s", seq.request_id, tok,
                      r.grammar.get_error())
            ended = "error"
        elif r.grammar is not None and r.grammar.is_stopped():
            ended = "stop"       # the grammar is complete and allows nothing more
        if ended != reason:
            if after:                 # the step's tokens after this one: never sampled
                del seq.token_ids[-after:]
            self.finish(seq, ended)
        final = ended is not None
        ev = TokenEvent(request_id=r.request_id, token_id=tok, text=r.detok.take(final=final),
                        index=index, time=now, finished=final, finish_reason=ended,
                        logprobs=logprobs, choice=r.choice,
                        prompt_logprobs=r.prompt_logprobs if index == 1 else None,
                        stop_reason=seq.stop_reason, draft=draft, rejected=rejected)
        all_ended = final and self._end(r, now, deliver=False)
        delivered = self._deliver(r, ev)
        if all_ended:
            r.first.done.set()
        return ev, delivered

    def add_prompt_logprobs(self, spans, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Logprobs of prompt tokens from the rows of a prefill (see ModelRunner.prepare):
        the row at position p scores prompt token p + 1 (`targets`, on the logits' device).
        One batched pass for the step. spans: (request id, first position, count)."""
        reqs = [(self.requests.get(rid), first, count) for rid, first, count in spans]
        k = max(r.seq.params.prompt_logprobs for r, _, _ in reqs)
        lp = compute_logprobs(logits, targets, k).to_host()
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
        r = self.requests.get(request_id)
        if r is None:
            return
        now = self.clock.now() if now is None else now
        for c in (r.parent.started() if r.parent is not None and r is r.first else [r]):
            if not c.seq.is_finished:
                self.end(c, reason, now)

    def end(self, r: Request, reason: str, now: float) -> None:
        """End one choice from outside its tokens (an abort, a failed step): free its blocks
        and deliver a final event, with any text still held back."""
        self.finish(r.seq, reason)
        self._end(r, now)

    def _end(self, r: Request, now: float, deliver: bool = True) -> bool:
        """Book-keeping for a choice that ended (finished, stopped or aborted): the request
        is let go of and recorded when its last choice ends. Returns whether it has."""
        first = r.first
        ended = r.parent.end(r) if r.parent is not None else [r]
        all_ended = r.parent is None or r.parent.num_unfinished == 0
        self.requests.let_go(r, all_ended)
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
                    request_id=c.request_id, token_id=None, text=c.detok.take(final=True),
                    index=c.seq.num_output_tokens, time=now, finished=True,
                    finish_reason=c.seq.finish_reason, choice=c.choice,
                    prompt_logprobs=c.prompt_logprobs if c.seq.num_output_tokens == 0 else None))
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
