"""One step's modelled time.

The step's work is counted by `roofline.step_cost` (FLOPs, weight bytes, KV bytes) and split in
two parts, each held to the device's roofline (the slower of its arithmetic at the peak and
its bytes at the bandwidth):

    linear  = max(matmul FLOPs / peak, weight bytes / bandwidth)      the layers and LM head
    attn    = max(attention FLOPs / peak, KV bytes / bandwidth)       what attention reads
    compute = matmul_scale * linear
              + max(attention_scale * attn, attention_per_context_token * longest context)
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
that runs a prompt adds `launch_prefill_per_layer` per layer (its attention's path).

A step takes device + host, except a replayed decode graph with async scheduling on: the
host prepares the next step while the device runs this one, so it takes the longer of the
two (as the real engine's pipeline overlaps them).
"""
from __future__ import annotations

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
    """The linear layers' roofline bound, seconds (before matmul_scale)."""
    attention: float
    """Attention's roofline bound, seconds (before attention_scale)."""
    launch: float


@dataclass(slots=True, frozen=True)
class StepFeatures:
    """What a step's time depends on, on given roofs (the coefficients aside)."""
    linear: float
    attention: float
    requests: int
    tokens: int
    max_context: int
    """The longest context (cached + new tokens) among the step's requests."""
    prefill: bool
    """Whether a prompt (or a chunk of one) runs in the step."""


def step_features(tokens_per_request: dict[str, int], context_lens: dict[str, int],
                  kinds: dict[str, str], info, peak_flops: float, bandwidth: float
                  ) -> StepFeatures:
    """What one step's time depends on, on these roofs."""
    ev = SimpleNamespace(tokens_per_request=tokens_per_request, context_lens=context_lens,
                         kinds=kinds)
    c = step_cost(ev, info)
    tokens = sum(tokens_per_request.values())
    sampled = sum(1 for k in kinds.values() if k != "chunk")
    mm_flops = 2 * tokens * info.num_layer_params + 2 * sampled * info.hidden_size * info.vocab_size
    attn_flops = c.flops - mm_flops
    linear = max(mm_flops / peak_flops, c.weight_bytes / bandwidth) if tokens else 0.0
    attention = max(attn_flops / peak_flops, c.kv_bytes / bandwidth)
    longest = max((context_lens.get(r, 0) + q for r, q in tokens_per_request.items()), default=0)
    prefill = any(k != "decode" for k in kinds.values())
    return StepFeatures(linear, attention, len(tokens_per_request), tokens, longest, prefill)


def combine(k: Coefficients, f: StepFeatures, graph_kind: str | None, num_layers: int,
            async_scheduling: bool, behind_host: bool = True) -> StepTime:
    """The step's time from its features and the coefficients (the formula above);
    behind_host: the device runs behind the host's launches (not the CPU)."""
    if graph_kind == FULL:
        launch = k.launch_graph
    elif graph_kind == PIECEWISE:
        launch = k.launch_graph + PIECEWISE_EAGER_SHARE * k.launch_eager_per_layer * num_layers
    else:
        launch = k.launch_eager_per_layer * num_layers
    if f.prefill:
        launch += k.launch_prefill_per_layer * num_layers
    compute = (k.matmul_scale * f.linear
               + max(k.attention_scale * f.attention, k.attention_per_context_token * f.max_context))
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
              async_scheduling: bool) -> StepTime:
    """One step's modelled time on `profile` for the engine `info` describes."""
    f = step_features(tokens_per_request, context_lens, kinds, info, profile.peak_flops,
                      profile.bandwidth)
    return combine(profile.coefficients, f, graph_kind, info.num_layers, async_scheduling,
                   profile.runs_async)
