"""A model loaded onto a device as an EngineConfig asks: the platform and its attention
backend, the dtype, the weight format resolved ('auto' decided by the device), the checkpoint
read and the decoder built, checked and prepared on it. The one loading path: the engine's
RealDevice (engine/build.py) and a speculative draft model (spec_decode/draft_model.py) both
load through it."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ..config import EngineConfig
from ..platforms import get_platform
from .models import build_model, load_checkpoint


@dataclass(slots=True)
class DeviceModel:
    config: EngineConfig
    """The knobs with block_size resolved for the backend."""
    platform: object
    attn_backend: object
    dtype: torch.dtype
    quantization: str | None
    """The weight format as run ('auto' resolved)."""
    quantization_choice: str | None
    """What the device said of its choice, or of what a format asked for costs."""
    model: torch.nn.Module
    hf_config: object
    tokenizer: object | None
    model_path: Path | None
    gguf_path: str | None
    max_model_len: int
    """What max_len_of gave for the model's config."""
    notices: list[str]


def load_device_model(config: EngineConfig, max_len_of: Callable[[EngineConfig, object], int],
                      platform=None) -> DeviceModel:
    """Load config.model on config.device (`platform`: that device's, if made already).
    max_len_of(config, hf_config): the positions the model is built for
    (engine/sizing.model_max_len)."""
    platform = platform if platform is not None else get_platform(config.device)
    # config.DTYPES lists torch's own names for the dtypes.
    dtype = (platform.default_dtype if config.dtype == "auto" else getattr(torch, config.dtype))
    backend = platform.attention_backend(dtype, config.attention_backend)
    if config.block_size is None:
        config = replace(config, block_size=backend.default_block_size)
    # 'auto' stays 'auto' in the config (a rebuild with another model, an A/B arm or a
    # replay resolves it again); what it resolved to is info().quantization.
    # The device decides 'auto' (the CPU by measuring its kernels) and says what a format
    # asked for by name costs where it is slower than the plain weights.
    quantization, choice = config.quantization, None
    if platform.packed_weights and config.attention_backend == "auto":
        own = "gguf" if config.model == "smollm2" else None
        quantization, choice = platform.choose_quantization(quantization, own, dtype)
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
    max_model_len = max_len_of(config, ckpt.hf_config)
    platform.empty_cache()       # what dropped engines left cached counts as free
    platform.reset_peak_memory()
    ops = platform.model_ops(dtype) if config.attention_backend == "auto" else None
    model = build_model(ckpt, dtype, platform.device, max_model_len, config.seed, ops,
                        quantization)
    hf_config, tokenizer, path = ckpt.hf_config, ckpt.tokenizer, ckpt.path
    gguf_path = str(ckpt.gguf_path) if ckpt.gguf_path else None
    del ckpt                    # the loaded state's tensors go before the kernels prepare
    platform.check_model(model)
    model.ops.prepare(model, platform)
    platform.empty_cache()      # what measuring kernels cached is not in use
    notices = list(platform.notices()) + model.ops.notices()
    if choice and config.quantization != "auto":
        notices.append(choice)      # what the format asked for costs: said once
    return DeviceModel(config, platform, backend, dtype, quantization, choice, model,
                       hf_config, tokenizer, path, gguf_path, max_model_len, notices)
