"""The engine core: requests in, one step at a time, tokens out (vLLM v1's EngineCore).

A short loop over named parts: `build_engine` makes the model, the KV pool, the scheduler
and the runner; each step, the StepPipeline schedules, runs and samples, and the
OutputProcessor turns the sampled ids into TokenEvents. `add` and `abort` go through an inbox
under a short lock, so they never wait for a forward pass; the step (or the step loop,
`run_loop`, on the front door's background thread) picks them up at the start of the next
step. Tokenizing, streams and `generate` live in the front door (`llm_engine.Engine`).
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch

from ..config import EngineConfig
from ..core.block_manager import KVBlockSnapshot
from ..core.sampling_params import SamplingParams
from ..core.structured_output import StructuredOutputManager
from ..executor.models import model_digest
from ..executor.sampler import sample
from ..executor.sampling_metadata import SamplingMetadataBuilder, SamplingRow
from ..roofline import DeviceRoofs, probe_roofs
from ..telemetry import EngineInfo, EngineStats
from .build import RealDevice, build_engine
from .output_processor import OutputProcessor
from .pipeline import StepPipeline, StepResult
from .speculative import SpecDecoding
from .request import Request, RequestRegistry, RequestState, TokenEvent, make_request

log = logging.getLogger("workbench")


class EngineCore:
    def __init__(self, config: EngineConfig):
        if config.device.startswith("model:"):       # a modelled device (engine/modelled.py)
            from .modelled import ModelledDevice
            b = build_engine(ModelledDevice(config))
        else:
            b = build_engine(RealDevice(config))
        self.config = b.config
        """The knobs as run (block_size and graph_mode resolved for the device)."""
        self.platform = b.platform
        self.model = b.model
        self.runner = b.runner
        self.block_manager = b.block_manager
        self.scheduler = b.scheduler
        self.telemetry = b.telemetry
        self.tokenizer = b.tokenizer
        self.max_model_len = b.max_model_len
        self.vocab_size = b.info.vocab_size
        self._info = b.info
        self.clock = b.clock
        """Where every timestamp of this engine comes from (core/clock.py): the wall's, or
        a modelled device's virtual time."""
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size)
        self.requests = RequestRegistry()
        """Every request from add to its end (request.py)."""
        self.output = OutputProcessor(self.tokenizer, self.requests, self.scheduler.finish,
                                      self.telemetry, self.clock)
        pipeline = b.pipeline_class or StepPipeline
        sc = self.config.speculative()
        spec = (SpecDecoding(b.proposer, sc.num_speculative_tokens, self.scheduler,
                             sc.disable_by_batch_size, self.telemetry.spec_decode,
                             sc.adaptive)
                if b.proposer is not None else None)
        self.pipeline = pipeline(self.scheduler, self.runner, self.platform, self.output,
                                 self.structured_output, self.telemetry, b.eos_token_ids,
                                 b.async_scheduling, self.config.max_num_seqs,
                                 self.config.seed, self.clock, requests=self.requests,
                                 vocab_size=self.vocab_size, spec=spec)

        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()            # guards _inbox, _aborts
        self._step_lock = threading.Lock()       # one step at a time
        self._wake = threading.Condition(self._lock)
        self._looping = False
        """True while run_loop steps on another thread."""
        self._kv_wanted = False
        self._kv_last: KVBlockSnapshot | None = None
        self._closed = False

    # ---- the public read API --------------------------------------------------------------
    def info(self) -> EngineInfo:
        """What this engine is: model, device, dtype, KV pool, graph sizes, the knobs as run
        (`config`: block_size and graph_mode resolved for the device)."""
        return self._info

    def stats(self) -> EngineStats:
        """Running and waiting requests, KV blocks in use, preemptions, prefix-cache hits."""
        b = self.block_manager.stats()
        with self._lock:
            queued = len(self._inbox)
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting) + queued,
                           b.num_blocks, b.used, b.free, b.cached, self.scheduler.num_preemptions,
                           b.hits, b.queries, self.telemetry.num_steps,
                           self.telemetry.num_requests)

    def kv_blocks(self) -> KVBlockSnapshot | None:
        """The KV pool block by block. Never waits for a forward pass: while a step runs in
        the background it returns the snapshot taken at the end of the previous step it was
        asked for (None the first time) and asks for a fresh one at the end of this step."""
        if self._step_lock.acquire(blocking=False):
            try:
                return self._kv_snapshot()
            finally:
                self._step_lock.release()
        self._kv_wanted = True
        return self._kv_last

    def _kv_snapshot(self) -> KVBlockSnapshot:
        tables = {r.seq.request_id: list(r.seq.block_table) for r in self.requests.requests()
                  if r.seq.block_table}
        return self.block_manager.snapshot(tables, self.telemetry.num_steps - 1)

    def request_states(self) -> list[RequestState]:
        """Every unfinished request, in arrival order (waits for a running step to end)."""
        with self._step_lock:
            with self._lock:
                reqs = self.requests.requests()
                queued = {id(r) for r in self._inbox}
            return [RequestState(r.seq.request_id,
                                 "queued" if id(r) in queued else r.seq.status.value,
                                 r.seq.num_prompt_tokens, r.seq.num_output_tokens,
                                 r.seq.num_computed_tokens, r.seq.num_cached_tokens,
                                 r.seq.num_preemptions, list(r.seq.block_table), r.detok.text)
                    for r in reqs if not r.seq.is_finished]

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued or running (a loop of `step` runs until it is not)."""
        return self.requests.has_unfinished()

    def prompt_logits(self, prompt_ids: list[int]):
        """The logits at a prompt's last position from one real prefill step, for numerics
        checks against a reference (benchmarks/gpu.py, npu.py). Only while idle; the request
        is aborted afterwards, so nothing else changes."""
        if self._info.modelled is not None:
            raise ValueError("device: a modelled device runs no model (no logits); "
                             "prompt_logits needs a real one")
        with self._step_lock:
            if self.requests.has_unfinished() or self.pipeline.in_flight is not None:
                raise RuntimeError("prompt_logits: the engine has requests; run it when idle")
            req = self.make_request(list(prompt_ids), prompt_ids, SamplingParams(max_tokens=1),
                                    "prompt-logits")
            self.add([req])
            self._drain_inbox()
            logits = self.runner.execute(self.scheduler.schedule()).logits[0].float()
        self.abort(req.seq.request_id)
        return logits

    def sampler_cost(self, params: SamplingParams, batch: int, reps: int = 5) -> dict:
        """What picking one step's tokens costs on this device, measured now: the sampler
        over `batch` rows of random logits of this vocabulary, with `params` and greedy, the
        best of `reps` runs each (Platform.best_time), in ms. Uses a generator of its own, so
        the engine's draws are untouched."""
        vocab, dev = self.vocab_size, self.platform.device
        gen = torch.Generator(device=dev).manual_seed(0)
        logits = torch.randn(batch, vocab, device=dev, generator=gen) * 4
        out = {}
        builder = SamplingMetadataBuilder(self.platform, vocab)
        for name, p in (("greedy", SamplingParams(temperature=0)), ("sampled", params)):
            rows = [SamplingRow(p, [1], 1)] * batch
            t = self.platform.best_time(
                lambda: sample(logits, builder.build(rows, shared=gen)), reps)
            out[f"{name}_ms"] = round(t * 1e3, 2)
        return out

    def device_roofs(self, refresh: bool = False) -> DeviceRoofs:
        """This device's measured matmul throughput and memory bandwidth in the model's dtype
        (probed once per machine, device and dtype, then cached; see roofline.probe_roofs);
        a modelled device's own roofs."""
        if self._info.modelled is not None:      # the modelled device's roofs, not the host's
            return DeviceRoofs.modelled(self._info)
        return probe_roofs(self.platform, next(self.model.parameters()).dtype, refresh)

    def model_sha256(self) -> str | None:
        """The sha256 that identifies the weights wherever they live: the embedded model's
        GGUF, a checkpoint directory's files; None for random weights (their name and seed say
        what they are). What a shared trace names instead of a local path; hashed on first
        call (a large checkpoint takes seconds), then remembered."""
        return model_digest(self.config.model, self._info.model_path)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (the blocks stay in the pool, free)."""
        with self._step_lock:
            self.block_manager.reset_prefix_cache()

    # ---- requests -------------------------------------------------------------------------
    def make_request(self, prompt_ids: list[int], prompt: Any, params: SamplingParams,
                     request_id: str) -> Request:
        """A Request for validated token ids (see request.make_request)."""
        self.pipeline.check_request(params)
        return make_request(prompt_ids, prompt, params, request_id, tokenizer=self.tokenizer,
                            max_model_len=self.max_model_len, device=self.platform.device,
                            structured_output=self.structured_output)

    def add(self, reqs: list[Request], arrival_time: float | None = None) -> None:
        """Queue requests. arrival_time: when they arrive, on this engine's clock (None: now);
        one in the future waits in the inbox until the clock reaches it (a modelled engine's
        virtual clock jumps there when nothing else is left to do), so an open-loop
        workload can be queued whole and replayed on virtual time."""
        self.check_open()
        if arrival_time is not None and not math.isfinite(arrival_time):
            raise ValueError(f"arrival_time: must be a finite time on the engine's clock "
                             f"(got {arrival_time!r})")
        with self._lock:
            self.requests.add(reqs)
            t = self.clock.now() if arrival_time is None else float(arrival_time)
            for r in reqs:
                r.seq.arrival_time = r.metrics.arrival_time = t
            self._inbox.extend(reqs)
            self._wake.notify_all()

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at the next step boundary. False if unknown."""
        with self._lock:
            if request_id not in self.requests:
                return False
            self._aborts.append(request_id)
            self._wake.notify_all()
        if not self._looping and not self._step_lock.locked():
            with self._step_lock:
                self._drain_inbox()
        return True

    def abort_all(self) -> None:
        """Abort every request, queued ones included, now."""
        for r in self.requests.requests():
            self.abort(r.seq.request_id)
        with self._step_lock:
            self._drain_inbox()

    # ---- stepping -------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        now = self.clock.now()
        with self._lock:
            new = [r for r in self._inbox if r.seq.arrival_time <= now]
            self._inbox = [r for r in self._inbox if r.seq.arrival_time > now] \
                if len(new) < len(self._inbox) else []
            aborts, self._aborts = self._aborts, []
        for r in new:
            self.scheduler.add(r.seq)
        for rid in aborts:
            self.output.abort(rid)
            with self._lock:     # an aborted request that had not arrived yet
                self._inbox = [r for r in self._inbox if r.seq.request_id != rid]

    def _next_arrival(self) -> float | None:
        """When the earliest request still to arrive does (None: none waits to)."""
        with self._lock:
            return min((r.seq.arrival_time for r in self._inbox), default=None)

    def _arrived(self) -> bool:
        """Whether a request in the inbox has arrived by now."""
        now = self.clock.now()
        with self._lock:
            return any(r.seq.arrival_time <= now for r in self._inbox)

    def _quiet(self) -> bool:
        """No request arrived or was aborted since the step began (the pipeline may run
        ahead)."""
        return not self._aborts and not self._arrived()

    def _step(self, run_ahead: bool = True) -> StepResult:
        self._drain_inbox()
        result = self.pipeline.step(self._quiet if run_ahead else lambda: False)
        if result.idle and self.clock.virtual and self.pipeline.in_flight is None:
            # Nothing could run: modelled time moves on to whatever happens next (the next
            # arrival, or the end of a prefill held back by waiting_timeout_ms).
            due = [t for t in (self._next_arrival(),
                               self._wakeup(self.scheduler.next_wakeup(self.clock.now())))
                   if t is not None]
            if due:
                self.clock.advance_to(min(due))
        if self._kv_wanted:
            self._kv_wanted = False
            self._kv_last = self._kv_snapshot()
        return result

    def step(self) -> list[TokenEvent]:
        """Run one scheduler step: admit, run the model, sample, deliver. Returns the events
        (with async scheduling, of the step launched the call before)."""
        self.check_open()
        with self._step_lock:
            return self._step().events

    def finish_in_flight(self) -> None:
        """Hand out the step still in flight, launching nothing after it."""
        if self.pipeline.in_flight is not None:
            with self._step_lock:
                if self.pipeline.in_flight is not None:
                    self._step(run_ahead=False)

    def _wakeup(self, wait: float | None) -> float | None:
        return None if wait is None else self.clock.now() + max(wait, 1e-6)

    def run_loop(self, stop: threading.Event) -> None:
        """Step until `stop` is set, sleeping while there is nothing to do (the front door's
        background thread runs this). A modelled engine's clock paces meanwhile: its
        tokens stream at the modelled device's speed (for a UI watching), not as fast as
        the host can simulate."""
        self._looping = True
        if self.clock.virtual:
            self.clock.paced = True
        try:
            while not stop.is_set():
                with self._lock:
                    if (not self._inbox and not self._aborts and self.pipeline.in_flight is None
                            and not self.scheduler.has_unfinished()):
                        self._wake.wait(timeout=0.5)
                        continue
                    if (not self.clock.virtual and self._inbox and not self._aborts
                            and self.pipeline.in_flight is None
                            and not self.scheduler.has_unfinished()):
                        # Only requests still to arrive (arrival_time ahead): wait for them.
                        # (under self._lock already: read the inbox directly)
                        left = min(r.seq.arrival_time for r in self._inbox) - self.clock.now()
                        if left > 0:
                            self._wake.wait(timeout=min(left, 0.5))
                            continue
                try:
                    with self._step_lock:
                        result = self._step()
                except Exception:   # keep serving: fail the requests of the broken step only
                    # (a failure one request causes ends that request alone, in the
                    # pipeline; what reaches here is the step's own: the device, the model)
                    log.exception("engine step failed; failing its requests: %s",
                                  ", ".join(s.request_id for s in self.scheduler.running))
                    self.pipeline.in_flight = None
                    for seq in list(self.scheduler.running):
                        r = self.requests.get(seq.request_id)
                        if r is None:
                            self.scheduler.finish(seq, "error")
                        else:
                            self.output.end(r, "error", self.clock.now())
                    continue
                if result.idle and not self._arrived() and not self.clock.virtual:
                    # Nothing could run (a held-back batch): sleep until it may be admitted.
                    wait = self.scheduler.next_wakeup(self.clock.now())
                    with self._lock:
                        self._wake.wait(timeout=min(wait if wait is not None else 0.01, 0.05))
        finally:
            self._looping = False
            if self.clock.virtual:
                self.clock.paced = False

    # ---- release --------------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine: closed (close() freed its KV pool and weights); "
                               "build a new Engine")

    def close(self) -> None:
        """Abort every request, hand out a step still in flight, and free the KV pool,
        captured graphs and weights now. Idempotent."""
        if self._closed:
            return
        self.finish_in_flight()
        self.abort_all()
        with self._step_lock:
            self._closed = True
            self.runner.release()
            self.model = None
        self.platform.empty_cache()

    def wake(self) -> None:
        """Wake a sleeping run_loop (to notice its stop event)."""
        with self._lock:
            self._wake.notify_all()
