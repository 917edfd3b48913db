"""TunePanel: a goodput tuning run (workbench.tune) as it goes: a progress bar, a Stop button,
and throughput against p99 TTFT and p99 TPOT for every measured configuration, the Pareto
frontier drawn through them and the winner marked; under it the winner as an EngineConfig
and as `vllm serve` flags.

    panel = TunePanel(base=EngineConfig(device="cpu"), workload=Workload(num_requests=24,
                      request_rate=2), slo=SLO(ttft_ms=2000, tpot_ms=100))
    panel                       # set rate, SLO, trials; press Run (a worker thread runs them)
    TunePanel(result=tune(...)) # draw a finished run

`tune_figure(result)` draws the same chart as a static figure for a notebook.
"""
from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import replace

import ipywidgets as w
import plotly.graph_objects as go
import traitlets
from plotly.subplots import make_subplots

from workbench.config import EngineConfig
from workbench.tune import SLO, Space, Trial, TuneResult, Workload, tune
from workbench.tune.result import LATENCIES

from .figures import LivePlot
from .style import DECODE, PREFILL, css_widget, esc

WINNER = "#e15759"


def _finite(x):
    return None if x is None or math.isinf(x) else x


def _hover(t: Trial) -> str:
    m = t.measurement
    knobs = "<br>".join(f"{k} = {v}" for k, v in t.knobs.items())
    return (f"trial {t.number} (rung {t.rung}, {t.budget} requests)<br>goodput "
            f"{m.goodput:.3g} req/s, {m.attainment:.0%} within the SLO<br>{knobs}")


def draw(fig, result: TuneResult | None) -> None:
    """Fill the chart's traces (made by new_figure) from `result`."""
    trials = result.final_trials() if result else []
    win = result.winner if result else None
    with fig.batch_update():
        for col, lat in enumerate(LATENCIES, start=0):
            base = col * 4
            ok = [t for t in trials if t.measurement.meets_slo]
            miss = [t for t in trials if not t.measurement.meets_slo]
            front = result.pareto(lat) if result else []
            for i, group in ((0, ok), (1, miss), (2, front), (3, [win] if win else [])):
                tr = fig.data[base + i]
                tr.x = [_finite(getattr(t.measurement, lat)) for t in group]
                tr.y = [t.measurement.throughput for t in group]
                tr.hovertext = [_hover(t) for t in group]
        if result is not None:
            fig.layout.title = dict(text=chart_title(result), font=dict(size=13))
        if result is not None:     # the SLO's limits, dotted across each plot
            fig.layout.shapes = [dict(type="line", xref=x, yref=f"{y} domain", x0=limit,
                                      x1=limit, y0=0, y1=1, line=dict(color="#999", dash="dot"))
                                 for x, y, limit in (("x", "y", result.slo.ttft_ms),
                                                     ("x2", "y2", result.slo.tpot_ms))]


def chart_title(result: TuneResult) -> str:
    """Says where the numbers come from: measured on the device, or modelled (with the
    profile's measured error, or that it is uncalibrated and has none)."""
    m = result.modelled
    if m is None:
        return f"measured on {esc(result.device)}"
    err = (m.get("error") or {}).get("max_abs_pct")
    how = ("uncalibrated: spec-sheet guesses, no measured error" if not m.get("calibrated")
           else f"calibrated, measured error up to {err:.0f} %" if err is not None
           else "calibrated, error not measured")
    return f"MODELLED on {esc(result.device)} ({how})"


def new_figure(height: int = 360) -> go.Figure:
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08,
                        subplot_titles=("throughput against p99 TTFT",
                                        "throughput against p99 TPOT"))
    for col in (1, 2):
        first = col == 1
        fig.add_scatter(mode="markers", name="within the SLO", legendgroup="ok",
                        showlegend=first, marker=dict(color=DECODE, size=9),
                        hoverinfo="text", row=1, col=col)
        fig.add_scatter(mode="markers", name="misses the SLO", legendgroup="miss",
                        showlegend=first, marker=dict(color="#bbb", size=9, symbol="x"),
                        hoverinfo="text", row=1, col=col)
        fig.add_scatter(mode="lines", name="Pareto frontier", legendgroup="front",
                        showlegend=first, line=dict(color=PREFILL, width=2, shape="hv"),
                        hoverinfo="skip", row=1, col=col)
        fig.add_scatter(mode="markers", name="winner (most goodput)", legendgroup="win",
                        showlegend=first, marker=dict(color=WINNER, size=18, symbol="star"),
                        hoverinfo="text", row=1, col=col)
        fig.update_xaxes(title_text=list(LATENCIES.values())[col - 1], row=1, col=col)
        fig.update_yaxes(title_text="requests/s" if first else None, row=1, col=col)
    fig.update_layout(height=height, template="plotly_white", margin=dict(t=70, l=60, r=20, b=50),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def tune_figure(result: TuneResult, height: int = 360) -> go.Figure:
    """The chart of a finished run, as a static figure (for notebooks)."""
    fig = new_figure(height)
    draw(fig, result)
    return fig


def winner_html(result: TuneResult) -> str:
    notes = "".join(f'<div class="notice">{esc(n)}</div>' for n in result.notes)
    w_ = result.winner
    head = (f'<div class="muted">{len(result.trials)} trials on {esc(result.device)} in '
            f'{result.seconds:.0f} s{" (stopped early)" if result.stopped else ""} · '
            f'{esc(result.workload.describe())} · SLO {esc(result.slo.describe())}</div>')
    failed = [t for t in result.trials if not t.ok]
    fails = "".join(f'<div class="error">trial {t.number} failed: {esc(t.error)}</div>'
                    for t in failed)
    if w_ is None:
        return f'<div class="wb">{notes}{head}{fails}<b>No trial was measured.</b></div>'
    m, flags = w_.measurement, result.winner_flags()
    config = ", ".join(f"{k}={v!r}" for k, v in w_.knobs.items())
    unmapped = "".join(f"<li><code>{esc(k)}={esc(repr(w_.knobs[k]))}</code>: {esc(why)}</li>"
                       for k, why in flags.unmapped.items())
    return (f'<div class="wb">{notes}{head}<h3>Winner: trial {w_.number}, goodput '
            f'{m.goodput:.3g} req/s ({m.attainment:.0%} within the SLO, '
            f'{"meets" if m.meets_slo else "misses"} it at p{result.slo.percentile:g})</h3>'
            f'<div><code>EngineConfig({esc(config)})</code></div>'
            f'<div>{"vLLM-Ascend" if flags.ascend else "vLLM"}: '
            f'<code>{esc(flags.command(result.base.model))}</code></div>'
            + (f'<div>No vLLM equivalent:<ul>{unmapped}</ul></div>' if unmapped else "")
            + f'{fails}</div>')


class TunePanel(w.VBox):
    """Controls (rate, requests, the SLO's limits, trials), Run and Stop, a progress bar,
    the chart and the winner. Built with a `result`, it draws it; with a `base` config, Run
    tunes it (the trials build their own engines from it, one at a time)."""

    num_runs = traitlets.Int(0)

    def __init__(self, result: TuneResult | None = None, *, workload: Workload | None = None,
                 slo: SLO | None = None, space: Space | None = None,
                 base: EngineConfig | None = None, n_trials: int = 8, **tune_kwargs):
        self.workload = workload or Workload(num_requests=24, request_rate=2.0)
        self.slo = slo or SLO(ttft_ms=2000, tpot_ms=200)
        self.space, self.base, self.tune_kwargs = space, base, tune_kwargs
        self.result = result
        self.stop_event = threading.Event()
        small = dict(layout=w.Layout(width="190px"), style={"description_width": "95px"})
        self.rate = w.BoundedFloatText(value=self.workload.request_rate or 0.0, min=0.0,
                                       max=1e4, description="requests/s",
                                       tooltip="Poisson arrivals; 0: the workload's closed "
                                               "loop", **small)
        self.num_requests = w.BoundedIntText(value=self.workload.num_requests, min=1, max=10000,
                                             description="requests", **small)
        self.ttft = w.BoundedFloatText(value=self.slo.ttft_ms, min=0.0, max=1e7,
                                       description="p99 TTFT ms", **small)
        self.tpot = w.BoundedFloatText(value=self.slo.tpot_ms, min=0.0, max=1e7,
                                       description="p99 TPOT ms", **small)
        self.trials = w.BoundedIntText(value=n_trials, min=1, max=1000, description="trials",
                                       **small)
        self.progress = w.IntProgress(value=0, min=0, max=n_trials, bar_style="info",
                                      layout=w.Layout(width="40%"))
        self.status = w.HTML()
        self.run_button = w.Button(description="Run", icon="play", button_style="primary",
                                   disabled=base is None)
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="warning",
                                    disabled=True)
        self.run_button.on_click(lambda _: self._clicked())
        self.stop_button.on_click(lambda _: self.stop())
        self.fig = new_figure()
        draw(self.fig, result)
        self.plot = LivePlot(self.fig)
        self.view = w.HTML(winner_html(result) if result else "")
        controls = w.HBox([self.rate, self.num_requests, self.ttft, self.tpot, self.trials],
                          layout=w.Layout(flex_flow="row wrap",
                                          display="none" if base is None else None))
        super().__init__([css_widget(), controls,
                          w.HBox([self.run_button, self.stop_button, self.progress]),
                          self.status, self.plot, self.view])
        self.add_class("wb-tune")

    def settings(self) -> tuple[Workload, SLO, int]:
        """The workload, SLO and trial count the controls say (ValueError naming a field)."""
        wl = self.workload
        rate = self.rate.value or None
        if rate is not None or wl.request_rate is None:
            wl = replace(wl, request_rate=rate, concurrency=None if rate else wl.concurrency)
        wl = replace(wl, num_requests=self.num_requests.value)
        slo = replace(self.slo, ttft_ms=self.ttft.value, tpot_ms=self.tpot.value)
        return wl, slo, self.trials.value

    def show(self, result: TuneResult) -> None:
        self.result = result
        draw(self.fig, result)
        self.plot.sync()
        self.view.value = winner_html(result)
        self.progress.value = min(len(result.trials), self.progress.max)

    def on_trial(self, trial: Trial, done: int, total: int) -> None:
        """One trial ended (the tuner's progress callback, on the kernel's loop)."""
        self.progress.max = total
        self.progress.value = done
        what = (f"goodput {trial.measurement.goodput:.3g} req/s" if trial.ok
                else f"failed: {trial.error}")
        self.status.value = (f'<div class="wb muted">trial {done}/{total} (rung {trial.rung}, '
                             f'{trial.budget} requests): {esc(what)}</div>')

    def stop(self) -> None:
        """Stop after the trial that runs now (what was measured is kept)."""
        self.stop_event.set()
        self.stop_button.disabled = True
        self.status.value = '<div class="wb muted">stopping after this trial…</div>'

    def _tune(self, on_trial) -> TuneResult:
        workload, slo, n_trials = self.settings()
        return tune(workload, slo, self.space, base=self.base, n_trials=n_trials,
                    progress=on_trial, should_stop=self.stop_event.is_set, **self.tune_kwargs)

    def run(self) -> TuneResult:
        """Tune now in this thread (blocks) and draw the result."""
        self.stop_event.clear()
        result = self._tune(self.on_trial)
        self.num_runs += 1
        self.show(result)
        return result

    def _clicked(self) -> None:
        """From the button: tune in a worker thread; progress is drawn on the kernel's loop."""
        loop = asyncio.get_running_loop()
        self.stop_event.clear()
        self.run_button.disabled, self.stop_button.disabled = True, False
        self.progress.value = 0
        self.status.value = '<div class="wb muted">warming up…</div>'

        def on_trial(trial, done, total):
            loop.call_soon_threadsafe(self.on_trial, trial, done, total)

        async def go_():
            try:
                result = await loop.run_in_executor(None, self._tune, on_trial)
                self.num_runs += 1
                self.show(result)
                self.status.value = ""
            except (ValueError, TypeError) as e:
                self.status.value = f'<div class="wb"><div class="error">{esc(str(e))}</div></div>'
            finally:
                self.run_button.disabled, self.stop_button.disabled = False, True

        asyncio.ensure_future(go_())
