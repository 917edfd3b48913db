"""Telemetry as data: one StepEvent per engine step, one RequestMetrics per finished request.

The engine appends; anyone reads: the timeline widget, the server's /metrics, the bench
report, a JSON file. Reads from other threads go through `steps_since`/`snapshot`, which copy
under a lock.
"""
from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class StepEvent:
    step: int
    start: float
    """time.monotonic() when the step began."""
    duration: float
    """Seconds, schedule + forward + sample + bookkeeping."""
    phase: str
    """'prefill', 'decode', 'mixed' or 'idle'."""
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_tokens: int
    """Prompt tokens served by the prefix cache for requests admitted in this step."""
    tokens_per_request: dict[str, int]
    kinds: dict[str, str]
    """What each scheduled request did: 'prefill' (its prompt's last chunk; it got a token),
    'chunk' (a prompt chunk that did not reach the end; no token) or 'decode'."""
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    num_preempted: int
    preempted: list[str]
    graph: bool = False
    """Whether captured graphs ran this step (always False in eager mode)."""
    graph_size: int | None = None
    """The captured size replayed: a decode batch size ('full') or a token bucket
    ('piecewise'); padding fills the rest."""
    graph_kind: str | None = None
    """'full': the whole step was one graph (decode steps); 'piecewise': graphs between
    eagerly run attention (graph_mode 'full', prefill and mixed steps); None: eager."""
    finished: list[str] = field(default_factory=list)
    scheduled_ahead: bool = False
    """Launched before the previous step's tokens reached the host (async scheduling): its
    input ids came from that step's sampled ids on the device."""
    context_lens: dict[str, int] = field(default_factory=dict)
    """Tokens each scheduled request already had in the KV cache before the step (its
    attention read them besides its new tokens; see roofline.step_cost)."""

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def graph_label(self) -> str:
        """How the step ran, in words: 'eager', 'graph replay @4' (a whole decode step at
        batch 4) or 'piecewise replay @64 tokens'."""
        if not self.graph:
            return "eager"
        if self.graph_kind == "piecewise":
            return f"piecewise replay @{self.graph_size} tokens"
        return f"graph replay @{self.graph_size}"

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool referenced by live requests after the step."""
        total = self.kv_blocks_used + self.kv_blocks_free
        return self.kv_blocks_used / total if total else 0.0


@dataclass(slots=True)
class RequestMetrics:
    request_id: str
    arrival_time: float
    prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Every inter-token gap, seconds."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, seconds."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e, itl=self.itl)
        return d


@dataclass(slots=True)
class MemoryStats:
    weights_bytes: int
    kv_cache_bytes: int
    """The whole KV pool: num_kv_blocks plus one scratch block."""
    peak_bytes: int
    """Device peak allocation where the platform tracks it, else the process's peak RSS."""
    kv_bytes_per_block: int
    num_kv_blocks: int


def _tail(d: deque, n: int) -> list:
    """The last n items of a deque (all of it if n is larger), without walking the rest."""
    n = min(max(n, 0), len(d))
    return [d[i] for i in range(len(d) - n, len(d))]


class Telemetry:
    def __init__(self, max_steps: int = 100_000, max_requests: int = 100_000):
        self._lock = threading.Lock()
        self.steps: deque[StepEvent] = deque(maxlen=max_steps)
        self.requests: deque[RequestMetrics] = deque(maxlen=max_requests)
        self.num_steps = 0
        self.num_requests = 0
        """Finished request records ever added (RequestMetrics are numbered from 0)."""
        self.memory: MemoryStats | None = None
        self.notices: list[str] = []
        """What the engine does differently from what was asked (e.g. graph mode on a CPU)."""

    def add_step(self, ev: StepEvent) -> None:
        with self._lock:
            self.steps.append(ev)
            self.num_steps += 1

    def add_request(self, m: RequestMetrics) -> None:
        with self._lock:
            self.requests.append(m)
            self.num_requests += 1

    def requests_since(self, n: int) -> list[RequestMetrics]:
        """Request records numbered >= n (for pollers that remember where they were)."""
        with self._lock:
            return _tail(self.requests, self.num_requests - n)

    def steps_since(self, step: int) -> list[StepEvent]:
        """Step events with index >= step (for pollers that remember where they were)."""
        with self._lock:
            return _tail(self.steps, self.num_steps - step)

    def snapshot(self) -> tuple[list[StepEvent], list[RequestMetrics]]:
        with self._lock:
            return list(self.steps), list(self.requests)

    def clear(self) -> None:
        with self._lock:
            self.steps.clear()
            self.requests.clear()

    def to_dict(self) -> dict:
        steps, reqs = self.snapshot()
        return {"memory": asdict(self.memory) if self.memory else None,
                "notices": list(self.notices),
                "steps": [asdict(s) for s in steps],
                "requests": [r.to_dict() for r in reqs]}

    def to_json(self, path: str | None = None, indent: int | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text
