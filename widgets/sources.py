"""Where panels get their data: the in-process Engine, or a remote OpenAI-compatible server.

A source buffers what happens (token events arrive from the engine's thread, or from asyncio
streams for a remote server) and hands everything over in one `poll()` per UI tick, so the
panels redraw at the UI's pace, never once per token.

Both sources give the panels the same shapes:
- token events with `request_id, text, index, time, finished, finish_reason`
  (the engine's `TokenEvent`, or `RemoteTokenEvent` with the source's own request id);
- timeline points with the fields of a `StepEvent` that a timeline draws (a remote server
  has no per-step record, so each poll of its `/metrics` becomes one `MetricsPoint`; a server
  without /metrics gets points from what this client sees of its streams);
- one `RequestRecord` per finished request, for the summary;
- errors as (who, message) pairs, for an error log that counts repeats.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from workbench import Engine, SamplingParams
from workbench.telemetry import EngineInfo
from workbench.trace import prompt_label

from .style import modelled_label



@dataclass
class RequestRecord:
    """A finished request, as the summary sees it (seconds; None where unknown)."""
    request_id: str
    ttft: float | None
    tpot: float | None
    e2e: float | None
    output_tokens: int
    finish_reason: str | None
    num_preemptions: int = 0
    end: float = 0.0
    """time.monotonic() when it finished."""


@dataclass
class MetricsPoint:
    """One interval of a remote server, with the StepEvent fields a timeline draws: a poll of
    its /metrics (phase 'poll'), or, for a server without /metrics, what this client saw of
    its own streams in that interval (phase 'client')."""
    step: int
    start: float
    duration: float
    num_prefill_tokens: int
    """Prompt tokens the server counted since the previous poll (0 in the client's view)."""
    num_decode_tokens: int
    """Output tokens since the previous point: the server's count, or in the client's view
    the tokens its streams brought (a request's usage count, where the server gave one,
    replaces its chunk count when it ends, as everywhere else)."""
    num_running: int
    """Requests running (client's view: streaming, first token received)."""
    num_waiting: int
    """Requests waiting (client's view: sent, no token yet)."""
    kv_usage: float | None
    """KV pool in use, 0..1; None where unknown (the client's view)."""
    num_preempted: int
    phase: str = "poll"
    ttfts: list = field(default_factory=list)
    """Client's view: TTFTs (s) of the requests whose first token came in this interval."""
    graph: bool | None = None
    """Unknown: a server's /metrics does not say."""
    graph_size: int | None = None
    graph_kind: str | None = None
    tokens_per_request: dict = field(default_factory=dict)
    kinds: dict = field(default_factory=dict)
    preempted: list = field(default_factory=list)
    finished: list = field(default_factory=list)


@dataclass
class Update:
    """Everything that happened since the previous poll."""
    submitted: list[tuple[str, float, str]] = field(default_factory=list)
    """(request id, time.monotonic() sent, a short label of the prompt)."""
    events: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    finished: list[RequestRecord] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    """(who: a request id or an endpoint, message)."""

    def __bool__(self) -> bool:
        return bool(self.submitted or self.events or self.steps or self.finished or self.errors)


def describe_engine(i: EngineInfo) -> dict[str, str]:
    """What an engine runs, in a few words per item, for a header (a live engine's, or a
    recorded trace's)."""
    c = i.config
    weights = "+".join(getattr(i, "weight_formats", ()) or ()) or i.dtype
    device = i.device if not getattr(i, "modelled", None) else f"{i.device} (MODELLED)"
    return {"model": c.model, "device": device, "dtype": i.dtype, "weights": weights,
            "attention": i.attention,
            "block size": str(c.block_size), "KV blocks": str(i.num_kv_blocks),
            "max_num_seqs": str(c.max_num_seqs),
            "max_num_batched_tokens": str(c.max_num_batched_tokens),
            "graph mode": i.graph_mode if i.graph_mode == c.graph_mode
            else f"{i.graph_mode} (asked: {c.graph_mode})",
            "prefix caching": "on" if c.enable_prefix_caching else "off",
            **({"speculative": _speculative(c)} if c.speculative_config else {})}


def _speculative(c) -> str:
    """speculative_config in a few words: 'ngram, k=4' or 'draft_model random:tiny, k=4'."""
    sc = c.speculative()
    what = f"{sc.method} {sc.model}" if sc.model else sc.method
    return f"{what}, k={sc.num_speculative_tokens}"


class LocalSource:
    """The in-process engine, stepping in its background thread."""

    resolution = "step"

    def __init__(self, engine: Engine):
        self.engine = engine.start()
        self._events: deque = deque()             # appended from the engine's thread
        self._submitted: list[tuple[str, float, str]] = []
        self._pending: set[str] = set()
        self._next_step = engine.telemetry.num_steps
        self._next_request = engine.telemetry.num_requests
        self._cost_key, self._cost = None, ""

    @property
    def config(self):
        return self.engine.info().config

    @property
    def notices(self) -> list[str]:
        return list(self.engine.telemetry.notices)

    def describe(self) -> dict[str, str]:
        return describe_engine(self.engine.info())

    @property
    def modelled(self) -> str:
        """'' on a real device; on a modelled one, what its times are (style.modelled_label)."""
        return modelled_label(self.engine.info())

    def sampling_cost(self, params: SamplingParams, batch: int) -> str:
        """What sampling with `params` costs a step of `batch` rows against greedy on this
        engine's device: three interleaved measurements between two looks at the machine
        (bench.steady), the medians in words. Kept per (temperature, top-p, top-k, min-p,
        batch) once measured on a quiet machine; on a busy one the figure says so and is
        measured again the next time the header is drawn."""
        from workbench.bench.steady import Runs, checked
        key = (params.temperature, params.top_p, params.top_k, params.min_p, batch)
        if self._cost_key != key:
            runs, machine = checked(lambda: [self.engine.sampler_cost(params, batch)
                                             for _ in range(3)])
            sampled = Runs([c["sampled_ms"] for c in runs]).median
            greedy = Runs([c["greedy_ms"] for c in runs]).median
            text = (f"adds {max(0.0, sampled - greedy):.1f} ms to a step of {batch} requests on "
                    f"this machine ({sampled:.1f} ms sampled, {greedy:.1f} ms greedy)")
            if machine.busy:
                return text + (" — measured while this machine was busy, so not the engine's "
                               f"figure ({machine.describe()})")
            self._cost_key, self._cost = key, text
        return self._cost

    def submit(self, prompt: Any, params: SamplingParams) -> str:
        """Queue one request (bad input raises ValueError and queues nothing)."""
        rid = self.engine.add_request(prompt, params, listener=self._events.append)
        self._submitted.append((rid, time.monotonic(), prompt_label(prompt)))
        self._pending.add(rid)
        return rid

    @property
    def num_pending(self) -> int:
        """Requests sent through this source whose final event has not been polled yet."""
        return len(self._pending)

    def abort_all(self) -> None:
        for rid in list(self._pending):
            self.engine.abort(rid)

    def poll(self) -> Update:
        u = Update(self._submitted)
        self._submitted = []
        while self._events:
            ev = self._events.popleft()
            u.events.append(ev)
            if ev.finished:
                self._pending.discard(ev.request_id)
        tel = self.engine.telemetry
        u.steps = [s for s in tel.steps_since(self._next_step) if s.phase != "idle"]
        self._next_step = tel.num_steps
        for m in tel.requests_since(self._next_request):
            u.finished.append(RequestRecord(m.request_id, m.ttft, m.tpot, m.e2e, m.output_tokens,
                                            m.finish_reason, m.num_preemptions,
                                            m.finished_time or time.monotonic()))
        self._next_request = tel.num_requests
        return u

    def kv_blocks(self):
        return self.engine.kv_blocks()

    def prefix_cache_stats(self) -> tuple[int, int]:
        st = self.engine.stats()
        return st.prefix_cache_hits, st.prefix_cache_queries

    def close(self) -> None:
        self.engine.shutdown()


def request_fields(params: SamplingParams) -> dict[str, Any]:
    """The request-body fields for `params` beyond max_tokens and temperature: only those set
    away from their defaults, so a strict OpenAI server sees nothing the user did not ask for
    (vLLM's extensions top_k, stop_token_ids and ignore_eos included)."""
    default = SamplingParams()
    out = {name: getattr(params, name) for name in ("top_p", "seed", "stop", "stop_token_ids",
                                                     "ignore_eos")
           if getattr(params, name) != getattr(default, name)}
    if params.top_k > 0:
        out["top_k"] = params.top_k
    return out


class RemoteSource:
    """A remote OpenAI-compatible server (vLLM, vLLM-Ascend, `workbench serve`, others).

    At connect it asks once what the server offers (`RemoteEngine.probe()`): its models, its
    /metrics, its version. Requests stream as asyncio tasks on the caller's running loop (in
    Jupyter, the kernel's). Where the server has vLLM's /metrics, they are polled every
    `metrics_interval` seconds into MetricsPoints (`resolution` 'poll'); where it has none,
    the points come from this client's own streams at that interval (`resolution` 'client'),
    and `notices` says so. `model`: the model id to request (default: the first listed; a
    server that lists none needs it, and says so in `notices` until given). Needs a running
    asyncio loop to send: use it from a notebook cell, a widget callback or an `async` function.
    """

    def __init__(self, url, *, api_key: str | None = None, model: str | None = None,
                 chat: bool = True, metrics_interval: float = 0.5):
        from workbench.serving.client import RemoteEngine, RemoteError
        self.remote = url if isinstance(url, RemoteEngine) else RemoteEngine(url, model, api_key)
        if model is not None:
            self.remote.model = model
        self.chat = chat
        self.metrics_interval = metrics_interval
        self.info = self.remote.probe()
        self.config = None                        # a server's knobs are not ours to turn
        self.notices: list[str] = []
        try:
            self.model: str | None = self.remote.model
        except RemoteError as e:
            self.model = None
            self.notices.append(f"{e}. Until then nothing can be sent.")
        self.resolution = "poll" if self.info.metrics else "client"
        if not self.info.metrics:
            self.notices.append(self._no_metrics())
        self._ids = itertools.count()
        self._events: deque = deque()
        self._submitted: list[tuple[str, float, str]] = []
        self._points: list[MetricsPoint] = []
        self._records: list[RequestRecord] = []
        self._errors: list[tuple[str, str]] = []
        self._tasks: dict[str, asyncio.Task] = {}
        self._metrics_task: asyncio.Task | None = None
        self._last: dict | None = None
        """The previous /metrics read: each point is the counters' change since it."""
        self._polls = 0
        self._first_token: dict[str, float | None] = {}   # client's view: rid -> TTFT, in flight
        self._tokens = 0                                  # client's view: tokens this interval
        self._ttfts: list[float] = []

    def _no_metrics(self) -> str:
        return (f"{self.remote.url} has no vLLM /metrics (GET /metrics: {self.info.metrics_why}): "
                "the timeline shows this client's own view of its requests (in flight, waiting "
                "for a first token, tokens per interval, TTFT), not the server's.")

    def describe(self) -> dict[str, str]:
        out = {"server": self.remote.url, "model": self.model or "none listed: pass model="}
        if self.info.version:
            out["version"] = self.info.version
        out["metrics"] = (f"/metrics every {self.metrics_interval:g} s" if self.info.metrics
                          else f"none ({self.info.metrics_why}): client view")
        return out

    @property
    def num_pending(self) -> int:
        return len(self._tasks)

    def ready(self) -> None:
        """Raise ValueError if nothing can be sent yet (no model to name)."""
        if self.model is None:
            raise ValueError(f"model: the server at {self.remote.url} lists no models; give the "
                             "model id to request (model=... or workbench dashboard --model)")

    def submit(self, prompt: Any, params: SamplingParams) -> str:
        """Send one request (bad input, or no model to name, raises ValueError; nothing sent)."""
        params.validate()
        self.ready()
        rid = f"remote-{next(self._ids)}"
        self._ensure_metrics()
        task = asyncio.ensure_future(self._stream(rid, prompt, params))
        self._tasks[rid] = task
        self._first_token[rid] = None
        self._submitted.append((rid, time.monotonic(), prompt_label(prompt)))
        return rid

    async def _stream(self, rid: str, prompt: Any, params: SamplingParams) -> None:
        last = None
        try:
            async for ev in self.remote.astream(prompt, params.max_tokens, chat=self.chat,
                                                temperature=params.temperature,
                                                **request_fields(params)):
                ev.request_id = rid
                last = ev
                self._events.append(ev)
                if ev.text:
                    self._tokens += 1
                    if self._first_token.get(rid, 0) is None:
                        self._first_token[rid] = ev.since_start
                        self._ttfts.append(ev.since_start)
            st = last.stats
            self._tokens += st.num_tokens - st.num_chunks   # the usage count is the count
            self._records.append(RequestRecord(rid, st.ttft, st.tpot, st.e2e, st.num_tokens,
                                               st.finish_reason, 0, time.monotonic()))
        except asyncio.CancelledError:
            self._final(rid, "abort")
            raise
        except Exception as e:   # the server said no, or the connection broke
            self._errors.append((rid, str(e)))
            self._final(rid, "error")
        finally:
            self._tasks.pop(rid, None)
            self._first_token.pop(rid, None)

    def _final(self, rid: str, reason: str) -> None:
        from workbench.serving.client import RemoteTokenEvent
        now = time.monotonic()
        self._events.append(RemoteTokenEvent(rid, "", 0, now, 0.0, None, True, reason))

    def _ensure_metrics(self) -> None:
        if self._metrics_task is None or self._metrics_task.done():
            if self.resolution == "poll" and self._last is None:
                # The counters' baseline, read before the first request goes out: every
                # token the server counts from here on lands in some point.
                try:
                    self._last = self.remote.poll_metrics()
                except Exception as e:
                    self._errors.append(("/metrics", str(e)))
            self._metrics_task = asyncio.ensure_future(self._poll_metrics())

    async def _poll_metrics(self) -> None:
        """One point per interval: from /metrics while the server answers it (a 404 ends the
        polling, with one notice, and the client's view takes over), else the client's view."""
        while True:
            t0 = time.monotonic()
            if self.resolution == "poll":
                try:
                    m = await self.remote.apoll_metrics()
                except Exception as e:
                    self._errors.append(("/metrics", str(e)))
                else:
                    if m is None:
                        self.info.metrics, self.info.metrics_why = False, "404"
                        self.resolution = "client"
                        self.notices.append(self._no_metrics())
                    else:
                        self._add_point(m, t0)
            else:
                self._add_client_point(t0)
            await asyncio.sleep(max(0.0, self.metrics_interval - (time.monotonic() - t0)))

    def _add_client_point(self, t0: float) -> None:
        running = sum(v is not None for v in self._first_token.values())
        self._points.append(MetricsPoint(
            self._polls, t0, self.metrics_interval, 0, self._tokens, running,
            len(self._first_token) - running, None, 0, phase="client", ttfts=self._ttfts))
        self._tokens, self._ttfts = 0, []
        self._polls += 1

    def _add_point(self, m: dict, t0: float) -> None:
        prev, self._last = self._last, m
        if prev is None:
            return   # the first poll is the baseline for the counters

        def delta(key: str) -> int:
            a, b = prev.get(key), m.get(key)
            return int(round(b - a)) if a is not None and b is not None else 0

        self._points.append(MetricsPoint(
            self._polls, t0, m["time"] - prev["time"], delta("prompt_tokens_total"),
            delta("generation_tokens_total"), int(m.get("num_requests_running") or 0),
            int(m.get("num_requests_waiting") or 0), float(m.get("kv_cache_usage_perc") or 0.0),
            delta("num_preemptions_total")))
        self._polls += 1

    def abort_all(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()

    def poll(self) -> Update:
        u = Update(self._submitted, list(self._events), self._points, self._records, self._errors)
        self._events.clear()
        self._submitted, self._points, self._records, self._errors = [], [], [], []
        return u

    def kv_blocks(self):
        return None     # a server does not publish its block table

    def kv_note(self) -> str:
        """What the KV map says instead of a block table."""
        return "A remote server does not publish its block table" + (
            "; the timeline shows its KV usage from /metrics." if self.resolution == "poll"
            else ", and this one has no /metrics either: nothing here shows its KV cache.")

    def prefix_cache_stats(self) -> tuple[int, int] | None:
        return None

    def close(self) -> None:
        self.abort_all()
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        self.remote.close()


def as_source(obj) -> LocalSource | RemoteSource:
    """An Engine, a source, a RemoteEngine or a server URL -> a source."""
    if isinstance(obj, (LocalSource, RemoteSource)):
        return obj
    if isinstance(obj, Engine):
        return LocalSource(obj)
    if isinstance(obj, str) and obj.startswith(("http://", "https://")):
        return RemoteSource(obj)
    from workbench.serving.client import RemoteEngine
    if isinstance(obj, RemoteEngine):
        return RemoteSource(obj)
    raise TypeError(f"expected an Engine, a RemoteEngine, a server URL or a source "
                    f"(got {type(obj).__name__})")
