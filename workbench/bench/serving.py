"""A serving benchmark in the manner of `vllm bench serve`, against any OpenAI-compatible
server (`workbench bench --url URL`): N streamed requests at a concurrency limit and/or a
Poisson request rate, reporting throughput and TTFT / TPOT / ITL / end-to-end percentiles,
plus the server's peak load where it has /metrics."""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict

import httpx

from ..serving.client import RemoteEngine, RemoteError, RemoteStats
from ..telemetry import distribution

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
          "which but have an they you were her she there would their we him been has when who "
          "will more no if out so said what up its about into than them can only other new "
          "some could time these two may then do first any my now such like our over man me "
          "even most made after also did many before must through back years where much your "
          "way well down should because each just those people how too little state good very "
          "make world still own see men work long get here between both life being under never "
          "day same another know while last might us great old year off come since against go "
          "came right used take three").split()


async def bench_async(url: str, num_requests: int = 64, concurrency: int = 16,
                      input_words: tuple[int, int] = (16, 256), output_len: tuple[int, int] = (16, 256),
                      model: str | None = None, api_key: str | None = None, seed: int = 0,
                      chat: bool = False, ignore_eos: bool = False,
                      metrics_interval: float = 0.5, request_rate: float = math.inf,
                      progress: bool = False, endpoint: str | None = None) -> dict:
    """Send `num_requests` streamed requests, at most `concurrency` at a time, with random word
    prompts of `input_words` words and `output_len` max_tokens. `ignore_eos` (vLLM's extension,
    sent only when True) makes each run to its length on servers that take it. `request_rate`
    (requests/s) spaces the arrivals as a Poisson process (seeded); inf sends them all at
    once. Where the server has /metrics, it is polled for the peak running / waiting / KV
    usage (`server_peaks`: gauges sampled at that interval, so a short burst can fall
    between two polls), and its counters are read before the first request and after the last
    (`server_counts`: requests finished by reason, prompt and generated tokens, and the
    latency histograms' sample counts, all as the server counted them, which sees every
    request whatever the polling caught; None where it has no /metrics). `progress` shows a
    progress bar on stderr. `endpoint` ("completions", "chat" or "responses"; default: chat
    if `chat`, else completions) is the API the requests go to. Returns a JSON-able report;
    `errors` maps each distinct error to its count.
    A server that lists no models, with no `model` given, raises RemoteError."""
    endpoint = endpoint or ("chat" if chat else "completions")
    if concurrency < 1 or num_requests < 1 or not request_rate > 0:
        raise ValueError("num_requests and concurrency must be >= 1, request_rate > 0")
    rng = random.Random(seed)
    jobs = [(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(*input_words))),
             rng.randint(*output_len)) for _ in range(num_requests)]
    arrivals, t = [], 0.0
    for _ in jobs:
        arrivals.append(t)
        t += rng.expovariate(request_rate) if math.isfinite(request_rate) else 0.0
    remote = RemoteEngine(url, model=model, api_key=api_key)
    results: list[RemoteStats] = []
    errors: dict[str, int] = {}
    bar = None
    try:
        info = remote.probe()
        model_name = remote.model
        peaks = dict.fromkeys(("num_requests_running", "num_requests_waiting",
                               "kv_cache_usage_perc"), 0.0) if info.metrics else None
        before = await _counters(remote) if info.metrics else None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=num_requests, desc="requests", unit="req")
        sem = asyncio.Semaphore(concurrency)
        done = asyncio.Event()
        extra = {"ignore_eos": True} if ignore_eos else {}

        async def one(prompt: str, n: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            async with sem:
                try:
                    async for ev in remote.astream(prompt, n, endpoint=endpoint, **extra):
                        if ev.stats is not None:
                            results.append(ev.stats)
                except (RemoteError, httpx.HTTPError) as e:
                    key = f"{type(e).__name__}: {e}"
                    errors[key] = errors.get(key, 0) + 1
                if bar is not None:
                    bar.update(1)

        async def watch() -> None:
            while peaks is not None and not done.is_set():
                try:
                    m = await remote.apoll_metrics()
                except (RemoteError, httpx.HTTPError, ValueError):
                    m = {}
                if m is None:
                    return          # the server stopped answering /metrics (404)
                for k in peaks:
                    if m.get(k) is not None:
                        peaks[k] = max(peaks[k], m[k])
                try:
                    await asyncio.wait_for(done.wait(), metrics_interval)
                except asyncio.TimeoutError:
                    pass

        watcher = asyncio.ensure_future(watch())
        t0 = time.monotonic()
        await asyncio.gather(*(one(p, n, at) for (p, n), at in zip(jobs, arrivals)))
        duration = time.monotonic() - t0
        done.set()
        await watcher
        counts = None
        if before is not None:
            after = await _counters(remote)
            counts = None if after is None else counter_deltas(before, after)
    finally:
        if bar is not None:
            bar.close()
        await remote.aclose()
        remote.close()
    out_tokens = sum(s.num_tokens for s in results)
    in_tokens = sum(s.prompt_tokens or 0 for s in results)
    return {
        "url": url, "model": model_name, "server": asdict(info),
        "workload": {"num_requests": num_requests, "concurrency": concurrency,
                     "request_rate": request_rate if math.isfinite(request_rate) else "inf",
                     "input_words": list(input_words), "output_len": list(output_len),
                     "seed": seed, "chat": endpoint == "chat", "endpoint": endpoint,
                     "ignore_eos": ignore_eos},
        "completed": len(results), "failed": sum(errors.values()), "errors": errors,
        "duration_s": duration,
        "arrival_span_s": arrivals[-1],
        "request_throughput": len(results) / duration if duration else None,
        "output_throughput": out_tokens / duration if duration else None,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_s": distribution([s.ttft for s in results if s.ttft is not None]),
        "tpot_s": distribution([s.tpot for s in results if s.tpot is not None]),
        "itl_s": distribution([g for s in results for g in s.itl]),
        "e2e_s": distribution([s.e2e for s in results if s.e2e is not None]),
        "server_peaks": peaks,
        "server_counts": counts,
    }


async def _counters(remote: RemoteEngine) -> dict | None:
    """One /metrics read for its counters (None: it failed or the server has none now)."""
    try:
        return await remote.apoll_metrics()
    except (RemoteError, httpx.HTTPError, ValueError):
        return None


def counter_deltas(before: dict, after: dict) -> dict:
    """What the server counted between two /metrics reads (`RemoteEngine.poll_metrics`):
    requests finished by reason (and their total), prompt and generated tokens, preemptions,
    and each latency histogram's number of samples. A counter the server lacks is None."""
    def delta(key: str):
        a, b = before.get(key), after.get(key)
        return None if a is None or b is None else b - a

    ra, rb = before["request_success_total"], after["request_success_total"]
    reasons = {r: rb[r] - ra.get(r, 0.0) for r in rb if rb[r] - ra.get(r, 0.0)}
    hist = {}
    for name, h in after["histograms"].items():
        h0 = before["histograms"].get(name)
        if h is not None and h0 is not None:
            hist[name] = h["count"] - h0["count"]
    return {"request_success": sum(reasons.values()) if rb else None,
            "request_success_by_reason": reasons,
            "prompt_tokens": delta("prompt_tokens_total"),
            "generation_tokens": delta("generation_tokens_total"),
            "num_preemptions": delta("num_preemptions_total"),
            "histogram_counts": hist}


def bench(url: str, **kw) -> dict:
    """Synchronous wrapper of `bench_async` (not for use inside a running event loop)."""
    return asyncio.run(bench_async(url, **kw))


def format_report(r: dict) -> str:
    def ms(d, k):
        v = d.get(k)
        return "n/a" if v is None else f"{v * 1e3:.1f}"

    lines = [f"{r['completed']}/{r['workload']['num_requests']} requests in {r['duration_s']:.1f} s "
             f"({r['failed']} failed) against {r['url']} ({r['model']})",
             f"  {r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} output tok/s",
             "  metric      mean     p50     p90     p99   (ms)"]
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = r[name]
        lines.append(f"  {name[:-2]:<8} {ms(d, 'mean'):>7} {ms(d, 'p50'):>7} {ms(d, 'p90'):>7} "
                     f"{ms(d, 'p99'):>7}")
    p = r["server_peaks"]
    if p is None:
        lines.append(f"  server peaks: no data (GET /metrics: {r['server']['metrics_why']}); "
                     "the figures above are the client's")
    else:
        lines.append(f"  server peaks (sampled every poll): running {p['num_requests_running']:.0f}, "
                     f"waiting {p['num_requests_waiting']:.0f}, KV usage "
                     f"{p['kv_cache_usage_perc']:.0%}")
    c = r.get("server_counts")
    if c is not None:
        def n(v):
            return "n/a" if v is None else f"{v:.0f}"
        lines.append(f"  server counted: {n(c['request_success'])} requests finished, "
                     f"{n(c['prompt_tokens'])} prompt + {n(c['generation_tokens'])} generated "
                     f"tokens, {n(c['num_preemptions'])} preemptions")
    for message, n in r["errors"].items():
        lines.append(f"  error x{n}: {message}")
    return "\n".join(lines)
