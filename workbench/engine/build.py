"""Building an engine, in one place: the device and its attention backend, the checkpoint
and model, the KV pool sized for what memory is left, the scheduler, the captured graphs,
and EngineInfo, the record of what was built (vLLM does the same across EngineCore's and
its workers' start-up)."""
from __future__ import annotations

import gc
import logging
import sys
from dataclasses import dataclass, field, replace

import torch

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.clock import Clock, WallClock
from ..core.scheduler import Scheduler
from ..executor.kv_sizing import kv_bytes_per_block, num_kv_blocks
from ..executor.models import build_model, load_checkpoint
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


def build_engine(config: EngineConfig) -> BuiltEngine:
    if config.device.startswith("model:"):       # a modelled device (engine/modelled.py)
        from .modelled import build_modelled_engine
        return build_modelled_engine(config, BuiltEngine)
    modules = len(sys.modules)
    platform = get_platform(config.device)
    # config.DTYPES lists torch's own names for the dtypes.
    dtype = platform.default_dtype if config.dtype == "auto" else getattr(torch, config.dtype)
    backend = platform.attention_backend(dtype, config.attention_backend)
    if config.block_size is None:
        config = replace(config, block_size=backend.default_block_size)
    # 'auto' stays 'auto' in the config (a rebuild with another model, an A/B arm or a
    # replay resolves it again); what it resolved to is info().quantization.
    # The device decides 'auto' (the CPU by measuring its kernels) and says what a format
    # asked for by name costs where it is slower than the plain weights.
    quantization, quantization_choice = config.quantization, None
    if platform.packed_weights and config.attention_backend == "auto":
        own = "gguf" if config.model == "smollm2" else None
        quantization, quantization_choice = platform.choose_quantization(quantization, own, dtype)
    elif quantization == "auto":
        quantization = None
    if quantization == "bf16c" and dtype != torch.bfloat16:
        raise ValueError(f"quantization: 'bf16c' keeps bf16 weights; it needs "
                         f"dtype='bfloat16' (got {str(dtype).removeprefix('torch.')})")
    platform.check_config(config)
    backend.check_config(config, platform.name)
    if quantization is not None and not platform.packed_weights:
        raise ValueError(f"quantization: low-bit weights ({quantization!r}) run on the "
                         f"CPU's kernels; {platform.name} takes them unquantized (None)")

    ckpt = load_checkpoint(config.model, quantization)
    ckpt_gguf = str(ckpt.gguf_path) if ckpt.gguf_path else None
    hf_config, tokenizer, model_path = ckpt.hf_config, ckpt.tokenizer, ckpt.path
    max_model_len = model_max_len(config, hf_config)

    platform.empty_cache()       # what dropped engines left cached counts as free
    platform.reset_peak_memory()
    ops = platform.model_ops(dtype) if config.attention_backend == "auto" else None
    model = build_model(ckpt, dtype, platform.device, max_model_len, config.seed, ops,
                        quantization)
    del ckpt
    platform.check_model(model)
    model.ops.prepare(model, platform)
    platform.empty_cache()      # what measuring kernels cached is not in use
    bs = config.block_size
    num_blocks = num_kv_blocks(config, platform.memory_info(),
                               kv_bytes_per_block(model, bs, dtype), hf_config, dtype)
    block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
    max_model_len = fit_max_model_len(config, max_model_len, block_manager.num_usable_blocks * bs)

    eos = eos_ids(hf_config, tokenizer, model_path)
    scheduler = Scheduler(config, block_manager, max_model_len, eos)
    runner = ModelRunner(model, num_blocks, bs, platform, backend,
                         max_num_tokens=config.max_num_batched_tokens,
                         max_num_seqs=config.max_num_seqs,
                         max_model_len=max_model_len)
    telemetry = Telemetry(config.max_step_events, config.max_request_records)
    weights = weight_bytes(model)
    telemetry.memory = MemoryStats(weights, runner.kv_cache_bytes, platform.peak_memory_bytes(),
                                   kv_bytes_per_block(model, bs, dtype), num_blocks)
    graph_mode, capture_sizes, piecewise_sizes, notices = runner.capture_graphs(config,
                                                                                max_model_len)
    if config.graph_mode is None:        # the device's choice, now made
        config = replace(config, graph_mode=graph_mode)
    notices = [*platform.notices(), *notices]
    if quantization_choice and config.quantization != "auto":
        notices.append(quantization_choice)      # what the format asked for costs: said once
    for text in notices:
        telemetry.notices.append(text)
        log.info(text)
    # Async scheduling needs decode graphs (the next step's ids are fed on the device) and
    # pays off where the device runs behind the host.
    run_ahead = (config.async_scheduling if config.async_scheduling is not None
                 else platform.runs_async) and runner.graphs is not None
    info = EngineInfo(
        model=config.model, model_path=str(model_path) if model_path else None,
        device=platform.name, device_name=platform.device_name(),
        dtype=str(dtype).replace("torch.", ""),
        max_model_len=max_model_len, block_size=bs, num_kv_blocks=num_blocks,
        kv_bytes_per_block=telemetry.memory.kv_bytes_per_block,
        graph_mode=graph_mode, capture_sizes=tuple(capture_sizes),
        piecewise_sizes=tuple(piecewise_sizes),
        attention=backend.name, ops=model.ops.name,
        async_scheduling=run_ahead, vocab_size=hf_config.vocab_size,
        num_params=num_params(model), quantization=quantization,
        quantization_choice=quantization_choice, kernels=platform.kernel_state(),
        weight_formats=weight_formats(model), gguf_path=ckpt_gguf,
        num_layers=model.num_layers, **model_shape(model, hf_config, dtype), config=config,
        generation_defaults=(generation_defaults(model_path)
                             if config.generation_config == "auto" else {}))
    built = BuiltEngine(config, platform, backend, tokenizer, model, runner, block_manager,
                        scheduler, telemetry, max_model_len, eos, run_ahead, info)
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
