"""The engine: the front door (`Engine`) and the engine core it drives.

This floor sits above the executor and the pure-Python core (vLLM's `v1/engine/`): it
turns prompts into requests, steps the scheduler and the model runner, and turns sampled
ids back into text and events.

    llm_engine.py       Engine, the front door: tokenize, generate, stream/astream, the thread
    input_processor.py  prompts (text, chat, ids) to checked token ids
    core.py             EngineCore: add / abort / step / run_loop, the public read API
    build.py            building and sizing an engine (model, KV pool, graphs, EngineInfo)
    pipeline.py         one step, with async scheduling's run-ahead (StepPipeline)
    output_processor.py the scheduler's verdicts to TokenEvents: text, stop strings, logprobs
    request.py          Request (one sequence as the engine holds it), ParentRequest (n > 1),
                        RequestRegistry, TokenEvent, RequestState
    detokenizer.py      incremental detokenizing with stop strings
"""
from .llm_engine import CompletionOutput, Engine, RequestOutput
from .request import RequestState, TokenEvent

__all__ = ["Engine", "RequestOutput", "CompletionOutput", "TokenEvent", "RequestState"]
