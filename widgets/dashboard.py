"""Dashboard: prompt box, "send N concurrent requests", token streams, batch timeline, KV
block map, summary and knobs, all fed by one engine (or one remote server).

    from widgets import Dashboard
    Dashboard()                                   # the embedded model on this machine
    Dashboard(url="http://127.0.0.1:8000")        # watch and drive a vLLM / workbench server
    Dashboard(url=..., model="org/name")          # a server that lists no model, or several
    Dashboard(replay="run.trace.json.gz")         # a recorded run, no model loaded

`workbench dashboard` serves it with Voila (notebooks/dashboard.ipynb).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import ipywidgets as w
import traitlets

from workbench import Engine, EngineConfig, SamplingParams

from .ab import ABPanel
from .knobs import KnobPanel
from .figures import when_drawn
from .kv_map import KVBlockMap
from .live import ErrorLog, Pump, running_loop
from .progress import BuildProgress
from .replay import ReplaySource
from .roofline import RooflinePanel
from .tune import TunePanel
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

LOGPROBS = 5 if "logprobs" in SamplingParams.__dataclass_fields__ else 0
"""Top candidates asked for per token (issue 12's `SamplingParams.logprobs`, where this
engine has it), for the token stream's shading and hover."""

DEMO_SEED = 0
"""The page's default seed: with it, the first Send on a fresh page samples the same replies
each time on a machine, so a page shown to an audience says nothing its presenter has not
read. `seed=None` draws a new seed per page."""

DASHBOARD_DEFAULTS = dict(max_num_seqs=32, num_kv_blocks=384)
"""A pool small enough that a burst of long replies fills it and preemption shows."""

PLAY_ANYWAY_S = 30.0
"""A replay waits for the page's figures to be drawn, but no longer than this after the page
first shows."""


class Dashboard(w.VBox):
    """The whole workbench on one page. Give an `engine`, a `config`, a server `url` (with
    `api_key` and `model`, the model id to request, where needed), or a recorded trace to
    `replay` (at `speed`; it plays as soon as the page shows it, or with `autoplay=False`
    when Play is pressed).

    Layout (made to fit 1440×900 while 8 requests stream): the header, then the controls on
    the left, and on the right the summary over two columns: compact token-stream cards,
    and the timeline above the KV block map. `add_panel()` puts more views (a roofline, an
    A/B comparison) in `self.more`, under the plots, and feeds them with the others.

    Given a `config` inside a running kernel (Jupyter, Voila), the page appears at once and
    the engine is built in a worker thread behind a live progress bar (`self.loading`);
    Send is enabled when it is ready. Outside a kernel it is built before returning."""

    num_sent = traitlets.Int(0)
    num_rebuilds = traitlets.Int(0)
    ready = traitlets.Bool(False, help="An engine or server is attached and Send works.")

    def __init__(self, engine: Engine | None = None, *, config: EngineConfig | None = None,
                 url: str | None = None, api_key: str | None = None, model: str | None = None,
                 replay: str | Path | None = None, speed: float = 1.0, autoplay: bool = True,
                 hz: float = 20.0, seed: int | None = DEMO_SEED):
        if sum(x is not None for x in (engine, config, url, replay)) > 1:
            raise ValueError("give one of engine, config, url or replay")
        if url is None and (api_key is not None or model is not None):
            raise ValueError("api_key, model: only with url= (a local engine's model is in its "
                             "config)")
        self.header = w.HTML()
        self.notices = w.HTML()
        self.loading = BuildProgress(layout=w.Layout(width="100%", max_width="720px"))
        self.streams = TokenStreamPanel(max_cards=12)
        self.timeline = BatchTimeline()
        self.kv = KVBlockMap(columns=40)
        self.summary = SummaryPanel()
        self.more = w.VBox()
        """Extra panels (`add_panel`), under the plots."""

        self.prompts = w.Textarea(value=EXAMPLE_PROMPTS, rows=6, layout=w.Layout(width="98%"),
                                  placeholder="One prompt per line; requests cycle through them")
        self.n = w.IntSlider(value=8, min=1, max=64, description="Requests",
                             tooltip="how many requests one Send fires at once",
                             style={"description_width": "70px"}, layout=w.Layout(width="98%"))
        self.chat = w.Checkbox(value=True, description="use the chat template", indent=False)
        self.send_button = w.Button(description="Send", icon="paper-plane", button_style="success",
                                    disabled=True, layout=w.Layout(width="32%"))
        self.abort_button = w.Button(description="Abort all", icon="stop", button_style="warning",
                                     layout=w.Layout(width="32%"))
        self.clear_button = w.Button(description="Clear", icon="eraser",
                                     tooltip="clear the panels", layout=w.Layout(width="32%"))
        self.message = w.HTML()
        """Why the last Send sent nothing (bad input)."""
        self.errors = ErrorLog()
        """What the engine or server answered with errors, each distinct one once, counted."""
        self.send_button.on_click(lambda _: self.send())
        self.abort_button.on_click(lambda _: self.source and self.source.abort_all())
        self.clear_button.on_click(lambda _: self.clear())
        local_config = config or (engine.info().config if engine is not None else
                                  EngineConfig(**DASHBOARD_DEFAULTS))
        self.knobs = KnobPanel(local_config, on_apply=self.swap_engine,
                               seed=random.randrange(2**31) if seed is None else seed)
        self.knobs_title = w.HTML('<div class="wb"><h3>Knobs</h3></div>')
        self.replay_button = w.Button(
            description="Replay from the start" if autoplay else "Play the recording",
            icon="repeat" if autoplay else "play", button_style="" if autoplay else "info",
            layout=w.Layout(width="98%", display="" if replay is not None else "none"))
        self.replay_button.on_click(lambda _: self.restart_replay())

        controls = w.VBox([w.HTML('<div class="wb"><h3>Send requests</h3></div>'), self.prompts,
                           self.n, self.chat,
                           w.HBox([self.send_button, self.abort_button, self.clear_button]),
                           self.replay_button, self.message, self.errors,
                           self.knobs_title, self.knobs],
                          layout=w.Layout(width="330px", min_width="330px", padding="0 8px 0 0"))
        plots = w.VBox([self.timeline, self.kv], layout=w.Layout(flex="1.35 1 0", min_width="0"))
        self.streams.layout = w.Layout(flex="1 1 0", min_width="0", max_height="640px",
                                       overflow="hidden auto", padding="0 6px 0 0")
        main = w.VBox([self.summary, w.HBox([self.streams, plots]), self.more],
                      layout=w.Layout(flex="1 1 auto", min_width="0"))
        super().__init__([css_widget(), self.header, self.notices, self.loading,
                          w.HBox([controls, main])], layout=w.Layout(width="100%"))
        self.source: LocalSource | RemoteSource | None = None
        self.pump: Pump | None = None
        self.load_error: str | None = None
        self._hz = hz
        self._extra: list = []
        source = None          # attached now, or (a config inside a kernel) once built
        if url is not None:
            source = RemoteSource(url, api_key=api_key, model=model)
        elif replay is not None:
            source = ReplaySource(replay, speed, autoplay=False)   # played by _play_when_shown
        elif engine is not None:
            source = as_source(engine)
        elif running_loop() is None:
            source = LocalSource(Engine(local_config))
        self.roofline = RooflinePanel(*_roofline_model(source),
                                      missing="waiting for the engine to load" if
                                      source is None else None)
        """Each step by arithmetic intensity against achieved FLOP/s, under this device's roofs."""
        self.add_panel(self.roofline)
        if replay is not None and autoplay:
            self._play_when_shown()
        if url is None and replay is None:
            c = asdict(local_config)
            self.ab = ABPanel(model=c.pop("model"), engine_kwargs=c)
            ab = w.Accordion([self.ab], selected_index=None)
            ab.set_title(0, "A/B run: two configurations on the same requests")
            self.add_panel(ab, feed=False)
            self.tune = TunePanel(base=local_config)
            """The goodput tuner over this page's settings (its trials build their own
            engines, one at a time; this page's engine stays loaded while they run)."""
            tuner = w.Accordion([self.tune], selected_index=None)
            tuner.set_title(0, "Tune for an SLO: the most goodput under p99 TTFT and TPOT limits")
            self.add_panel(tuner, feed=False)
        if source is not None:
            self._attach(source)
        else:
            self.header.value = _title(f"loading {local_config.model}…")
            self._load_task = asyncio.ensure_future(self._load(local_config))

    async def _load(self, config: EngineConfig) -> None:
        try:
            engine = await self.loading.run(lambda: Engine(config), f"Loading {config.model}",
                                            expected_s=8.0)
        except Exception as e:
            self.load_error = str(e) or type(e).__name__
            self.message.value = (f'<div class="wb"><div class="error"><b>The engine could not '
                                  f'be built.</b> {esc(self.load_error)}</div></div>')
            self.header.value = _title("no engine")
            return
        self._attach(LocalSource(engine))

    def _attach(self, source: LocalSource | RemoteSource | ReplaySource) -> None:
        self.source = source
        self.timeline.set_resolution(source.resolution)
        if isinstance(source, RemoteSource):
            self.knobs.apply_button.disabled = True
            self.knobs.status.value = ('<div class="wb muted">A remote server\'s engine knobs are '
                                       'set where it runs; temperature and max tokens apply.</div>')
            self.kv.unavailable(source.kv_note())
        elif isinstance(source, ReplaySource):
            self.knobs.apply_button.disabled = True
            self.knobs.layout.display = "none"     # knobs of no engine would mislead
            self.knobs_title.value = ('<div class="wb muted">A replay plays a recorded trace: '
                                      'no model is loaded, so knobs and Send do not apply.</div>')
            self.clear_button.layout.display = "none"
        else:
            self.knobs.show_config(source.engine.info().config)
        if self.roofline.info is None:                  # built in the background: shown by now
            self.roofline.set_model(*_roofline_model(source))
        self.pump = Pump(source, [self.streams, self.timeline, self.kv, self.summary,
                                  *self._extra], self._hz)
        self.pump.on_tick.append(self._show_errors)
        self._describe()
        self.pump.start()
        replaying = isinstance(source, ReplaySource)
        self.send_button.disabled = self.abort_button.disabled = replaying
        self.ready = not replaying

    def add_panel(self, panel, feed: bool = True) -> None:
        """Show `panel` under the plots; with `feed`, the pump hands it each Update
        (`panel.update(u)`) like the built-in panels."""
        self.more.children = (*self.more.children, panel)
        if feed:
            self._extra = [*self._extra, panel]
            if self.pump is not None:
                self.pump.panels.append(panel)

    @classmethod
    def from_env(cls) -> "Dashboard":
        """Settings from WORKBENCH_URL (+ WORKBENCH_API_KEY, WORKBENCH_MODEL) for a server, else
        WORKBENCH_MODEL / WORKBENCH_DEVICE (+ WORKBENCH_SPECULATIVE_CONFIG, JSON) for an
        engine here, or WORKBENCH_REPLAY (+
        WORKBENCH_REPLAY_SPEED, WORKBENCH_REPLAY_PAUSED) for a trace (what `workbench
        dashboard` sets)."""
        url = os.environ.get("WORKBENCH_URL")
        if os.environ.get("WORKBENCH_REPLAY"):
            return cls(replay=os.environ["WORKBENCH_REPLAY"],
                       speed=float(os.environ.get("WORKBENCH_REPLAY_SPEED", "1")),
                       autoplay=not os.environ.get("WORKBENCH_REPLAY_PAUSED"))
        if url:
            return cls(url=url, api_key=os.environ.get("WORKBENCH_API_KEY"),
                       model=os.environ.get("WORKBENCH_MODEL"))
        spec = os.environ.get("WORKBENCH_SPECULATIVE_CONFIG")
        config = EngineConfig(model=os.environ.get("WORKBENCH_MODEL", "smollm2"),
                              device=os.environ.get("WORKBENCH_DEVICE", "auto"),
                              speculative_config=json.loads(spec) if spec else None,
                              **DASHBOARD_DEFAULTS)
        return cls(config=config)

    # ---- header -----------------------------------------------------------------------------
    def _describe(self) -> None:
        described = self.source.describe()
        if isinstance(self.source, LocalSource):
            p = self.knobs.sampling_params()
            if not p.greedy:     # what the Send button's sampling costs against greedy
                described[f"sampling at temperature {p.temperature:g}"] = self.source.sampling_cost(
                    p, self.n.value)
        items = " · ".join(f'<span class="muted">{esc(k)}</span> <b>{esc(v)}</b>'
                           for k, v in described.items())
        kind = ("remote server" if isinstance(self.source, RemoteSource) else
                "replay (recorded trace, no model loaded)" if isinstance(self.source, ReplaySource)
                else "engine")
        # Why the weights are in the format they are, with the figure that decided it.
        why = getattr(_engine_info(self.source), "quantization_choice", None)
        self.header.value = _title(f"{kind}: {items}", escape=False) + (
            f'<div class="wb"><div class="engine-why muted">{esc(why)}</div></div>' if why else "")
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
        if isinstance(self.source, LocalSource) and self.source.engine.tokenizer is None:
            # Random weights have no tokenizer: each line is token ids ("17 42 99").
            try:
                return [[int(t) for t in ln.replace(",", " ").split()] for ln in lines]
            except ValueError:
                raise ValueError("prompt: this model has no tokenizer; write each prompt as "
                                 "token ids, e.g. 17 42 99") from None
        chat = self.chat.value and isinstance(self.source, LocalSource) \
            and getattr(self.source.engine.tokenizer, "chat_template", None)
        return [[{"role": "user", "content": ln}] if chat else ln for ln in lines]

    def send(self, n: int | None = None, params: SamplingParams | None = None) -> list[str]:
        """Send n requests (default: the slider), cycling through the prompt lines. Sampled
        requests are seeded from the Seed knob (or `params.seed`) counting up, one per request
        sent from this page, so replies differ between requests and repeat on a fresh page.
        Bad input shows an error and sends nothing."""
        n = self.n.value if n is None else n
        if self.source is None:
            self.message.value = ('<div class="wb"><div class="error">The engine is still '
                                  'loading.</div></div>')
            return []
        try:
            if isinstance(self.source, ReplaySource):
                self.source.submit(None, None)        # says why a replay takes no requests
            prompts = self.prompt_list()
            base = params or self.knobs.sampling_params()
            if isinstance(self.source, LocalSource) and LOGPROBS and base.logprobs is None:
                base = replace(base, logprobs=LOGPROBS)   # the stream panel shades by them
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
            seed = None if base.greedy else \
                (self.knobs.seed.value if base.seed is None else base.seed) + self.num_sent + i
            rids.append(self.source.submit(prompts[i % len(prompts)], replace(base, seed=seed)))
        self.num_sent += n
        self.pump.start()
        return rids

    async def wait(self, timeout: float | None = None) -> bool:
        """Until the engine is loaded and every request sent has finished (the panels keep
        moving meanwhile); False on timeout or if the engine could not be built."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.pump is None:
            if self.load_error is not None or (end is not None and time.monotonic() > end):
                return False
            await asyncio.sleep(0.05)
        self.pump.start()
        return await self.pump.wait(None if end is None else max(0.0, end - time.monotonic()))

    def clear(self) -> None:
        for p in (self.streams, self.timeline, self.summary, self.errors, self.roofline):
            p.clear()

    def _play_when_shown(self) -> None:
        """Start the replay when a browser has drawn this page's figures (LivePlot.drawn):
        a recording of a few seconds would otherwise be over before the page appeared.
        Should a figure never report (a frontend without widgets), the replay starts anyway
        PLAY_ANYWAY_S after the page first showed, so its text still plays."""
        started = False

        def start() -> None:
            nonlocal started
            if not started:
                started = True
                self.restart_replay()

        def shown(change) -> None:
            if change["new"]:
                self.unobserve(shown, "_view_count")
                loop = running_loop()
                if loop is not None:
                    loop.call_later(PLAY_ANYWAY_S, start)

        when_drawn([self.timeline.plot, self.roofline.plot], start)
        self._view_count = 0
        self.observe(shown, "_view_count")

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
        # One engine's run everywhere: step numbers restart, and the cards of the old engine's
        # requests (finished or just aborted) go with its statistics.
        for p in (self.timeline, self.summary, self.streams, self.errors):
            p.clear()
        self.roofline.set_model(*_roofline_model(self.source))
        self.num_rebuilds += 1
        self._describe()


def _engine_info(src):
    """What the source's engine is (a live engine's info, a trace's), or None for a server."""
    if isinstance(src, LocalSource):
        return src.engine.info()
    return src.trace.info if isinstance(src, ReplaySource) else None


def _roofline_model(src):
    """(model shape, device roofs) for the roofline, or (None, None) for a server or none."""
    info = _engine_info(src)
    if info is None:
        return None, None
    return info, (src.engine.device_roofs() if isinstance(src, LocalSource) else src.trace.roofs)


def _title(info: str, escape: bool = True) -> str:
    return (f'<div class="wb"><h2 style="margin:2px 0">Prefill/decode workbench</h2>'
            f'<div class="engine-info">{esc(info) if escape else info}</div></div>')
