"""A tuning workload and the driver that runs it on an engine.

A `Workload` says how requests arrive (open loop: Poisson arrivals at `request_rate`, the
way `vllm bench serve --request-rate` sends them; or closed loop: `concurrency` requests in
flight, the next sent when one ends) and how long they are (prompt and output lengths
drawn uniformly from ranges, or taken from a recorded trace's requests, `from_trace`).
Prompts are random token ids, optionally behind a shared prefix (a system prompt), which is
what makes prefix caching matter. Every request ignores EOS so that it runs to its length.

`run_workload(engine, workload)` drives an engine in the caller's thread and returns one
`RequestRecord` per request with TTFT, TPOT and E2E as telemetry.py defines them, read from
the engine's own request records (`engine.telemetry`). Each request's arrival time is its
scheduled one (`Engine.add_request(arrival_time=)`), not when the loop got round to adding it
(a request that arrives while a step runs waits for that step: that wait is part of its
TTFT, as it is for a server's client). On a modelled device (`device="model:<name>"`) the
same run goes by the engine's virtual clock. A run is bounded by `time_limit`: what has not
finished by then is aborted and counts as not served.
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..core.sampling_params import SamplingParams
from ..engine import Engine
from ..telemetry import RequestMetrics, distribution


def _check_range(name: str, r) -> tuple[int, int]:
    try:
        lo, hi = (int(r[0]), int(r[1]))
    except (TypeError, ValueError, IndexError):
        raise ValueError(f"{name}: must be a (low, high) pair of integers (got {r!r})") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{name}: must satisfy 1 <= low <= high (got {r!r})")
    return lo, hi


@dataclass(frozen=True)
class WorkRequest:
    """One request of a workload: its prompt length, output length and (open loop) when it
    is sent, in seconds from the run's start."""
    prompt_len: int
    output_len: int
    arrival: float | None = None


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    request_rate: float | None = None
    """Open loop: mean requests per second of Poisson arrivals (exponential gaps)."""
    concurrency: int | None = None
    """Closed loop: requests kept in flight (give this or request_rate, not both)."""
    prompt_len: tuple[int, int] = (32, 256)
    """Prompt tokens, uniform in [low, high] (after the shared prefix)."""
    output_len: tuple[int, int] = (16, 128)
    """Output tokens, uniform in [low, high]."""
    shared_prefix_len: int = 0
    """Tokens every prompt starts with (a system prompt): what the prefix cache can serve."""
    lengths: tuple[tuple[int, int], ...] | None = None
    """(prompt, output) lengths to cycle through instead of the ranges (from_trace)."""
    seed: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"num_requests: must be an integer >= 1 (got {self.num_requests!r})")
        if (self.request_rate is None) == (self.concurrency is None):
            raise ValueError("request_rate, concurrency: give one of them (open loop at a rate, "
                             "or closed loop at a concurrency)")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 requests/s (got {self.request_rate!r})")
        if self.concurrency is not None and (not isinstance(self.concurrency, int)
                                             or self.concurrency < 1):
            raise ValueError(f"concurrency: must be an integer >= 1 (got {self.concurrency!r})")
        _check_range("prompt_len", self.prompt_len)
        _check_range("output_len", self.output_len)
        if not isinstance(self.shared_prefix_len, int) or self.shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len: must be an integer >= 0 "
                             f"(got {self.shared_prefix_len!r})")
        if self.lengths is not None:
            if not self.lengths:
                raise ValueError("lengths: must hold at least one (prompt, output) pair")
            for pair in self.lengths:
                if (len(pair) != 2 or not all(isinstance(x, int) and x >= 1 for x in pair)):
                    raise ValueError(f"lengths: each must be a (prompt, output) pair of "
                                     f"integers >= 1 (got {pair!r})")

    @property
    def open_loop(self) -> bool:
        return self.request_rate is not None

    def describe(self) -> str:
        how = (f"Poisson arrivals at {self.request_rate:g} req/s" if self.open_loop
               else f"{self.concurrency} in flight")
        if self.lengths is not None:
            size = f"lengths from a trace ({len(self.lengths)} requests)"
        else:
            size = (f"prompts {self.prompt_len[0]}-{self.prompt_len[1]}, outputs "
                    f"{self.output_len[0]}-{self.output_len[1]} tokens")
        prefix = f", {self.shared_prefix_len}-token shared prefix" if self.shared_prefix_len else ""
        return f"{self.num_requests} requests, {how}, {size}{prefix}"

    def with_requests(self, n: int) -> "Workload":
        """The same traffic, n requests long (a search's budget)."""
        return replace(self, num_requests=n)

    def requests(self) -> list[WorkRequest]:
        """The requests, the same for the same seed: lengths, then (open loop) arrivals."""
        r = random.Random(self.seed)
        out, t = [], 0.0
        for i in range(self.num_requests):
            if self.lengths is not None:
                p, o = self.lengths[i % len(self.lengths)]
            else:
                p, o = r.randint(*self.prompt_len), r.randint(*self.output_len)
            arrival = None
            if self.open_loop:
                arrival = t
                t += r.expovariate(self.request_rate)
            out.append(WorkRequest(self.shared_prefix_len + p, o, arrival))
        return out

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Random token ids for each request (ids below 10 skipped: special tokens)."""
        r = random.Random(self.seed + 1)
        hi = max(vocab_size - 1, 11)
        prefix = [r.randrange(10, hi) for _ in range(self.shared_prefix_len)]
        return [prefix + [r.randrange(10, hi) for _ in range(q.prompt_len - len(prefix))]
                for q in self.requests()]

    @classmethod
    def from_trace(cls, trace, *, request_rate: float | None = None,
                   concurrency: int | None = None, num_requests: int | None = None,
                   seed: int = 0) -> "Workload":
        """The prompt and output lengths of a recorded trace's requests (a `workbench.trace.
        Trace` or a path to one), sent at `request_rate` or `concurrency`."""
        if isinstance(trace, (str, Path)):
            from ..trace import Trace
            trace = Trace.load(trace)
        lengths = tuple((m.prompt_tokens, max(m.output_tokens, 1)) for m in trace.requests
                        if m.prompt_tokens > 0)
        if not lengths:
            raise ValueError("trace: holds no finished request to take lengths from")
        return cls(num_requests=num_requests or len(lengths), request_rate=request_rate,
                   concurrency=concurrency, lengths=lengths, seed=seed)


@dataclass(slots=True)
class RequestRecord:
    """One request as the workload saw it (seconds)."""
    prompt_len: int
    output_len: int
    """Tokens it was asked for (and, ignoring EOS, got if it finished)."""
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    finished: bool = False
    """It ran to its end before the run's time limit."""


@dataclass
class RunResult:
    """A workload's run on one engine."""
    records: list[RequestRecord]
    duration: float
    """Seconds from the first request's arrival to the last one's end (or the time limit)."""
    timed_out: bool = False
    """The time limit cut the run short (unfinished requests were aborted)."""
    device: str = ""
    """The device in words (EngineInfo.device_name)."""
    notices: list[str] = field(default_factory=list)
    modelled: dict | None = None
    """EngineInfo.modelled: None on a real device; on a modelled one its profile, whether it
    is calibrated and its measured error (every time in the records is modelled)."""

    @property
    def num_finished(self) -> int:
        return sum(r.finished for r in self.records)

    @property
    def throughput(self) -> float:
        """Finished requests per second."""
        return self.num_finished / self.duration if self.duration > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        """Output tokens per second of the finished requests."""
        toks = sum(r.output_len for r in self.records if r.finished)
        return toks / self.duration if self.duration > 0 else 0.0

    def summary(self) -> dict:
        return {"requests": len(self.records), "finished": self.num_finished,
                "duration_s": self.duration, "timed_out": self.timed_out,
                "req_s": self.throughput, "out_tok_s": self.output_throughput,
                "ttft": distribution(r.ttft for r in self.records if r.finished),
                "tpot": distribution(r.tpot for r in self.records if r.finished)}


def run_workload(engine: Engine, workload: Workload, time_limit: float | None = None,
                 should_stop: Callable[[], bool] | None = None) -> RunResult:
    """Run `workload` on `engine` (idle, not looping in the background) in this thread;
    stop after `time_limit` seconds or when `should_stop()` says so, aborting what runs.

    Time is the engine's clock (`engine.clock`): the wall's on a real device, where open-loop
    requests are added as their arrival times come round; a modelled device's virtual time,
    where they are all queued at once with their arrival times and the clock jumps to each
    (a run takes as long as the host's bookkeeping). Either way each request's arrival time
    is its scheduled one, so its TTFT includes the wait for a step in progress, and
    `time_limit` is in the engine's time."""
    if engine.is_running_in_background:
        raise ValueError("engine: runs its own loop in the background; the workload driver "
                         "steps it itself (build it without start())")
    if engine.has_unfinished_requests():
        raise ValueError("engine: has unfinished requests; a workload needs it idle")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit: must be > 0 seconds or None (got {time_limit!r})")
    reqs = workload.requests()
    prompts = workload.prompts(engine.info().vocab_size)
    max_len = engine.info().max_model_len
    for q in reqs:
        if q.prompt_len + q.output_len > max_len:
            raise ValueError(f"workload: a request of {q.prompt_len} prompt + {q.output_len} "
                             f"output tokens exceeds the engine's max_model_len ({max_len})")
    clock = engine.clock
    tel = engine.telemetry
    seen = tel.num_requests
    ids: dict[str, int] = {}
    done: dict[int, RequestMetrics] = {}
    pending = deque(range(len(reqs)))
    in_flight = 0
    t0 = clock.now()
    deadline = t0 + time_limit if time_limit is not None else None

    def send(i: int, at: float | None) -> None:
        nonlocal in_flight
        params = SamplingParams(max_tokens=reqs[i].output_len, ignore_eos=True, temperature=0)
        rid = engine.add_request(prompts[i], params, request_id=f"tune-{i}", arrival_time=at)
        ids[rid] = i
        in_flight += 1

    if workload.open_loop and clock.virtual:       # queued whole; the clock jumps to each
        while pending:
            i = pending.popleft()
            send(i, t0 + reqs[i].arrival)
    timed_out = False
    while pending or in_flight:
        now = clock.now()
        if (deadline is not None and now >= deadline) or (should_stop and should_stop()):
            timed_out = True
            break
        if workload.open_loop:
            while pending and t0 + reqs[pending[0]].arrival <= now:
                i = pending.popleft()
                send(i, t0 + reqs[i].arrival)
        else:
            while pending and in_flight < workload.concurrency:
                send(pending.popleft(), None)
        if engine.has_unfinished_requests():
            if not engine.step() and workload.open_loop and pending:
                time.sleep(0.0005)         # held back (waiting_timeout_ms): nothing ran
        elif pending and workload.open_loop:       # idle on the wall clock: wait for one
            wait = t0 + reqs[pending[0]].arrival - clock.now()
            if deadline is not None:
                wait = min(wait, deadline - clock.now())
            time.sleep(max(min(wait, 0.05), 0))
        for m in tel.requests_since(seen):
            seen += 1
            if m.request_id in ids:
                done[ids[m.request_id]] = m
                in_flight -= 1
    end = clock.now()
    if timed_out:
        for rid, i in ids.items():
            if i not in done:
                engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()
    records = []
    last_end = t0
    for i, q in enumerate(reqs):
        rec = RequestRecord(q.prompt_len, q.output_len)
        m = done.get(i)
        if m is not None and m.finish_reason == "length" and m.first_token_time is not None:
            rec.finished = True
            rec.ttft, rec.tpot, rec.e2e = m.ttft, m.tpot, m.e2e
            last_end = max(last_end, m.finished_time)
        records.append(rec)
    duration = (end if timed_out else last_end) - t0
    info = engine.info()
    return RunResult(records, duration, timed_out, info.device_name,
                     list(engine.telemetry.notices), info.modelled)
