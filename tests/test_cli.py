"""The command line, run as a user would: a real subprocess on the embedded model."""
from __future__ import annotations

import json
import subprocess
import sys


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_streams_and_reports_latency(smollm2_dir):
    r = run("generate", "What is the capital of France?", "--max-tokens", "12", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "TTFT" in r.stderr and "TPOT" in r.stderr


def test_generate_bad_knob_is_a_clear_error():
    r = run("generate", "hi", "--block-size", "24", "--device", "cpu")
    assert r.returncode == 2 and "block_size" in r.stderr and "Traceback" not in r.stderr


def test_bench_small_run_writes_json(tmp_path, smollm2_dir):
    out = tmp_path / "b.json"
    r = run("bench", "--num-requests", "4", "--input-len", "8:16", "--output-len", "4:8",
            "--peers", "hf_static", "--static-batch", "2", "--device", "cpu", "--output", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["results"]["workbench"]["tokens"] == report["workload"]["output_tokens"]
    assert report["ratios"]["vs_hf_static"] > 0
    assert "output tok/s" in r.stdout
