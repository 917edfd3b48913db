"""BatchTimeline: what every engine step did, live.

Three rows on one step axis: prompt (prefill) tokens per step, output (decode) tokens per
step, each on its own y axis so that a 1-token-per-request decode step stays readable next
to a prefill of hundreds; then running and waiting requests, with KV-pool usage on the right
axis. Steps that replayed a captured graph are drawn hatched, so eager and graph steps tell
apart at a glance. Hovering a bar names the requests in the step and what each did. With
speculative decoding, once any step drafted, the output row also shows each verify step's
drafted tokens (grey) and, inside them, those the target accepted (green), with the
acceptance by request and by draft position in their hover text. The x
axis keeps at most ~10 tick labels whatever the number of steps, and `clear()` (a rebuilt
engine restarts at step 0) forgets the old axis ranges.

For a remote server the x axis is the /metrics poll, not the step: the server does not
publish its steps, so each bar is the tokens it counted between two polls. A server without
/metrics is drawn from the client's own view, and labelled so: output tokens its streams
brought per interval, requests streaming and waiting for a first token, no KV line.
"""
from __future__ import annotations

from collections import deque

import ipywidgets as w
import traitlets
from plotly.subplots import make_subplots

from .figures import LivePlot
from .sources import Update
from .style import ACCEPTED, DECODE, DRAFTED, KV, PREFILL, RUNNING, WAITING, css_widget, esc

HOVER_REQUESTS = 8


def _hover(s) -> str:
    if s.phase == "client":
        ttft = ", ".join(f"{t * 1e3:.0f}" for t in s.ttfts[:HOVER_REQUESTS])
        return (f"client view {s.step} · {s.duration * 1e3:.0f} ms<br>{s.num_decode_tokens} "
                f"output tokens ({s.num_decode_tokens / s.duration:.1f} tok/s)<br>"
                f"{s.num_running} streaming · {s.num_waiting} waiting for a first token"
                + (f"<br>TTFT ms: {ttft}" if ttft else ""))
    if s.phase == "poll":
        return (f"poll {s.step} · {s.duration * 1e3:.0f} ms<br>{s.num_prefill_tokens} prompt + "
                f"{s.num_decode_tokens} output tokens<br>{s.num_running} running · "
                f"{s.num_waiting} waiting · KV {s.kv_usage:.0%}")
    lines = [f"step {s.step} · {s.phase} · {s.graph_label} · {s.duration * 1e3:.1f} ms",
             f"{s.num_prefill_tokens} prefill + {s.num_decode_tokens} decode tokens"]
    items = list(s.tokens_per_request.items())
    for rid, n in items[:HOVER_REQUESTS]:
        kind = s.kinds.get(rid, "")
        lines.append(f"{esc(rid)}: {kind}" + (f" {n} tok" if kind != "decode" else ""))
    if len(items) > HOVER_REQUESTS:
        lines.append(f"… {len(items) - HOVER_REQUESTS} more")
    if s.preempted:
        lines.append("preempted: " + ", ".join(map(esc, s.preempted[:HOVER_REQUESTS])))
    if getattr(s, "drafts", None):
        lines.append(_spec_line(s))
    return "<br>".join(lines)


def _spec_line(s) -> str:
    d, a = s.num_draft_tokens, s.num_accepted_tokens
    return f"speculative: {d} drafted, {a} accepted" + (f" ({a / d:.0%})" if d else "")


def _spec_hover(s) -> str | None:
    """A verify step's drafts against what the target kept, by request and by position."""
    if not getattr(s, "drafts", None):
        return None
    per_pos = s.accepted_per_pos
    drafted_at = [sum(len(d) > j for d in s.drafts.values()) for j in range(len(per_pos))]
    lines = [f"step {s.step} · verify", _spec_line(s),
             "accepted by position: " + " ".join(f"{a}/{n}" for a, n in zip(per_pos, drafted_at))]
    items = list(s.drafts.items())
    for rid, d in items[:HOVER_REQUESTS]:
        lines.append(f"{esc(rid)}: {s.accepted.get(rid, 0)} of {len(d)} kept")
    if len(items) > HOVER_REQUESTS:
        lines.append(f"… {len(items) - HOVER_REQUESTS} more")
    return "<br>".join(lines)


class BatchTimeline(w.VBox):
    """Feed it with `update(source.poll())`; keeps the last `window` steps."""

    num_points = traitlets.Int(0, help="Steps (or polls) drawn now.")
    num_updates = traitlets.Int(0, help="Figure updates sent (one per tick with new steps).")
    last_step = traitlets.Int(-1)

    def __init__(self, window: int = 300, height: int = 360, resolution: str = "step",
                 title: str = "Batch timeline", **kw):
        self.window = window
        self.title = title
        self.points: deque = deque(maxlen=window)
        self._revision = 0
        self._refit = False
        fig = make_subplots(rows=3, cols=1, shared_xaxes=True, row_heights=[0.36, 0.28, 0.36],
                            vertical_spacing=0.04,
                            specs=[[{}], [{}], [{"secondary_y": True}]])
        bar = dict(marker_line_width=0, hoverinfo="text")
        hatch = dict(shape="/", fgcolor="#ffffff", size=5)
        fig.add_bar(name="prefill", marker_color=PREFILL, row=1, col=1, **bar)
        fig.add_bar(name="decode", marker_color=DECODE, row=2, col=1, **bar)
        fig.add_bar(name="prefill · graph", marker=dict(color=PREFILL, pattern=hatch),
                    row=1, col=1, showlegend=False, **bar)
        fig.add_bar(name="decode · graph", marker=dict(color=DECODE, pattern=hatch),
                    row=2, col=1, showlegend=False, **bar)
        line = dict(mode="lines", line_shape="hv", hoverinfo="x+y+name")
        fig.add_scatter(name="running", line_color=RUNNING, row=3, col=1, **line)
        fig.add_scatter(name="waiting", line_color=WAITING, row=3, col=1, **line)
        fig.add_scatter(name="KV used %", line=dict(color=KV, dash="dot"), mode="lines",
                        row=3, col=1, secondary_y=True, hoverinfo="x+y+name")
        # Speculative decoding: narrower bars inside each verify step's output bar (which
        # counts the drafts fed with each request's token), shown once any step drafted.
        fig.add_bar(name="drafted", marker_color=DRAFTED, width=0.6, row=2, col=1,
                    visible=False, **bar)
        fig.add_bar(name="accepted", marker=dict(color=ACCEPTED, line=dict(color="#59a14f",
                                                                           width=1)),
                    width=0.3, row=2, col=1, visible=False, hoverinfo="text")
        fig.update_layout(barmode="overlay", bargap=0.05, height=height,
                          title=dict(text=title, x=0, xanchor="left", y=0.99, yanchor="top",
                                     font=dict(size=14)),
                          margin=dict(l=56, r=50, t=48, b=40), template="plotly_white",
                          legend=dict(orientation="h", y=1.0, yanchor="bottom", x=1,
                                      xanchor="right", font=dict(size=11)),
                          hoverlabel=dict(align="left"), uirevision=0)
        fig.update_xaxes(type="linear", nticks=10, rangemode="nonnegative")
        fig.update_yaxes(title_text="prompt tok", row=1, col=1, rangemode="nonnegative")
        fig.update_yaxes(title_text="output tok", row=2, col=1, rangemode="nonnegative")
        fig.update_yaxes(title_text="requests", row=3, col=1, rangemode="nonnegative")
        fig.update_yaxes(title_text="KV %", range=[0, 100], dtick=25, row=3, col=1,
                         secondary_y=True, showgrid=False)
        self.fig = fig
        self.plot = LivePlot(fig)
        self.set_resolution(resolution)
        super().__init__([css_widget(), self.plot], **kw)

    AXIS = {"step": "engine step", "poll": "/metrics poll",
            "client": "interval, as this client saw its streams (the server has no /metrics)"}

    def set_modelled(self, label: str) -> None:
        """Title the chart as a modelled run's ('' : a real device's)."""
        self.fig.update_layout(title_text=f"{self.title} · {label}" if label else self.title)
        self.plot.sync()

    def set_resolution(self, resolution: str) -> None:
        """'step' (the in-process engine), 'poll' (a server's /metrics) or 'client' (a server
        without /metrics, seen through this client's streams)."""
        if resolution not in self.AXIS:
            raise ValueError(f"resolution: one of {', '.join(self.AXIS)} (got {resolution!r})")
        self.resolution = resolution
        self.fig.update_xaxes(title_text=self.AXIS[resolution], row=3, col=1)
        self.plot.sync()

    @property
    def x_title(self) -> str:
        """What the x axis counts, as its title says (under the bottom row)."""
        return self.fig.layout.xaxis3.title.text or ""

    X_AXES = ("xaxis", "xaxis2", "xaxis3")
    Y_AXES = ("yaxis", "yaxis2", "yaxis3")

    def clear(self) -> None:
        """Forget every step, and the axis ranges with them: plotly keeps an axis's last
        range when its data goes (and autorange on no data changes nothing), so the empty
        axes get explicit small ranges and a new uirevision; the next steps autorange."""
        self.points.clear()
        self._revision += 1
        self._refit = True
        with self.fig.batch_update():
            self.fig.layout.uirevision = self._revision
            for axis in self.X_AXES:
                self.fig.layout[axis].range = (0, 10)
            for axis in self.Y_AXES:
                self.fig.layout[axis].range = (0, 1)
        self._draw()

    def update(self, u: Update) -> None:
        if not u.steps:
            return
        if u.steps[-1].phase == "client" != self.resolution:
            self.set_resolution("client")        # the server stopped answering /metrics
        self.points.extend(u.steps)
        self._draw()

    def _draw(self) -> None:
        pts = list(self.points)
        x = [p.step for p in pts]
        graph = [bool(p.graph) for p in pts]
        hover = [_hover(p) for p in pts]

        def split(values, on_graph):
            return [v if g == on_graph else None for v, g in zip(values, graph)]

        pre = [p.num_prefill_tokens for p in pts]
        dec = [p.num_decode_tokens for p in pts]
        data = self.fig.data
        with self.fig.batch_update():
            for trace, ys in zip(data[:4], (split(pre, False), split(dec, False),
                                            split(pre, True), split(dec, True))):
                trace.x, trace.y, trace.hovertext = x, ys, hover
            for trace in data[2:4]:     # graph-replay entries appear once a graph has run
                trace.showlegend = any(graph)
            data[4].x, data[4].y = x, [p.num_running for p in pts]
            data[5].x, data[5].y = x, [p.num_waiting for p in pts]
            data[6].x, data[6].y = x, [None if p.kv_usage is None else round(100 * p.kv_usage, 1)
                                       for p in pts]
            spec = [_spec_hover(p) for p in pts]
            drafted = any(spec)
            if drafted or data[7].visible:     # (nothing to send while no step drafted)
                for trace, ys in zip(data[7:9], ([p.num_draft_tokens if h else None
                                                  for p, h in zip(pts, spec)],
                                                 [p.num_accepted_tokens if h else None
                                                  for p, h in zip(pts, spec)])):
                    trace.x, trace.y, trace.hovertext = x, ys, spec
                    trace.visible = drafted
            # Whole-step ticks while there are few steps (plotly would put ticks at halves);
            # past that plotly picks round steps, at most `nticks` of them. The mode is set
            # each time: a dtick left from the first few steps would label every step.
            few = bool(x) and x[-1] - x[0] < 10
            for axis in self.X_AXES:
                self.fig.layout[axis].update(tickmode="linear" if few else "auto",
                                             dtick=1 if few else None, tick0=0)
            if x and self._refit:           # data again after a clear(): fit it
                self._refit = False
                for axis in self.X_AXES + self.Y_AXES:
                    self.fig.layout[axis].autorange = True
        self.plot.sync()
        self.num_points = len(pts)
        self.num_updates += 1
        self.last_step = x[-1] if x else -1
