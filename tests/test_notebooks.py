"""Every notebook runs top to bottom at its defaults (what a learner's Run All does) on a
headless kernel (nbclient), on the CPU, with the embedded model, within a stated bound
(BOUND_S: from what 00_start_here states, for a 2-core machine); the sentences that cite a figure are checked against the
figure the cell produced, and a few numbers for sense. Each is saved
after running, widget state included (what nbclient and "save with outputs" keep), and must
stay under 600 kB; what a notebook writes goes to $WORKBENCH_EXPORT_DIR, never its folder."""
from __future__ import annotations

import json
import os
import queue
import re
import time
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
MAX_SAVED_BYTES = 600_000
"""A notebook saved with its outputs and widget state (02 with its speculative decoding
section: about 555 kB), never with plotly.js inlined (megabytes)."""


def stated_seconds() -> dict[str, float]:
    """What 00_start_here tells a learner each notebook takes at its defaults ("about 20 s",
    "about 1½ minutes"), in seconds."""
    text = nbformat.read(NOTEBOOKS / "00_start_here.ipynb", as_version=4).cells[0].source
    out = {}
    for name, amount, unit in re.findall(r"^\| `(\S+\.ipynb)` \|.*\| about ([\d½]+) "
                                         r"(s|minutes?) \|$", text, re.M):
        n = float(amount.replace("½", ".5")) if amount != "½" else 0.5
        out[name] = n * (60 if unit.startswith("minute") else 1)
    return out


BOUND_S = {**{name: max(120.0, 4 * s) for name, s in stated_seconds().items()},
           "dashboard.ipynb": 300}
"""Run All at the defaults, on a 2-core CPU, the C++ kernel built: four times what the start
page tells a learner (2 minutes at least), which leaves room for a machine busy with other
work (CI's runs the suite's background jobs), and fails when a change makes a notebook much
slower than the page says."""


def run_notebook(name: str, cwd: Path, answers: dict[str, str] | None = None,
                 max_saved: int | None = MAX_SAVED_BYTES):
    """Run a notebook in `cwd` with exports to cwd/exports; `answers` replaces the
    `name = None` lines of exercise cells with a value (code)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        for var, value in (answers or {}).items():
            cell.source = cell.source.replace(f"{var} = None", f"{var} = {value}")
    env = {"WORKBENCH_DEVICE": "cpu", "WORKBENCH_EXPORT_DIR": str(cwd / "exports")}
    os.environ.update(env)
    t0 = time.monotonic()
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        for k in env:
            os.environ.pop(k)
    took = time.monotonic() - t0
    assert took < BOUND_S[name], f"{name} took {took:.0f} s at its defaults (bound {BOUND_S[name]} s)"
    saved = cwd / "exports" / f"saved-{name}"
    saved.parent.mkdir(exist_ok=True)
    nbformat.write(nb, saved)                   # outputs and widget state, as a user saves it
    if max_saved is not None:
        assert saved.stat().st_size < max_saved, f"{name} saved: {saved.stat().st_size:,} B"
    assert [p.name for p in cwd.iterdir()] == ["exports"], "a notebook wrote to its folder"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    return text, outputs, nb


def cell_html(nb, printed: str) -> str:
    """The HTML a cell displayed, for the cell that printed `printed`."""
    for cell in nb.cells:
        if cell.cell_type == "code" and any(printed in o.get("text", "") for o in cell.outputs):
            return "".join(o.get("data", {}).get("text/html", "") for o in cell.outputs)
    raise AssertionError(f"no cell printed {printed!r}")


def markdown(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def plotly_figures(outputs) -> int:
    """Figures shown as plotly JSON only (no plotly.js inlined into the notebook)."""
    assert not any("plotly" in o.get("data", {}).get("text/html", "") for o in outputs)
    return sum("application/vnd.plotly.v1+json" in o.get("data", {}) for o in outputs)


def test_the_start_page_lists_every_lesson_with_its_time():
    """`workbench lab` opens on 00_start_here: every numbered notebook is in its table, with
    the time that bounds its run here (BOUND_S)."""
    lessons = {p.name for p in NOTEBOOKS.glob("0[1-9]_*.ipynb")}
    assert lessons and set(stated_seconds()) == lessons


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"
    cfg = json.loads((NOTEBOOKS / "voila.json").read_text())["VoilaConfiguration"]
    assert cfg["template"] == "lab" and cfg["strip_sources"] is True


@pytest.mark.timeout(BOUND_S["01_quickstart.ipynb"] + 120)
def test_quickstart(tmp_path):
    text, outputs, _ = run_notebook("01_quickstart.ipynb", tmp_path)
    assert "Paris" in text
    from workbench.platforms.cpu_kernels import kernel_is_built
    if kernel_is_built():            # the figures are the kernel's, not the fallback's
        assert "the C++ CPU kernel is loaded" in text and "fallback" not in text
    m = re.search(r"(\d+) requests · ([\d.]+) output tokens/s", text)
    assert m and int(m.group(1)) == 8 and float(m.group(2)) > 0
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert json.loads((tmp_path / "exports" / "quickstart_telemetry.json").read_text())["steps"]
    assert plotly_figures(outputs) == 1                 # the batch's steps


@pytest.mark.timeout(BOUND_S["02_prefill_decode_step_by_step.ipynb"] + 120)
def test_prefill_decode_step_by_step(tmp_path):
    # The exercises answered right, the first from the model's shape: its check compares it
    # with the FLOP/byte model of the decode steps measured in the notebook.
    text, outputs, nb = run_notebook("02_prefill_decode_step_by_step.ipynb", tmp_path, answers={
        "answer1": "8 * 2 * (info.num_layer_params + info.hidden_size * info.vocab_size) "
                   "/ info.weight_bytes", "answer2": "5", "answer3": "1",
        "answer_nucleus": "next(i + 1 for i in range(len(dist.probs)) "
                          "if sum(dist.probs[:i + 1]) >= 0.8 * dist.head_mass)",
        "answer_spec": "(1 - alpha ** (k + 1)) / (1 - alpha)"})
    assert text.count("right:") == 5 and "not quite" not in text
    # The batch-size lesson says what its figures show, or that the machine was too busy.
    verdict = re.search(r"^(This machine was busy \(.*|Decode's time per token falls as the batch "
                        r"grows: decode .*|The lesson says decode's time per token falls .*)$",
                        text, re.M)
    assert verdict, text[:3000]
    if not verdict.group(1).startswith("This machine was busy"):   # its figures: the ones printed
        printed = [float(x) for x in re.findall(r"^batch \d+: prefill .* decode +([\d.]+) ms/token",
                                                text, re.M)]
        claimed = [float(x) for x in re.findall(r"([\d.]+) ms a token at batch \d+",
                                                verdict.group(1).split("Prefill's")[0])]
        assert claimed == printed and len(printed) >= 2, (claimed, printed)
    # The sampling step: every engine draw in the kept set; seeds repeat.
    kept_lines = re.findall(r"^(.{10}) keeps +(\d+) tokens; 20 draws: .*; all in the kept set: (\w+)$",
                            text, re.M)
    assert len(kept_lines) == 5 and all(ok == "True" for _, _, ok in kept_lines), kept_lines
    assert "the same seeds again give the same draws: True; other seeds give others: True" in text
    assert re.search(r"at batch 1, sampling adds -?[\d.]+ ms to a decode step", text)
    # Its cost and the KV cache's, in rounds: each sentence is the printed figures' (medians).
    said = re.search(r"^(This machine was busy \(.*|(?:The lesson says t|T)emperature 0.7 with "
                     r"top-p 0.9 costs a step more than greedy.*)$", text, re.M)
    assert said, text
    if not said.group(1).startswith("This machine"):
        printed = re.findall(r"^batch (\d+): greedy ([\d.]+) ms \([\d.-]+\), temperature 0.7 "
                             r"with top-p 0.9 ([\d.]+) ms \([\d.-]+\) a step$", text, re.M)
        assert len(printed) == 2 and said.group(1).count(" against ") == 2, printed
        for b, g, s in printed:
            assert f"{s} against {g} ms at batch {b}" in said.group(1), (printed, said.group(1))
    kv = re.search(r"^same tokens: True; (\d+) tokens in ([\d.]+) s with the cache \([\d.-]+\), "
                   r"([\d.]+) s recomputing \([\d.-]+\); medians of 3 rounds$", text, re.M)
    assert kv, text                                                    # cache vs recompute
    said = re.search(r"^(This machine was busy \(.*|(?:The lesson says r|R)ecomputing the sequence "
                     r"for every token takes longer than the cache.*)$", text, re.M)
    assert said, text
    if not said.group(1).startswith("This machine"):
        n, cached, again = kv.groups()
        assert f"{n} tokens in {cached} s with the cache, {again} s recomputing" in said.group(1)
    assert plotly_figures(outputs) == 7       # batch scaling, roofline, formats, block table, KV,
    #                                           preemption, decode against verify
    spec_section(text, nb)
    assert re.search(r"gguf  \(q4_1\+q8_0\):  +\d+ MB of weights", text)
    # The formats take turns in rounds; the sentence is their printed medians', or the warning.
    formats = re.findall(r"^(\w+) +\([\w+]+\): +(\d+) MB of weights, TPOT +([\d.]+) ms "
                         r"\([\d.]+-[\d.]+\)", text, re.M)
    said = re.search(r"^(This machine was busy \(.*|(?:The lesson says f|F)ewer bytes of weights "
                     r"take less time a token.*)$", text, re.M)
    assert len(formats) >= 3 and said, text
    if not said.group(1).startswith("This machine"):
        for name, mb, tpot in formats:
            assert f"{name} {mb} MB in {tpot} ms" in said.group(1), (formats, said.group(1))
    # Section 3's batch 1 against batch 4 are section 2's medians (a step: b x per token),
    # within the two printings' rounding: the step's to 0.1 ms (0.05), the per-token figure's
    # to 0.01 ms, times b (0.02 at batch 4: 0.06 was exceeded, 18.3 against 4 x 4.56).
    per_token = dict(re.findall(r"^batch (\d+): prefill .* decode +([\d.]+) ms/token", text, re.M))
    m = re.search(r"^decode step, batch 1: ([\d.]+) ms   batch 4: ([\d.]+) ms", text, re.M)
    assert m and float(m.group(1)) == pytest.approx(float(per_token["1"]), abs=0.05 + 0.005 + 1e-9)
    assert float(m.group(2)) == pytest.approx(4 * float(per_token["4"]), abs=0.05 + 0.02 + 1e-9)
    from workbench.platforms.cpu_kernels import load_cpu_kernels
    if hasattr(load_cpu_kernels(), "bf16c_fast"):    # bf16's numbers in fewer bytes, shown
        mb = dict(re.findall(r"^(bf16c?) +\((?:bfloat16|bf16c)\): +(\d+) MB", text, re.M))
        assert int(mb["bf16c"]) < 0.8 * int(mb["bf16"]), mb
    m = re.search(r"balance ([\d.]+) FLOP/byte", text)
    assert m and float(m.group(1)) > 0
    m = re.search(r"preemption cost: (\d+) tokens fed again", text)
    assert m and int(m.group(1)) > 0
    assert re.search(r"step 0: prefill of \d+ prompt tokens", text)
    assert re.search(r"step \d+: mixed", text)                       # continuous batching
    assert re.search(r"chunk +fed \d+", text)                         # chunked prefill
    cached = [int(x) for x in re.findall(r"(\d+) served from the prefix cache", text)]
    assert cached and all(c > 0 for c in cached)                      # prefix caching
    assert re.search(r"blocks shared by req-\d+ and req-\d+: \[\d", text)
    assert "preempted ['req-" in text and "every request still finished: True" in text
    assert re.search(r"one decode step: [\d,]+ aten operator calls", text)
    assert "profiler_start" not in text and "profiler_stop" not in text   # kept off the page

    # Each section's snapshot shows the step it talks about, not the Stepper's last one.
    first = re.search(r"step (\d+): prefill of \d+ prompt tokens", text).group(1)
    assert f"<h3>Step {first} " in cell_html(nb, f"step {first}: prefill of")
    mixed = re.search(r"^step (\d+): mixed$", text, re.M).group(1)
    shown = cell_html(nb, f"step {mixed}: mixed")
    assert f"<h3>Step {mixed} " in shown and f"<tr><td>{mixed}</td>" in shown   # and its history
    # The preemption pool: the text's usable blocks are what the engine printed and counted.
    pool = re.search(r"pool: (\d+) blocks, (\d+) of them hold KV", text)
    usable = int(pool.group(2))
    assert usable == int(pool.group(1)) - 1                              # the null block
    assert f"**{usable} blocks**" in markdown(nb) and f"With {usable} usable blocks" in markdown(nb)
    assert {int(x) for x in re.findall(r"KV \d+/(\d+) blocks in use", text)} == {usable}
    assert "notice above" not in markdown(nb)


def spec_section(text: str, nb) -> None:
    """Section 10 (speculative decoding): each verify step's printed drafted/accepted/rejected
    add up to the engine's RequestMetrics printed under them; the snapshot is the step that
    kept some drafts and cut others; the tokens are plain greedy decoding's; the sentences
    are the figures'."""
    steps = [tuple(map(int, m)) for m in re.findall(
        r"^step (\d+): verify, drafted (\d+), accepted (\d+), rejected (\d+) -> (\d+) tokens?",
        text, re.M)]
    total = re.search(r"^req-\d+: (\d+) tokens drafted in (\d+) verify steps, (\d+) accepted "
                      r"\(acceptance rate ([\d.]+)\); (\d+) tokens in (\d+) steps \(([\d.]+) a step", text, re.M)
    assert steps and total, text[-4000:]
    drafted, verifies, accepted = (int(total.group(i)) for i in (1, 2, 3))
    assert (sum(s[1] for s in steps), len(steps), sum(s[2] for s in steps)) == (drafted, verifies, accepted)
    assert all(d == a + r and 1 <= n <= a + 1 for _, d, a, r, n in steps)
    assert float(total.group(4)) == pytest.approx(accepted / drafted, abs=5e-4)
    assert 0 < accepted < drafted                        # the repeated passage: kept and cut
    out, n_steps = int(total.group(5)), int(total.group(6))
    assert float(total.group(7)) == pytest.approx(out / n_steps, abs=5e-3) and n_steps < out
    assert "the same tokens as plain greedy decoding: True" in text
    cut = re.search(r"^step (\d+): drafted (\d+), the model accepted (\d+) and cut (\d+);", text, re.M)
    assert cut, "no verify step kept some drafts and cut others"
    n, d, a, r = map(int, cut.groups())
    assert (n, d, a, r) in {(s[0], s[1], s[2], s[3]) for s in steps} and 0 < a < d
    shown = cell_html(nb, cut.group(0))
    assert f"<h3>Step {n} " in shown and f"drafted {d}, accepted {a}, rejected {r}" in shown
    assert shown.count("class='draft-rejected'") == r and shown.count("class='draft-accepted'") == a
    # the roofline's sentences: about one decode step where the verify is left of the balance
    for name, one in re.findall(r"^  -> (.+?): (?:at batch 1 verifying \d+ drafts costs about one "
                                r"decode step \(([\d.]+)x\)|even at batch 1)", text, re.M):
        ratio = float(re.search(rf"^{re.escape(name)} +batch  1: .* costs ([\d.]+)x", text, re.M).group(1))
        assert (one != "") == (ratio < 1.5), (name, ratio)
    assert re.search(r"^  -> H200, bf16: at batch 1 verifying 4 drafts costs about one decode step", text, re.M)
    assert re.search(r"^(This machine was busy \(|A verify of 4 drafts costs less than the 5 decode "
                     r"steps it can replace: it took|The lesson says a verify)", text, re.M)
    # the exercise: the formula with the engine's alpha, beside the engine's own figure
    from workbench.bench.speculative import expected_tokens_per_step
    f = re.search(r"the formula with alpha = ([\d.]+), k = 4: ([\d.]+) tokens a verify step; the engine: "
                  r"([\d.]+) \((\d+) verify steps\), and ([\d.]+) a step", text)
    assert f and float(f.group(1)) == pytest.approx(accepted / drafted, abs=5e-4)
    assert float(f.group(2)) == pytest.approx(expected_tokens_per_step(accepted / drafted, 4), abs=5e-3)
    assert float(f.group(3)) == pytest.approx(sum(s[4] for s in steps) / len(steps), abs=5e-3)
    assert f.group(5) == total.group(7)


def test_the_tokens_per_step_exercise_checks_its_answer():
    """Notebook 02's exercise 4: its check accepts (1 - a^(k+1)) / (1 - a) and refuses others."""
    from workbench.bench.speculative import check_tokens_per_step, expected_tokens_per_step
    a, k = 0.7, 4
    assert check_tokens_per_step((1 - a ** (k + 1)) / (1 - a), a, k).startswith("right: 2.77")
    assert check_tokens_per_step(sum(a ** j for j in range(k + 1)), a, k).startswith("right:")
    for wrong in (1 / (1 - a), a * k, a * k + 1, (1 - a ** k) / (1 - a), "2.77"):
        assert check_tokens_per_step(wrong, a, k).startswith("not quite"), wrong
    assert check_tokens_per_step(None, a, k).startswith("not answered yet")
    assert expected_tokens_per_step(1.0, 4) == 5 and expected_tokens_per_step(0.0, 4) == 1
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_step(1.5, 4)


@pytest.mark.timeout(BOUND_S["03_tuning.ipynb"] + 120)
def test_tuning(tmp_path):
    text, outputs, nb = run_notebook("03_tuning.ipynb", tmp_path)
    from workbench.platforms.cpu_kernels import kernel_is_built
    if kernel_is_built():            # the sweeps time the kernel, not the fallback
        assert "the C++ CPU kernel is loaded" in text and "fallback" not in text
    assert "at once:" in text and "x the throughput" in text
    rows = (tmp_path / "exports" / "tuning_results.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 + 2 + 2
    data = json.loads((tmp_path / "exports" / "tuning_results.json").read_text())
    alone, batched = data["results"]["alone_vs_batched"]
    assert alone["requests"] == 1 and batched["requests"] == 8
    # Batching pays, even on a CPU: said with the figures where they show it on a quiet
    # machine; a busy machine or contradicting figures are said instead (issue 42: the
    # 1,128 ms TPOT of one request alone that read as the engine's).
    assert len(alone["tpot_p50_ms_runs"]) == len(batched["out_tok_s_runs"]) == 3
    claim = (f"8 requests at once serve more tokens a second than one alone: "
             f"{batched['out_tok_s']:.1f} against {alone['out_tok_s']:.1f} tok/s")
    assert claim in text or re.search(r"^(This machine was busy \(|The lesson says 8 requests at "
                                      r"once serve more tokens)", text, re.M), text
    assert (claim in text) <= (batched["out_tok_s"] > alone["out_tok_s"])
    # The sweeps ran their points in interleaved rounds, every run kept.
    assert all(len(r["out_tok_s_runs"]) == 2 for rs in ("max_num_seqs", "block_size", "graph_mode")
               for r in data["results"][rs])
    assert plotly_figures(outputs) == 6       # three sweeps, speculative k, alone against batched,
    #                                           the tuner's
    # Speculative decoding, method and k: the printed rows are the exported ones, greedy tokens
    # unchanged by k, and the sentences are the figures'.
    spec = data["results"]["speculative"]
    assert {(r["workload"], r["k"]) for r in spec} == {(w, k) for w in ("grounded", "open")
                                                       for k in (0, 2, 4)}
    assert all(r["same_tokens"] for r in spec)
    for r in spec:
        acc = "   -" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        assert (f"{r['workload']:8s} k={r['k']}: acceptance {acc}, {r['tokens_per_step']:.2f} "
                f"tokens/step, {r['tok_s_median']:6.1f} tok/s") in text, r
        assert (r["k"] == 0) == (r["acceptance_rate"] is None)
    by = {(r["workload"], r["k"]): r for r in spec}
    # Drafts kept on the grounded prompt (how many depends on the passage drawn from this
    # repository's files, which change with it: the sentences below are checked instead).
    assert by["grounded", 4]["acceptance_rate"] > 0 and by["grounded", 4]["tokens_per_step"] > 1
    g, o = by["grounded", 4]["tokens_per_step"], by["open", 4]["tokens_per_step"]
    assert f"At k=4 a step kept {g:.2f} tokens on the grounded prompt and {o:.2f} on the open one" in text
    assert ("prompt lookup finds its drafts where" in text) == (g > o)
    assert re.search(r"^(This machine was busy \(|Speculation decodes the grounded prompt faster than "
                     r"plain decoding: k=\d|The lesson says speculation)", text, re.M)
    assert "winner: trial" in text and "vllm serve" in text     # the SLO tuner (workbench.tune)
    assert data["results"]["tune"]["winner"]["measurement"]["goodput"] > 0
    # Trials are numbered as progress counted them (1, 2, …): the winner is one of them.
    numbers = [t["number"] for t in data["results"]["tune"]["trials"]]
    assert numbers == list(range(1, len(numbers) + 1))
    assert int(re.search(r"winner: trial (\d+)", text).group(1)) in numbers
    # The batch-size sentence is the sweep's own figures.
    lo, hi = data["results"]["max_num_seqs"][0], data["results"]["max_num_seqs"][-1]
    assert (f"throughput {lo['out_tok_s']:.1f} -> {hi['out_tok_s']:.1f} tok/s" in text
            and f"TPOT p50 {lo['tpot_p50_ms']:.0f} -> {hi['tpot_p50_ms']:.0f} ms" in text), text
    assert "rises a little" not in markdown(nb) and "QUICK" not in markdown(nb)


@pytest.mark.timeout(BOUND_S["dashboard.ipynb"] + 120)
def test_dashboard_notebook(tmp_path):
    # Voila's page, never saved with outputs: its live plotly panels carry plotly's bundle.
    _, outputs, _ = run_notebook("dashboard.ipynb", tmp_path, max_saved=None)
    assert [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert not [o for o in outputs if o.output_type == "error"]


@pytest.mark.timeout(BOUND_S["04_streaming.ipynb"] + 120)
def test_streaming(tmp_path):
    """A real `workbench serve` started and stopped by the notebook, read by its SSE client,
    through the buffering proxy and around it; a client that hangs up frees its blocks."""
    import psutil
    text, outputs, _ = run_notebook("04_streaming.ipynb", tmp_path, answers={
        "answer_ttft": "ex_arrivals[0] - ex_sent",
        "answer_tpot": "(ex_arrivals[-1] - ex_arrivals[0]) / (len(ex_arrivals) - 1)"})
    assert text.count("right:") == 1 and "not quite" not in text
    pid = int(re.search(r"\(pid (\d+)\)", text).group(1))
    assert "server stopped: True" in text and not psutil.pid_exists(pid)
    m = re.search(r"(\d+) tokens; 1 request finished", text)
    assert m and int(m.group(1)) == 48
    ttft = re.search(r"TTFT +([\d.]+) ms +([\d.]+) ms", text)
    tpot = re.search(r"TPOT +([\d.]+) ms +([\d.]+) ms", text)
    assert ttft and float(ttft.group(1)) >= float(ttft.group(2)) > 0   # the client's holds the engine's
    assert tpot and float(tpot.group(2)) > 0
    bursts = {name: int(n) for name, n in
              re.findall(r"^(direct|proxy, 4 KiB buffer|proxy, buffering off) +48 tokens in +(\d+) bursts",
                         text, re.M)}
    assert len(bursts) == 3
    # Bytes decide the buffered bursts (48 events of ~250 B through a 4 KiB buffer), whatever
    # the machine's speed; the sentence under the chart says what the figures show.
    assert bursts["proxy, 4 KiB buffer"] <= 5 < bursts["direct"]
    assert (f"in {bursts['proxy, 4 KiB buffer']} bursts instead of {bursts['direct']}" in text) == \
        (bursts["proxy, 4 KiB buffer"] < bursts["direct"] / 3)
    m = re.search(r"got 10 tokens, then hung up; at most (\d+) of (\d+) KV blocks were in use, "
                  r"(\d+) now; requests the server aborted: 1\b", text)
    assert m and int(m.group(1)) > 0 and int(m.group(3)) == 0
    assert plotly_figures(outputs) == 3


def test_a_notebook_waits_for_the_kernel_build_a_server_would_start(monkeypatch):
    """04 starts a server on the device it names: on a CPU whose kernel is not built, the
    notebook's own process starts the build (what the server would do), shows the bar until
    it is done, and the server then starts on a built kernel. The build is stood in for (the
    real one is checked in test_caches); what is checked is the notebook's side of it."""
    from workbench.platforms import cpu_kernels as ck

    import widgets.notebook as nbk
    built, started, shown = [False], [], []
    monkeypatch.setattr(ck, "kernel_is_built", lambda: built[0])
    monkeypatch.setattr(ck, "failure", lambda: None)
    monkeypatch.setattr(ck, "build_in_background", lambda: started.append(1))
    monkeypatch.setattr(ck, "kernel_is_building", lambda: bool(started) and not built[0])
    monkeypatch.setattr(ck, "wait_for_kernel", lambda t: built.__setitem__(0, True))
    monkeypatch.setattr(ck, "kernels", lambda: object() if built[0] else None)
    monkeypatch.setattr("IPython.display.display", lambda w: shown.append(w))
    line = nbk.wait_for_cpu_kernel("cpu")
    assert started == [1] and len(shown) == 1 and line.startswith("the C++ CPU kernel is loaded")
    started.clear()
    assert nbk.wait_for_cpu_kernel("cpu") == "the C++ CPU kernel is loaded" and not started


@pytest.mark.timeout(300)
def test_kernel_interrupt_ends_a_running_sweep_in_one_line(tmp_path):
    """Kernel > Interrupt, for real: notebook 03's set-up cells on a real IPython kernel
    (started through jupyter_client, as Lab starts it), its first sweep started at the FULL
    sizes (minutes of work), and the interrupt sent once the sweep's progress bar shows: the
    cell ends with one stderr line and no traceback, and the next cell runs."""
    from jupyter_client.manager import start_new_kernel

    nb = nbformat.read(NOTEBOOKS / "03_tuning.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    sweep_cell = next(i for i, c in enumerate(code) if c.startswith('results["max_num_seqs"]'))
    env = {**os.environ, "WORKBENCH_DEVICE": "cpu", "WORKBENCH_FULL": "1",
           "WORKBENCH_EXPORT_DIR": str(tmp_path / "exports")}
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path), env=env)
    pid = km.provisioner.process.pid
    try:
        def run(source: str, interrupt_when=None, timeout: float = 120.0) -> tuple[list, float]:
            """The cell's output messages, and when the interrupt went (0: not sent)."""
            msg_id, seen, sent = kc.execute(source), [], 0.0
            deadline = time.monotonic() + timeout
            while True:
                assert time.monotonic() < deadline, f"the cell ran past {timeout} s: {seen}"
                try:
                    msg = kc.get_iopub_msg(timeout=1)
                except queue.Empty:                    # nothing this second
                    msg = None
                if msg and msg["parent_header"].get("msg_id") == msg_id:
                    kind, content = msg["msg_type"], msg["content"]
                    if kind == "status" and content["execution_state"] == "idle":
                        return seen, sent
                    if kind in ("stream", "error", "display_data", "execute_result"):
                        seen.append((kind, content))
                if interrupt_when and not sent and interrupt_when(seen):
                    km.interrupt_kernel()
                    sent = time.monotonic()

        for i in range(sweep_cell):
            out, _ = run(code[i])
            assert not [c for k, c in out if k == "error" or c.get("name") == "stderr"], \
                (code[i][:80], out)                  # no traceback, no warning text
        # The sweep's progress bar is a widget (a display_data) shown as the sweep starts:
        # interrupt 3 s after it shows, inside the first run.
        shown = []

        def bar_shown_3_s_ago(seen) -> bool:
            if not shown and any(k == "display_data" for k, _ in seen):
                shown.append(time.monotonic())
            return bool(shown) and time.monotonic() - shown[0] > 3

        out, sent = run(code[sweep_cell], bar_shown_3_s_ago, timeout=240)
        assert sent, "the sweep finished before it could be interrupted"
        assert time.monotonic() - sent < 30, "the interrupt took more than 30 s to end the cell"
        assert not [c for k, c in out if k == "error"], out             # no traceback
        stderr = "".join(c["text"] for k, c in out if k == "stream" and c["name"] == "stderr")
        assert stderr.strip().splitlines() == [
            "Interrupted: this cell stopped (run it again to start it over)."], stderr
        out, _ = run("2 + 2")
        assert [c["data"]["text/plain"] for k, c in out if k == "execute_result"] == ["4"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    with pytest.raises(ProcessLookupError):             # the kernel is gone
        os.kill(pid, 0)


def test_an_interrupt_ends_a_cell_in_one_line(capsys):
    """What the notebooks set up (widgets.notebook.interrupts_in_one_line): Kernel >
    Interrupt during a cell prints one line, not a traceback through the engine."""
    from IPython.core.interactiveshell import InteractiveShell

    from widgets.notebook import interrupts_in_one_line
    shell = InteractiveShell.instance()
    try:
        interrupts_in_one_line()
        shell.run_cell("def deep(n):\n    return deep(n - 1) if n else (_ for _ in ()).throw("
                       "KeyboardInterrupt())\ndeep(20)")
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err and "deep" not in out + err
        assert err.strip().splitlines() == [
            "Interrupted: this cell stopped (run it again to start it over)."]
        assert shell.run_cell("1 + 1").result == 2       # the next cell runs
    finally:
        InteractiveShell.clear_instance()
