"""Every notebook runs top to bottom on a headless kernel (nbclient), on the CPU, with the
embedded model; a few of the numbers each one prints are checked for sense."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def run_notebook(name: str, cwd: Path) -> tuple[str, list]:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    os.environ["WORKBENCH_QUICK"] = "1"
    os.environ["WORKBENCH_DEVICE"] = "cpu"
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        os.environ.pop("WORKBENCH_QUICK")
        os.environ.pop("WORKBENCH_DEVICE")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    return text, outputs


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"
    cfg = json.loads((NOTEBOOKS / "voila.json").read_text())["VoilaConfiguration"]
    assert cfg["template"] == "lab" and cfg["strip_sources"] is True


def test_quickstart(tmp_path):
    text, outputs = run_notebook("01_quickstart.ipynb", tmp_path)
    assert "Paris" in text
    m = re.search(r"(\d+) requests · ([\d.]+) output tokens/s", text)
    assert m and int(m.group(1)) == 8 and float(m.group(2)) > 0
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert json.loads((tmp_path / "quickstart_telemetry.json").read_text())["steps"]


def test_prefill_decode_step_by_step(tmp_path):
    text, _ = run_notebook("02_prefill_decode_step_by_step.ipynb", tmp_path)
    assert re.search(r"step 0: prefill of \d+ prompt tokens", text)
    assert re.search(r"step \d+: mixed", text)                       # continuous batching
    assert re.search(r"chunk +fed \d+", text)                         # chunked prefill
    cached = [int(x) for x in re.findall(r"(\d+) served from the prefix cache", text)]
    assert cached and all(c > 0 for c in cached)                      # prefix caching
    assert re.search(r"blocks shared by req-\d+ and req-\d+: \[\d", text)
    assert "preempted ['req-" in text and "every request still finished: True" in text
    assert re.search(r"one decode step: [\d,]+ aten operator calls", text)


def test_tuning(tmp_path):
    text, outputs = run_notebook("03_tuning.ipynb", tmp_path)
    assert "at once:" in text and "x the throughput" in text
    rows = (tmp_path / "tuning_results.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 + 2 + 2
    data = json.loads((tmp_path / "tuning_results.json").read_text())
    alone, batched = data["results"]["alone_vs_batched"]
    assert alone["requests"] == 1 and batched["requests"] == 8
    assert batched["out_tok_s"] > alone["out_tok_s"]          # batching pays, even on a CPU
    assert sum("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs) == 3


def test_dashboard_notebook(tmp_path):
    _, outputs = run_notebook("dashboard.ipynb", tmp_path)
    assert [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert not [o for o in outputs if o.output_type == "error"]
