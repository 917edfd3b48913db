"""Building an engine on a modelled device (`device="model:<name>"`, workbench/modelled/) and
the step it runs.

Everything but the forward pass is the real engine's: the scheduler, the block pool and its
prefix cache, preemption, the output processor (stop conditions, streams, request records)
and the telemetry. The model is built on torch's meta device (its shape, no weights), the KV
pool is sized as the device's memory would hold it but never allocated, and each step the
ModelledRunner times the step and picks random tokens; the engine's VirtualClock moves by the
step's modelled time, so every TTFT, TPOT and ITL the engine records is a modelled one.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.clock import VirtualClock
from ..core.sampling_params import SamplingParams
from ..core.scheduler import Scheduler, SchedulerOutput
from ..executor.kv_sizing import kv_bytes_per_block, kv_bytes_per_token, num_kv_blocks
from ..executor.models import LlamaForCausalLM, load_checkpoint
from ..executor.models.loader import generation_defaults
from ..executor.sampler import LogprobsTensors
from ..modelled import ModelledRunner
from ..modelled.cpu_cache import cached_cpu_profile, cpu_dtype
from ..modelled.profiles import parse_device, spec_profile
from ..platforms import get_platform
from ..telemetry import FULL, EngineInfo, MemoryStats, Telemetry
from .pipeline import StepPipeline, StepResult
from .request import ParentRequest
from .sizing import eos_ids, fit_max_model_len, model_max_len, num_params, weight_bytes

log = logging.getLogger("workbench")

@dataclass(slots=True)
class ModelledStep:
    """A modelled step, timed and its tokens drawn, not handed out yet."""
    sched: SchedulerOutput
    reqs: list
    tokens: list[int]
    graph: tuple[str, int] | None
    t0: float
    seconds: float
    ahead: bool


class ModelledPipeline(StepPipeline):
    """One modelled step: schedule, time it, draw random tokens, move the clock to its end,
    hand out, in StepPipeline's order and bookkeeping. With async scheduling, StepPipeline's
    pipeline too: a replayed decode step stays in flight while the next one is scheduled
    from it (Scheduler.schedule_next_decode), and its tokens are handed out by the call
    after, so a request that ends frees its place a step later and a client that replaces
    it is admitted a step later, as on the real device. The overlap of host and device
    itself is in the step's modelled time (cost.py), so each step starts where the one
    before it ended on the virtual clock."""

    def step(self, run_ahead) -> StepResult:
        pending, self.in_flight = self.in_flight, None
        if pending is None:
            sched, t0 = self._schedule()
            if sched.is_empty:
                return self._hand_out(sched, [], [], None, None, t0)
            pending = self._run(sched, t0, ahead=False)
        # Step N ends on the clock; with async scheduling and a replayed graph, N+1 is
        # scheduled from it and stays in flight (not handed out) before N is handed out.
        self.clock.advance(pending.seconds)
        self.scheduler.update_after_step(pending.sched)
        if (self.async_scheduling and pending.graph is not None and pending.graph[0] == FULL
                and run_ahead()):
            nxt = self.scheduler.schedule_next_decode(pending.sched, lambda seq: True)
            if nxt is not None:
                self.in_flight = self._run(nxt[1], self.clock.now(), ahead=True)
        return self._hand_out_step(pending)

    def _run(self, sched: SchedulerOutput, t0: float, ahead: bool) -> ModelledStep:
        ran = self.runner.execute(sched)
        tokens = ran.sampled_token_ids
        rows, reqs = ParentRequest.sampling_rows(self.requests.requests_of(ran.req_ids))
        if rows is not None:                 # n > 1: one token per choice from its row
            tokens = self.runner.tokens(len(reqs))
        return ModelledStep(sched, reqs, tokens, ran.graph, t0, ran.seconds, ahead)

    def _hand_out_step(self, s: ModelledStep) -> StepResult:
        return self._hand_out(s.sched, s.reqs, s.tokens, self._logprobs(s.reqs, s.tokens),
                              s.graph, s.t0, s.ahead)

    def _logprobs(self, reqs, tokens: list[int]) -> LogprobsTensors | None:
        """The logprobs of the distribution the tokens were drawn from: uniform over the
        vocabulary (EOS aside), so every token's is -log(V) at rank 1, and its 'top k' are
        other draws from it."""
        ks = [r.seq.params.logprobs for r in reqs if r.seq.params.logprobs is not None]
        if not ks:
            return None
        k = max(ks)
        cols = [tokens] + [self.runner.tokens(len(tokens)) for _ in range(k)]
        ids = torch.tensor(cols, dtype=torch.long).T.reshape(len(tokens), k + 1)
        lp = torch.full(ids.shape, -math.log(self.runner.vocab_size - len(self.runner.eos)))
        return LogprobsTensors(ids, lp, torch.ones(len(tokens), dtype=torch.long))

    def check_request(self, params: SamplingParams) -> None:
        """What a modelled device cannot give: prompt logprobs and grammars need real
        logits (a token's logprob it can give: its draw is uniform)."""
        for name in ("prompt_logprobs", "structured_outputs"):
            if getattr(params, name) is not None:
                raise ValueError(f"{name}: a modelled device emits random tokens, without "
                                 "logits; run this request on a real device")


# ---- building ------------------------------------------------------------------------------------
def build_modelled_engine(config: EngineConfig, built_class):
    """A BuiltEngine (build.py's record) for `config.device` = 'model:<name>'."""
    name = parse_device(config.device)
    platform = get_platform("cpu")       # the host: sampling params, generators live here
    if name == "cpu":
        dtype = cpu_dtype(config)
        profile = cached_cpu_profile(config, dtype, platform)
        if profile is None:
            raise ValueError("device: model:cpu is fitted to a short run of the real CPU engine "
                             "on this machine, and none is cached for this model; "
                             "Engine(device='model:cpu') runs it first "
                             "(workbench.engine.calibrate.calibrate_cpu)")
    else:
        profile = spec_profile(name)
        dtype = profile.dtype if config.dtype == "auto" else config.dtype
    if config.block_size is None:
        config = replace(config, block_size=profile.default_block_size)
    torch_dtype = getattr(torch, dtype)
    ckpt = load_checkpoint(config.model, None)
    hf_config, tokenizer, model_path = ckpt.hf_config, ckpt.tokenizer, ckpt.path
    del ckpt
    max_model_len = model_max_len(config, hf_config)
    with torch.device("meta"):           # the shape alone: no weights are made
        model = LlamaForCausalLM(hf_config, max_model_len).to(torch_dtype)
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    weights = weight_bytes(model)
    bs = config.block_size
    per_block = kv_bytes_per_block(model, bs, torch_dtype)
    memory = (None if profile.memory_bytes is None        # in use: the weights
              else (profile.memory_bytes - weights, profile.memory_bytes))
    num_blocks = num_kv_blocks(config, memory, per_block, hf_config, torch_dtype,
                               f"the modelled {profile.device_name}")
    block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
    max_model_len = fit_max_model_len(config, max_model_len, block_manager.num_usable_blocks * bs)
    eos = eos_ids(hf_config, tokenizer, model_path)
    scheduler = Scheduler(config, block_manager, max_model_len, eos)
    runner = ModelledRunner(profile, hf_config.vocab_size, eos, num_blocks * per_block,
                            config.seed)
    telemetry = Telemetry(config.max_step_events, config.max_request_records)
    telemetry.memory = MemoryStats(weights, num_blocks * per_block, weights + num_blocks * per_block,
                                   per_block, num_blocks)
    graph_mode, capture_sizes, piecewise_sizes, notices = runner.capture_graphs(config,
                                                                                max_model_len)
    if config.graph_mode is None:
        config = replace(config, graph_mode=graph_mode)
    err, med = profile.error.get("max_abs_pct"), profile.error.get("median_abs_pct")
    notices = [*notices, f"modelled device: {profile.device_name}, "
               + (f"calibrated (measured error: median {med or 0:.0f} %, worst {err:.0f} %; "
                  "docs/modelled.md)" if profile.calibrated and err is not None
                  else "calibrated (error not measured yet)" if profile.calibrated
                  else "UNCALIBRATED (spec-sheet roofs; no measured error)")
               + ": every time is modelled, every token random"]
    for text in notices:
        telemetry.notices.append(text)
    run_ahead = (config.async_scheduling if config.async_scheduling is not None
                 else profile.runs_async) and runner.graphs is not None
    runner.async_scheduling = run_ahead
    info = EngineInfo(
        model=config.model, model_path=str(model_path) if model_path else None,
        device=config.device, device_name=f"{profile.device_name} (modelled)", dtype=dtype,
        max_model_len=max_model_len, block_size=bs, num_kv_blocks=num_blocks,
        kv_bytes_per_block=per_block, graph_mode=graph_mode, capture_sizes=tuple(capture_sizes),
        piecewise_sizes=tuple(piecewise_sizes), attention="modelled", ops="modelled",
        async_scheduling=run_ahead, vocab_size=hf_config.vocab_size,
        num_params=num_params(model), quantization=None, weight_formats=(dtype,),
        num_layers=model.num_layers, num_layer_params=num_params(model.layers),
        hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, weight_bytes=weight_bytes(model.layers) + weight_bytes(head),
        kv_bytes_per_token=kv_bytes_per_token(model, torch_dtype), config=config,
        generation_defaults=(generation_defaults(model_path)
                             if config.generation_config == "auto" else {}),
        modelled=profile.summary())
    runner.info = info
    return built_class(config, platform, None, tokenizer, model, runner, block_manager,
                       scheduler, telemetry, max_model_len, eos, run_ahead, info,
                       clock=VirtualClock(), pipeline_class=ModelledPipeline)

