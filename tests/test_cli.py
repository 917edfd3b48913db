"""The command line, run as a user would: a real subprocess on the embedded model."""
from __future__ import annotations

import json
import subprocess
import sys

import background


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_streams_and_reports_latency(smollm2_dir):
    r = run("generate", "What is the capital of France?", "--max-tokens", "12", "--device", "cpu",
            "--graph-mode", "decode", "--cudagraph-capture-sizes", "1,2")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "TTFT" in r.stderr and "TPOT" in r.stderr
    assert "note: graph_mode='decode' asked for, but graph capture is not available on cpu" \
        in r.stderr                                      # the CPU says it runs eager


def test_generate_bad_knob_is_a_clear_error():
    for knob in (["--block-size", "24"], ["--graph-mode", "always"],
                 ["--cudagraph-capture-sizes", "0,4"]):
        r = run("generate", "hi", "--device", "cpu", *knob)
        # argparse names the flag where the knob has a fixed domain (config.py lists it),
        # EngineConfig names the field otherwise.
        names = (knob[0], knob[0][2:].replace("-", "_"))
        assert r.returncode == 2 and any(n in r.stderr for n in names), r.stderr
        assert "Traceback" not in r.stderr
    r = run("generate", "hi", "--cudagraph-capture-sizes", "1,x")
    assert r.returncode == 2 and "integers separated by commas" in r.stderr


@background.job
def bench_small_run():
    """A small `workbench bench` with the static-batch HF peer (a background job:
    tests/background.py): the process and its JSON report."""
    out = background.tmpdir("bench") / "b.json"
    r = background.run([sys.executable, "-m", "workbench.cli", "bench", "--num-requests", "4",
                        "--input-len", "8:16", "--output-len", "4:8", "--peers", "hf_static",
                        "--static-batch", "2", "--device", "cpu", "--output", str(out)])
    return r, (json.loads(out.read_text()) if r.returncode == 0 else None)


def test_bench_small_run_writes_json(bench_small_run):
    r, report = bench_small_run
    assert r.returncode == 0, r.stderr
    assert report["results"]["workbench"]["tokens"] == report["workload"]["output_tokens"]
    assert report["ratios"]["vs_hf_static"] > 0
    assert "output tok/s" in r.stdout
    # The sampled workloads beside greedy, on the same requests (issue 21).
    sampled = report["results"]["workbench_sampled"]
    assert set(sampled) == {"qwen3_defaults", "t0.7_top_p0.9", "greedy_stop_string",
                            "greedy_logprobs5"}
    assert all(s["tokens"] == report["workload"]["output_tokens"] for s in sampled.values())
    assert set(report["ratios"]["sampled_vs_greedy"]) == set(sampled)
    assert "workbench, t0.7_top_p0.9" in r.stdout


def test_lab_serves_the_notebooks_and_its_first_line_opens_it(tmp_path):
    """`workbench lab` starts JupyterLab on notebooks/ (bound to loopback); the first line it
    prints is a URL that opens the Lab (its token in it), and the terminal stays clean while a
    notebook is opened and a kernel runs: no untrusted shipped notebook, no per-kernel warning
    about unencrypted TCP."""
    import re

    import pytest
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("jupyterlab")
    from conftest import start_server, stop_tree
    log = tmp_path / "lab.log"
    proc, url = start_server([sys.executable, "-m", "workbench.cli", "lab"], log,
                             ready="/api/status", ok=lambda code: code < 500, timeout=120,
                             what="workbench lab")
    try:
        first = log.read_text(errors="replace").splitlines()[0]
        m = re.search(r"(http://127\.0\.0\.1:\d+/lab/tree/00_start_here\.ipynb\?token=([\w-]+))",
                      first)
        assert m and m.group(1).startswith(url), first
        with httpx.Client(timeout=60) as browser:          # what opening the URL does
            page = browser.get(m.group(1), follow_redirects=True)
            assert page.status_code == 200 and "/login" not in str(page.url), page.url
            assert "JupyterLab" in page.text
        api = {"token": m.group(2)}
        r = httpx.get(f"{url}/api/contents", params=api, timeout=30)
        names = {c["name"] for c in r.json()["content"]}
        assert {"00_start_here.ipynb", "01_quickstart.ipynb", "02_prefill_decode_step_by_step.ipynb",
                "03_tuning.ipynb", "dashboard.ipynb"} <= names
        for name in sorted(names):
            if name.endswith(".ipynb"):
                assert httpx.get(f"{url}/api/contents/{name}", params=api,
                                 timeout=30).status_code == 200
        r = httpx.post(f"{url}/api/kernels", params=api, json={"name": "python3"}, timeout=60)
        assert r.status_code == 201, r.text
        ws = url.replace("http", "ws") + f"/api/kernels/{r.json()['id']}/channels?token={m.group(2)}"
        assert run_in_kernel(ws, "print(6 * 7)") == "42\n"       # the kernel answers
        text = log.read_text(errors="replace")
        for noise in ("is not trusted", "without encryption", "notebook_dir",
                      "config is deprecated", "Warning"):
            assert noise not in text, f"{noise!r} in the terminal:\n{text}"
    finally:
        assert stop_tree(proc) == [], "processes outlived workbench lab"


def run_in_kernel(ws_url: str, code: str, timeout: float = 180) -> str:
    """Run `code` in a Jupyter kernel through the server's websocket (what the Lab's page
    does) and return what it printed."""
    import asyncio
    import json

    from jupyter_client.session import Session
    from tornado.websocket import websocket_connect

    async def run() -> str:
        conn = await asyncio.wait_for(websocket_connect(ws_url), timeout)
        msg = Session().msg("execute_request", {"code": code, "silent": False})
        await conn.write_message(json.dumps({**msg, "channel": "shell"}, default=str))
        out = ""
        while True:
            reply = json.loads(await asyncio.wait_for(conn.read_message(), timeout))
            if reply.get("parent_header", {}).get("msg_id") != msg["header"]["msg_id"]:
                continue
            if reply["msg_type"] == "stream":
                out += reply["content"]["text"]
            if reply["msg_type"] == "status" and reply["content"]["execution_state"] == "idle":
                conn.close()
                return out
    return asyncio.run(run())


def test_dashboard_and_lab_need_a_checkout(monkeypatch, tmp_path):
    from workbench import cli, launch
    monkeypatch.setattr(launch, "__file__", str(tmp_path / "workbench" / "launch.py"))
    r = cli.main(["dashboard", "--port", "1"])
    assert r == 2
