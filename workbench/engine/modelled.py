"""A modelled device (`device="model:<name>"`, workbench/modelled/): what it brings to
build_engine (ModelledDevice) and the step it runs (ModelledPipeline).

Everything but the forward pass is the real engine's: the scheduler, the block pool and its
prefix cache, preemption, the output processor (stop conditions, streams, request records)
and the telemetry. The model is built on torch's meta device (its shape, no weights), the KV
pool is sized as the device's memory would hold it but never allocated, and each step the
ModelledRunner times the step and picks random tokens; the engine's VirtualClock moves by the
step's modelled time, so every TTFT, TPOT and ITL the engine records is a modelled one.
Speculative decoding runs as on a real device (SpecDecoding drafts, the scheduler budgets
and allocates, the pipeline books each verify), with random drafts whose accepted count the
runner draws at a rate measured on the workload by a real run (modelled/speculative.py).
"""
from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, replace

import torch

from ..config import EngineConfig
from ..core.clock import VirtualClock
from ..core.sampling_params import SamplingParams
from ..core.scheduler import SchedulerOutput
from ..executor.kv_sizing import kv_bytes_per_block
from ..executor.models import LlamaForCausalLM, load_checkpoint
from ..executor.sampler import LogprobsTensors
from ..modelled import ModelledRunner
from ..modelled.cpu_cache import cached_cpu_profile, cpu_dtype
from ..modelled.profiles import parse_device, spec_profile
from ..modelled.speculative import ModelledProposer
from ..platforms import get_platform
from ..telemetry import FULL
from .build import Device
from .pipeline import StepPipeline, StepResult
from .request import ParentRequest
from .sizing import eos_ids, model_max_len, weight_bytes


@dataclass(slots=True)
class ModelledStep:
    """A modelled step, timed and its tokens drawn, not handed out yet."""
    sched: SchedulerOutput
    reqs: list
    tokens: list[list[int]]
    """Each request's kept tokens (a verify's accepted drafts, then its own)."""
    drafts: dict[str, list[int]]
    accepted: dict[str, int]
    """A verify step's drafts and accepted counts by sequence id (speculative decoding)."""
    graph: tuple[str, int] | None
    t0: float
    seconds: float
    ahead: bool
    may_run_ahead: bool
    """A replayed decode graph under async scheduling: the next step may be scheduled from it."""


class ModelledPipeline(StepPipeline):
    """One modelled step: schedule, time it, draw random tokens, move the clock to its end,
    hand out, in StepPipeline's order and bookkeeping. With async scheduling, StepPipeline's
    pipeline too: a replayed decode step stays in flight while the next one is scheduled
    from it (Scheduler.schedule_next_decode), and its tokens are handed out by the call
    after, so a request that ends frees its place a step later and a client that replaces
    it is admitted a step later, as on the real device. The overlap of host and device
    itself is in the step's modelled time (cost.py), so each step starts where the one
    before it ended on the virtual clock."""

    def _launch(self, sched: SchedulerOutput, t0: float) -> ModelledStep:
        """Time the step and draw its tokens; it is handed out once the clock reaches its
        end. A verify keeps the drafts the runner drew as accepted, then its own token, and
        SpecDecoding books it as a real verify (SpecDecoding.verified)."""
        ran = self.runner.execute(sched)
        own = ran.sampled_token_ids
        rows, reqs = ParentRequest.sampling_rows(self.requests.requests_of(ran.req_ids))
        if rows is not None:                 # n > 1: one token per choice from its row
            own = self.runner.tokens(len(reqs))
        drafts_of = {s.req_id: s.spec_token_ids for s in sched.scheduled if s.spec_token_ids}
        tokens, drafts, accepted = [], {}, {}
        for e, (r, t) in enumerate(zip(reqs, own)):
            i = e if rows is None else rows[e]
            d = drafts_of.get(ran.req_ids[i])
            if d:
                n = ran.num_accepted[i]
                tokens.append(d[:n] + [t])
                drafts[r.seq_id], accepted[r.seq_id] = list(d), n
                self.spec.verified(r, d, n)
            else:
                tokens.append([t])
        graph = ran.graph
        return ModelledStep(sched, reqs, tokens, drafts, accepted, graph, t0, ran.seconds,
                            ahead=False, may_run_ahead=(self.async_scheduling and graph is not None
                                                        and graph[0] == FULL))

    def _end(self, pending: ModelledStep) -> None:
        self.clock.advance(pending.seconds)

    def _launch_next(self, pending: ModelledStep, rows: list[int],
                     sched: SchedulerOutput) -> ModelledStep:
        step = self._launch(sched, self.clock.now())
        step.ahead = True
        return step

    def _finish(self, s: ModelledStep) -> StepResult:
        lp_rows = [0, *itertools.accumulate(map(len, s.tokens))][:-1]
        return self._hand_out(s.sched, s.reqs, s.tokens, self._logprobs(s.reqs, s.tokens),
                              s.graph, s.t0, s.ahead, lp_rows=lp_rows, drafts=s.drafts,
                              accepted=s.accepted)

    def _logprobs(self, reqs, tokens: list[list[int]]) -> LogprobsTensors | None:
        """The logprobs of the distribution the tokens were drawn from: uniform over the
        vocabulary (EOS aside), so every token's is -log(V) at rank 1, and its 'top k' are
        other draws from it. One row per kept token, each request's in order."""
        ks = [r.seq.params.logprobs for r in reqs if r.seq.params.logprobs is not None]
        if not ks:
            return None
        k = max(ks)
        flat = [t for ts in tokens for t in ts]
        cols = [flat] + [self.runner.tokens(len(flat)) for _ in range(k)]
        ids = torch.tensor(cols, dtype=torch.long).T.reshape(len(flat), k + 1)
        lp = torch.full(ids.shape, -math.log(self.runner.vocab_size - len(self.runner.eos)))
        return LogprobsTensors(ids, lp, torch.ones(len(flat), dtype=torch.long))

    def check_request(self, params: SamplingParams) -> None:
        """What a modelled device cannot give: prompt logprobs and grammars need real
        logits (a token's logprob it can give: its draw is uniform)."""
        for name in ("prompt_logprobs", "structured_outputs"):
            if getattr(params, name) is not None:
                raise ValueError(f"{name}: a modelled device emits random tokens, without "
                                 "logits; run this request on a real device")


# ---- building ------------------------------------------------------------------------------------
class ModelledDevice(Device):
    """What a modelled device brings to build_engine (`config.device` = 'model:<name>'): the
    model's shape on torch's meta device (no weights), the memory the modelled device would
    have, a runner that times steps and draws tokens, a virtual clock and its pipeline."""
    clock_class = VirtualClock
    pipeline_class = ModelledPipeline

    def __init__(self, config: EngineConfig):
        self.modules_before = len(sys.modules)
        name = parse_device(config.device)
        self.platform = get_platform("cpu")   # the host: sampling params, generators live here
        if name == "cpu":
            dtype = cpu_dtype(config)
            profile = cached_cpu_profile(config, dtype, self.platform)
            if profile is None:
                raise ValueError("device: model:cpu is fitted to a short run of the real CPU "
                                 "engine on this machine, and none is cached for this model; "
                                 "Engine(device='model:cpu') runs it first "
                                 "(workbench.engine.calibrate.calibrate_cpu)")
        else:
            profile = spec_profile(name)
            dtype = profile.dtype if config.dtype == "auto" else config.dtype
        if config.block_size is None:
            config = replace(config, block_size=profile.default_block_size)
        self.config, self.profile, self.dtype = config, profile, getattr(torch, dtype)
        ckpt = load_checkpoint(config.model, None)
        self.hf_config, self.tokenizer, self.model_path = ckpt.hf_config, ckpt.tokenizer, ckpt.path
        del ckpt
        self.max_model_len = model_max_len(config, self.hf_config)
        with torch.device("meta"):           # the shape alone: no weights are made
            self.model = LlamaForCausalLM(self.hf_config, self.max_model_len).to(self.dtype)
        self.weights = weight_bytes(self.model)
        self.memory = (None if profile.memory_bytes is None        # in use: the weights
                       else (profile.memory_bytes - self.weights, profile.memory_bytes))
        self.memory_label = f"the modelled {profile.device_name}"
        self.runs_async = profile.runs_async
        err, med = profile.error.get("max_abs_pct"), profile.error.get("median_abs_pct")
        self.notices = [f"modelled device: {profile.device_name}, "
                        + (f"calibrated (measured error: median {med or 0:.0f} %, worst "
                           f"{err:.0f} %; docs/modelled.md)" if profile.calibrated and err is not None
                           else "calibrated (error not measured yet)" if profile.calibrated
                           else "UNCALIBRATED (spec-sheet roofs; no measured error)")
                        + ": every time is modelled, every token random"]
        spec = config.speculative()
        if spec is not None:
            a = spec.acceptance
            k = spec.num_speculative_tokens
            self.notices.append(
                f"speculative decoding on a modelled device: drafts are random tokens, "
                f"accepted at the rate measured on the workload, {a.rate:.3f} "
                f"({a.num_accepted_tokens}/{a.num_draft_tokens} drafted tokens), made for "
                + (f"{a.draft_share:.3f} of the requests asked (measured, {a.num_drafted}/"
                   f"{a.num_asked})" if a.draft_share is not None else
                   "every request asked (how often the proposer found a draft was not measured)")
                + ", " + (f"{min(a.mean_draft_length, k):.2f} tokens long on average (measured)"
                          if a.mean_draft_length is not None else
                          f"{k} tokens long (their length was not measured)")
                + f"; measured by {a.source}")

    def make_runner(self, num_blocks: int, max_model_len: int) -> ModelledRunner:
        per_block = kv_bytes_per_block(self.model, self.config.block_size, self.dtype)
        spec = self.config.speculative()
        return ModelledRunner(self.profile, self.hf_config.vocab_size,
                              eos_ids(self.hf_config, self.tokenizer, self.model_path),
                              num_blocks * per_block, self.model.num_layers, self.config.seed,
                              acceptance_rate=spec.acceptance.rate if spec else None)

    def make_proposer(self, spec, runner: ModelledRunner, max_model_len: int) -> ModelledProposer:
        """Random drafts as often and as long as the real run's (modelled/speculative.py);
        the runner draws how many the target accepts, at the rate measured on the workload
        (spec.acceptance)."""
        a = spec.acceptance
        return ModelledProposer(spec.num_speculative_tokens, runner.tokens, runner.rng,
                                a.draft_share, a.mean_draft_length)

    def peak_memory_bytes(self, runner: ModelledRunner) -> int:
        return self.weights + runner.kv_cache_bytes

    def info_fields(self) -> dict:
        dtype = str(self.dtype).replace("torch.", "")
        return dict(device=self.config.device, device_name=f"{self.profile.device_name} (modelled)",
                    dtype=dtype, attention="modelled", ops="modelled", quantization=None,
                    weight_formats=(dtype,), modelled=self.profile.summary())

    def built(self, runner: ModelledRunner, info, run_ahead: bool) -> None:
        runner.async_scheduling = run_ahead
        runner.info = info
