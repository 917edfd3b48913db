"""Dashboard: prompt box, "send N concurrent requests", token streams, batch timeline, KV
block map, summary and knobs, all fed by one engine (or one remote server).

    from widgets import Dashboard
    Dashboard()                                   # the embedded model on this machine
    Dashboard(url="http://127.0.0.1:8000")        # watch and drive a vLLM / workbench server
    Dashboard(url=..., model="org/name")          # a server that lists no model, or several
    Dashboard(replay="run.trace.json.gz")         # a recorded trace, no model loaded

`workbench dashboard` serves it with Voila (notebooks/dashboard.ipynb).
"""
from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path

import ipywidgets as w
import traitlets

from workbench import Engine, EngineConfig, SamplingParams

from .ab import ABPanel
from .knobs import KnobPanel
from .kv_map import KVBlockMap
from .live import ErrorLog, Pump
from .replay import ReplaySource
from .roofline import RooflinePanel
from .sources import LocalSource, RemoteSource, as_source
from .style import css_widget, esc, notices_html
from .summary import SummaryPanel
from .timeline import BatchTimeline
from .token_stream import TokenStreamPanel

EXAMPLE_PROMPTS = """Explain in two sentences why the sky is blue.
Write a haiku about a paged KV cache.
List three uses of a hash map.
What is the difference between a process and a thread?
Give me a short recipe for pancakes.
Why do cats purr?
Summarise the plot of Romeo and Juliet in three sentences.
Write a limerick about a GPU that ran out of memory."""

DASHBOARD_DEFAULTS = dict(max_num_seqs=32, num_kv_blocks=384)
"""A pool small enough that a burst of long replies fills it and preemption shows."""


class Dashboard(w.VBox):
    """The whole workbench on one page. Give an `engine`, a `config`, or a server `url` (with
    `api_key` and `model`, the model id to request, where needed)."""

    num_sent = traitlets.Int(0)
    num_rebuilds = traitlets.Int(0)

    def __init__(self, engine: Engine | None = None, *, config: EngineConfig | None = None,
                 url: str | None = None, api_key: str | None = None, model: str | None = None,
                 replay: str | Path | None = None, speed: float = 1.0, autoplay: bool = False,
                 hz: float = 20.0):
        if sum(x is not None for x in (engine, config, url, replay)) > 1:
            raise ValueError("give one of engine, config, url or replay")
        if url is None and (api_key is not None or model is not None):
            raise ValueError("api_key, model: only with url= (a local engine's model is in its "
                             "config)")
        if url is not None:
            source = RemoteSource(url, api_key=api_key, model=model)
        elif replay is not None:
            source = ReplaySource(replay, speed, autoplay)
        else:
            source = as_source(engine if engine is not None
                               else Engine(config or EngineConfig(**DASHBOARD_DEFAULTS)))
        self.source: LocalSource | RemoteSource | ReplaySource = source
        self.header = w.HTML()
        self.notices = w.HTML()
        self.streams = TokenStreamPanel(max_cards=12)
        self.timeline = BatchTimeline(resolution=source.resolution)
        self.kv = KVBlockMap(columns=48)
        self.summary = SummaryPanel()

        self.prompts = w.Textarea(value=EXAMPLE_PROMPTS, rows=8, layout=w.Layout(width="100%"),
                                  placeholder="One prompt per line; requests cycle through them")
        self.n = w.IntSlider(value=8, min=1, max=64, description="requests",
                             style={"description_width": "70px"}, layout=w.Layout(width="100%"))
        self.chat = w.Checkbox(value=True, description="use the chat template", indent=False)
        self.send_button = w.Button(description="Send", icon="paper-plane", button_style="success",
                                    layout=w.Layout(width="49%"))
        self.abort_button = w.Button(description="Abort all", icon="stop", button_style="warning",
                                     layout=w.Layout(width="49%"))
        self.clear_button = w.Button(description="Clear panels", icon="eraser",
                                     layout=w.Layout(width="100%"))
        self.message = w.HTML()
        """Why the last Send sent nothing (bad input)."""
        self.errors = ErrorLog()
        """What the engine or server answered with errors, each distinct one once, counted."""
        self.send_button.on_click(lambda _: self.send())
        self.abort_button.on_click(lambda _: self.source.abort_all())
        self.clear_button.on_click(lambda _: self.clear())
        self.knobs = KnobPanel(source.config or EngineConfig(), on_apply=self.swap_engine)
        if isinstance(source, RemoteSource):
            self.knobs.apply_button.disabled = True
            self.knobs.status.value = ('<div class="wb muted">A remote server\'s engine knobs are '
                                       'set where it runs; temperature and max tokens apply.</div>')
            self.kv.unavailable(source.kv_note())
        # ---- issue 13 part B: the roofline (and replay controls) -----------------------------
        self.knobs_title = w.HTML('<div class="wb"><h3>Knobs</h3></div>')
        self.roofline = RooflinePanel(*self._roofline_model())
        extra = [self.roofline]
        if isinstance(source, LocalSource):
            c = asdict(source.config)
            self.ab = ABPanel(model=c.pop("model"), engine_kwargs=c)
            ab = w.Accordion([self.ab], selected_index=None)
            ab.set_title(0, "A/B run: two configurations on the same requests")
            extra.append(ab)
        if isinstance(source, ReplaySource):
            self.knobs.apply_button.disabled = True
            self.send_button.disabled = self.abort_button.disabled = True
            self.knobs_title.value = ('<div class="wb muted">A replay plays a recorded trace: '
                                      'no model is loaded, so knobs and Send do not apply.'
                                      '</div>')
            self.replay_button = w.Button(
                description="Replay from the start" if autoplay else "Play the recording",
                icon="repeat" if autoplay else "play", button_style="" if autoplay else "info",
                layout=w.Layout(width="100%"))
            self.replay_button.on_click(lambda _: self.restart_replay())
            self.clear_button.layout.display = "none"
            self.knobs.layout.display = "none"     # knobs of no engine would mislead
        # -----------------------------------------------------------------------------------

        controls = w.VBox([w.HTML('<div class="wb"><h3>Send requests</h3></div>'), self.prompts,
                           self.n, self.chat, w.HBox([self.send_button, self.abort_button]),
                           self.clear_button, *([self.replay_button] if isinstance(
                               source, ReplaySource) else []), self.message, self.errors,
                           self.knobs_title, self.knobs],
                          layout=w.Layout(width="390px", min_width="390px", padding="0 12px 0 0"))
        main = w.VBox([self.summary, self.streams, self.timeline, self.kv, *extra],
                      layout=w.Layout(flex="1 1 auto", min_width="0"))
        super().__init__([css_widget(), self.header, self.notices, w.HBox([controls, main])],
                         layout=w.Layout(width="100%"))
        self.pump = Pump(source, [self.streams, self.timeline, self.kv, self.summary,
                                  self.roofline], hz)
        self.pump.on_tick.append(self._show_errors)
        self._describe()
        self.pump.start()

    @classmethod
    def from_env(cls) -> "Dashboard":
        """Settings from WORKBENCH_URL (+ WORKBENCH_API_KEY, WORKBENCH_MODEL) for a server, else
        WORKBENCH_MODEL / WORKBENCH_DEVICE for an engine here (what `workbench dashboard` sets)."""
        url = os.environ.get("WORKBENCH_URL")
        if os.environ.get("WORKBENCH_REPLAY"):
            return cls(replay=os.environ["WORKBENCH_REPLAY"],
                       speed=float(os.environ.get("WORKBENCH_REPLAY_SPEED", "1")))
        if url:
            return cls(url=url, api_key=os.environ.get("WORKBENCH_API_KEY"),
                       model=os.environ.get("WORKBENCH_MODEL"))
        config = EngineConfig(model=os.environ.get("WORKBENCH_MODEL", "smollm2"),
                              device=os.environ.get("WORKBENCH_DEVICE", "auto"),
                              **DASHBOARD_DEFAULTS)
        return cls(config=config)

    # ---- header -----------------------------------------------------------------------------
    def _describe(self) -> None:
        items = " · ".join(f'<span class="muted">{esc(k)}</span> <b>{esc(v)}</b>'
                           for k, v in self.source.describe().items())
        kind = ("remote server" if isinstance(self.source, RemoteSource) else
                "replay (recorded trace, no model loaded)" if isinstance(self.source, ReplaySource)
                else "engine")
        self.header.value = (f'<div class="wb"><h2 style="margin:4px 0">Prefill/decode '
                             f'workbench</h2><div class="engine-info">{kind}: {items}</div></div>')
        self.notices.value = notices_html(self.source.notices)

    def _show_errors(self, u) -> None:
        self.errors.add(u.errors)
        if notices_html(self.source.notices) != self.notices.value:   # e.g. /metrics went away
            self._describe()
            if isinstance(self.source, RemoteSource):
                self.kv.unavailable(self.source.kv_note())

    # ---- actions ------------------------------------------------------------------------------
    def prompt_list(self) -> list:
        lines = [ln.strip() for ln in self.prompts.value.splitlines() if ln.strip()]
        if not lines:
            raise ValueError("prompt: write at least one prompt (one per line)")
        chat = self.chat.value and isinstance(self.source, LocalSource) \
            and getattr(self.source.engine.tokenizer, "chat_template", None)
        return [[{"role": "user", "content": ln}] if chat else ln for ln in lines]

    def send(self, n: int | None = None, params: SamplingParams | None = None) -> list[str]:
        """Send n requests (default: the slider), cycling through the prompt lines, each with
        its own seed so sampled replies differ. Bad input shows an error and sends nothing."""
        n = self.n.value if n is None else n
        try:
            if isinstance(self.source, ReplaySource):
                self.source.submit(None, None)        # says why a replay takes no requests
            prompts = self.prompt_list()
            base = params or self.knobs.sampling_params()
            base.validate()
            if isinstance(self.source, RemoteSource):
                self.source.ready()
                self.source.chat = self.chat.value
            else:
                for p in prompts:
                    self.source.engine.tokenize(p)
        except ValueError as e:
            self.message.value = f'<div class="wb"><div class="error">{esc(str(e))}</div></div>'
            return []
        self.message.value = ""
        rids = []
        for i in range(n):
            seed = None if base.greedy else (base.seed or 0) + self.num_sent + i
            rids.append(self.source.submit(prompts[i % len(prompts)], replace(base, seed=seed)))
        self.num_sent += n
        self.pump.start()
        return rids

    async def wait(self, timeout: float | None = None) -> bool:
        """Until every request sent has finished (the panels keep moving meanwhile)."""
        self.pump.start()
        return await self.pump.wait(timeout)

    def clear(self) -> None:
        for p in (self.streams, self.timeline, self.summary, self.errors, self.roofline):
            p.clear()

    def _roofline_model(self):
        """(model shape, device roofs) for the roofline, or (None, None) for a server."""
        src = self.source
        if isinstance(src, LocalSource):
            return src.engine.info(), src.engine.device_roofs()
        if isinstance(src, ReplaySource):
            return src.trace.info, src.trace.roofs
        return None, None

    def restart_replay(self) -> None:
        """Play the recorded trace (again) from its start."""
        self.clear()
        self.source.play()
        self.replay_button.description, self.replay_button.icon = "Replay from the start", "repeat"
        self.replay_button.button_style = ""
        self.pump.start()

    def swap_engine(self, engine: Engine) -> None:
        """Put a newly built engine in place of the current one (what Apply does)."""
        old = self.source
        self.pump.tick()                      # take what the old engine still had
        new = LocalSource(engine)
        self.pump.source = self.source = new
        old.close()                           # stops it; its unfinished requests are aborted
        self.streams.update(old.poll())       # show those aborts
        old.engine.close()                    # its KV pool, graphs and weights, freed now: a
                                              # GPU needs that memory for the new engine
        self.timeline.clear()                 # step numbers restart with the new engine
        self.summary.clear()
        self.roofline.set_model(*self._roofline_model())
        self.num_rebuilds += 1
        self._describe()
