"""The 'cpu' modelled profile, fitted to a short run of the real CPU engine on this machine
(a few seconds on a small model) and cached per machine, model and dtype. Engine runs it
before building a model:cpu engine whose profile is not cached yet (or always, with
WORKBENCH_MODELLED_RECALIBRATE=1); the modelled build itself only reads the cache."""
from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import replace

from ..config import EngineConfig
from ..core.sampling_params import SamplingParams
from ..modelled import DeviceProfile
from ..modelled import cpu_cache
from ..modelled.fit import fit_cpu_steps
from ..modelled.profiles import parse_device
from ..platforms import get_platform
from .core import EngineCore

log = logging.getLogger("workbench")


def needs_calibration(config: EngineConfig) -> bool:
    """A model:cpu engine whose profile is not cached (or a recalibration asked for)."""
    if not config.device.startswith("model:") or parse_device(config.device) != "cpu":
        return False
    return (os.environ.get("WORKBENCH_MODELLED_RECALIBRATE") == "1"
            or cpu_cache.cached_cpu_profile(config, cpu_cache.cpu_dtype(config),
                                             get_platform("cpu")) is None)


def cpu_calibration_workload(max_num_seqs: int, vocab: int, max_len: int
                             ) -> list[list[tuple[list[int], int]]]:
    """Phases of (prompt ids, new tokens), each run to its end before the next: decode at
    batch 1, 2, 4, 8 and 16 (up to max_num_seqs), several steps each, so that every batch size
    weighs alike in the fit; then prompts of unlike lengths together (prefill, chunks, mixed
    steps). About 10 s for a 135M model on two cores."""
    r = random.Random(7)

    def prompt(n: int) -> list[int]:
        return [r.randrange(10, vocab) for _ in range(min(n, max_len - 40))]
    phases = [[(prompt(64), 16)]]
    phases += [[(prompt(r.randint(16, 48)), 10) for _ in range(b)]
               for b in (2, 4, 8, 16) if b <= max_num_seqs]
    phases.append([(prompt(n), 8) for n in (24, 96, 200, 380)]
                  + [(prompt(r.randint(24, 96)), 12) for _ in range(4)])
    return phases


def calibrate_cpu(config: EngineConfig) -> DeviceProfile:
    """Fit the 'cpu' profile for `config`'s model to the real CPU engine's steps on
    cpu_calibration_workload (weights unquantized, as the modelled engine counts them), and
    cache it."""
    dtype = cpu_cache.cpu_dtype(config)
    t = time.perf_counter()
    real = EngineCore(replace(config, device="cpu", dtype=dtype, quantization=None,
                              graph_mode="eager", async_scheduling=None, num_kv_blocks=None,
                              kv_cache_memory_gb=None, max_num_seqs=16,
                              max_num_batched_tokens=256, enable_prefix_caching=False,
                              prefill_interval=1, waiting_timeout_ms=0.0,
                              max_step_events=100_000))
    try:
        info = real.info()
        roofs = real.device_roofs()
        phases = cpu_calibration_workload(16, info.vocab_size, real.max_model_len)
        for i, work in enumerate(phases):
            real.add([real.make_request(p, p, SamplingParams(max_tokens=n, temperature=0,
                                                             ignore_eos=True), f"cal-{i}-{j}")
                      for j, (p, n) in enumerate(work)])
            while real.has_unfinished_requests():
                real.step()
        steps = real.telemetry.snapshot()[0][1:]       # the first step warms up
        k, fit = fit_cpu_steps(steps, info, roofs.peak_flops, roofs.bandwidth)
    finally:
        real.close()
    source = (f"fitted to {fit['steps']} steps of the real CPU engine on {config.model} "
              f"({dtype}) in {time.perf_counter() - t:.1f} s; fit residual median "
              f"{fit['median_rel_err']:.1%}, worst {fit['max_rel_err']:.1%}")
    log.info("modelled cpu: %s", source)
    path = cpu_cache.cpu_profile_path(config, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
    tmp.write_text(json.dumps({"coefficients": k.as_dict(), "source": source, "fit": fit}))
    tmp.replace(path)
    profile = cpu_cache.cached_cpu_profile(config, dtype, get_platform("cpu"))
    assert profile is not None, path
    return profile
