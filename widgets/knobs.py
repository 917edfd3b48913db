"""KnobPanel: the engine's knobs. "Apply" builds a new engine from them; the old one keeps
serving until the new one is ready, and stays if the new one cannot be built.

Temperature and max tokens are per-request settings (`sampling_params()`), not rebuilds.

Speculative decoding is three knobs that make one `speculative_config` (vLLM's shape): the
method (off, n-gram prompt lookup, or a draft model with its source) and k, the tokens drafted
per request per step. The config's other fields (lookup bounds, the draft's dtype, ...) are
kept while the method stays the same.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Callable

import ipywidgets as w
import traitlets

from workbench import Engine, EngineConfig, SamplingParams
from workbench.config import BLOCK_SIZES, GRAPH_MODES, SpeculativeConfig
from workbench.modelled import profile_names
from workbench.platforms import available_devices, block_sizes

from .live import running_loop
from .progress import BuildProgress
from .style import css_widget, esc

MODELS = ["smollm2", "random:tiny", "random:smollm2-135m", "random:qwen3-0.6b"]


def _devices() -> list[str]:
    """The devices this machine runs, then the modelled ones (workbench/modelled/)."""
    return [*available_devices(), *(f"model:{n}" for n in profile_names())]


def _block_sizes(device: str) -> tuple[int, ...]:
    """platforms.block_sizes; a modelled device takes any of the knob's sizes."""
    return BLOCK_SIZES if device.startswith("model:") else block_sizes(device)


DEVICE_CHOICE = 0
"""The block-size option that leaves the size to the device (config block_size=None): a
Dropdown reads the value None as "nothing selected" and shows a blank box."""


def _block_size_options(device: str) -> list:
    """The block sizes the device's attention backend takes (platforms.block_sizes), as
    (label, value) pairs: a Dropdown given a mix of pairs and bare values labels each pair with
    its repr."""
    return [("device's choice", DEVICE_CHOICE), *((str(b), b) for b in _block_sizes(device))]


def _label(text: str, tip: str, width: str = "150px") -> dict:
    return dict(description=text, description_allow_html=False, tooltip=tip,
                style={"description_width": width}, layout=w.Layout(width="98%"))


GRAPH_MODE_LABELS = {"eager": "eager (no graphs)", "decode": "decode steps",
                     "full": "all steps (piecewise)"}

SPEC_OFF = "off"
SPEC_METHOD_LABELS = {SPEC_OFF: "off", "ngram": "n-gram (prompt lookup)",
                      "draft_model": "draft model"}
"""The speculative method knob's options (config.SPEC_METHODS, and off)."""


class KnobPanel(w.VBox):
    """Knobs for `config`; `on_apply(engine)` receives each engine built by Apply."""

    builds = traitlets.Int(0, help="Engines built successfully.")
    failures = traitlets.Int(0, help="Applies that raised (the old engine was kept).")
    building = traitlets.Bool(False)

    def __init__(self, config: EngineConfig | None = None,
                 on_apply: Callable[[Engine], None] | None = None,
                 engine_factory: Callable[[EngineConfig], Engine] = Engine, seed: int = 0,
                 **kw):
        self.config = config or EngineConfig()
        self.on_apply = on_apply
        self.engine_factory = engine_factory
        self.last_error: str | None = None
        self._expected_build_s = 6.0
        c = self.config
        self.model = w.Combobox(value=c.model, options=MODELS, ensure_option=False,
                                placeholder="smollm2, random:<shape> or a checkpoint dir",
                                **_label("Model", "model: smollm2 (embedded), random:<shape> "
                                         "(seeded random weights), or a local Hugging Face "
                                         "checkpoint directory"))
        self.device = w.Dropdown(options=_devices(), value=c.device
                                 if c.device in _devices() else "auto",
                                 **_label("Device", "device: auto picks npu, then cuda, then "
                                          "cpu; model:<profile> is a modelled device (its "
                                          "times modelled, its tokens random)"))
        self.block_size = w.Dropdown(options=_block_size_options(self.device.value),
                                     value=c.block_size or DEVICE_CHOICE,
                                     **_label("KV block (tokens)", "block_size: tokens per KV "
                                              "block. Small blocks waste less memory at the end "
                                              "of each request; big ones mean shorter block "
                                              "tables"))
        self.num_kv_blocks = w.IntText(value=c.num_kv_blocks or 0,
                                       **_label("KV pool (blocks)", "num_kv_blocks: size of the "
                                                "paged KV pool; 0 sizes it from "
                                                "kv_cache_memory_gb. When it runs out, requests "
                                                "are preempted"))
        self.max_num_seqs = w.IntSlider(value=c.max_num_seqs, min=1, max=256,
                                        **_label("Batch (requests)", "max_num_seqs: most "
                                                 "requests running in one step"))
        self.max_num_batched_tokens = w.IntText(value=c.max_num_batched_tokens,
                                                **_label("Step budget (tokens)",
                                                         "max_num_batched_tokens: token budget "
                                                         "of one step; longer prompts are "
                                                         "prefilled in chunks"))
        self.graph_mode = w.Dropdown(options=[(GRAPH_MODE_LABELS.get(m, m), m)
                                              for m in GRAPH_MODES],
                                     value=c.graph_mode or GRAPH_MODES[0],
                                     **_label("Graph capture", "graph_mode: replay captured "
                                              "graphs of decode steps (decode), and of prefill "
                                              "steps piecewise around attention (full), where "
                                              "the device can capture; the CPU runs eager"))
        self.enable_prefix_caching = w.Checkbox(value=c.enable_prefix_caching, indent=False,
                                                description="Prefix caching", tooltip="enable_prefix_caching: "
                                                "requests that share a prompt prefix reuse its "
                                                "KV blocks instead of recomputing them")
        sc = c.speculative()
        self.spec_method = w.Dropdown(
            options=[(label, m) for m, label in SPEC_METHOD_LABELS.items()],
            value=sc.method if sc else SPEC_OFF,
            **_label("Speculative decoding", "speculative_config.method: draft tokens cheaply "
                     "and verify them all in one forward pass of the model. ngram looks the "
                     "request's last tokens up in its own prompt and output (pays off when "
                     "the reply copies the prompt); draft_model asks a smaller model with "
                     "the same vocabulary"))
        self.num_speculative_tokens = w.IntSlider(
            value=sc.num_speculative_tokens if sc else 4, min=1,
            max=max(16, sc.num_speculative_tokens if sc else 0),
            **_label("Drafts per step (k)", "speculative_config.num_speculative_tokens: most "
                     "tokens drafted per request per step; a step then yields 1 to k+1 tokens. "
                     "Larger k wins more when drafts are right and wastes more compute when "
                     "they are wrong"))
        self.spec_model = w.Combobox(
            value=(sc.model or "") if sc else "", options=MODELS, ensure_option=False,
            placeholder="smollm2, random:<shape> or a checkpoint dir",
            **_label("Draft model", "speculative_config.model: the draft's source (any the "
                     "engine loads); its vocabulary and tokenizer must be the target's"))
        self.spec_method.observe(lambda _: self._show_spec_knobs(), names="value")
        self._show_spec_knobs()
        self.temperature = w.FloatSlider(value=0.7, min=0.0, max=2.0, step=0.05,
                                         **_label("Temperature", "0 is greedy; replies differ "
                                                  "between sends unless a seed is set"))
        self.max_tokens = w.IntSlider(value=128, min=1, max=1024,
                                      **_label("Max output (tokens)", "max_tokens: the most "
                                               "tokens one reply may have"))
        self.seed = w.IntText(value=seed, **_label("Seed", "seed: sampled requests are seeded "
                                                   "from here, one more per request sent, so a "
                                                   "fresh page repeats its replies; change it "
                                                   "for others"))
        self.apply_button = w.Button(description="Apply (rebuild engine)", button_style="primary",
                                     icon="refresh", layout=w.Layout(width="100%"))
        self.progress = BuildProgress()
        self.status = w.HTML()
        self.apply_button.on_click(lambda _: self._clicked())
        self.device.observe(self._device_changed, names="value")
        engine_knobs = [self.model, self.device, self.block_size, self.num_kv_blocks,
                        self.max_num_seqs, self.max_num_batched_tokens, self.graph_mode,
                        self.enable_prefix_caching, self.spec_method,
                        self.num_speculative_tokens, self.spec_model]
        # Apply and its outcome first: at the foot of the knobs, a refusal fell below a
        # 900-px fold; here it shows right under the button that was clicked.
        super().__init__([css_widget(), self.apply_button, self.progress, self.status,
                          w.HTML("<b>Engine</b> <span style='opacity:.7'>(Apply "
                                 "rebuilds it)</span>"), *engine_knobs,
                          w.HTML("<b>Requests</b>"), self.temperature, self.max_tokens,
                          self.seed], **kw)

    def _device_changed(self, change) -> None:
        """Offer only the block sizes the new device's attention takes; a size it does not
        take falls back to the device's choice."""
        keep = self.block_size.value
        self.block_size.options = _block_size_options(change["new"])
        self.block_size.value = keep if keep in _block_sizes(change["new"]) else DEVICE_CHOICE

    def _show_spec_knobs(self) -> None:
        """k only while speculation is on, the draft's source only for draft_model."""
        method = self.spec_method.value
        self.num_speculative_tokens.layout.display = "none" if method == SPEC_OFF else ""
        self.spec_model.layout.display = "" if method == "draft_model" else "none"

    def speculative_config(self) -> dict | None:
        """The speculative knobs as EngineConfig.speculative_config (None: off), with the
        current config's other fields kept where its method is the same."""
        method = self.spec_method.value
        if method == SPEC_OFF:
            return None
        sc = self.config.speculative()
        d = dict(self.config.speculative_config) if sc and sc.method == method else {}
        d.update(method=method, num_speculative_tokens=self.num_speculative_tokens.value)
        if method == "draft_model":
            d["model"] = self.spec_model.value.strip()
        return d

    def _set_speculative(self, d: dict | None) -> None:
        sc = SpeculativeConfig.from_dict(d)      # (a bad dict: its ValueError, nothing set)
        self.spec_method.value = sc.method if sc else SPEC_OFF
        if sc:
            k = self.num_speculative_tokens
            k.max = max(k.max, sc.num_speculative_tokens)
            k.value = sc.num_speculative_tokens
            self.spec_model.value = sc.model or ""

    # ---- reading the knobs ----------------------------------------------------------------
    def values(self) -> dict:
        return dict(model=self.model.value.strip(), device=self.device.value,
                    block_size=self.block_size.value or None,
                    num_kv_blocks=self.num_kv_blocks.value or None,
                    max_num_seqs=self.max_num_seqs.value,
                    max_num_batched_tokens=self.max_num_batched_tokens.value,
                    graph_mode=self.graph_mode.value,
                    enable_prefix_caching=self.enable_prefix_caching.value,
                    speculative_config=self.speculative_config())

    def make_config(self) -> EngineConfig:
        """The knobs as a config (raises ValueError naming the field, like EngineConfig)."""
        return replace(self.config, **self.values())

    def sampling_params(self, **overrides) -> SamplingParams:
        p = SamplingParams(temperature=self.temperature.value, max_tokens=self.max_tokens.value)
        return replace(p, **overrides) if overrides else p

    def show_config(self, config: EngineConfig) -> None:
        """Show what an engine runs with (its resolved config: the device's block size and
        graph mode rather than 'device's choice')."""
        self.config = config
        self.set_values(**{k: getattr(config, k) for k in self.values()})

    def set_values(self, **values) -> None:
        """Set knobs by EngineConfig name (for notebooks and tests)."""
        for name, v in values.items():
            if name == "speculative_config":
                self._set_speculative(v)
                continue
            widget = getattr(self, name, None)
            if not isinstance(widget, w.ValueWidget):
                raise ValueError(f"{name}: not a knob of this panel")
            widget.value = 0 if (name in ("num_kv_blocks", "block_size") and v is None) else v

    # ---- applying -------------------------------------------------------------------------
    def _clicked(self) -> None:
        if self.building:
            return
        if running_loop() is not None:
            asyncio.ensure_future(self.apply_async())
        else:
            self.apply()

    def _fail(self, e: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        self.status.value = (f'<div class="wb"><div class="error"><b>Not applied.</b> '
                             f'{esc(self.last_error)}<br>The running engine was kept.</div></div>')

    def _succeed(self, engine: Engine, seconds: float) -> None:
        self.show_config(engine.info().config)
        self.builds += 1
        self.last_error = None
        self._expected_build_s = seconds
        notes = "".join(f"<br>{esc(n)}" for n in engine.telemetry.notices)
        self.status.value = (f'<div class="wb"><div class="ok">Engine rebuilt in {seconds:.1f} s: '
                             f'block_size {engine.info().config.block_size}, '
                             f'{engine.info().num_kv_blocks} KV blocks, max_num_seqs '
                             f'{engine.info().config.max_num_seqs}.{notes}</div></div>')
        if self.on_apply is not None:
            self.on_apply(engine)

    def _begin(self) -> EngineConfig | None:
        try:
            config = self.make_config()
        except ValueError as e:
            self._fail(e)
            return None
        self.building = True
        self.apply_button.disabled = True
        self.status.value = ""
        return config

    def _end(self) -> None:
        self.building = False
        self.apply_button.disabled = False

    def apply(self) -> Engine | None:
        """Build an engine from the knobs, here and now; None (error shown) if it failed."""
        config = self._begin()
        if config is None:
            return None
        t0 = time.monotonic()
        try:
            engine = self.engine_factory(config)
        except Exception as e:
            return self._built(t0, error=e)
        return self._built(t0, engine)

    async def apply_async(self) -> Engine | None:
        """Build in a worker thread while the progress bar moves on the kernel's loop."""
        config = self._begin()
        if config is None:
            return None
        t0 = time.monotonic()
        try:
            engine = await self.progress.run(lambda: self.engine_factory(config),
                                             "Building the engine", self._expected_build_s)
        except Exception as e:
            return self._built(t0, error=e)
        return self._built(t0, engine)

    def _built(self, t0: float, engine: Engine | None = None,
               error: Exception | None = None) -> Engine | None:
        """The end of a build, either way: the panel re-enabled, the outcome shown."""
        self._end()
        if error is not None:
            self._fail(error)
            return None
        self._succeed(engine, time.monotonic() - t0)
        return engine
