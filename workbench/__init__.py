"""The prefill/decode workbench: a small paged-KV, continuous-batching LLM engine.

    from workbench import Engine, EngineConfig, SamplingParams

The names below are imported when first used (PEP 562), so that what does not need torch
(`workbench --help`, a command line refused by argparse, `workbench lab` and `workbench
dashboard`, whose Jupyter kernels import the engine themselves) does not wait seconds for it.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {"EngineConfig": ".config", "Engine": ".engine", "CompletionOutput": ".engine",
            "RequestOutput": ".engine", "TokenEvent": ".engine",
            "SamplingParams": ".core.sampling_params",
            "StructuredOutputsParams": ".core.sampling_params", "Logprob": ".core.sequence"}
__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "TokenEvent", "Logprob", "StructuredOutputsParams"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
