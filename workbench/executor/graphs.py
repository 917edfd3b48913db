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
