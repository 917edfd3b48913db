"""The model runner of a modelled device: no weights, no KV pool, no forward pass. Each step
it decides how the real runner would have run it (a replayed decode graph, a piecewise
replay, eager: the same rules as executor/runner.py), times it with the cost model, and
picks each sampling request's token at random (never an EOS id: a modelled request runs
to its max_tokens, its stop tokens or stop strings, as a benchmark's ignore_eos request
does). A verify (speculative decoding: a decode with drafts) is timed as the real runner
runs it, a chunk of 1 + drafts positions on cached context, each of them sampled (so its
matmuls and LM head grow with the drafts, its weight reads do not), and its accepted drafts
are drawn from the measured acceptance rate (speculative.py)."""
from __future__ import annotations

import numpy as np

from ..core.scheduler import SchedulerOutput
from ..executor.graphs import GraphPlan, padded_size, plan_graphs
from ..executor.runner import ModelRunnerOutput
from ..telemetry import FULL, PIECEWISE
from .cost import StepTime, step_time
from .profiles import DeviceProfile
from .speculative import draw_accepted


class ModelledRunner:
    def __init__(self, profile: DeviceProfile, vocab_size: int, eos_token_ids: set[int],
                 kv_cache_bytes: int, num_layers: int, seed: int = 0,
                 acceptance_rate: float | None = None):
        self.profile = profile
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.kv_cache_bytes = kv_cache_bytes
        """What the modelled pool would take on the device (nothing is allocated)."""
        self.graphs = None
        """The decode batch sizes 'captured' (as the real runner's DecodeGraphs), or None."""
        self.piecewise = None
        """The token buckets 'captured' piecewise, or None."""
        self.info = None
        """The EngineInfo the cost model reads the model's shape from (set once built)."""
        self.async_scheduling = False
        self.acceptance_rate = acceptance_rate
        """Speculative decoding: the measured share of drafts accepted (None: off)."""
        self.rng = np.random.default_rng(seed)
        """Every draw of the modelled device (tokens, drafts, acceptances), seeded by
        EngineConfig.seed."""
        self._eos = np.array(sorted(t for t in eos_token_ids if 0 <= t < vocab_size),
                             dtype=np.int64)

    @property
    def eos(self) -> list[int]:
        """The EOS ids it never draws."""
        return self._eos.tolist()

    def capture_graphs(self, config, max_model_len: int) -> GraphPlan:
        """ModelRunner.capture_graphs' plan on the modelled device (graphs.plan_graphs, with
        its kind's platform rules), capturing nothing."""
        plan = plan_graphs(config, self.profile, True, self.num_layers)
        self.graphs = plan.decode_sizes or None
        self.piecewise = plan.piecewise_sizes or None
        return plan

    def graph_for(self, sched: SchedulerOutput) -> tuple[str, int] | None:
        """How the real runner would run this step: (FULL, batch size) for a pure decode
        batch a captured size holds, (PIECEWISE, token bucket) where a bucket holds its
        tokens, else None (eager)."""
        if self.graphs and sched.scheduled and all(s.is_decode and not s.spec_token_ids
                                                   for s in sched.scheduled):
            size = padded_size(len(sched.scheduled), self.graphs)
            if size is not None:
                return FULL, size
        if self.piecewise:
            size = padded_size(sum(s.num_new_tokens for s in sched.scheduled), self.piecewise)
            if size is not None:
                return PIECEWISE, size
        return None

    def time(self, sched: SchedulerOutput, graph: tuple[str, int] | None) -> StepTime:
        tokens = {s.req_id: s.num_new_tokens for s in sched.scheduled}
        context = {s.req_id: s.start for s in sched.scheduled}
        kinds = {s.req_id: "verify" if s.spec_token_ids else "decode" if s.is_decode
                 else "prefill" if s.will_sample else "chunk" for s in sched.scheduled}
        drafts = {s.req_id: s.spec_token_ids for s in sched.scheduled if s.spec_token_ids}
        return step_time(self.profile, self.info, tokens, context, kinds,
                         graph[0] if graph else None, self.async_scheduling, drafts)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One modelled step, as the real runner's result: the requests that sample (plain
        decodes first, then prompts that reach their end and verifies, as the real runner
        orders its logits rows), how graphs ran it, a random token id for each (the
        target's own token: a verify's comes after its accepted drafts), each verify's
        accepted drafts, drawn, and its modelled time."""
        plain = [s for s in sched.scheduled if s.is_decode and not s.spec_token_ids]
        rest = [s for s in sched.scheduled
                if (not s.is_decode or s.spec_token_ids) and s.will_sample]
        graph = self.graph_for(sched)
        num_rows = num_accepted = None
        if any(s.spec_token_ids for s in rest):
            num_rows = [1 + len(s.spec_token_ids) for s in plain + rest]
            num_accepted = [draw_accepted(self.rng, self.acceptance_rate, len(s.spec_token_ids))
                            if s.spec_token_ids else 0 for s in plain + rest]
        sampling = [s.req_id for s in plain + rest]
        return ModelRunnerOutput(sampling, graph, sampled_token_ids=self.tokens(len(sampling)),
                                 seconds=self.time(sched, graph).seconds, num_rows=num_rows,
                                 num_accepted=num_accepted)

    def tokens(self, n: int) -> list[int]:
        """n random token ids, none of them an EOS id."""
        eos = self._eos
        ids = self.rng.integers(0, self.vocab_size - len(eos), size=n)
        if len(eos):                       # shift past each EOS id at or below it
            for e in eos:
                ids = ids + (ids >= e)
        return ids.tolist()

    def release(self) -> None:
        self.graphs = self.piecewise = None
