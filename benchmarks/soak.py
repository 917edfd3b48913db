"""Soak: mixed traffic against `workbench serve` for a bounded time; nothing but caches may grow.

    python benchmarks/soak.py --minutes 30 --output soak.json     # a real soak (docs/soak.md)
    python benchmarks/soak.py --minutes 0.5                       # what the test suite runs

It starts the server itself (its own session, stopped at the end, process tree and all),
warms it up, then records the server process's RSS, open file descriptors and threads, and
from /metrics the requests running and waiting and the share of KV blocks in use. Then
`--concurrency` clients loop until the time is up, each request one of: streamed to the end,
not streamed, a stream cut after a random number of chunks, a non-streamed request abandoned
after a random delay. Once the clients are gone and the server is idle, it records the same
figures again and fails (exit 1) if anything grew: requests or KV blocks left behind, more
fds or threads, or RSS beyond `--rss-slack-mb` (allocator caches and the prefix cache's
blocks are the only growth allowed; prefix-cached blocks are not "in use").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from workbench.serving.prometheus import parse_prometheus, summarize_metrics  # noqa: E402

WORDS = ("the engine schedules requests in steps and every step either prefills a chunk of a "
         "prompt or decodes one token for each running request while blocks of the cache are "
         "allocated freed and shared between prompts with a common prefix").split()
KINDS = ("stream", "complete", "cut_stream", "abandon")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, extra: list[str], log_path: Path, timeout: float = 300.0):
    port = free_port()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", "--model", model,
                                 "--device", "cpu", "--port", str(port), "--log-level",
                                 "warning", "--allow-missing-model", *extra], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    raise RuntimeError(f"the server did not come up:\n{log_path.read_text(errors='replace')[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def snapshot(url: str, pid: int) -> dict:
    p = psutil.Process(pid)
    m = summarize_metrics(parse_prometheus(httpx.get(url + "/metrics", timeout=30).text))
    return {"rss_mb": round(p.memory_info().rss / 2**20, 1), "fds": p.num_fds(),
            "threads": p.num_threads(), "running": m["num_requests_running"],
            "waiting": m["num_requests_waiting"], "kv_usage": m["kv_cache_usage_perc"]}


def wait_idle(url: str, pid: int, timeout: float = 30.0, settle_to: dict | None = None) -> dict:
    """The server's figures once nothing runs or waits (bounded). With `settle_to`, also
    until its fds and threads are back to those levels: a connection the client just closed
    may take the server a moment to close. The bound is longer than the server's header
    timeout (10 s), so whatever is still open after it is a leak."""
    deadline = time.monotonic() + timeout
    while True:
        s = snapshot(url, pid)
        idle = s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0
        settled = settle_to is None or all(s[k] <= settle_to[k] for k in ("fds", "threads"))
        if (idle and settled) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


async def one_request(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random,
                      counts: dict) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120)))
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 48), "temperature": 0.8,
            "seed": rng.randrange(2**31), "stream": kind in ("stream", "cut_stream")}
    try:
        if kind == "abandon":             # a client that gives up mid-request
            await asyncio.wait_for(client.post(url + "/v1/completions", json=body),
                                   timeout=rng.uniform(0.05, 1.5))
        elif body["stream"]:
            cut = rng.randint(1, 12) if kind == "cut_stream" else None
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data:")
                    if cut is not None and n >= cut:
                        break             # leaving the block closes the connection mid-stream
        else:
            (await client.post(url + "/v1/completions", json=body)).raise_for_status()
        counts[kind] += 1
    except asyncio.TimeoutError:
        counts[kind] += 1
    except httpx.HTTPError as e:
        counts["errors"] += 1
        counts["last_error"] = f"{kind}: {type(e).__name__}: {e}"


async def traffic(url: str, seconds: float, concurrency: int, seed: int) -> dict:
    counts = dict.fromkeys(KINDS, 0) | {"errors": 0}
    deadline = time.monotonic() + seconds

    async def client_loop(i: int):
        rng = random.Random(seed * 1000 + i)
        # One connection per request, as browsers and SDKs often do: the server must close
        # every one of them.
        while time.monotonic() < deadline:
            async with httpx.AsyncClient(timeout=120) as client:
                await one_request(client, url, rng.choice(KINDS), rng, counts)

    await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    return counts


def judge(start: dict, end: dict, rss_slack_mb: float) -> list[str]:
    bad = []
    for k in ("running", "waiting", "kv_usage"):
        if end[k] != 0:
            bad.append(f"{k} is {end[k]} after the traffic stopped")
    for k in ("fds", "threads"):
        if end[k] > start[k]:
            bad.append(f"{k} grew from {start[k]} to {end[k]}")
    if end["rss_mb"] > start["rss_mb"] + rss_slack_mb:
        bad.append(f"RSS grew from {start['rss_mb']} MB to {end['rss_mb']} MB "
                   f"(allowed: +{rss_slack_mb} MB)")
    return bad


def soak(minutes: float, model: str = "smollm2", concurrency: int = 8, seed: int = 0,
         rss_slack_mb: float = 64.0, server_args: tuple[str, ...] = (),
         log_path: Path | None = None) -> dict:
    log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-{os.getpid()}.log"
    proc, url = start_server(model, ["--max-step-events", "1000", *server_args], log_path)
    try:
        asyncio.run(traffic(url, min(20.0, 0.2 * minutes * 60), concurrency, seed + 1))  # warm-up
        start = wait_idle(url, proc.pid)
        t = time.monotonic()
        counts = asyncio.run(traffic(url, minutes * 60, concurrency, seed))
        elapsed = time.monotonic() - t
        end = wait_idle(url, proc.pid, settle_to=start)
        ok_health = httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        stop_server(proc)
    failures = judge(start, end, rss_slack_mb)
    if not ok_health:
        failures.append("/health is not 200 after the soak")
    if counts["errors"]:
        failures.append(f"{counts['errors']} requests failed (last: {counts.get('last_error')})")
    return {"minutes": minutes, "elapsed_s": round(elapsed, 1), "model": model,
            "concurrency": concurrency, "seed": seed, "requests": counts, "start": start,
            "end": end, "rss_slack_mb": rss_slack_mb, "failures": failures,
            "ok": not failures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-slack-mb", type=float, default=64.0,
                    help="RSS growth allowed for allocator caches (default 64)")
    ap.add_argument("--output", default=None, help="write the report as JSON here")
    a = ap.parse_args(argv)
    if not (a.minutes > 0 and a.concurrency > 0):
        ap.error("--minutes and --concurrency must be > 0")
    report = soak(a.minutes, a.model, a.concurrency, a.seed, a.rss_slack_mb)
    print(json.dumps(report, indent=1))
    if a.output:
        Path(a.output).write_text(json.dumps(report, indent=1))
    for f in report["failures"]:
        print(f"FAIL: {f}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
