"""The CPU platform: its name, memory, fused ops (cpu_ops.py) and attention backend
(cpu_attention.py), both on the C++ kernels of cpu_kernels.py once they are built."""
from __future__ import annotations

import os
import platform
import resource
from pathlib import Path

import torch

from . import cpu_kernels, cpu_ops
from .base import Platform
from .cpu_attention import CpuAttention
from .cpu_ops import CpuOps


def _measure_small_m_rows(k) -> dict[str, int]:
    """cpu_ops' small-row choice, measured once per kernel build (cpu_choice.py)."""
    from . import cpu_choice
    return cpu_choice.small_m_rows(cpu_kernels.kernel_dir(), k)


cpu_ops.MEASURE_SMALL_M_ROWS = _measure_small_m_rows


class CpuPlatform(Platform):
    name = "cpu"
    packed_weights = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    def streams_bf16c(self) -> bool:
        k = cpu_kernels.kernels()
        return k is not None and hasattr(k, "bf16c_fast")

    def device_name(self) -> str:
        try:
            info = Path("/proc/cpuinfo").read_text()
            model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                          if ln.startswith("model name")), "")
        except OSError:
            model = ""
        # macOS has no sched_getaffinity (nor /proc): all of its cores are the process's.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count()
        return f"{model or platform.processor() or platform.machine()}, {cores} cores"

    def kernel_state(self) -> str:
        return cpu_kernels.kernel_state()

    def notices(self) -> list[str]:
        rec = cpu_kernels.failure() if cpu_kernels.build_failed() else None
        if rec is None:
            return []
        return [f"CPU kernel unavailable ({rec['error']}): serving on the plain-torch path; "
                f"not rebuilt until the compiler or the sources change (`workbench "
                f"build-kernels` retries; `workbench doctor --device cpu` shows the log's tail)"]

    def choose_quantization(self, asked, own, dtype):
        """'auto': where the kernel is built, the fastest candidate by a GEMV measured once
        per kernel build (cpu_choice.py); while it builds, the checkpoint's own format (its
        packed layers served dequantized once, at fp32's speed, until the kernel arrives);
        where it cannot be built, the weights in `dtype` (no packed format beats fp32 on the
        plain-torch path, and they take the least memory there). A format asked for by
        name that measured slower than the plain weights here says what it costs."""
        from . import cpu_choice
        state = cpu_kernels.kernel_state()
        if state.startswith("failed") or cpu_kernels.build_failed():
            if asked != "auto":
                return asked, (f"quantization={asked!r}: the CPU kernel could not be built, so "
                               f"its weights are dequantized once at load and run as "
                               f"{str(dtype).removeprefix('torch.')} in plain torch (the memory "
                               f"of both, the speed of the plain weights)")
            return None, ("quantization 'auto': the weights in "
                          f"{str(dtype).removeprefix('torch.')}: the CPU kernel could not be "
                          "built, and on the plain-torch path no packed format is faster")
        if state != "built" or cpu_kernels.load_cpu_kernels() is None:
            if asked != "auto":
                return asked, None
            q = own if dtype == torch.float32 else None
            return q, (f"quantization 'auto': {q}, the checkpoint's own format; until the CPU "
                       f"kernel being built arrives its weights run dequantized once, at "
                       f"fp32's speed" if q else None)
        folder = cpu_kernels.kernel_dir()
        figures = cpu_choice.measured(folder, cpu_kernels.kernels())
        if asked == "auto":
            return cpu_choice.pick(figures, dtype, own, cpu_choice.threads_of(folder))
        return asked, cpu_choice.cost(figures, asked, dtype)

    def peak_memory_bytes(self) -> int:
        # ru_maxrss is in KiB on Linux: the process's peak resident set, weights included.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def model_ops(self, dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            return super().model_ops(dtype)
        return CpuOps()                             # fused fp32 and bf16 ops, packed weights

    def attention_backend(self, dtype, choice: str = "auto"):
        if choice != "auto" or dtype not in CpuAttention.supported_dtypes:
            return super().attention_backend(dtype, choice)
        if cpu_kernels.build_failed():
            return super().attention_backend(dtype, choice)
        if cpu_kernels.kernels() is None and not cpu_kernels.kernel_is_built():
            cpu_kernels.build_in_background()    # first start on this machine: don't wait for it
        elif cpu_kernels.load_cpu_kernels() is None:
            return super().attention_backend(dtype, choice)          # no compiler
        return CpuAttention(dtype)

    @classmethod
    def attention_backend_classes(cls) -> tuple[type, ...]:
        return (*super().attention_backend_classes(), CpuAttention)


def doctor_lines() -> tuple[list[str], bool]:
    """`workbench doctor --device cpu`: the CPU and its ISA flags, the kernel's build (where,
    its state; a failed one's error and the tail of its log) and what 'auto' measured for
    this build; whether the kernel is usable. Starts no build."""
    import json
    from . import cpu_choice
    ident = cpu_kernels.cpu_identity()
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_vbmi", "avx512_vbmi2", "amx_bf16", "amx_int8", "asimd", "bf16", "sve")
    flags = cpu_kernels.isa_flags()
    state = cpu_kernels.kernel_state()
    lines = [f"cpu            {CpuPlatform().device_name()}",
             f"isa            {' '.join(f for f in wanted if f in flags) or '(none of note)'}",
             *(f"               {k}: {v}" for k, v in ident.items()
               if k in ("CPU implementer", "CPU part")),
             f"build flags    {' '.join(cpu_kernels.cflags())}",
             f"kernel         {state}",
             f"kernel dir     {cpu_kernels.kernel_dir()}"]
    rec = cpu_kernels.failure()
    if rec is not None:
        lines += [f"compiler       {rec.get('compiler')}", "log tail:",
                  *(f"  {ln}" for ln in rec.get("log_tail", "").splitlines()),
                  "fix            install a C++ compiler (g++ or clang++) and ninja, or point "
                  "CXX at one; then `workbench build-kernels`"]
    try:
        figures = json.loads((cpu_kernels.kernel_dir() / cpu_choice.FILE).read_text())["us"]
        threads = cpu_choice.threads_of(cpu_kernels.kernel_dir())
        lines.append("auto measured  " + ", ".join(f"{f} {us:.0f} µs" for f, us in figures.items())
                     + f" (batch-1 GEMV, {'+'.join(f'{n}x{k}' for n, k in cpu_choice.SHAPES)}, "
                     f"{threads} thread{'s' if threads > 1 else ''})")
        for dtype in (torch.float32, torch.bfloat16):
            lines.append(f"auto picks     {cpu_choice.pick(figures, dtype, 'gguf', threads)[1]}")
    except (OSError, ValueError, KeyError):
        lines.append("auto measured  not yet (the first engine on a built kernel measures)")
    lines.append(few_rows_line(cpu_kernels.kernel_dir()))
    lines.append(memory_line())
    return lines, state == "built"


def memory_line() -> str:
    """The memory free now, and what that allows oneDNN's packed copies (CpuOps.prepare)."""
    from .cpu_onednn import PACK_SHARE, available_memory, onednn_bf16
    free = available_memory()
    if free is None:
        return "memory         not known here: batched linears always keep their packed copies"
    gib = free / 2 ** 30
    size = ("in bf16 for a bf16 model, else in fp32" if onednn_bf16() else
            "in fp32: oneDNN has no native bf16 here")
    return (f"memory         {gib:.1f} GiB free now: a model's batched linears keep a copy "
            f"packed for oneDNN where it fits in {PACK_SHARE * gib:.1f} GiB (its linear "
            f"weights {size})")


def few_rows_line(folder) -> str:
    """What the kernel build measured for a few rows and for batches (cpu_choice.small_m_rows),
    in words with the figures that decided it."""
    import json
    from . import cpu_choice
    try:
        kept = json.loads((folder / cpu_choice.SMALL_M_FILE).read_text())
        rows, us = kept["rows"], kept["us"]
    except (OSError, ValueError, KeyError):
        return "few rows       not measured yet (the first engine on a built kernel measures)"
    dense = ", ".join(f"{dt} up to {rows.get(dt, 0)}" for dt in ("float32", "bfloat16"))
    text = f"few rows       small_m_linear: {dense} rows (else the batched linear)"
    if rows.get("onednn") and "float32 32 onednn" in us:
        text += (f"; fp32 batched: oneDNN on prepacked weights (32 rows: "
                 f"{us['float32 32 onednn'] / 1000:.1f} ms against F.linear's "
                 f"{us['float32 32 torch'] / 1000:.1f} ms, one thread)")
    elif "onednn" in rows:
        text += "; fp32 batched: torch's F.linear (oneDNN prepacked was not faster)"
    most = rows.get("packed", 16)
    key = f"q4_1 {most} packed"
    if key in us:
        text += (f"; packed weights stay packed up to {most} rows (q4_1 at {most}: "
                 f"{us[key] / 1000:.1f} ms against {us[f'q4_1 {most} slices'] / 1000:.1f} ms on "
                 f"dequantized slices, one thread)")
    else:
        text += f"; packed weights stay packed up to {most} rows"
    return text


def describe() -> dict:
    """The CPU, its ISA flags of note, the kernel this process runs (the ISA macros its build
    saw, its -march) and what 'auto' measured and picks: what the CPU benchmarks print
    beside their figures."""
    import json
    from . import cpu_choice
    k = cpu_kernels.kernels() or (cpu_kernels.load_cpu_kernels()
                                  if cpu_kernels.kernel_is_built() else None)
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_vbmi", "avx512_vbmi2", "amx_bf16", "amx_int8", "asimd", "bf16", "sve")
    flags = cpu_kernels.isa_flags()
    out = {"cpu": CpuPlatform().device_name(),
           "isa_flags": [f for f in wanted if f in flags],
           "kernel": cpu_kernels.kernel_state(), "kernel_isa": k.isa() if k is not None and
           hasattr(k, "isa") else None, "march": os.environ.get(cpu_kernels.MARCH_ENV, "native"),
           "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
           "threads": torch.get_num_threads()}
    try:
        figures = json.loads((cpu_kernels.kernel_dir() / cpu_choice.FILE).read_text())["us"]
        out["auto_gemv_us"] = figures
        out["auto_gemv_threads"] = cpu_choice.threads_of(cpu_kernels.kernel_dir())
        out["auto_fp32"] = cpu_choice.pick(figures, torch.float32, "gguf")[0] or "fp32"
        out["auto_bf16"] = cpu_choice.pick(figures, torch.bfloat16, None)[0] or "bf16"
    except (OSError, ValueError, KeyError):
        pass
    return out
