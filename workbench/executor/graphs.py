"""Graph-capture policy, device-independent: which batch sizes to capture, how to pad.

vLLM-Ascend's meanings for `graph_mode`: 'eager' captures nothing; 'decode'
(FULL_DECODE_ONLY) captures decode steps at a list of batch sizes, pads a decode batch up to
the next captured size and replays it, and runs eager above the largest size; 'full' also
captures prefill and mixed steps, piecewise: everything but attention is captured at
bucketed token counts, and attention runs eager between the pieces.

Why piecewise for prefill: a prefill's attention depends on each chunk's length and cached
prefix, which a whole-step graph would bake in; every other op of a layer (norms,
projections, RoPE, MLP) works row by row, so padding the token count up to a bucket changes
nothing for the real rows. This is vLLM's FULL_AND_PIECEWISE. Buckets stop at 512 tokens:
a bigger step is compute-bound, the device runs behind the host's launches anyway, and
padding it would cost more than the launches saved.

Capture itself is a platform's business (CUDAGraph, NPUGraph); a platform without it runs
eager and says so (`Engine.telemetry.notices`, StepEvent.graph stays False).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += range(16, max_num_seqs + 1, 16)
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def padded_size(batch: int, sizes: list[int]) -> int | None:
    """The captured size a decode batch of `batch` replays at (the smallest >= batch), or
    None when it is larger than every captured size and must run eager. The padding slots
    feed a dummy token whose K/V go to a scratch slot no request owns."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


PIECEWISE_SIZES = (16, 32, 64, 128, 192, 256, 384, 512)


def default_piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts to capture piecewise: PIECEWISE_SIZES up to the step's token budget (and
    the budget itself when it is below 512)."""
    sizes = [s for s in PIECEWISE_SIZES if s <= max_num_batched_tokens]
    if max_num_batched_tokens < PIECEWISE_SIZES[-1] and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    return sizes


@dataclass(slots=True)
class GraphPlan:
    """What `graph_mode` comes to on a device: the mode as it will run, the decode batch
    sizes to capture whole, the token buckets to capture piecewise, and notices saying what
    runs differently from what was asked."""
    mode: str
    decode_sizes: list[int] = field(default_factory=list)
    piecewise_sizes: list[int] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)


def plan_graphs(config, rules, can_capture_decode: bool, num_layers: int) -> GraphPlan:
    """The one decision of what to capture, for a real device (ModelRunner.capture_graphs
    captures it) and a modelled one (its runner replays the plan in time only). `rules`: the
    platform's (Platform, or a modelled DeviceProfile following its kind's): name,
    supports_graphs, default_graph_mode, decode_graph_sizes, piecewise_graph_sizes.
    can_capture_decode: the attention reads the pool through static tables (fused paged
    attention), so a whole decode step can be captured."""
    asked = config.graph_mode
    if asked is None:             # the platform's choice (Platform.default_graph_mode)
        asked = rules.default_graph_mode if rules.supports_graphs else "eager"
        if asked == "decode" and not can_capture_decode:
            asked = "eager"
    if asked == "eager":
        return GraphPlan("eager")
    why = None
    if not rules.supports_graphs:
        why = f"graph capture is not available on {rules.name} in this build"
    elif not can_capture_decode and asked == "decode":
        why = ("capture needs the platform's fused paged attention, and this engine "
               "uses the plain-torch path (attention_backend or dtype)")
    if why is not None:
        return GraphPlan("eager", notices=[f"graph_mode={asked!r} asked for, but {why}: every "
                                           "step runs eager (StepEvent.graph stays False)"])
    decode = rules.decode_graph_sizes(config, asked) if can_capture_decode else []
    if decode is None:
        decode = config.cudagraph_capture_sizes or default_capture_sizes(config.max_num_seqs)
    decode = sorted(set(decode))
    piecewise = []
    if asked == "full":
        piecewise = rules.piecewise_graph_sizes(config, num_layers, len(decode))
        if piecewise is None:
            piecewise = default_piecewise_sizes(config.max_num_batched_tokens)
    notices = []
    if asked == "full" and not can_capture_decode:
        notices.append("graph_mode='full': decode steps replay piecewise graphs with attention "
                       "eager; whole decode-step graphs need the platform's fused paged "
                       "attention (attention_backend or dtype)")
    return GraphPlan(asked, decode, list(piecewise), notices)
