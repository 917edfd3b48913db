"""RooflinePanel: each engine step as a point, arithmetic intensity (FLOPs per byte of weights
and KV read) against achieved FLOP/s, under this device's two measured roofs.

Left of the ridge (the machine balance) a step is memory-bound: decode steps sit there, close
under the bandwidth roof, because every weight is read for one token per request. Right of it
a step can be compute-bound: a long prefill reuses each weight for many tokens and climbs
toward the matmul roof. Hover a point for its step, phase and batch.

    RooflinePanel(engine.info(), engine.device_roofs())   # then update(Update) per tick
"""
from __future__ import annotations

import ipywidgets as w
import plotly.graph_objects as go
import traitlets

from workbench.roofline import DeviceRoofs, roofline_points
from workbench.telemetry import EngineInfo

from .figures import TITLE_AND_LEGEND, LivePlot, log_ticks
from .style import DECODE, PREFILL, css_widget, esc, modelled_html, modelled_label

MIXED = "#8e6bbf"
PHASES = {"prefill": PREFILL, "decode": DECODE, "mixed": MIXED}


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def roofline_figure(info: EngineInfo | None = None, roofs: DeviceRoofs | None = None,
                    steps=(), height: int = 380) -> go.Figure:
    """A static roofline of `steps` (for a notebook: no widget state to save); the panel
    below is the live one."""
    fig = go.Figure()
    fig.add_scatter(name="bandwidth roof", mode="lines", line=dict(color="#555", width=2),
                    hoverinfo="name")
    fig.add_scatter(name="compute roof", mode="lines",
                    line=dict(color="#555", width=2, dash="dash"), hoverinfo="name")
    for phase, colour in PHASES.items():
        fig.add_scatter(name=phase, mode="markers", hoverinfo="text",
                        marker=dict(color=colour, size=8, opacity=0.75,
                                    line=dict(width=0.5, color="#fff")))
    fig.update_layout(TITLE_AND_LEGEND, height=height, template="plotly_white",
                      uirevision="keep", hoverlabel=dict(align="left"),
                      title_text="Roofline: each step's FLOP/s against its intensity")
    fig.update_xaxes(type="log", title_text="arithmetic intensity (FLOP per byte read)")
    fig.update_yaxes(type="log", title_text="achieved FLOP/s", exponentformat="SI")
    points = roofline_points(steps, info) if info is not None and steps else []
    _fill(fig, points, roofs)
    return fig


FORMAT_COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd")


def formats_roofline_figure(roofs: DeviceRoofs, runs, height: int = 380) -> go.Figure:
    """The same decode step in several weight formats on one roofline: `runs` is a list of
    (label, EngineInfo, steps); each format's decode steps are one colour. Fewer bytes per
    weight move a step right (more FLOPs per byte) and, while it stays under the bandwidth
    roof, up: that is the whole reason a 4-bit decode is faster."""
    fig = go.Figure()
    fig.add_scatter(name="bandwidth roof", mode="lines", line=dict(color="#555", width=2))
    fig.add_scatter(name="compute roof", mode="lines", line=dict(color="#555", width=2, dash="dash"))
    everything = []
    for (label, info, steps), colour in zip(runs, FORMAT_COLOURS):
        pts = [p for p in roofline_points(steps, info) if p.phase == "decode"]
        everything += pts
        fig.add_scatter(name=f"{label}: {info.weight_bytes / 1e6:.0f} MB", mode="markers",
                        x=[p.intensity for p in pts], y=[p.flops_per_s for p in pts],
                        marker=dict(color=colour, size=8, opacity=0.8),
                        hovertext=[f"{label} · step {p.step}<br>{p.intensity:.3g} FLOP/byte · "
                                   f"{_si(p.flops_per_s, 'FLOP/s')}" for p in pts],
                        hoverinfo="text")
    lo = min([p.intensity for p in everything] + [roofs.balance]) / 4
    hi = max([p.intensity for p in everything] + [roofs.balance]) * 4
    fig.data[0].x, fig.data[0].y = [lo, roofs.balance], [lo * roofs.bandwidth, roofs.peak_flops]
    fig.data[1].x, fig.data[1].y = [roofs.balance, hi], [roofs.peak_flops, roofs.peak_flops]
    fig.update_layout(TITLE_AND_LEGEND, height=height, template="plotly_white",
                      title_text="One decode step, weight formats compared")
    fig.update_xaxes(type="log", title_text="arithmetic intensity (FLOP per byte read)")
    fig.update_yaxes(type="log", title_text="achieved FLOP/s", exponentformat="SI")
    _label_decades(fig)
    return fig


def verify_roofline_figure(devices, height: int = 400) -> go.Figure:
    """Decoding against verifying k drafts, at a small and a large batch, where the roofline
    puts them: `devices` is a list of (name, DeviceRoofs, [(label, StepCost), ...]); each
    device's roofs are drawn, and each step sits on them at its intensity (the most FLOP/s it
    can reach there; its hover, the least time it can take). Left of a device's balance, k + 1
    rows a request cost the bytes of one row; right of it, they cost their FLOPs."""
    fig = go.Figure()
    xs = [c.intensity for _, _, shapes in devices for _, c in shapes]
    xs += [r.balance for _, r, _ in devices]
    lo, hi = min(xs) / 4, max(xs) * 4
    for (name, r, shapes), dash, symbol in zip(devices, ("solid", "dot", "dashdot"),
                                               ("circle", "diamond", "square")):
        fig.add_scatter(name=f"{name}: roofs (balance {r.balance:.3g} FLOP/byte)", mode="lines",
                        x=[lo, r.balance, hi],
                        y=[lo * r.bandwidth, r.peak_flops, r.peak_flops],
                        line=dict(color="#555", width=2, dash=dash), hoverinfo="name")
        for (label, c), colour in zip(shapes, FORMAT_COLOURS):
            fig.add_scatter(name=f"{name}: {label}", mode="markers", x=[c.intensity],
                            y=[r.attainable(c.intensity)],
                            marker=dict(color=colour, size=11, opacity=0.85, symbol=symbol),
                            hovertext=[f"{name} · {label}<br>{c.intensity:.3g} FLOP/byte · at "
                                       f"least {r.least_time(c) * 1e3:.3g} ms"],
                            hoverinfo="text")
    fig.update_layout(TITLE_AND_LEGEND, height=height, template="plotly_white",
                      title_text="Decode, or verify k drafts: where each step sits on the roofline")
    fig.update_xaxes(type="log", title_text="arithmetic intensity (FLOP per byte read)")
    fig.update_yaxes(type="log", title_text="attainable FLOP/s", exponentformat="SI")
    _label_decades(fig)
    return fig


def _label_decades(fig) -> None:
    """Tick labels at decades (figures.log_ticks) over what the figure holds."""
    xs = [x for t in fig.data for x in (t.x or ())]
    ys = [y for t in fig.data for y in (t.y or ())]
    fig.update_xaxes(log_ticks(xs))
    fig.update_yaxes(log_ticks(ys))


def _fill(fig, pts, r: DeviceRoofs | None) -> None:
    """Draw the roofs and the points into `fig`."""
    data = fig.data
    with fig.batch_update():
        if r is not None:
            xs = [p.intensity for p in pts] or [r.balance]
            lo = min(min(xs), r.balance) / 4
            hi = max(max(xs), r.balance) * 4
            data[0].x, data[0].y = [lo, r.balance], [lo * r.bandwidth, r.peak_flops]
            data[1].x, data[1].y = [r.balance, hi], [r.peak_flops, r.peak_flops]
            data[0].name = f"bandwidth roof {_si(r.bandwidth, 'B/s')}"
            data[1].name = f"compute roof {_si(r.peak_flops, 'FLOP/s')}"
        for trace, phase in zip(data[2:], PHASES):
            mine = [p for p in pts if p.phase == phase]
            trace.x = [p.intensity for p in mine]
            trace.y = [p.flops_per_s for p in mine]
            trace.hovertext = [
                f"step {p.step} · {p.phase}<br>batch {p.batch} requests, {p.tokens} tokens"
                f"<br>{p.intensity:.3g} FLOP/byte · {_si(p.flops_per_s, 'FLOP/s')}"
                + (f" ({p.flops_per_s / r.attainable(p.intensity):.0%} of the roof)"
                   if r is not None else "")
                + f"<br>{p.duration * 1e3:.1f} ms" for p in mine]
        _label_decades(fig)


class RooflinePanel(w.VBox):
    """Feed it with `update(u)` (an Update from a source) or `add_steps(events)`."""

    num_points = traitlets.Int(0, help="Steps drawn.")

    def __init__(self, info: EngineInfo | None = None, roofs: DeviceRoofs | None = None,
                 window: int = 2000, height: int = 380, missing: str | None = None, **kw):
        self.window = window
        self.points: list = []
        self.note = w.HTML()
        self.fig = roofline_figure(height=height)
        self.plot = LivePlot(self.fig)
        self.set_model(info, roofs, missing)
        super().__init__([css_widget(), self.note, self.plot], **kw)
        self.add_class("wb-roofline")

    def set_model(self, info: EngineInfo | None, roofs: DeviceRoofs | None,
                  missing: str | None = None) -> None:
        """A new engine (or trace): its info counts the FLOPs, its device gives the roofs.
        `missing` says why there are none yet (an engine still loading)."""
        self.info, self.roofs = info, roofs
        self.points = []
        self.note.value = modelled_html(modelled_label(info)) + roofs_note(info, roofs, missing)
        self._draw()

    def clear(self) -> None:
        self.points = []
        self._draw()

    def update(self, u) -> None:
        if u.steps:
            self.add_steps(u.steps)

    def add_steps(self, steps) -> None:
        if self.info is None or not hasattr(steps[0], "context_lens"):
            return                       # a remote server's /metrics polls have no steps
        self.points.extend(roofline_points(steps, self.info))
        del self.points[:-self.window]
        self._draw()

    def _draw(self) -> None:
        _fill(self.fig, self.points, self.roofs)
        self.plot.sync()
        self.num_points = len(self.points)


def roofs_note(info: EngineInfo | None, roofs: DeviceRoofs | None,
               missing: str | None = None) -> str:
    """The measured roofs and the machine balance, in a sentence (HTML); without them, why
    (`missing`, else: a remote server's are unknown)."""
    if info is None or roofs is None:
        if missing:
            return f'<div class="wb muted">Roofline: {esc(missing)}.</div>'
        return ('<div class="wb muted">No roofline: the model\'s shape or the device\'s roofs '
                'are unknown (a remote server).</div>')
    how = "modelled" if getattr(info, "modelled", None) else "measured"
    return (f'<div class="wb muted">{esc(roofs.device)} · {esc(roofs.dtype)}: {how} '
            f'{_si(roofs.peak_flops, "FLOP/s")} matmul, {_si(roofs.bandwidth, "B/s")} memory; '
            f'balance <b>{roofs.balance:.3g} FLOP/byte</b> (left of it a step is '
            f'memory-bound)</div>')
