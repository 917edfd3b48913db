"""The command line, run as a user would: a real subprocess on the embedded model."""
from __future__ import annotations

import json
import subprocess
import sys


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


def test_bench_small_run_writes_json(tmp_path, smollm2_dir):
    out = tmp_path / "b.json"
    r = run("bench", "--num-requests", "4", "--input-len", "8:16", "--output-len", "4:8",
            "--peers", "hf_static", "--static-batch", "2", "--device", "cpu", "--output", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
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


def test_lab_serves_the_notebooks(tmp_path):
    """`workbench lab` starts JupyterLab on notebooks/ (bound to loopback) and says where."""
    import pytest
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("jupyterlab")
    from conftest import start_server, stop_tree
    proc, url = start_server([sys.executable, "-m", "workbench.cli", "lab"], tmp_path / "lab.log",
                             ready="/api/contents?token=t0k3n", timeout=90,
                             env={"JUPYTER_TOKEN": "t0k3n"}, what="workbench lab")
    log = tmp_path / "lab.log"
    port = int(url.rsplit(":", 1)[1])
    try:
        r = httpx.get(f"{url}/api/contents?token=t0k3n", timeout=10)
        names = {c["name"] for c in r.json()["content"]}
        assert {"01_quickstart.ipynb", "02_prefill_decode_step_by_step.ipynb", "03_tuning.ipynb",
                "dashboard.ipynb"} <= names
        assert f"http://127.0.0.1:{port}/lab" in log.read_text(errors="replace")
    finally:
        assert stop_tree(proc) == [], "processes outlived workbench lab"


def test_dashboard_and_lab_need_a_checkout(monkeypatch, tmp_path):
    from workbench import cli, launch
    monkeypatch.setattr(launch, "__file__", str(tmp_path / "workbench" / "launch.py"))
    r = cli.main(["dashboard", "--port", "1"])
    assert r == 2
