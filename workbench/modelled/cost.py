"""One step's modelled time.

The step's work is counted by `roofline.step_cost` (FLOPs, weight bytes, KV bytes) and each
part is timed at the device's roofs: its matmul FLOPs at the peak (`matmul`), the weights at
the bandwidth (`weights`), attention's FLOPs at the peak (`attention_flops`) and the KV it
reads at the bandwidth (`kv`).

On a GPU or NPU the two roofs bound each part, as the roofline says (the slower of its
arithmetic and its bytes):

    linear  = max(matmul, weights)                                the layers and LM head
    attn    = max(attention_flops, kv)
    compute = matmul_scale * linear
              + max(attention_scale * attn, attention_per_context_token * longest context)

On the CPU the terms add, each with its own scale, and the rows cost by their count's log:

    compute = weight_scale * weights + matmul_scale * matmul
              + attention_scale * attention_flops + rows_log2 * log2(tokens)

The same two cores stream the weights and do the arithmetic, and the probed roofs are off
the real kernels' by different factors for each: a fit of the max() form to the real CPU
engine's steps was 20-30 % too fast on prompts, whose FLOPs dominate, where it matched
batch-1 decode, whose weight bytes do. And a GEMM's rows get cheaper as they grow: measured
on two Sapphire Rapids cores (fp32, SmolLM2-135M), decode at 1, 2, 4, 8 and 16 rows took
30, 42, 69, 97 and 122 ms, about a fixed time per doubling over the FLOPs' linear part,
while a 256-token prompt's rows cost 2 ms each. The KV bytes' own term (kv), a per-request
and a per-prefill-step cost were fitted too and came out 0 or noise, so the CPU's form has
four coefficients.

    host    = host_step + host_per_request * requests + host_per_token * tokens

On a device that runs behind the host (a GPU, an NPU), the host issues an eager step's
launches while the device computes, so the step's device time is the longer of the two:
max(launches, launch_graph + compute), where launch_graph is what even a replayed graph of
the step costs the device (its kernels' own latencies); a replayed graph takes
launch_graph + compute. On the CPU the host computes each op as it launches it: launches +
compute.

launches: eager, `launch_eager_per_layer` per decoder layer; a replayed whole-step graph,
`launch_graph`; a piecewise replay, one graph launch plus attention's eager launches (a
fifth of a layer's, a guess: attention is one of about five launches of a layer); a step
that runs a prompt adds `launch_prefill_per_layer` per layer (its attention's path), as
does a verify (speculative decoding: the real runner feeds its 1 + drafts positions as a
chunk on cached context, through the same attention path, never a captured decode graph).

A step takes device + host, except a replayed decode graph with async scheduling on: the
host prepares the next step while the device runs this one, so it takes the longer of the
two (as the real engine's pipeline overlaps them). On the CPU every part adds, so a step's
time is linear in the coefficients (fit.py fits them by non-negative least squares).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from ..roofline import step_cost
from ..telemetry import FULL, PIECEWISE
from .profiles import Coefficients, DeviceProfile

PIECEWISE_EAGER_SHARE = 0.2
"""The share of a layer's eager launches left in a piecewise replay (attention)."""


@dataclass(slots=True, frozen=True)
class StepTime:
    seconds: float
    device: float
    host: float
    linear: float
    """The linear layers' roofline bound, seconds (before any scale)."""
    attention: float
    """Attention's roofline bound, seconds (before any scale)."""
    launch: float


@dataclass(slots=True, frozen=True)
class StepFeatures:
    """What a step's time depends on, on given roofs (the coefficients aside); times in
    seconds at the roofs."""
    matmul: float
    """The matmuls' FLOPs at the peak (layers and LM head)."""
    weights: float
    """The weights' bytes at the bandwidth (0 for a step that feeds no token)."""
    attention_flops: float
    """Attention's FLOPs at the peak."""
    kv: float
    """The K and V attention reads, at the bandwidth."""
    requests: int
    tokens: int
    max_context: int
    """The longest context (cached + new tokens) among the step's requests."""
    prefill: bool
    """Whether a prompt (or a chunk of one) or a verify runs in the step (the prefill
    path's attention)."""

    @property
    def linear(self) -> float:
        """The linear layers' roofline bound."""
        return max(self.matmul, self.weights)

    @property
    def attention(self) -> float:
        """Attention's roofline bound."""
        return max(self.attention_flops, self.kv)


def step_features(tokens_per_request: dict[str, int], context_lens: dict[str, int],
                  kinds: dict[str, str], info, peak_flops: float, bandwidth: float,
                  drafts: dict[str, list[int]] | None = None) -> StepFeatures:
    """What one step's time depends on, on these roofs. drafts: a verify's (speculative
    decoding): each of its 1 + drafts positions is sampled (the LM head's rows), and it
    runs the prefill path's attention, as a chunk on cached context does."""
    drafts = drafts or {}
    ev = SimpleNamespace(tokens_per_request=tokens_per_request, context_lens=context_lens,
                         kinds=kinds, drafts=drafts)
    c = step_cost(ev, info)
    tokens = sum(tokens_per_request.values())
    sampled = sum(1 + len(drafts.get(r, ())) for r, k in kinds.items() if k != "chunk")
    mm_flops = 2 * tokens * info.num_layer_params + 2 * sampled * info.hidden_size * info.vocab_size
    longest = max((context_lens.get(r, 0) + q for r, q in tokens_per_request.items()), default=0)
    prefill = any(k != "decode" for k in kinds.values())
    return StepFeatures(mm_flops / peak_flops, c.weight_bytes / bandwidth if tokens else 0.0,
                        (c.flops - mm_flops) / peak_flops, c.kv_bytes / bandwidth,
                        len(tokens_per_request), tokens, longest, prefill)


def combine(k: Coefficients, f: StepFeatures, graph_kind: str | None, num_layers: int,
            async_scheduling: bool, behind_host: bool = True) -> StepTime:
    """The step's time from its features and the coefficients (the formulas above);
    behind_host: the device runs behind the host's launches (a GPU or NPU: the roofline's
    max() form), else the CPU's (every term adds)."""
    if graph_kind == FULL:
        launch = k.launch_graph
    elif graph_kind == PIECEWISE:
        launch = k.launch_graph + PIECEWISE_EAGER_SHARE * k.launch_eager_per_layer * num_layers
    else:
        launch = k.launch_eager_per_layer * num_layers
    if f.prefill:
        launch += k.launch_prefill_per_layer * num_layers
    if behind_host:
        compute = (k.matmul_scale * f.linear
                   + max(k.attention_scale * f.attention,
                         k.attention_per_context_token * f.max_context))
    else:
        compute = (k.weight_scale * f.weights + k.matmul_scale * f.matmul
                   + k.attention_scale * f.attention_flops
                   + k.rows_log2 * math.log2(max(f.tokens, 1)))
    if not behind_host:
        device = launch + compute
    elif graph_kind == FULL:
        device = launch + compute
    else:
        device = max(launch, k.launch_graph + compute)
    host = k.host_step + k.host_per_request * f.requests + k.host_per_token * f.tokens
    total = max(device, host) if (async_scheduling and graph_kind == FULL) else device + host
    return StepTime(total, device, host, f.linear, f.attention, launch)


def step_time(profile: DeviceProfile, info, tokens_per_request: dict[str, int],
              context_lens: dict[str, int], kinds: dict[str, str], graph_kind: str | None,
              async_scheduling: bool, drafts: dict[str, list[int]] | None = None) -> StepTime:
    """One step's modelled time on `profile` for the engine `info` describes (drafts: each
    verify's drafted tokens, speculative decoding)."""
    f = step_features(tokens_per_request, context_lens, kinds, info, profile.peak_flops,
                      profile.bandwidth, drafts)
    return combine(profile.coefficients, f, graph_kind, info.num_layers, async_scheduling,
                   profile.runs_async)
