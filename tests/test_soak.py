"""The soak script (benchmarks/soak.py), for 30 seconds: mixed traffic with disconnects
against a real `workbench serve`, and nothing grows but the caches (docs/soak.md has the
30-minute run)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("psutil")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import soak  # noqa: E402


def test_judge_names_what_grew():
    start = dict(rss_mb=1000.0, fds=7, threads=8, running=0, waiting=0, kv_usage=0.0)
    assert soak.judge(start, dict(start, rss_mb=1060.0), 64) == []
    bad = soak.judge(start, dict(start, rss_mb=1100.0, fds=9, threads=9, running=1,
                                 kv_usage=0.25), 64)
    assert len(bad) == 5 and any("fds grew from 7 to 9" in b for b in bad)


def test_a_half_minute_soak_leaks_nothing(smollm2_dir, tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "0.5",
                        "--concurrency", "6", "--output", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["requests"]["errors"] == 0
    kinds = report["requests"]
    assert all(kinds[k] > 0 for k in soak.KINDS), kinds     # every kind of traffic ran
    end = report["end"]
    assert end["running"] == 0 and end["waiting"] == 0 and end["kv_usage"] == 0
