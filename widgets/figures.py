"""Static plotly figures for the notebooks, drawn from measurements the engine side makes
(telemetry, `workbench.bench.offline`). Static on purpose: a saved notebook keeps each figure's
data only (a few KB), where a live FigureWidget would keep plotly's whole 5 MB bundle in its
widget state. The live panels (timeline, roofline) are for the dashboard.

    show(steps_figure(engine.telemetry.steps))
"""
from __future__ import annotations

import plotly.graph_objects as go

from .style import DECODE, PALETTE, PREFILL

RENDERER = "plotly_mimetype"
"""Figures go out as plotly JSON only (JupyterLab and VS Code draw it), never with plotly.js
inlined into the notebook."""


def show(fig: go.Figure) -> None:
    fig.show(renderer=RENDERER)


def when_drawn(figures, callback) -> None:
    """Call `callback()` once, when a browser has drawn every FigureWidget in `figures`.

    Until its 5 MB script has loaded, a FigureWidget's browser side drops what it is sent:
    plotly's model applies each edit from handlers that its `initialize` registers, and that
    runs only once the script is in. A page that starts changing a figure as soon as it shows
    can therefore leave it stuck at its first state on a slow browser. plotly has no public
    "drawn" event; its view reports the drawn traces back (the `_js2py_traceDeltas` message)
    when its first plot is done, in every plotly since 4, and that is the signal used here."""
    pending = {id(fig): fig for fig in figures}

    def drawn(change) -> None:
        fig = change["owner"]
        if change["new"] is None or id(fig) not in pending:
            return                                  # plotly resets it to None after reading
        fig.unobserve(drawn, names="_js2py_traceDeltas")
        del pending[id(fig)]
        if not pending:
            callback()

    for fig in pending.values():
        fig.observe(drawn, names="_js2py_traceDeltas")


def _layout(fig: go.Figure, title: str, height: int = 340) -> go.Figure:
    fig.update_layout(title=dict(text=title, font=dict(size=14), x=0.01), height=height,
                      template="plotly_white", margin=dict(l=60, r=20, t=50, b=50),
                      legend=dict(orientation="h", y=1.12, x=0))
    return fig


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
    fig.update_yaxes(title_text="tokens", type="log" if any(
        s.num_prefill_tokens > 20 * max(1, s.num_decode_tokens) for s in steps) else "linear")
    return _layout(fig, title)


def batch_scaling_figure(rows) -> go.Figure:
    """Time per token against batch size, prefill and decode (rows from
    `bench.offline.time_per_token_by_batch`)."""
    b = [r["batch"] for r in rows]
    fig = go.Figure()
    fig.add_scatter(x=b, y=[r["prefill_s_per_token"] * 1e3 for r in rows], name="prefill",
                    mode="lines+markers", line_color=PREFILL)
    fig.add_scatter(x=b, y=[r["decode_s_per_token"] * 1e3 for r in rows], name="decode",
                    mode="lines+markers", line_color=DECODE)
    fig.update_xaxes(title_text="requests in the step (batch size)", type="log", tickvals=b)
    fig.update_yaxes(title_text="ms per token", type="log")
    return _layout(fig, "Time per token: decode gets cheaper with batch size, prefill barely")


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
