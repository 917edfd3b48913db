"""The remote client, the serving benchmark and the panels against a server that is not ours:
`transformers serve` (a strict OpenAI server: it refuses vLLM's extra fields, has no /metrics,
and lists no model until one is requested), serving the locally converted SmolLM2 folder with
the hub offline, so nothing is downloaded. The same tests run against `workbench serve`, so
the two stay interchangeable. Every server is a real process group, stopped by the test."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import start_server, stop_tree  # noqa: E402
from workbench.serving.client import RemoteEngine, RemoteError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMERS = Path(sys.executable).parent / "transformers"


@dataclass
class Server:
    kind: str
    url: str
    model: str
    """The model id requests name."""
    log: Path

    def metrics_requests(self) -> int:
        """GET /metrics requests the server logged so far (transformers: uvicorn's access log)."""
        return len(re.findall(r'"GET /metrics HTTP', self.log.read_text(errors="replace")))


def _start(cmd: list[str], env: dict, log: Path, timeout: float):
    """A server in its own process group on a free loopback port (conftest.start_server)."""
    return start_server(cmd, log, timeout=timeout, env=env)


def _stop(proc) -> None:
    """The server's process group stopped; nothing of it may survive."""
    assert stop_tree(proc, timeout=20) == [], "processes of the server's group survived it"


def _start_transformers(tmp: Path, log: Path):
    if not TRANSFORMERS.exists():
        pytest.skip(f"no `transformers` command next to {sys.executable}")
    if subprocess.run([str(TRANSFORMERS), "serve", "--help"], capture_output=True,
                      timeout=120).returncode != 0:
        pytest.skip("this transformers has no working `transformers serve` "
                    "(pip install 'transformers[serving]')")
    hf_home = tmp / "hf-home"          # empty: no cached hub model is listed or used
    hf_home.mkdir(exist_ok=True)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(hf_home)}
    return _start([str(TRANSFORMERS), "serve", "--host", "127.0.0.1", "--device", "cpu",
                   "--log-level", "info"], env, log, timeout=120)


@pytest.fixture(scope="module", params=["workbench", "transformers"])
def server(request, smollm2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"remote-{request.param}")
    log = tmp / "server.log"
    if request.param == "workbench":
        proc, url = _start([sys.executable, "-m", "workbench.cli", "serve", "--device", "cpu",
                            "--model", "smollm2", "--num-kv-blocks", "256", "--max-model-len",
                            "1024", "--log-level", "info"], {}, log, timeout=180)
        model = "smollm2"
    else:
        # Started without a model: it lists none and loads the folder on the first request.
        proc, url = _start_transformers(tmp, log)
        model = str(smollm2_dir)
    yield Server(request.param, url, model, log)
    _stop(proc)


def _bench(server: Server, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "bench", "--url", server.url,
                        "--model", server.model, "--concurrency", "2", "--input-words", "4:8",
                        "--output", str(out), *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    return r, json.loads(out.read_text())


def test_bench_url_completes_and_says_what_the_server_lacks(server, tmp_path):
    r, report = _bench(server, tmp_path, "--num-requests", "4", "--output-len", "3:5")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert report["completed"] == 4 and report["failed"] == 0 and report["errors"] == {}
    assert 4 <= report["total_output_tokens"] <= 20 and report["ttft_s"]["p50"] > 0
    assert report["workload"]["ignore_eos"] is False
    assert "4/4 requests" in r.stdout and "Traceback" not in r.stderr
    if server.kind == "transformers":
        assert report["server"]["metrics"] is False and report["server"]["metrics_why"] == "404"
        assert report["server_peaks"] is None and report["server_counts"] is None
        assert "server peaks: no data (GET /metrics: 404)" in r.stdout
    else:
        assert report["server"]["metrics"] is True
        # The server's counters see every request, whatever the polling caught (a gauge
        # sampled every 0.5 s can miss 4 short requests entirely on a quiet machine).
        counts = report["server_counts"]
        assert counts["request_success"] == 4, counts
        assert sum(counts["request_success_by_reason"].get(r, 0) for r in ("stop", "length")) == 4
        assert counts["generation_tokens"] == report["total_output_tokens"]
        assert counts["prompt_tokens"] == report["total_input_tokens"] > 0
        assert counts["histogram_counts"]["time_to_first_token_seconds"] == 4
        assert set(report["server_peaks"]) == {"num_requests_running", "num_requests_waiting",
                                               "kv_cache_usage_perc"}
        assert "server counted: 4 requests finished" in r.stdout
        import workbench
        assert report["server"]["version"] == workbench.__version__

    # vLLM's ignore_eos, asked for: honoured by the workbench, refused by a strict server
    # with an error that names the field, the server and the flag that leaves it out.
    r, report = _bench(server, tmp_path, "--num-requests", "2", "--output-len", "4:4",
                       "--ignore-eos")
    assert report["workload"]["ignore_eos"] is True
    if server.kind == "transformers":
        assert r.returncode == 1 and report["completed"] == 0 and report["failed"] == 2
        [(message, count)] = report["errors"].items()       # one distinct error, counted
        assert count == 2 and "422" in message
        assert f"the server at {server.url} refuses 'ignore_eos'" in message
        assert "--no-ignore-eos" in message and "error x2" in r.stdout
    else:
        assert r.returncode == 0 and report["completed"] == 2
        assert report["total_output_tokens"] == 8


def test_vllm_extensions_go_out_only_when_asked(server):
    with RemoteEngine(server.url, model=server.model) as remote:
        info = remote.probe()
        assert info.metrics is (server.kind == "workbench")
        if server.kind == "transformers":
            assert remote.poll_metrics() is None           # no /metrics: no data, no exception
            with pytest.raises(RemoteError) as e:
                list(remote.stream("Hello", max_tokens=2, top_k=5))
            assert e.value.status == 422 and e.value.param == "top_k"
            assert server.url in str(e.value) and "top_k=0" in str(e.value)
        # OpenAI's own fields pass everywhere.
        st = remote.generate("Once upon a time", max_tokens=4, temperature=0.8, top_p=0.9,
                             seed=7, stop=["\u2603"])
        assert st.text and st.num_tokens == 4 and st.finish_reason == "length"
        if server.kind == "workbench":
            # The extensions are honoured: ignore_eos runs past the end of a short answer,
            # top_k=1 samples the greedy token.
            short = remote.generate("Say one word.", max_tokens=30, chat=True, temperature=0)
            assert short.finish_reason == "stop" and short.num_tokens < 30
            long = remote.generate("Say one word.", max_tokens=30, chat=True, temperature=0,
                                   ignore_eos=True)
            assert long.finish_reason == "length" and long.num_tokens == 30
            k1 = remote.generate("Say one word.", max_tokens=30, chat=True, temperature=1.0,
                                 seed=3, top_k=1)
            assert k1.text == short.text


def test_remote_source_panels_fill(server):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from widgets import BatchTimeline, KVBlockMap, Live, RemoteSource, SummaryPanel, TokenStreamPanel
    from workbench import SamplingParams
    metrics_before = server.metrics_requests()

    async def run():
        source = RemoteSource(server.url, model=server.model, metrics_interval=0.2)
        live = Live(source, TokenStreamPanel(), BatchTimeline(window=100_000), KVBlockMap(),
                    SummaryPanel())
        rids = await live.generate(["Name a colour.", "Say hello.", "Count to three."],
                                   SamplingParams(max_tokens=5, temperature=0), timeout=240)
        # The timeline's points count every token of the batch once the next interval has
        # been polled (the server's counters, or the client's own count): wait for that.
        streams, timeline = live.panels[0], live.panels[1]
        want = sum(streams.streams[rid].num_tokens for rid in rids)
        deadline = time.monotonic() + 30
        while sum(p.num_decode_tokens for p in timeline.points) < want:
            assert time.monotonic() < deadline, "the timeline never counted the batch's tokens"
            await asyncio.sleep(0.05)
            live.pump.tick()
        n_points = len(timeline.points)
        # Two requests the server refuses (transformers: vLLM's ignore_eos; workbench: a prompt
        # longer than its context), then a good one: the error stays listed, counted.
        params = SamplingParams(max_tokens=4, temperature=0,
                                ignore_eos=server.kind == "transformers")
        if server.kind == "workbench":
            bad = [source.submit("word " * 1500, params) for _ in range(2)]
        else:
            bad = [source.submit("Hi.", params) for _ in range(2)]
        await live.pump.wait(timeout=120)
        ok = source.submit("Say hi.", SamplingParams(max_tokens=3, temperature=0))
        await live.pump.wait(timeout=120)
        live.close()
        return live, source, rids, bad, ok, n_points

    live, source, rids, bad, ok, n_points = asyncio.run(run())
    streams, timeline, kv, summary = live.panels
    for rid in rids + [ok]:
        st = streams.streams[rid]
        assert st.status in ("stop", "length") and st.text and st.ttft > 0 and st.num_tokens > 0
    # One token count everywhere: the server's usage count (it reports one) per request, the
    # same in the streams, the summary and the records.
    records = {r.request_id: r.output_tokens for r in summary.records}
    assert set(records) == set(rids + [ok])
    assert all(streams.streams[rid].num_tokens == n for rid, n in records.items())
    assert summary.output_tokens == streams.num_tokens == sum(records.values())
    # Request errors stay visible, each distinct one once with its count.
    for rid in bad:
        assert streams.streams[rid].status == "error"
    # The two refusals come back concurrently, so in either order.
    [(message, (count, whos))] = live.errors.entries.items()
    assert count == 2 and sorted(whos) == sorted(bad)
    assert "×2" in live.errors.value
    if server.kind == "transformers":
        assert "refuses 'ignore_eos'" in message and server.url in message
        # No /metrics: said once, polled once (the probe), never reported as an error; the
        # timeline is the client's own view, labelled as such.
        assert source.resolution == "client" and timeline.resolution == "client"
        assert "as this client saw its streams" in timeline.x_title
        [notice] = source.notices
        assert "has no vLLM /metrics (GET /metrics: 404)" in notice
        assert live.notices.value.count("has no vLLM /metrics") == 1
        assert server.metrics_requests() - metrics_before == 1
        pts = list(timeline.points)
        assert pts and all(p.phase == "client" and p.kv_usage is None for p in pts)
        # The points up to the first batch's end hold exactly its tokens, and its TTFTs.
        first = pts[:n_points]
        assert sum(p.num_decode_tokens for p in first) == sum(records[r] for r in rids)
        ttfts = {r.request_id: r.ttft for r in summary.records}
        assert sorted(t for p in first for t in p.ttfts) == sorted(ttfts[r] for r in rids)
        assert "no /metrics either" in kv.view.value
    else:
        assert "400" in message and "prompt" in message
        assert source.resolution == "poll" and not source.notices and live.notices.value == ""
        pts = list(timeline.points)
        assert pts and all(p.phase == "poll" for p in pts)
        # The server's counters, polled from before the first request: the points up to the
        # first batch's end hold exactly its tokens and prompts (a sampled gauge such as
        # num_running can miss a short burst between two polls; a counter cannot).
        first = pts[:n_points]
        assert sum(p.num_decode_tokens for p in first) == sum(records[r] for r in rids)
        assert sum(p.num_prefill_tokens for p in first) > 0
        assert "timeline shows its KV usage" in kv.view.value


def test_server_that_lists_no_models(smollm2_dir, tmp_path):
    """A server started without a model: clear errors that name the fix, never a traceback;
    with the model given, everything works."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from widgets import Dashboard
    from workbench import SamplingParams
    proc, url = _start_transformers(tmp_path, tmp_path / "server.log")
    try:
        with RemoteEngine(url) as remote:
            assert remote.probe().models == []
            with pytest.raises(RemoteError) as e:
                remote.model
            assert str(e.value).startswith("GET /v1/models: the server at ")
            assert "lists no models" in str(e.value) and "model=" in str(e.value)
        r = subprocess.run([sys.executable, "-m", "workbench.cli", "bench", "--url", url,
                            "--num-requests", "1", "--output", ""],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "lists no models" in r.stderr and "--model" in r.stderr

        async def dashboards():
            d = Dashboard(url=url)
            assert "lists no models" in d.notices.value and "none listed" in d.header.value
            assert d.send(1) == [] and "model" in d.message.value
            d.source.close()
            d.pump.stop()
            d2 = Dashboard(url=url, model=str(smollm2_dir))
            d2.prompts.value = "Say one word."
            d2.send(1, SamplingParams(max_tokens=3, temperature=0))
            ok = await d2.wait(timeout=120)
            d2.source.close()
            d2.pump.stop()
            return d2, ok

        d2, ok = asyncio.run(dashboards())
        assert ok and d2.streams.num_finished == 1
        assert 1 <= d2.summary.output_tokens == d2.streams.num_tokens <= 3
        assert d2.errors.num_errors == 0 and "404" in d2.notices.value
    finally:
        _stop(proc)


def test_panels_send_only_the_fields_that_were_set():
    from widgets.sources import request_fields
    from workbench import SamplingParams
    assert request_fields(SamplingParams(max_tokens=5, temperature=0.3)) == {}
    assert request_fields(SamplingParams(top_k=-1)) == {}
    p = SamplingParams(top_p=0.9, top_k=20, seed=1, stop="x", stop_token_ids=[7], ignore_eos=True)
    assert request_fields(p) == {"top_p": 0.9, "top_k": 20, "seed": 1, "stop": ["x"],
                                 "stop_token_ids": [7], "ignore_eos": True}


def test_error_log_counts_repeats_and_keeps_the_newest():
    pytest.importorskip("ipywidgets")
    from widgets.live import ErrorLog
    log = ErrorLog(keep=2)
    log.add([("remote-0", "400: prompt: too long"), ("/metrics", "500: boom")])
    log.add([("remote-1", "400: prompt: too long"), ("remote-2", "422: refuses 'ignore_eos'")])
    assert log.num_errors == 4
    assert list(log.entries) == ["400: prompt: too long", "422: refuses 'ignore_eos'"]
    assert log.entries["400: prompt: too long"] == [2, ["remote-0", "remote-1"]]
    assert "×2" in log.value and "boom" not in log.value and "ignore_eos" in log.value
