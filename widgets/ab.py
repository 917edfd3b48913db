"""ABPanel: two engine configurations on the same request set, side by side with the deltas.

Write each arm's knobs as `name = value` lines (EngineConfig names: block_size = 128,
max_num_seqs = 8, graph_mode = "eager", ...), choose the workload, press Run. The arms run one
after the other on this device (A is built, run and closed, then B), never at once, so each
has the device to itself; the panel says so. From code:

    from workbench.bench.offline import ab_run, make_workload
    result = ab_run({"block_size": 16}, {"block_size": 128}, make_workload(16, (16, 128),
                    (16, 64), vocab=49152))
    ABPanel(result=result)

In the dashboard the arms start from the dashboard's own settings, and its engine stays
loaded while they run: on a GPU sized by gpu_memory_utilization, give the arms a smaller
share (e.g. `gpu_memory_utilization = 0.3` in both) or run A/B from a notebook.
"""
from __future__ import annotations

import ast
import asyncio

import ipywidgets as w
import traitlets

from workbench.bench.offline import AB_METRICS, ABResult, ab_run, make_workload

from .style import css_widget, esc

HIGHER_IS_BETTER = {"out_tok_s"}


def parse_knobs(text: str, which: str = "knobs") -> dict:
    """`name = value` lines (Python literals; a bare word is a string) -> a dict. Blank lines
    and `#` comments are skipped; anything else that does not parse is an error naming it."""
    out = {}
    for i, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, eq, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name.isidentifier() or not value:
            raise ValueError(f"{which}, line {i}: write `name = value` (got {line!r})")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            if not value.replace("-", "_").replace(":", "_").isidentifier():
                raise ValueError(f"{which}, line {i}: {value!r} is not a value") from None
            out[name] = value
    return out


def _fmt(x) -> str:
    if x is None:
        return "—"
    return f"{x:,.3g}" if isinstance(x, float) else f"{x:,}"


def result_html(r: ABResult) -> str:
    """The two arms' figures side by side, with B − A and a better/worse mark per metric."""
    def knobs(k: dict) -> str:
        return esc(", ".join(f"{n}={v}" for n, v in k.items()) or "(defaults)")
    rows = []
    for key, d in r.deltas().items():
        mark = ""
        if d["delta"]:
            better = (d["delta"] > 0) == (key in HIGHER_IS_BETTER)
            mark = (f"<span class='{'ok' if better else 'error'}' style='padding:0 4px'>"
                    f"{'better' if better else 'worse'}</span>")
        rel = f" ({d['relative']:+.0%})" if d["relative"] is not None else ""
        rows.append(f"<tr><td>{esc(AB_METRICS[key])}</td><td>{_fmt(d['a'])}</td>"
                    f"<td>{_fmt(d['b'])}</td><td>{_fmt(d['delta'])}{rel} {mark}</td></tr>")
    return (f'<div class="wb"><h3>A/B run</h3><div class="muted">A and B ran one after the '
            f'other on {esc(r.device)}, each alone with the device (never at once), on the '
            f'same requests.</div><table class="steps"><tr><th>metric</th><th>A: '
            f'{knobs(r.knobs_a)}</th><th>B: {knobs(r.knobs_b)}</th><th>B − A</th></tr>'
            f'{"".join(rows)}</table></div>')


class ABPanel(w.VBox):
    """Knobs for A and B over `engine_kwargs` (the common settings, e.g. model and device).
    Prompts are random token ids below `vocab` (1000 fits any real model's vocabulary)."""

    num_runs = traitlets.Int(0)

    def __init__(self, result: ABResult | None = None, *, model: str = "smollm2",
                 engine_kwargs: dict | None = None, a: str = "block_size = 16",
                 b: str = "block_size = 128", vocab: int = 1000):
        self.model, self.engine_kwargs, self.vocab = model, dict(engine_kwargs or {}), vocab
        self.result = result
        area = dict(rows=3, layout=w.Layout(width="49%"))
        self.a = w.Textarea(value=a, placeholder="A: name = value per line", **area)
        self.b = w.Textarea(value=b, placeholder="B: name = value per line", **area)
        self.num_requests = w.BoundedIntText(value=16, min=1, max=1024, description="requests",
                                             layout=w.Layout(width="180px"))
        self.input_len = w.IntRangeSlider(value=(16, 128), min=1, max=2048,
                                          description="prompt len")
        self.output_len = w.IntRangeSlider(value=(16, 64), min=1, max=2048,
                                           description="output len")
        self.run_button = w.Button(description="Run A then B", icon="play", button_style="primary")
        self.run_button.on_click(lambda _: self._clicked())
        self.view = w.HTML()
        super().__init__([css_widget(), w.HBox([self.a, self.b]),
                          w.HBox([self.num_requests, self.input_len, self.output_len]),
                          self.run_button, self.view])
        self.add_class("wb-ab")
        if result is not None:
            self.show(result)

    def show(self, result: ABResult) -> None:
        self.result = result
        self.view.value = result_html(result)

    def _compute(self) -> ABResult:
        knobs_a, knobs_b = parse_knobs(self.a.value, "A"), parse_knobs(self.b.value, "B")
        wl = make_workload(self.num_requests.value, self.input_len.value, self.output_len.value,
                           self.vocab)
        return ab_run(knobs_a, knobs_b, wl, self.model, self.engine_kwargs)

    def run(self) -> ABResult:
        """Run both arms now (blocks; minutes for a real model) and show the result."""
        result = self._compute()
        self.num_runs += 1
        self.show(result)
        return result

    def _clicked(self) -> None:
        """From the button: run in a worker thread so the page stays live, then draw."""
        self.run_button.disabled = True
        self.view.value = ('<div class="wb muted">Running A, then B (one after the other on '
                           'this device)…</div>')

        async def go():
            try:
                result = await asyncio.get_running_loop().run_in_executor(None, self._compute)
                self.num_runs += 1
                self.show(result)          # drawn on the kernel's loop, not the worker
            except (ValueError, TypeError) as e:
                self.view.value = f'<div class="wb"><div class="error">{esc(str(e))}</div></div>'
            finally:
                self.run_button.disabled = False
        asyncio.ensure_future(go())
