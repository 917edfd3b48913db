"""One engine step: schedule, run the model, sample, hand the ids to the output processor,
record the StepEvent; with async scheduling (vLLM's name), a pipeline that keeps one step in
flight.

Synchronously, a step's tokens are handed out before the next step is scheduled. With async
scheduling, a decode step that replayed a graph keeps its sampled ids on the device and stays
in flight (an InFlightStep); the next call advances its sequences, schedules and launches the
step after it from those ids (Scheduler.schedule_next_decode) and only then waits for them,
so the host's bookkeeping for step N runs while the device computes step N+1. That call's
events are step N's; the step still in flight is handed out by the call after it (or by
`step(run_ahead=False)`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..core.clock import Clock, WallClock
from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.structured_output import StructuredOutputManager
from ..executor.runner import ModelRunner
from ..executor.sampler import LogprobsTensors, SamplerOutput, sample
from ..executor.sampling_metadata import (STAND_IN, SamplingMetadata, SamplingMetadataBuilder,
                                          SamplingRow)
from ..telemetry import FULL, StepEvent, Telemetry
from .output_processor import OutputProcessor
from .request import ParentRequest, Request, RequestRegistry, TokenEvent

log = logging.getLogger("workbench")


@dataclass(slots=True)
class StepResult:
    """What one call of StepPipeline.step did."""
    events: list[TokenEvent]
    """The tokens it handed out (with async scheduling, of the step launched before)."""
    phase: str
    """The phase of the step whose tokens it handed out ('prefill', 'decode', 'mixed'), or
    'idle': nothing could be scheduled (a queue held back by waiting_timeout_ms, say; see
    Scheduler.next_wakeup)."""

    @property
    def idle(self) -> bool:
        return self.phase == "idle"


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose sampled ids are still on their way to the host."""
    sched: SchedulerOutput
    reqs: list[Request]
    token_ids: torch.Tensor
    """[rows] on the device, in the step's sampling order (the next step's input ids)."""
    host_ids: torch.Tensor
    """Where they land on the host, once `ready` has passed."""
    host_logprobs: LogprobsTensors | None
    """The rows' logprobs (when a row asked), also copied to the host without waiting."""
    ready: Any
    graph: tuple[str, int]
    t0: float
    ahead: bool
    """Scheduled before the step before it had handed out its tokens."""
    may_run_ahead: bool = True
    """The step after it may be launched from its ids before they reach the host."""


def held_back_by(r: Request) -> str | None:
    """Why a request's next step may not be launched before its token reaches the host, or
    None: it may. Sampling (seeded or not), penalties, logit_bias, min_tokens and logprobs all
    run on the device (penalties count the token still in flight from the device), and stop
    strings are checked a step late like EOS (the extra row is dropped, so the text is cut
    where a synchronous engine cuts it). Only a grammar holds a request back: its mask for
    the next step depends on this step's token."""
    return "grammar" if r.grammar is not None else None


def may_run_ahead(r: Request) -> bool:
    return held_back_by(r) is None


class StepPipeline:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, platform,
                 output: OutputProcessor, structured_output: StructuredOutputManager,
                 telemetry: Telemetry, eos_token_ids: set[int], async_scheduling: bool,
                 max_num_seqs: int, seed: int = 0, clock: Clock | None = None, *,
                 requests: RequestRegistry, vocab_size: int, spec=None):
        self.scheduler = scheduler
        self.requests = requests
        """Where a step's rows find their requests (by sequence id)."""
        self.clock = clock if clock is not None else WallClock()
        """Where the step's timestamps come from (the engine core's clock)."""
        self.runner = runner
        self.platform = platform
        self.output = output
        self.structured_output = structured_output
        self.telemetry = telemetry
        self.eos_token_ids = eos_token_ids
        self.async_scheduling = async_scheduling
        self.in_flight: InFlightStep | None = None
        """The step launched last, whose tokens are not handed out yet (async scheduling)."""
        self._host_ids = ([platform.host_buffer(max_num_seqs, torch.long) for _ in range(2)]
                          if async_scheduling else [])
        self._host_flip = 0
        self.generator = torch.Generator(device=platform.device).manual_seed(seed)
        """What unseeded sampled rows draw from (a seeded request has its own): the same
        engine seed and the same requests in the same order sample the same tokens."""
        self.sampling = SamplingMetadataBuilder(platform, vocab_size, eos_token_ids)
        """Builds each step's SamplingMetadata from its requests (and copies it, staged)."""
        self.spec = spec
        """Speculative decoding (speculative.py's SpecDecoding), or None: off."""

    def step(self, run_ahead: Callable[[], bool]) -> StepResult:
        """One step's worth of work (see the module's docstring). `run_ahead()` is asked just
        before a next step would be launched early: False (requests arrived or were aborted
        meanwhile, or the caller wants the pipeline drained) hands out the step in flight
        and launches nothing. The control flow of every device; how a step runs is
        _launch, _end, _launch_next and _finish (a modelled device's pipeline overrides those)."""
        pending, self.in_flight = self.in_flight, None
        if pending is None:
            sched, t0 = self._schedule()
            if sched.is_empty:
                return self._hand_out(sched, [], [], None, None, t0)
            pending = self._launch(sched, t0)
            if isinstance(pending, StepResult):         # ran synchronously, handed out
                return pending
        # Step N is in flight: advance its sequences, launch N+1 from its ids, then wait
        # for N's ids and hand them out.
        self._end(pending)
        self.scheduler.update_after_step(pending.sched)
        if pending.may_run_ahead and run_ahead() and (self.spec is None
                                                      or not self.spec.would_draft()):
            nxt = self.scheduler.schedule_next_decode(
                pending.sched, lambda seq: may_run_ahead(self.requests.get(seq.request_id)))
            if nxt is not None:
                self.in_flight = self._launch_next(pending, *nxt)
        return self._finish(pending)

    def _launch(self, sched: SchedulerOutput, t0: float) -> InFlightStep | StepResult:
        """Run a scheduled step. A step that may not run ahead (synchronous scheduling, an
        eager step, a request held back) is sampled, advanced and handed out here; one that
        may stays on the device, its ids on their way to the host."""
        ran = self.runner.execute(sched)
        logits, graph, spans = ran.logits, ran.graph, ran.prompt_spans
        reqs = self.requests.requests_of(ran.req_ids)
        ahead = self.async_scheduling and graph is not None and graph[0] == FULL
        held = {r.seq_id: why for r in reqs if (why := held_back_by(r))} if ahead else {}
        if ahead and not held:
            return self._copy_to_host(sched, self._sample(logits, reqs), reqs, graph, t0,
                                      ahead=False)
        if spans:
            num_rows = len(ran.req_ids) if ran.num_rows is None else sum(ran.num_rows)
            self.output.add_prompt_logprobs(spans, logits[num_rows:], ran.prompt_targets)
        rows, reqs = ParentRequest.sampling_rows(reqs)
        if ran.num_rows is not None:          # verifies: speculative decoding
            tokens, lp, lp_rows, drafts, accepted = self.spec.verify(
                logits, ran, reqs, rows, sched, self.sampling, self.generator,
                lambda some, at: self._sample(logits, some, at))
            self.scheduler.update_after_step(sched)
            return self._hand_out(sched, reqs, tokens, lp and lp.to_host(), graph, t0,
                                  held_back=held, lp_rows=lp_rows, drafts=drafts,
                                  accepted=accepted)
        out = self._sample(logits, reqs, rows)
        self.scheduler.update_after_step(sched)
        lp = out.logprobs.to_host() if out.logprobs is not None else None
        return self._hand_out(sched, reqs, [[t] for t in out.token_ids.tolist()], lp, graph, t0,
                              held_back=held)

    def _end(self, pending) -> None:
        """Step `pending` ends before the next is launched (a modelled device's clock moves
        to its end; a real device's ends when it ends)."""

    def _launch_next(self, pending: InFlightStep, rows: list[int],
                     sched: SchedulerOutput) -> InFlightStep:
        """Launch the decode step after `pending` from its ids still on the device (`rows`:
        pending's row of each of sched's requests)."""
        t1 = self.clock.now()
        # No larger than the step before it, so a captured size holds it. Its input ids:
        # rows `rows` of step N's, on the device.
        ran = self.runner.execute(sched, input_ids=pending.token_ids, input_rows=rows)
        reqs = self.requests.requests_of(ran.req_ids)
        # each row's token of step N, not yet in its Sequence (penalties count it)
        return self._copy_to_host(sched, self._sample(ran.logits, reqs, pending_ids=ran.input_ids),
                                  reqs, ran.graph, t1, ahead=True)

    def _finish(self, pending: InFlightStep) -> StepResult:
        """Wait for `pending`'s ids and hand them out."""
        pending.ready.synchronize()
        return self._hand_out(pending.sched, pending.reqs, [[t] for t in pending.host_ids.tolist()],
                              pending.host_logprobs, pending.graph, pending.t0, pending.ahead)

    def _schedule(self) -> tuple[SchedulerOutput, float]:
        """The next step, scheduled at the clock's time (and noted as scheduled), and that
        time."""
        t0 = self.clock.now()
        if self.spec is not None:
            self.spec.propose(self._draft_row, self.generator)
        sched = self.scheduler.schedule(t0)
        self.output.note_scheduled(sched, t0)
        return sched, t0

    def _draft_row(self, seq) -> SamplingRow:
        """A sampled sequence's SamplingRow for a draft model that draws its drafts (its own
        generator where it is seeded)."""
        r = self.requests.get(seq.request_id)
        return SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens,
                           r.generator if r is not None else None)

    def check_request(self, params) -> None:
        """Raise ValueError for what this pipeline cannot run (a real device runs anything
        the params' own checks let through, but a grammar under speculative decoding)."""
        if self.spec is not None and params.structured_outputs is not None:
            raise ValueError("structured_outputs: not supported by an engine with "
                             "speculative decoding (speculative_config); drafted positions "
                             "are not masked by the grammar")

    def _sample(self, logits: torch.Tensor, reqs: list[Request], rows: list[int] | None = None,
                pending_ids: torch.Tensor | None = None) -> SamplerOutput:
        """Each request's token (and its logprobs, when asked) from its logits row (`rows`,
        see ParentRequest.sampling_rows; None: request i's is row i), with a failure kept to
        the request that caused it: when the batch fails, each row is tried alone; the rows
        that fail alone end their requests with 'error' (logged with the cause), and the
        step is sampled again with a greedy stand-in in their place, from the generators'
        states before the rows were tried, so the others get the tokens they would have got
        had the failing request never come. A step that does not fail pays nothing for
        this. A failure no single row causes (or that every row causes) is the step's, and
        raises. A failed row's token is the stand-in's (its request has ended, so nothing
        hands it out). pending_ids: see SamplingMetadataBuilder.build."""
        try:
            return sample(logits, self.metadata(reqs, rows, pending_ids))
        except Exception:
            if len(reqs) == 1:
                raise
            # (the metadata is built before any generator moves, so a row's bad parameter
            # fails before any generator moved)
            gens = list({id(g): g for g in (self.generator, *(r.generator for r in reqs))
                         if g is not None}.values())
            states = [g.get_state() for g in gens]
            bad = []
            for i, r in enumerate(reqs):
                try:
                    sample(logits, self.metadata(
                        [r], [i if rows is None else rows[i]],
                        None if pending_ids is None else pending_ids[i:i + 1]))
                except Exception:
                    log.exception("%s: sampling failed; that request alone fails", r.request_id)
                    bad.append(i)
            for g, state in zip(gens, states):
                g.set_state(state)
            if not bad or len(bad) == len(reqs):
                raise
        now = self.clock.now()
        for i in bad:
            if not reqs[i].seq.is_finished:
                self.output.end(reqs[i], "error", now)
        return sample(logits, self.metadata(reqs, rows, pending_ids, skip=set(bad)))

    def metadata(self, reqs: list[Request], rows: list[int] | None = None,
                 pending_ids: torch.Tensor | None = None, skip=frozenset()) -> SamplingMetadata:
        """The step's SamplingMetadata: one row per request (its params, tokens and
        generator), reading logits row `rows[i]` (None: row i); the rows of requests with a
        grammar masked, all in one bitmask (so, as in vLLM, their logprobs are the masked
        distribution's); the rows in `skip` replaced by a greedy stand-in."""
        srows = [STAND_IN if i in skip else SamplingRow(r.seq.params, r.seq.token_ids,
                                                        r.seq.num_prompt_tokens, r.generator)
                 for i, r in enumerate(reqs)]
        masked = [i for i, r in enumerate(reqs) if r.grammar is not None and i not in skip]
        bitmask = (self.structured_output.grammar_bitmask([reqs[i].grammar for i in masked])
                   if masked else None)
        return self.sampling.build(srows, shared=self.generator, logits_rows=rows,
                                   bitmask=bitmask, bitmask_rows=masked, pending_ids=pending_ids)

    def _copy_to_host(self, sched, out: SamplerOutput, reqs, graph, t0,
                      ahead: bool) -> InFlightStep:
        """The sampled ids (and logprobs) copied to pinned host memory without waiting; two
        id buffers alternate, so the one being filled is never the one read."""
        ids = out.token_ids
        self._host_flip ^= 1
        host = self._host_ids[self._host_flip][:ids.shape[0]]
        host.copy_(ids, non_blocking=True)
        # (a non-blocking copy from the device lands in pinned memory)
        lp = None if out.logprobs is None else out.logprobs.to_host(non_blocking=True)
        return InFlightStep(sched, reqs, ids, host, lp, self.platform.record_event(), graph, t0,
                            ahead)

    def _update(self, reqs: list[Request], tokens: list[list[int]]) -> list:
        """The step's tokens into the scheduler (Scheduler.update_from_output), row by row
        in order, with the other choices of an n > 1 request started (Scheduler.fork on the
        first choice's blocks) just before its first choice's first token is taken in: the
        rows before it have finished by then, so a choice takes a running slot they freed
        (ParentRequest.sampling_rows gave the choices their rows of this step)."""
        outs, start = [], 0
        for i, r in enumerate(reqs):
            parent = r.parent
            if (parent is None or parent.forked or r.seq.is_finished
                    or r.seq.params.max_tokens == 0):
                continue
            outs += self.scheduler.update_from_output([q.seq for q in reqs[start:i]],
                                                      tokens[start:i])
            start = i
            started = parent.fork()
            for c in started:
                self.scheduler.fork(r.seq, c.seq)
            self.requests.adopt(started)
        return outs + self.scheduler.update_from_output([q.seq for q in reqs[start:]],
                                                        tokens[start:])

    def _hand_out(self, sched: SchedulerOutput, reqs: list[Request], tokens: list[list[int]],
                  logprobs: LogprobsTensors | None, graph, t0: float,
                  ahead: bool = False, held_back: dict[str, str] | None = None,
                  lp_rows: list[int] | None = None, drafts: dict | None = None,
                  accepted: dict | None = None) -> StepResult:
        """One step's tokens (a list per request) into the scheduler (the stop rule,
        finishing), then to the output processor (text, text stops, logprobs, events), and
        the step into telemetry. An n > 1 request whose prompt this step computed starts its
        other choices first. lp_rows: where each request's logprobs rows start (None: row
        i); drafts, accepted: a verify step's (speculative decoding)."""
        outs = self._update(reqs, tokens)
        events, finished = self.output.process(reqs, outs, logprobs, self.clock.now(), lp_rows,
                                               drafts, accepted)
        if self.spec is not None:
            self.spec.free([*finished, *sched.preempted])
        bstats = self.scheduler.block_manager.stats()
        if self.spec is not None and sched.scheduled and sched.num_prefill_tokens == 0:
            self.spec.observe(sched.num_decode_tokens, bool(drafts), self.clock.now() - t0)
        self.telemetry.add_step(StepEvent(
            step=self.telemetry.num_steps, start=t0, duration=self.clock.now() - t0,
            phase=sched.phase, num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens, num_cached_tokens=sched.num_cached_tokens,
            tokens_per_request={s.req_id: s.num_new_tokens for s in sched.scheduled},
            kinds={s.req_id: "verify" if s.spec_token_ids else "decode" if s.is_decode
                   else "prefill" if s.will_sample else "chunk" for s in sched.scheduled},
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bstats.used, kv_blocks_free=bstats.free, kv_blocks_cached=bstats.cached,
            num_preempted=len(sched.preempted), preempted=list(sched.preempted),
            graph=graph is not None, graph_kind=graph and graph[0],
            graph_size=graph and graph[1], finished=finished, scheduled_ahead=ahead,
            held_back=held_back or {},
            context_lens={s.req_id: s.start for s in sched.scheduled},
            drafts=drafts or {}, accepted=accepted or {}))
        return StepResult(events, sched.phase)
