"""oneDNN's matmul on weights packed once into its blocked layout, as the CPU's batched
linears run it (CpuOps.batched_linear): packing, the bounded row counts it is called with,
whether this CPU's oneDNN has native bf16, and the memory rule for the packed copies (they
are the weights' bytes once more: kept only where they fit, CpuOps.prepare)."""
from __future__ import annotations

import os

import torch

from . import cpu_kernels
from .quant import PackedWeight

_DTYPES = (torch.float32, torch.bfloat16)


_onednn_bf16: bool | None = None

_ONEDNN_BELOW_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                      "AVX512_CORE_VNNI"}
"""oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) whose cap leaves out its native bf16 dot products
(AVX512_CORE_BF16 and everything above it keep them)."""


def onednn_isa_has_bf16(cap: str | None) -> bool:
    """Whether oneDNN capped at `cap` (None, ALL, DEFAULT: not capped) keeps native bf16."""
    return (cap or "ALL").strip().upper() not in _ONEDNN_BELOW_BF16


ONEDNN_BLOCK = 256
"""oneDNN is called on at most this many rows at a time, each call's rows a count of
`onednn_rows`: torch's oneDNN linear builds (and caches, up to 1024) a primitive for every
row count it sees, and a server sees every count up to its step budget (a soak of mixed
traffic grew by 300 MB that way; in 256-row blocks and 16-row steps a weight has 31 counts)."""


def onednn_rows(m: int) -> int:
    """The rows a oneDNN call runs for m rows (m <= ONEDNN_BLOCK): m itself up to 16 (a verify
    step, a small batch), else m rounded up to a multiple of 16 (the rest zeros, cut off)."""
    return m if m <= 16 else -(-m // 16) * 16


PACK_SHARE = 0.5
"""The most of the memory free with the model loaded that oneDNN's packed copies of its
weights may take (CpuOps.prepare); the rest is the KV pool's (1 GiB by default), the steps'
and the machine's."""


def linear_weights(model) -> list:
    """The weights `model` passes to its ops' linear: every nn.Linear's, and the embedding
    where the LM head is tied to it; each once."""
    ws = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if getattr(model, "tie_word_embeddings", False):
        ws.append(model.embed_tokens.weight)
    return list({id(w): w for w in ws}.values())


def packed_dtype(weight, fp32: bool = True) -> torch.dtype | None:
    """The dtype CpuOps packs `weight` in for its batched linears (prepacked), or None where
    it does not pack it: bf16 and bf16c weights in bf16 where oneDNN has native bf16; fp32
    weights, and bf16 ones widened, in fp32 where oneDNN runs fp32 (`fp32`: the build's
    onednn_fp32; True: the most it may pack, before the kernel has measured)."""
    if isinstance(weight, PackedWeight):
        if weight.format != "bf16c":
            return None
        bf16 = True
    elif weight.dtype in _DTYPES:
        bf16 = weight.dtype == torch.bfloat16
    else:
        return None
    if bf16 and onednn_bf16():
        return torch.bfloat16
    return torch.float32 if fp32 else None


def packed_bytes(weight, fp32: bool = True) -> int:
    """The bytes `prepacked` adds for `weight` (see packed_dtype; 0 where it packs none)."""
    dtype = packed_dtype(weight, fp32)
    return 0 if dtype is None else weight.shape[0] * weight.shape[1] * dtype.itemsize


def available_memory() -> int | None:
    """Bytes this process can still take: the kernel's MemAvailable (psutil's available
    memory off Linux), or less where a cgroup (a container's memory limit) leaves less; None
    where none of them says."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        try:                        # not Linux (macOS): psutil's figure, where it is installed
            import psutil
            free = int(psutil.virtual_memory().available)
        except Exception:           # noqa: BLE001 (no psutil, or it cannot say)
            pass
    for limit_file, usage_file, stat_file in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
             "/sys/fs/cgroup/memory.stat"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
             "/sys/fs/cgroup/memory/memory.usage_in_bytes", "/sys/fs/cgroup/memory/memory.stat")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                used = int(f.read())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:        # 'max', or v1's "no limit"
            break
        try:                                    # page cache the limit would reclaim first
            with open(stat_file) as f:
                stat = dict(line.split()[:2] for line in f if line.strip())
            used -= int(stat.get("inactive_file", stat.get("total_inactive_file", 0)))
        except (OSError, ValueError):
            pass
        room = max(int(limit) - used, 0)
        free = room if free is None else min(free, room)
        break
    return free


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """x [M, K] times a weight packed by `prepacked` (oneDNN's matmul, as torch's mkldnn
    linear runs it), in blocks of ONEDNN_BLOCK rows, each of onednn_rows' count."""
    x = x.contiguous()
    if x.shape[0] <= 16:                          # one call of x's own count (0 rows too)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    outs = []
    for b in range(0, x.shape[0], ONEDNN_BLOCK):
        xb = x[b:b + ONEDNN_BLOCK]
        r = xb.shape[0]
        if onednn_rows(r) != r:
            xb = torch.nn.functional.pad(xb, (0, 0, 0, onednn_rows(r) - r))
        y = torch.ops.mkldnn._linear_pointwise(xb, packed, bias, "none", [], "")
        outs.append(y[:r] if y.shape[0] != r else y)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def onednn_packed(weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Weights (fp32 or bf16) in oneDNN's blocked layout (for rows about a batch: 32), or None
    where torch's oneDNN cannot pack them (a build without it)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        return [torch.ops.mkldnn._reorder_linear_weight(w.detach(), 32) for w in weights]
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def onednn_bf16() -> bool:
    """Whether torch's oneDNN runs bf16 matmuls natively on this CPU: AVX-512 BF16 or AMX in
    the CPU's flags, and not capped below them by ONEDNN_MAX_CPU_ISA (oneDNN's own switch,
    how an older Xeon is reproduced on a newer one). torch's own
    `_is_mkldnn_bf16_supported()` says yes on any AVX512BW CPU, where oneDNN emulates bf16
    (4x fp32's time for a 3072x576 layer at 128 rows); there batched bf16 takes fp32
    products instead (batched_linear, linear)."""
    global _onednn_bf16
    if _onednn_bf16 is None:
        flags = cpu_kernels.isa_flags()
        _onednn_bf16 = bool(torch.backends.mkldnn.is_available()
                            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                            and flags & {"avx512_bf16", "amx_bf16"}
                            and onednn_isa_has_bf16(os.environ.get("ONEDNN_MAX_CPU_ISA")
                                                    or os.environ.get("DNNL_MAX_CPU_ISA")))
    return _onednn_bf16
