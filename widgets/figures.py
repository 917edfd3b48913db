"""Static plotly figures for the notebooks, drawn from measurements the engine side makes
(telemetry, `workbench.bench.offline`). Static on purpose: a saved notebook keeps each figure's
data only (a few KB), where a live figure keeps plotly.js (4.6 MB) in its widget state. The
live panels (timeline, roofline, tuner) draw theirs with `LivePlot`, below.

    show(steps_figure(engine.telemetry.steps))
"""
from __future__ import annotations

import json
import math

import anywidget
import plotly.graph_objects as go
import traitlets

from .style import DECODE, PALETTE, PREFILL

RENDERER = "plotly_mimetype"
"""Figures go out as plotly JSON only (JupyterLab and VS Code draw it), never with plotly.js
inlined into the notebook."""


def show(fig: go.Figure) -> None:
    fig.show(renderer=RENDERER)


_ESM = r"""
// plotly.js is evaluated here, in the view (once per page), not as this module: anywidget
// handles no message for a model whose module has not loaded within 2 s, so a 5 MB module on
// a busy machine left a figure frozen at its first state for good.
function plotly(model) {
  if (!globalThis.__workbenchPlotly) {
    const src = model.get("_plotly");
    globalThis.__workbenchPlotly = new Promise((resolve) => setTimeout(() => {
      const m = { exports: {} };
      new Function("module", "exports", "define", src)(m, m.exports, undefined);
      resolve(m.exports);
    }, 0));
  }
  return globalThis.__workbenchPlotly;
}
export default {
  async render({ model, el }) {
    const Plotly = await plotly(model);
    let busy = false, again = false;
    const draw = async () => {       // one Plotly.react at a time, the newest state last
      if (busy) { again = true; return; }
      busy = true;
      do {
        again = false;
        await Plotly.react(el, model.get("traces"), model.get("figure_layout"), model.get("config"));
      } while (again);
      busy = false;
    };
    model.on("change:traces", draw);          // ("layout" is every DOM widget's CSS layout)
    model.on("change:figure_layout", draw);
    await draw();
    if (!model.get("drawn")) { model.set("drawn", true); model.save_changes(); }
    return () => Plotly.purge(el);
  },
};
"""

_plotly_js: str | None = None


def _plotly_source() -> str:
    """plotly.py's own plotly.js bundle, read once (the version its figures are built for)."""
    global _plotly_js
    if _plotly_js is None:
        from plotly.offline import get_plotlyjs
        _plotly_js = get_plotlyjs()
    return _plotly_js


class LivePlot(anywidget.AnyWidget):
    """A plotly figure drawn in the page, sent whole: `fig` (a go.Figure) is the state, and
    `sync()` sends what changed of its data and layout (one message). Each browser view
    draws it with Plotly.react, so a view shows the kernel's figure however many updates it
    missed. Unlike plotly's FigureWidget, whose edits are deltas and whose 5 MB module must
    load within anywidget's 2 s or every later edit is dropped, its module is small and
    plotly.js loads in the view."""
    _esm = _ESM
    _plotly = traitlets.Unicode().tag(sync=True)
    traces = traitlets.List().tag(sync=True)
    figure_layout = traitlets.Dict().tag(sync=True)
    config = traitlets.Dict().tag(sync=True)
    drawn = traitlets.Bool(False).tag(sync=True)
    """Set by the first browser view that has drawn the figure."""

    def __init__(self, fig, **kw):
        super().__init__(_plotly=_plotly_source(), config=dict(displaylogo=False), **kw)
        self.fig = fig
        self.num_syncs = 0
        self.sync()

    def sync(self) -> None:
        state = json.loads(self.fig.to_json(validate=False))
        with self.hold_sync():
            self.traces = state.get("data", [])
            self.figure_layout = state.get("layout", {})
        self.num_syncs += 1


def when_drawn(plots, callback) -> None:
    """Call `callback()` once, when a browser has drawn every LivePlot in `plots` (the
    replay starts then, so that it plays where someone sees it)."""
    pending = {id(p): p for p in plots}

    def drawn(change) -> None:
        plot = change["owner"]
        if not change["new"] or id(plot) not in pending:
            return
        plot.unobserve(drawn, names="drawn")
        del pending[id(plot)]
        if not pending:
            callback()

    for p in list(pending.values()):
        if p.drawn:
            del pending[id(p)]
        else:
            p.observe(drawn, names="drawn")
    if not pending:
        callback()


TITLE_AND_LEGEND = dict(
    margin=dict(l=60, r=20, t=72, b=50),
    title=dict(font=dict(size=14), x=0.01, xanchor="left", y=0.99, yanchor="top"),
    legend=dict(orientation="h", x=0, xanchor="left", y=1.02, yanchor="bottom"))
"""The title on the top line, the legend on the line below it, just above the plot: a legend
placed by a fixed fraction of the height overlapped the title when the figure was short."""


def _layout(fig: go.Figure, title: str, height: int = 340) -> go.Figure:
    fig.update_layout(TITLE_AND_LEGEND, title_text=title, height=height, template="plotly_white")
    return fig


def log_ticks(values) -> dict:
    """A log axis labelled at whole decades (1, 10, 100 …) where `values` span two or more,
    else at 1, 2 and 5 of each decade. Plotly's own choice on a short range labels every
    minor tick (… 7, 8, 9), which crowds into an unreadable row."""
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return dict(type="log")
    lo, hi = min(vals), max(vals)
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    decades = [10.0 ** e for e in range(e0, e1 + 1)]
    if sum(lo <= d <= hi for d in decades) < 2:
        decades = [m * 10.0 ** e for e in range(e0, e1 + 1) for m in (1, 2, 5)]
    return dict(type="log", tickvals=decades, tickmode="array")


def steps_figure(steps, title: str = "Tokens fed per engine step") -> go.Figure:
    """Prefill and decode tokens of each step as stacked bars; a red mark where the step
    preempted requests (their tokens will be fed again)."""
    steps = [s for s in steps if s.phase != "idle"]
    x = [s.step for s in steps]
    hover = [f"step {s.step} · {s.phase} · {s.duration * 1e3:.1f} ms<br>"
             + "<br>".join(f"{rid}: {s.kinds.get(rid, '')} {n}"
                           for rid, n in s.tokens_per_request.items())
             + (f"<br>preempted {', '.join(s.preempted)}" if s.preempted else "") for s in steps]
    fig = go.Figure()
    fig.add_bar(x=x, y=[s.num_prefill_tokens for s in steps], name="prefill tokens",
                marker_color=PREFILL, hovertext=hover, hoverinfo="text")
    fig.add_bar(x=x, y=[s.num_decode_tokens for s in steps], name="decode tokens",
                marker_color=DECODE, hovertext=hover, hoverinfo="text")
    pre = [s for s in steps if s.num_preempted]
    if pre:
        fig.add_scatter(x=[s.step for s in pre], y=[s.num_tokens for s in pre], mode="markers",
                        name="preemption", marker=dict(color="#d62728", symbol="x", size=11),
                        hovertext=[f"step {s.step}: preempted {', '.join(s.preempted)}"
                                   for s in pre], hoverinfo="text")
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="engine step")
    if any(s.num_prefill_tokens > 20 * max(1, s.num_decode_tokens) for s in steps):
        fig.update_yaxes(log_ticks([s.num_tokens for s in steps]))
    fig.update_yaxes(title_text="tokens")
    return _layout(fig, title)


def batch_scaling_figure(rows) -> go.Figure:
    """Time per token against batch size, prefill and decode (rows from
    `bench.offline.time_per_token_by_batch`): the medians, with bars from the fastest run to
    the slowest where it ran several."""
    b = [r["batch"] for r in rows]
    fig = go.Figure()
    for phase, color in (("prefill", PREFILL), ("decode", DECODE)):
        med = [r[f"{phase}_s_per_token"] * 1e3 for r in rows]
        runs = [r.get(f"{phase}_runs") for r in rows]
        err = None
        if all(x is not None and len(x.values) > 1 for x in runs):
            err = dict(type="data", symmetric=False,
                       array=[x.max * 1e3 - m for x, m in zip(runs, med)],
                       arrayminus=[m - x.min * 1e3 for x, m in zip(runs, med)])
        fig.add_scatter(x=b, y=med, name=phase, mode="lines+markers", line_color=color,
                        error_y=err)
    fig.update_xaxes(title_text="requests in the step (batch size)", type="log", tickvals=b)
    lo = [(x.min if x is not None else r[k]) * 1e3 for r in rows
          for k, x in (("prefill_s_per_token", r.get("prefill_runs")),
                       ("decode_s_per_token", r.get("decode_runs")))]
    hi = [(x.max if x is not None else r[k]) * 1e3 for r in rows
          for k, x in (("prefill_s_per_token", r.get("prefill_runs")),
                       ("decode_s_per_token", r.get("decode_runs")))]
    fig.update_yaxes(log_ticks(lo + hi),
                     title_text="ms per token (median; bars: fastest to slowest run)")
    return _layout(fig, "Time per token against batch size, prefill and decode")


def kv_cache_figure(result: dict) -> go.Figure:
    """Cumulative time to generate n tokens with the KV cache and by recomputing everything
    (`bench.offline.recompute_vs_cache`)."""
    with_c, without = result["with_cache_s"], result["without_cache_s"]
    fig = go.Figure()
    fig.add_scatter(x=list(range(1, len(with_c) + 1)), y=with_c, name="with the KV cache",
                    mode="lines+markers", line_color=DECODE)
    fig.add_scatter(x=list(range(1, len(without) + 1)), y=without, mode="lines+markers",
                    name="without: recompute the whole sequence per token", line_color=PREFILL)
    fig.update_xaxes(title_text="tokens generated")
    fig.update_yaxes(title_text="seconds since the request arrived")
    return _layout(fig, "Generation with and without the KV cache")


def block_table_figure(state, block_size: int) -> go.Figure:
    """One request's block table drawn as a row of pages: logical block i (positions
    i·block_size …) maps to physical block `block_table[i]`, filled up to its tokens."""
    n_tok, table = state.num_computed_tokens, state.block_table
    fig = go.Figure()
    for i, phys in enumerate(table):
        used = max(0, min(block_size, n_tok - i * block_size))
        colour = PALETTE[i % len(PALETTE)]
        fig.add_shape(type="rect", x0=i, x1=i + 0.92, y0=0, y1=1, line=dict(color="#444"),
                      fillcolor="#f4f4f4")
        fig.add_shape(type="rect", x0=i, x1=i + 0.92 * used / block_size, y0=0, y1=1,
                      line=dict(width=0), fillcolor=colour, opacity=0.55)
        fig.add_annotation(x=i + 0.46, y=0.62, text=f"<b>block {phys}</b>", showarrow=False)
        fig.add_annotation(x=i + 0.46, y=0.3, showarrow=False, font=dict(size=11),
                           text=f"pos {i * block_size}–{i * block_size + block_size - 1}"
                                f"<br>{used}/{block_size} filled")
    fig.add_scatter(x=[i + 0.46 for i in range(len(table))], y=[0.5] * len(table),
                    mode="markers", marker=dict(opacity=0), showlegend=False, hoverinfo="text",
                    hovertext=[f"logical block {i} → physical block {b}"
                               for i, b in enumerate(table)])
    fig.update_xaxes(visible=False, range=[-0.1, max(len(table), 1)])
    fig.update_yaxes(visible=False, range=[-0.05, 1.05])
    return _layout(fig, f"{state.request_id}'s block table: {n_tok} tokens in "
                        f"{len(table)} blocks of {block_size}", height=200)


def arrivals_figure(runs: dict[str, list[float]]) -> go.Figure:
    """When each token of a stream reached the client (seconds since the request was sent),
    one line per way of reading it: a smooth stream climbs steadily, a buffered one in steps."""
    fig = go.Figure()
    for (name, times), color in zip(runs.items(), PALETTE):
        fig.add_scatter(x=times, y=list(range(1, len(times) + 1)), name=name,
                        mode="lines+markers", line_shape="hv", line_color=color,
                        marker_size=4)
    fig.update_xaxes(title_text="seconds since the request was sent")
    fig.update_yaxes(title_text="tokens received")
    return _layout(fig, "When each token reached the client")


def kv_in_use_figure(samples: list[tuple[float, int]], pool: int,
                     hung_up: float | None = None) -> go.Figure:
    """KV blocks in use over time (polled from a server's /metrics), with the moment the
    client hung up marked."""
    fig = go.Figure()
    fig.add_scatter(x=[t for t, _ in samples], y=[u for _, u in samples], mode="lines",
                    line_shape="hv", name="KV blocks in use", line_color=DECODE)
    if hung_up is not None:
        fig.add_vline(x=hung_up, line_dash="dot", annotation_text="the client hangs up")
    fig.update_xaxes(title_text="seconds")
    fig.update_yaxes(title_text=f"blocks in use (of {pool})", rangemode="tozero")
    return _layout(fig, "The server frees a request's KV blocks when its client goes")
