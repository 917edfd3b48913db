"""Device launches per batch-1 decode step on the CUDA path, counted on the CPU.

Batch-1 decode on a GPU is paced by its launches as much as by its bytes (issue 10: 326
kernels per Qwen3-0.6B step on the H200), so this counts them where no GPU is: a Qwen3- or
Llama-shaped engine in fp16 runs CUDA's kernels (Triton attention, fused ops, the batch-1
GEMV) under Triton's interpreter on CPU tensors (tests/triton_on_cpu.py), and one eager
decode step is watched. Every Triton launch counts one; every torch op that would run a
device kernel counts one (views, allocations and other metadata ops count none; a cuBLAS
GEMM counts one, though for M = 1 cuBLAS may add a split-K reduction kernel).

Four setups, the same model and prompt: `before` (cuBLAS for every linear layer, the KV write
a launch of its own, one decode-attention program per (request, KV head): as before issue
10's batch-1 work), `gemv` (the Triton GEMV with the norms and SiLU-and-mul fused into it,
for every weight shape), `gemv+kv` (also the decode kernel writing its tokens' K/V) and
`gemv+kv+split` (also split-context decode attention, as CUDA picks it at batch 1 on an
H200: what runs now).

    TRITON_INTERPRET=1 python benchmarks/launches.py [--model random:tiny-qwen3]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from torch.utils._python_dispatch import TorchDispatchMode    # noqa: E402

NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "slice", "select", "split", "split_with_sizes",
    "unsqueeze", "squeeze", "expand", "t", "transpose", "permute", "as_strided", "detach",
    "alias", "empty", "empty_like", "empty_strided", "new_empty", "unbind", "chunk",
    "narrow", "lift_fresh", "_reshape_alias", "is_same_size", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_contiguous", "resolve_conj", "resolve_neg",
}


class Launches(TorchDispatchMode):
    """Counts what would launch on a device: torch ops that compute or copy, and Triton
    kernels (the torch ops the interpreter runs for a kernel are not counted)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.in_triton = 0
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_triton and name.rstrip("_") not in NO_KERNEL:
            self.counts[f"torch.{name}"] += 1
        return func(*args, **(kwargs or {}))


def count_decode_step(model: str, gemv: bool, splits: int | None, fused_write: bool) -> dict:
    from triton.runtime.interpreter import InterpretedFunction

    import workbench.platforms.triton_attention as ta
    from triton_on_cpu import triton_on_cpu
    from workbench import Engine, SamplingParams

    with triton_on_cpu(gemv):                         # without: cuBLAS's part, torch's linear
        e = Engine(model=model, device="cpu", dtype="float16", num_kv_blocks=64,
                   graph_mode="eager")
    orig_forward = ta.TritonAttention.forward
    if not fused_write:
        def forward(self, q, k, v, k_cache, v_cache, meta, scale):   # pure decode steps as
            if meta.prefill_plan is not None:                            # before: write first
                return orig_forward(self, q, k, v, k_cache, v_cache, meta, scale)
            ta.write_kv_cache(k_cache, v_cache, k, v, meta.slot_mapping)
            return ta.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                             meta.decode_lens, scale)
        ta.TritonAttention.forward = forward
    orig_splits = ta.decode_splits
    if splits is not None:
        ta.decode_splits = lambda *a: splits
    mode = Launches()
    orig_run = InterpretedFunction.run

    def run(self, *a, **k):
        if mode.active:
            mode.counts[f"triton.{self.fn.__name__}"] += 1
        mode.in_triton += 1
        try:
            return orig_run(self, *a, **k)
        finally:
            mode.in_triton -= 1

    InterpretedFunction.run = run
    try:
        e.add_request(list(range(1, 40)), SamplingParams(max_tokens=8, temperature=0,
                                                         ignore_eos=True))
        e.step()                                                  # the prefill
        e.step()
        with mode:
            e.step()                                              # a batch-1 decode
    finally:
        InterpretedFunction.run = orig_run
        ta.decode_splits = orig_splits
        ta.TritonAttention.forward = orig_forward
    layers = e.info().num_layers
    e.close()
    total = sum(mode.counts.values())
    return dict(total=total, layers=layers, by_op=dict(mode.counts.most_common()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:tiny-qwen3")
    a = ap.parse_args()
    rows = {"before": count_decode_step(a.model, gemv=False, splits=1, fused_write=False),
            "gemv": count_decode_step(a.model, gemv=True, splits=1, fused_write=False),
            "gemv+kv": count_decode_step(a.model, gemv=True, splits=1, fused_write=True),
            "gemv+kv+split": count_decode_step(a.model, gemv=True, splits=None,
                                               fused_write=True)}
    for name, r in rows.items():
        print(json.dumps(dict(setup=name, model=a.model, **r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
