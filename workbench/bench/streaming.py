"""Streaming to a client, measured from both ends: what a client sees of a token stream (when
each server-sent event arrived, TTFT and the gaps between tokens), what the engine says of
the same request (its /metrics histograms, before and after), and what a client that hangs
up leaves behind (the KV blocks in use, polled while it streams and after). For notebook 04;
needs httpx (the 'serve' extra). Latencies are the engine's definitions
(`workbench.telemetry`), so the two ends compare like for like."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..serving.client import RemoteEngine
from ..telemetry import time_per_output_token


@dataclass
class ClientStream:
    """One streamed request as its client saw it."""
    sent: float
    """time.monotonic() when the request went out."""
    arrivals: list[float] = field(default_factory=list)
    """time.monotonic() of each token's event, in order."""
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def since_sent(self) -> list[float]:
        return [t - self.sent for t in self.arrivals]

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    @property
    def tpot(self) -> float | None:
        return time_per_output_token(self.arrivals[0], self.arrivals[-1], len(self.arrivals))

    def bursts(self, within: float = 0.002) -> int:
        """Separate arrivals: tokens that came less than `within` s after the one before
        belong to the same burst (one read of the socket)."""
        return 1 + sum(g >= within for g in self.gaps) if self.arrivals else 0


def stream_timed(url: str, prompt, max_tokens: int, *, echo: bool = False,
                 hang_up_after: int | None = None, **params) -> ClientStream:
    """Stream one chat request from the server at `url`, noting when each token arrives;
    `echo` prints each as it comes. `hang_up_after`: close the connection after that many
    tokens (a client that goes away)."""
    with RemoteEngine(url) as remote:
        out = ClientStream(time.monotonic())
        events = remote.stream(prompt, max_tokens, chat=True, **params)
        for ev in events:
            if ev.text:
                out.arrivals.append(ev.time)
                out.texts.append(ev.text)
                if echo:
                    print(ev.text, end="", flush=True)
            if ev.finished:
                out.finish_reason = ev.finish_reason
            if hang_up_after is not None and len(out.arrivals) >= hang_up_after:
                events.close()                     # closes the response: the socket goes
                out.finish_reason = "hung up"
                break
        if echo:
            print()
        return out


def engine_metrics(url: str) -> dict:
    """The server's /metrics, summarized (RemoteEngine.poll_metrics)."""
    with RemoteEngine(url) as remote:
        m = remote.poll_metrics()
    if m is None:
        raise RuntimeError(f"{url} has no /metrics")
    return m


def engine_latency(before: dict, after: dict) -> dict[str, float | None]:
    """The engine's own TTFT and TPOT (s) for the requests that finished between two
    `engine_metrics` readings: each histogram's added sum over its added count (one request
    between them: exactly that request's)."""
    out = {}
    for key, name in (("ttft", "time_to_first_token_seconds"),
                      ("tpot", "request_time_per_output_token_seconds")):
        a, b = before["histograms"].get(name), after["histograms"].get(name)
        n = (b or {}).get("count", 0) - (a or {}).get("count", 0)
        out[key] = ((b["sum"] - (a or {}).get("sum", 0)) / n) if n else None
    out["requests"] = (after["histograms"]["time_to_first_token_seconds"] or {}).get("count", 0) - \
        (before["histograms"]["time_to_first_token_seconds"] or {}).get("count", 0)
    return out


def kv_blocks(metrics: dict) -> tuple[int, int]:
    """(blocks in use by live requests, blocks in the pool) from an `engine_metrics` reading:
    vLLM's kv_cache_usage_perc times the pool size its cache_config_info names."""
    info = metrics["samples"].get("vllm:cache_config_info") or [({}, 0)]
    total = int(info[0][0].get("num_gpu_blocks", 0))
    return round((metrics["kv_cache_usage_perc"] or 0.0) * total), total


@dataclass
class KvWatch:
    """What `watch_kv_during` saw."""
    result: object
    """What the action returned."""
    start: float
    """time.monotonic() when the watch began."""
    samples: list[tuple[float, int]]
    """(seconds since start, KV blocks in use), one per poll."""
    pool: int
    """Blocks in the pool."""


def watch_kv_during(url: str, action, period: float = 0.05, settle_s: float = 30.0) -> KvWatch:
    """Run `action()` while a thread polls the server's KV blocks in use every `period` s,
    and keeps polling after it until no request runs and no block is in use (at most
    `settle_s` more)."""
    import threading
    watch = KvWatch(None, time.monotonic(), [], 0)
    done = threading.Event()
    t_done = [float("inf")]

    def poll() -> None:
        with RemoteEngine(url) as remote:
            while True:
                m = remote.poll_metrics()
                used, watch.pool = kv_blocks(m)
                watch.samples.append((time.monotonic() - watch.start, used))
                if done.is_set() and ((not m["num_requests_running"] and not used)
                                      or time.monotonic() - t_done[0] > settle_s):
                    return
                time.sleep(period)

    th = threading.Thread(target=poll, daemon=True, name="kv-watch")
    th.start()
    try:
        watch.result = action()
    finally:
        t_done[0] = time.monotonic()
        done.set()
        th.join(settle_s + 10)
    return watch
