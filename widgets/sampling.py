"""SamplingExplorer: the sliders of the sampling lesson (notebook 02). Temperature, top-k,
top-p and min-p over a prompt's next-token distribution (`workbench.bench.sampling`), with the
tokens they keep and the renormalised probabilities side by side. The figure is redrawn as a
static plotly figure in an Output, so a saved notebook holds one small figure, not plotly.js."""
from __future__ import annotations

import ipywidgets as w
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.bench.sampling import NextToken, kept

from .figures import show
from .style import DECODE, esc

DROPPED = "#c8c8c8"


def sampling_figure(dist: NextToken, probs: list[float], title: str = "") -> go.Figure:
    """The raw distribution (kept tokens coloured, dropped ones grey) beside the kept tokens'
    renormalised probabilities."""
    labels = [repr(t)[1:-1] or "·" for t in dist.texts]
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "the model's distribution (grey: dropped)", "what the sampler draws from"))
    fig.add_bar(x=labels, y=dist.probs, marker_color=[DECODE if q > 0 else DROPPED for q in probs],
                row=1, col=1, showlegend=False)
    keep = [i for i, q in enumerate(probs) if q > 0]
    fig.add_bar(x=[labels[i] for i in keep], y=[probs[i] for i in keep], marker_color=DECODE,
                row=1, col=2, showlegend=False)
    fig.update_yaxes(title_text="probability", range=[0, 1], row=1, col=2)
    fig.update_yaxes(range=[0, max(dist.probs) * 1.05], row=1, col=1)
    fig.update_layout(height=320, margin=dict(l=50, r=20, t=60, b=60), title=title or None,
                      template="plotly_white")
    return fig


class SamplingExplorer(w.VBox):
    """Sliders over `dist`; `probs` is what the sampler would draw each token with now."""

    def __init__(self, dist: NextToken):
        self.dist = dist
        n = len(dist.probs)
        style = dict(style={"description_width": "90px"}, continuous_update=False)
        self.temperature = w.FloatSlider(1.0, min=0.0, max=2.0, step=0.05,
                                         description="temperature", **style)
        self.top_k = w.IntSlider(0, min=0, max=n, description="top-k (0: off)", **style)
        self.top_p = w.FloatSlider(1.0, min=0.05, max=1.0, step=0.05, description="top-p",
                                   **style)
        self.min_p = w.FloatSlider(0.0, min=0.0, max=1.0, step=0.01, description="min-p",
                                   **style)
        self.summary = w.HTML()
        self.out = w.Output()
        self.probs: list[float] = []
        self.figure: go.Figure | None = None
        """The figure shown now."""
        for s in (self.temperature, self.top_k, self.top_p, self.min_p):
            s.observe(self._update, "value")
        super().__init__([w.HBox([self.temperature, self.top_k]),
                          w.HBox([self.top_p, self.min_p]), self.summary, self.out])
        self._update()

    def _update(self, *_) -> None:
        self.probs = kept(self.dist, self.temperature.value, self.top_k.value, self.top_p.value,
                          self.min_p.value)
        keep = [i for i, q in enumerate(self.probs) if q > 0]
        raw = sum(self.dist.probs[i] for i in keep)
        top = max(keep, key=lambda i: self.probs[i])
        self.summary.value = (
            f'<div class="wb">Keeps <b>{len(keep)}</b> of the {len(self.probs)} tokens shown, '
            f'which hold {raw:.0%} of the model\'s probability; renormalised, the likeliest '
            f'(<code>{esc(repr(self.dist.texts[top]))}</code>) is drawn '
            f'{self.probs[top]:.0%} of the time (the model gave it '
            f'{self.dist.probs[top]:.0%}).</div>')
        self.figure = sampling_figure(self.dist, self.probs)
        with self.out:
            self.out.clear_output(wait=True)
            show(self.figure)
