"""Building an engine, in one place: the device and its attention backend, the checkpoint
and model, the KV pool sized for what memory is left, the scheduler, the captured graphs,
and EngineInfo, the record of what was built (vLLM does the same across EngineCore's and
its workers' start-up).

A device brings its parts (a `Device`: the model as it holds it, the memory its KV budget
reads, its runner, clock and step pipeline, what EngineInfo says of it); `build_engine`
assembles the rest the same way for every device, a real one (`RealDevice`, here) and a
modelled one (engine/modelled.py's ModelledDevice)."""
from __future__ import annotations

import gc
import logging
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.clock import Clock, WallClock
from ..core.scheduler import Scheduler
from ..spec_decode import make_proposer
from ..executor.kv_sizing import kv_bytes_per_block, num_kv_blocks
from ..executor.device_model import load_device_model
from ..executor.models.loader import generation_defaults
from ..executor.runner import ModelRunner
from ..platforms import get_platform
from ..telemetry import EngineInfo, MemoryStats, Telemetry
from .sizing import (eos_ids, fit_max_model_len, model_max_len, model_shape, num_params,
                     weight_bytes, weight_formats)

log = logging.getLogger("workbench")

@dataclass(slots=True)
class BuiltEngine:
    """The parts an EngineCore runs, as built."""
    config: EngineConfig
    """The knobs as run (block_size, graph_mode resolved for the device)."""
    platform: object
    attn_backend: object
    """The device's AttentionBackend: KV layout, block sizes and dtypes, attention."""
    tokenizer: object
    model: torch.nn.Module
    runner: ModelRunner
    block_manager: BlockManager
    scheduler: Scheduler
    telemetry: Telemetry
    max_model_len: int
    eos_token_ids: set[int]
    async_scheduling: bool
    """Whether steps run ahead (see pipeline.py): asked for, or the device's choice."""
    info: EngineInfo
    clock: Clock = field(default_factory=WallClock)
    """Where the engine reads the time (a modelled device's is virtual)."""
    pipeline_class: type | None = None
    """The step pipeline to run (None: StepPipeline; a modelled device has its own)."""
    proposer: object | None = None
    """Speculative decoding's proposer (spec_decode/), or None: off."""


class Device:
    """What a device brings to build_engine; each kind of device fills these in (its
    constructor loads what it needs: made just before build_engine is called)."""
    modules_before: int
    """Modules imported before the device was made (build_engine's cycle collection)."""
    config: EngineConfig
    """The knobs with block_size resolved for the device."""
    platform: object
    attn_backend: object | None = None
    dtype: torch.dtype
    tokenizer: object
    hf_config: object
    model_path: Path | None
    model: torch.nn.Module
    max_model_len: int
    """The longest request the model takes, before the KV pool is sized."""
    memory: tuple[int, int] | None
    """(free, total) bytes the KV budget reads (kv_sizing.kv_cache_budget); None: the CPU's."""
    memory_label: str = ""
    """The device in the budget's error."""
    runs_async: bool = False
    """Async scheduling's default here."""
    clock_class: type[Clock] = WallClock
    pipeline_class: type | None = None
    notices: tuple[str, ...] | list[str] = ()
    """What the device says once, before the graphs' notices."""

    def make_runner(self, num_blocks: int, max_model_len: int):
        raise NotImplementedError

    def peak_memory_bytes(self, runner) -> int:
        return self.platform.peak_memory_bytes()

    def info_fields(self) -> dict:
        """The EngineInfo fields that are the device's to say."""
        raise NotImplementedError

    def built(self, runner, info: EngineInfo, run_ahead: bool) -> None:
        """Called once the engine is assembled."""

    def make_proposer(self, spec, runner, max_model_len: int):
        """Speculative decoding's proposer for SpeculativeConfig `spec` (spec_decode/)."""
        return make_proposer(spec, target_vocab_size=self.hf_config.vocab_size,
                             target_tokenizer=self.tokenizer, device=self.platform.device,
                             max_model_len=max_model_len,
                             max_num_seqs=self.config.max_num_seqs,
                             enable_prefix_caching=self.config.enable_prefix_caching)


class RealDevice(Device):
    """A device torch computes on: its platform, attention backend and packed-weight choice;
    the checkpoint loaded and the model built on it; the memory left once it is."""

    def __init__(self, config: EngineConfig):
        self.modules_before = len(sys.modules)
        m = load_device_model(config, model_max_len, get_platform(config.device))
        self.config, self.platform, self.attn_backend, self.dtype = \
            m.config, m.platform, m.attn_backend, m.dtype
        self.quantization, self.quantization_choice = m.quantization, m.quantization_choice
        self.model, self.hf_config, self.tokenizer, self.model_path = \
            m.model, m.hf_config, m.tokenizer, m.model_path
        self.gguf_path, self.max_model_len = m.gguf_path, m.max_model_len
        self.memory = m.platform.memory_info()
        self.runs_async = m.platform.runs_async
        self.notices = m.notices

    def make_runner(self, num_blocks: int, max_model_len: int) -> ModelRunner:
        c = self.config
        return ModelRunner(self.model, num_blocks, c.block_size, self.platform, self.attn_backend,
                           max_num_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
                           max_model_len=max_model_len)

    def info_fields(self) -> dict:
        p = self.platform
        return dict(device=p.name, device_name=p.device_name(),
                    dtype=str(self.dtype).replace("torch.", ""), attention=self.attn_backend.name,
                    ops=self.model.ops.name, quantization=self.quantization,
                    quantization_choice=self.quantization_choice, kernels=p.kernel_state(),
                    weight_formats=weight_formats(self.model), gguf_path=self.gguf_path)


def build_engine(dev: Device) -> BuiltEngine:
    """The engine around what `dev` brought, assembled the same for every device."""
    modules = dev.modules_before
    config, model, hf_config, dtype = dev.config, dev.model, dev.hf_config, dev.dtype
    bs = config.block_size
    per_block = kv_bytes_per_block(model, bs, dtype)
    num_blocks = num_kv_blocks(config, dev.memory, per_block, hf_config, dtype, dev.memory_label)
    block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
    max_model_len = fit_max_model_len(config, dev.max_model_len,
                                      block_manager.num_usable_blocks * bs)
    eos = eos_ids(hf_config, dev.tokenizer, dev.model_path)
    scheduler = Scheduler(config, block_manager, max_model_len, eos)
    runner = dev.make_runner(num_blocks, max_model_len)
    telemetry = Telemetry(config.max_step_events, config.max_request_records)
    telemetry.memory = MemoryStats(weight_bytes(model), runner.kv_cache_bytes,
                                   dev.peak_memory_bytes(runner), per_block, num_blocks)
    plan = runner.capture_graphs(config, max_model_len)
    if config.graph_mode is None:        # the device's choice, now made
        config = replace(config, graph_mode=plan.mode)
    for text in [*dev.notices, *plan.notices]:
        telemetry.notices.append(text)
        log.info(text)
    # Async scheduling needs decode graphs (the next step's ids are fed on the device) and
    # pays off where the device runs behind the host.
    run_ahead = (config.async_scheduling if config.async_scheduling is not None
                 else dev.runs_async) and runner.graphs is not None
    spec, proposer = config.speculative(), None
    if spec is not None:
        proposer = dev.make_proposer(spec, runner, max_model_len)
        if run_ahead:
            run_ahead = spec.adaptive
            text = ("speculative decoding: async scheduling " + (
                "runs only while the budget drafts nothing (a verify step's kept tokens "
                "decide the next step's input, so neither it nor the step after it is "
                "launched ahead)" if run_ahead else
                "is off for this engine (a verify step's kept tokens decide the next step's "
                "input, so it is not launched ahead; with 'adaptive' it runs while no step "
                "drafts)"))
            telemetry.notices.append(text)
            log.info(text)
    info = EngineInfo(
        model=config.model, model_path=str(dev.model_path) if dev.model_path else None,
        max_model_len=max_model_len, block_size=bs, num_kv_blocks=num_blocks,
        kv_bytes_per_block=per_block, graph_mode=plan.mode,
        capture_sizes=tuple(plan.decode_sizes), piecewise_sizes=tuple(plan.piecewise_sizes),
        async_scheduling=run_ahead, vocab_size=hf_config.vocab_size, num_params=num_params(model),
        num_layers=model.num_layers, **model_shape(model, hf_config, dtype), config=config,
        generation_defaults=(generation_defaults(dev.model_path)
                             if config.generation_config == "auto" else {}),
        **dev.info_fields())
    dev.built(runner, info, run_ahead)
    built = BuiltEngine(config, dev.platform, dev.attn_backend, dev.tokenizer, model, runner,
                        block_manager, scheduler, telemetry, max_model_len, eos, run_ahead, info,
                        clock=dev.clock_class(), pipeline_class=dev.pipeline_class,
                        proposer=proposer)
    del dev
    if len(sys.modules) > modules and not gc.isenabled():
        # A library imported for the first time above may leave a reference cycle that
        # holds one of its import-time frames (trio, which transformers pulls in through
        # huggingface_hub, keeps the traceback of its start-up self-test in a local). A
        # frame keeps its callers' frames through f_back, up to Engine.__init__ and the
        # engine in it, for as long as the cycle lives: with the cyclic GC off, for ever,
        # so the first engine of a process would never be freed. Collect it now: the cycle
        # is garbage already, and our frames go free with it. (With the GC on, it collects
        # such cycles itself.)
        gc.collect()
    return built
