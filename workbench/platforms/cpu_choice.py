"""What `quantization='auto'` stores the weights as on this CPU, decided by measuring.

A format's worth at batch 1 is its GEMV's time: the step reads every weight once. Which
format wins is a property of the CPU and of the kernels built for it (AVX-512 BF16 streams
bf16 at half fp32's bytes; without it bf16 is widened to fp32 in registers; a build without
AVX-512 has other kernels again), not of the CPU's name. So once per kernel build the
candidates' batch-1 GEMVs are timed on two matrices of a small model's shapes (a second in
all, in rounds; on one thread and on the engine's threads, see `measured`), the figures kept
beside the kernel (`choice.json` in its folder, so a new build measures again and every
process of this build reads the same figures), and 'auto' takes the fastest;
`engine.info().quantization_choice` says which and by what figure.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from typing import Callable

import torch

SHAPES = ((3072, 576), (576, 1536))
"""[N, K] of the matrices timed: SmolLM2's gate_up and down projections (most of a layer's
bytes)."""
FORMATS = ("fp32", "q4_1", "q8_0", "int8", "bf16", "bf16c")
"""The weight formats timed (gguf's layers are q4_1, its embedding and LM head q8_0)."""
CANDIDATES = {torch.float32: {"gguf": "q4_1", None: "fp32"},
              torch.bfloat16: {"bf16c": "bf16c", None: "bf16"}}
"""quantization 'auto' may pick, per dtype -> the format whose figure decides it."""
FILE = "choice.json"


COPIES = 4
"""Each format's weights are timed in this many copies, used in turn: every round of the six
formats then reads about 4 x 27 MB before it comes back to the same bytes, more than a
2-core VM's last-level cache (a Zen 5's 32 MB held one copy of all six, and its GEMVs ran at
cache speed: fp32 ranked ahead of q4_1 there while a model, which streams from memory,
decoded at 0.63x fp32's time in q4_1)."""


def _runners(k, shape: tuple[int, int]) -> dict[str, Callable[[], object]]:
    """One batch-1 GEMV a format, as CpuOps runs it, on random weights of `shape`: each call
    on the next of COPIES copies (so that each reads its weights from memory, as a decode
    step does)."""
    from .cpu_ops import CpuOps
    from .quant import PackedWeight, bf16c_pack, quantize_int8
    n, kk = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, kk, generator=g)
    xb = x.bfloat16()
    ops = CpuOps()
    weights: dict[str, list] = {f: [] for f in FORMATS}
    for _ in range(COPIES):
        w = torch.randn(n, kk, generator=g) * 0.02
        wb = w.bfloat16()
        weights["fp32"].append(w)
        weights["q4_1"].append(_gguf(w, "q4_1"))
        weights["q8_0"].append(_gguf(w, "q8_0"))
        weights["int8"].append(quantize_int8(w))
        weights["bf16"].append(wb)
        c = bf16c_pack(wb)
        if c is not None:
            weights["bf16c"].append(c)
    assert all(isinstance(v, PackedWeight) for f in ("q4_1", "q8_0", "int8") for v in weights[f])

    def runner(fmt: str) -> Callable[[], object]:
        ws, xs = itertools.cycle(weights[fmt]), xb if fmt in ("bf16", "bf16c") else x
        return lambda: ops.linear(xs, next(ws))
    return {f: runner(f) for f in FORMATS if weights[f]}

def _gguf(w: torch.Tensor, fmt: str):
    """w in ggml's q4_1 or q8_0 blocks (quantized in torch: the timing needs the layout, not
    ggml's rounding)."""
    from .quant import PackedWeight
    n, k = w.shape
    b = w.view(n, k // 32, 32)
    if fmt == "q8_0":
        d = b.abs().amax(-1, keepdim=True) / 127
        q = torch.round(b / d.clamp_min(1e-12)).clamp(-127, 127).to(torch.int8)
        data = torch.cat((d.half().view(torch.uint8).view(n, k // 32, 2), q.view(torch.uint8)), -1)
    else:
        lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.round((b - lo) / d.clamp_min(1e-12)).clamp(0, 15).to(torch.uint8)
        nib = q[..., :16] | (q[..., 16:] << 4)
        data = torch.cat((d.half().view(torch.uint8).view(n, k // 32, 2),
                          lo.half().view(torch.uint8).view(n, k // 32, 2), nib), -1)
    return PackedWeight(data.reshape(n, -1).contiguous(), fmt, (n, k))


def measure(runners: dict[str, list[Callable[[], object]]],
            timer: Callable[[], float] = time.perf_counter, reps: int = 15) -> dict[str, float]:
    """Format -> µs of its calls (one a shape): one warm-up round, then `reps` rounds, each
    format once a round (so the machine's drift hits all alike), the best of each."""
    best = dict.fromkeys(runners, float("inf"))
    for i in range(reps + 1):
        for fmt, calls in runners.items():
            t0 = timer()
            for call in calls:
                call()
            if i:
                best[fmt] = min(best[fmt], timer() - t0)
    return {fmt: round(t * 1e6, 1) for fmt, t in best.items()}


def measured(folder, k=None, timer: Callable[[], float] = time.perf_counter,
             runners: dict[str, list[Callable[[], object]]] | None = None) -> dict[str, float]:
    """The figures of this build (`folder`: the kernel's): read, or measured once and kept.

    Timed on one thread first, then on the engine's threads, and the threaded figures are
    the ones kept where the threads ran in parallel (fp32's GEMV at least 10 % faster on
    them): the engine decodes on all its threads, and there a format bound by memory (fp32,
    whose threads share the bandwidth) and one bound by arithmetic (q4_1 on an AVX2 build,
    which the threads divide) rank otherwise than on one (on an AVX2 build, fp32 271 µs
    against q4_1's 322 on one thread, and a q4_1 step 0.66x fp32's on two). On a machine
    whose other work holds the cores the threaded figures are wake-ups, not GEMVs (fp32
    57 695 µs on two threads in one such measurement): the one-thread figures rank the
    formats as the threads would, and are kept."""
    path = folder / FILE
    try:
        return json.loads(path.read_text())["us"]
    except (OSError, ValueError, KeyError):
        pass
    if runners is None:
        per_shape = [_runners(k, s) for s in SHAPES]
        runners = {f: [r[f] for r in per_shape] for f in FORMATS if f in per_shape[0]}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            figures, used = measure(runners, timer), 1
            if threads > 1:
                torch.set_num_threads(threads)
                many = measure(runners, timer)
                if many["fp32"] < 0.9 * figures["fp32"]:
                    figures, used = many, threads
    finally:
        torch.set_num_threads(threads)
    tmp = path.with_name(f"{FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"us": figures, "shapes": SHAPES, "threads": used}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return figures


def threads_of(folder) -> int:
    """The threads the kept figures of this build were measured on (1 where none are kept)."""
    try:
        return int(json.loads((folder / FILE).read_text()).get("threads", 1))
    except (OSError, ValueError, AttributeError):
        return 1


def pick(figures: dict[str, float], dtype: torch.dtype,
         own: str | None, threads: int = 1) -> tuple[str | None, str]:
    """The fastest candidate of `dtype` (the checkpoint's own format, or the plain weights;
    bf16c for a bf16 model) and the sentence that says why."""
    cands = {q: f for q, f in CANDIDATES.get(dtype, {None: "fp32"}).items()
             if (q is None or q == own or q == "bf16c") and f in figures}
    best = min(cands, key=lambda q: figures[cands[q]])
    shown = ", ".join(f"{cands[q]} {figures[cands[q]]:.0f} µs" for q in cands)
    name = best or str(dtype).removeprefix("torch.")
    return best, (f"quantization 'auto': {name}, the fastest here by a batch-1 GEMV measured "
                  f"once for this kernel build ({shown}; {'+'.join(f'{n}x{k}' for n, k in SHAPES)}, "
                  f"{'one thread' if threads == 1 else f'{threads} threads'})")


MEASURED_AS = {"gguf": "q4_1", "int8": "int8", "bf16c": "bf16c"}
"""quantization -> the format whose figure it is judged by."""


def cost(figures: dict[str, float], asked: str | None, dtype: torch.dtype) -> str | None:
    """For a format (or dtype) chosen by name: a sentence saying what it costs at batch 1
    against the plain weights where it measured slower here, else None."""
    if asked is None:               # the plain weights: bf16's against fp32's
        fmt, plain = ("bf16", "fp32") if dtype == torch.bfloat16 else (None, None)
    else:
        fmt, plain = MEASURED_AS.get(asked), "bf16" if asked == "bf16c" else "fp32"
    if fmt not in figures or plain not in figures or figures[fmt] <= figures[plain]:
        return None
    what = f"quantization={asked!r}" if asked is not None else "dtype='bfloat16'"
    return (f"{what} is slower than {plain} on this CPU: its batch-1 GEMV measured "
            f"{figures[fmt]:.0f} µs against {plain}'s {figures[plain]:.0f} µs "
            f"({figures[fmt] / figures[plain]:.1f}x); 'auto' would not pick it")


# --- a few rows: the kernel's small_m_linear or torch's batched linear -----------------------

SMALL_M = (2, 4, 8, 16)
"""The row counts timed for small_m_linear against torch's linear (16: the kernel's most)."""
PACKED_M = (32, 64, 128, 256, 512, 1024, 2048)
"""The row counts timed for packed (q4_1) weights: the kernel's qlinear on the packed rows
(decoded in L1 for every x row) against it on dequantized slices with torch's GEMM: batches
of decodes, and prefill chunks up to the default step budget. Up to 16 rows the packed rows
always run (the verify and small-batch kernels); 2048 is the most they are allowed."""
ONEDNN_M = (32, 128)
"""The row counts (besides SMALL_M) timed for fp32's batched linear: oneDNN on weights packed
once into its layout against torch's F.linear (MKL's sgemm on x86 builds): a batch of decodes,
a verify step of a batch, a prefill chunk."""
SMALL_M_FILE = "small_m.json"


def small_m_rows(folder, k, timer: Callable[[], float] = time.perf_counter,
                 reps: int = 5) -> dict[str, int]:
    """dtype name -> the most rows for which the kernel's small_m_linear (a verify step's
    k + 1 tokens, a small batch: each weight row read once for all rows) was faster than
    the batched linear at every count of SMALL_M up to it (0: at none); 'onednn' -> 1 where
    fp32's batched linear is oneDNN on prepacked weights, which was faster than torch's F.linear
    at every count of ONEDNN_M (0: F.linear; MKL's sgemm ran at a third of
    oneDNN's speed on a Zen 5, 80 against 26 ms for SmolLM2's linears at 32 rows), and 'packed' ->
    the most rows (16, or a count of PACKED_M) for which qlinear on q4_1's packed rows was
    faster than on dequantized slices (multiplied by fp32's batched choice: oneDNN or torch's
    GEMM) at every count of PACKED_M up to it (16 where the
    build has no such choice); on SHAPES, one thread, in
    interleaved rounds; measured once per kernel build and kept beside it as `choice.json`
    is. Which wins is the CPU's (oneDNN with AMX against an AVX2 loop), not a constant."""
    path = folder / SMALL_M_FILE
    try:
        rows = json.loads(path.read_text())["rows"]
        if "onednn" in rows:           # (kept before fp32's batched choice was: measure it)
            return rows
    except (OSError, ValueError, KeyError):
        pass
    from .cpu_onednn import onednn_linear, onednn_packed
    from .cpu_ops import CpuOps
    ops = CpuOps()
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, kk, generator=g) * 0.02 for n, kk in SHAPES]
    runners: dict[str, list[Callable[[], object]]] = {}
    packed_f32 = onednn_packed(ws)
    try:                            # a torch whose oneDNN packs but cannot multiply: F.linear
        if packed_f32:
            onednn_linear(torch.zeros(2, ws[0].shape[1]), packed_f32[0], None)
    except (RuntimeError, NotImplementedError):
        packed_f32 = None
    for dt in (torch.float32, torch.bfloat16):
        name = str(dt).removeprefix("torch.")
        for m in SMALL_M + (ONEDNN_M if dt == torch.float32 else ()):
            xs = [torch.randn(m, w.shape[1], generator=g).to(dt) for w in ws]
            wd = [w.to(dt) for w in ws]
            if m in SMALL_M:
                runners[f"{name} {m} small_m"] = [
                    (lambda x=x, w=w: k.small_m_linear(x, w, None)) for x, w in zip(xs, wd)]
            # fp32: F.linear itself (the batched choice is made here); bf16: the batched path
            batched = torch.nn.functional.linear if dt == torch.float32 else ops.batched_linear
            runners[f"{name} {m} torch"] = [
                (lambda x=x, w=w, f=batched: f(x, w)) for x, w in zip(xs, wd)]
            if dt == torch.float32 and packed_f32:
                runners[f"{name} {m} onednn"] = [
                    (lambda x=x, p=p: onednn_linear(x, p, None)) for x, p in zip(xs, packed_f32)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    packed = k.set_packed_rows(0)                # 0: a build without the choice
    slices = k.set_onednn_slices(False) if hasattr(k, "set_onednn_slices") else None
    try:
        with torch.inference_mode():
            us = measure(runners, timer, reps)
            rows = {"onednn": int(bool(packed_f32) and all(
                us[f"float32 {m} onednn"] < us[f"float32 {m} torch"] for m in ONEDNN_M))}
            if packed:
                # the slices as they will run: their fp32 GEMM is fp32's batched choice
                if slices is not None:
                    k.set_onednn_slices(bool(rows["onednn"]))
                q4 = [_gguf(w, "q4_1") for w in ws]
                runners = {}
                for m in PACKED_M:
                    xs = [torch.randn(m, w.shape[1], generator=g) for w in ws]
                    for arm, most in (("packed", PACKED_M[-1]), ("slices", 1)):
                        runners[f"q4_1 {m} {arm}"] = [
                            (lambda x=x, w=w, most=most: (k.set_packed_rows(most),
                                                          k.qlinear(x, w.data, w.code)))
                            for x, w in zip(xs, q4)]
                us.update(measure(runners, timer, reps))
    finally:
        torch.set_num_threads(threads)
        if packed:
            k.set_packed_rows(packed)
        if slices is not None:
            k.set_onednn_slices(slices)
    for dt in ("float32", "bfloat16"):
        rows[dt] = 0
        batched = "onednn" if dt == "float32" and rows["onednn"] else "torch"
        for m in SMALL_M:
            if us[f"{dt} {m} small_m"] >= us[f"{dt} {m} {batched}"]:
                break
            rows[dt] = m
    rows["packed"] = 16
    for m in PACKED_M if packed else ():
        if us[f"q4_1 {m} packed"] >= us[f"q4_1 {m} slices"]:
            break
        rows["packed"] = m
    tmp = path.with_name(f"{SMALL_M_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"rows": rows, "us": us, "shapes": SHAPES, "threads": 1},
                                  indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return rows
