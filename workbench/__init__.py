"""The prefill/decode workbench: a small paged-KV, continuous-batching LLM engine.

    from workbench import Engine, EngineConfig, SamplingParams

The names below are imported when first used (PEP 562), so that what does not need torch
(`workbench --help`, a command line refused by argparse, `workbench lab` and `workbench
dashboard`, whose Jupyter kernels import the engine themselves) does not wait seconds for it.
"""
from __future__ import annotations

from .utils import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {"EngineConfig": ".config", "Engine": ".engine", "CompletionOutput": ".engine",
            "RequestOutput": ".engine", "TokenEvent": ".engine",
            "SamplingParams": ".core.sampling_params",
            "StructuredOutputsParams": ".core.sampling_params", "Logprob": ".core.sequence"}
__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "TokenEvent", "Logprob", "StructuredOutputsParams"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
