"""The 'cpu' profile's cache: fitted to a short run of the real CPU engine on this machine
(engine/calibrate.py runs it), kept under the cache root, keyed by what the fit depends on."""
from __future__ import annotations

import hashlib
import json
import socket

import torch

from ..cache import cache_root
from ..config import EngineConfig
from ..roofline import probe_roofs
from .profiles import Coefficients, DeviceProfile, cpu_profile

CPU_FIT_VERSION = 3
"""Bumped when the fit changes, so profiles fitted before are made again."""


def cpu_cache_key(config: EngineConfig, dtype: str) -> str:
    parts = [socket.gethostname(), config.model, dtype, str(config.block_size),
             config.attention_backend, torch.__version__, str(torch.get_num_threads()),
             str(CPU_FIT_VERSION)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cpu_profile_path(config: EngineConfig, dtype: str):
    return cache_root() / "modelled" / f"cpu-{cpu_cache_key(config, dtype)}.json"


def cpu_dtype(config: EngineConfig) -> str:
    return "float32" if config.dtype == "auto" else config.dtype


def cached_cpu_profile(config: EngineConfig, dtype: str, platform) -> DeviceProfile | None:
    """The 'cpu' profile fitted on this machine for this model and dtype (its roofs probed
    on `platform`, the CPU's), or None if there is none yet (Engine makes it:
    engine/calibrate.py)."""
    try:
        d = json.loads(cpu_profile_path(config, dtype).read_text())
        return cpu_profile(probe_roofs(platform, getattr(torch, dtype)),
                           Coefficients.from_dict(d["coefficients"]), d["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
