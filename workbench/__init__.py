"""The prefill/decode workbench: a small paged-KV, continuous-batching LLM engine.

    from workbench import Engine, EngineConfig, SamplingParams
"""
from .config import EngineConfig
from .engine import CompletionOutput, Engine, RequestOutput, TokenEvent
from .core.sampling_params import SamplingParams, StructuredOutputsParams
from .core.sequence import Logprob

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "TokenEvent", "Logprob", "StructuredOutputsParams"]
__version__ = "0.1.0"
