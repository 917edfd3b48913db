"""The decoder's ops on the CPU in fp32 or bf16 (csrc/cpu_ops.cpp): one C++ call each instead
of five to eight aten ops, a batch-1 GEMV that streams the weights faster than MKL's (bf16:
AVX-512 BF16's vdpbf16ps on the stored weights), and decode steps (a batch of decodes, a
verify step's drafts) through every layer in one call. At batch 1 a step reads all the weights (540 MB for SmolLM2-135M in fp32, 270 in
bf16) and the rest was dispatch; see docs/benchmarks.md. In bf16 each op rounds where the
torch reference's bf16 ops round. Until the kernel module is built (the first start on a
machine builds it in a detached process), and for other dtypes, they are the torch
reference's. A few rows (2-16: a speculative verify step, a small batch) take
`small_m_linear`, which reads each weight row once for all of them, up to the row count it
measured faster than torch's matmul on this CPU (cpu_choice.small_m_rows, once per kernel
build); packed weights stay packed up to the rows measured faster than dequantized slices
(256 on the AVX2 EPYC). Batched linear layers are oneDNN's matmul (AMX where the CPU has it) on
the weights packed once into its blocked layout (`CpuOps.prepacked`): in bf16, where torch's
F.linear repacks on every call (the same kernel and the same bits, 1.1-1.8x faster at
SmolLM2's shapes from 4 to 256 rows); in fp32 where the build measured it faster than F.linear,
whose MKL sgemm on a Zen 5 ran SmolLM2's linears at a third of its speed (32 rows: 80 ms
against 26; the cost: the fp32 weights' bytes once more, taken only where they fit:
CpuOps.prepare)."""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from . import cpu_kernels
from .cpu_attention import CpuAttention
from .cpu_onednn import (_DTYPES, PACK_SHARE, available_memory, linear_weights, onednn_bf16,
                         onednn_linear, onednn_packed, packed_bytes, packed_dtype)
from .ops import TorchOps
from .quant import FORMATS, UNTILED, PackedWeight, a8_linear

_LIVE: weakref.WeakSet = weakref.WeakSet()
"""The CpuOps objects that prepared a model and are still alive (CpuOps.prepare)."""
DECODE_ROWS = 256
"""The most rows decode_layers takes (kDecodeRows in csrc/cpu_ops.cpp); dense weights only up
to small_m_rows (small_m_linear's most, 16)."""
TILED_CODES = {FORMATS[f] for f in UNTILED}


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self):
        self._dense: dict[int, torch.Tensor] = {}
        """id(PackedWeight) -> its weights dequantized once, in the activations' dtype: what
        a packed weight runs as where no kernel streams it (the kernel is still building,
        cannot be built, or has no path for the format on this CPU). Unpacking the blocks on
        every step instead cost 10x fp32's step; this is fp32's (the memory of both, until
        the kernel arrives: then they are dropped)."""
        self._rows: dict[int, PackedWeight] = {}
        """id(PackedWeight) -> an 8-bit-activation weight in its row format (untiled), where
        the kernel has no VNNI (an AVX2 or Arm build): x rounded through its 8-bit blocks
        times these rows is the format's product, at the row format's speed (see linear)."""
        self._onednn: dict[tuple[int, torch.dtype],
                           tuple[torch.Tensor | PackedWeight, torch.Tensor]] = {}
        """(id(weight), dtype) -> (the weight, it in oneDNN's blocked layout): bf16 and fp32
        weights packed at their first batched use (see prepacked). Held by the ops object, which lives and
        dies with its model (model.ops), as the weights do."""
        self.packing = True
        """Whether batched linears may pack the weights for oneDNN (prepacked): not where the
        packed copy would take more than PACK_SHARE of the memory free (prepare)."""
        self._notices: list[str] = []
        self._pending = 0
        """Bytes prepare counted on that are not packed yet (what another model's prepare
        in this process must leave free)."""

    def prepare(self, model, platform) -> None:
        """Decide, once for the whole model, whether its batched linears keep a copy of the
        weights packed for oneDNN: up to fp32's bytes of every linear weight more (an fp32
        model's twice over, a bf16 one's widened). Where that copy would take more than
        PACK_SHARE of the memory free with the model loaded (a 7B model in bf16 on a CPU
        without native bf16: 28 GB more), they run unpacked, on torch's linear or the
        kernel's widened slices, slower at batch, and say so. Where they are kept and the
        kernel is loaded, they are packed here, as the engine loads: the memory an engine
        takes is taken before it serves, and its first request does not pay for it."""
        k = cpu_kernels.kernels()
        if k is not None and not self._kernel_seen:
            self._arrived()         # the build's measured choices (onednn_fp32)
        fp32 = k is None or onednn_fp32()   # the choice comes with the kernel: the most
        weights = [w for w in linear_weights(model) if packed_dtype(w, fp32) is not None]
        need = sum(packed_bytes(w, fp32) for w in weights)
        free = available_memory()
        if free is not None:        # less what other models here will still pack
            free = max(free - sum(o._pending for o in _LIVE if o.packing and o is not self), 0)
        self.packing = free is None or need <= PACK_SHARE * free
        self._pending = need if self.packing else 0
        _LIVE.add(self)
        if not self.packing:
            gib = 2 ** 30
            self._notices.append(
                f"batched linears unpacked: a copy of the weights packed for oneDNN would take "
                f"{need / gib:.1f} GiB, more than {PACK_SHARE:.0%} of the {free / gib:.1f} GiB "
                f"free with the model loaded; batches and prefill run on torch's linear "
                f"instead (the same numbers to rounding, slower on some CPUs)")
            return
        if k is not None:           # now, not in the first request (SmolLM2 fp32: 0.15 s)
            for w in weights:
                self.prepacked(w, packed_dtype(w, fp32))

    def notices(self) -> list[str]:
        return list(self._notices)

    def dense(self, weight: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
        """`weight` dequantized to `dtype`, once (the reference's numbers: quant.dequantize)."""
        w = self._dense.get(id(weight))
        if w is None or w.dtype != dtype:
            w = self._dense[id(weight)] = weight.dequantize(dtype)
        return w

    def linear(self, x, weight, bias=None):
        k = cpu_kernels.kernels()
        if k and not self._kernel_seen:
            self._arrived()
        if isinstance(weight, PackedWeight) and weight.format == "bf16c":
            if k and x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 \
                    and hasattr(k, "bf16c_stream"):
                return k.bf16c_gemv(x, weight.data, bias)
            if x.dtype == torch.bfloat16 and x.dim() == 2 and self.packing and onednn_bf16():
                return onednn_linear(x, self.prepacked(weight), bias)
            if x.dtype == torch.bfloat16 and x.dim() == 2 and self.packing and onednn_fp32() \
                    and x.shape[0] > widened_rows(k):
                return self._widened(x, weight, bias)
            if not (k and x.dim() == 2 and x.dtype == torch.bfloat16):
                return self._dense_linear(x, weight, bias)
        if isinstance(weight, PackedWeight):
            if not (k and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)):
                return self._dense_linear(x, weight, bias)
            if weight.activation_bits == 8 and not hasattr(k, "a8_linear"):
                # No VNNI: the 8-bit activations' numbers (each x block rounded as the tiled
                # kernel rounds it) times the weights' rows through the row formats' kernels,
                # not the torch reference (2.8x fp32's batch-1 step on an AVX2 build).
                x = k.a8_round_trip(x)
                weight = self._rows.get(id(weight)) or self._rows.setdefault(id(weight),
                                                                             weight.untiled())
            if x.dtype == torch.bfloat16 and not onednn_bf16():
                return _rounded(k.qlinear(x.float(), weight.data, weight.code), bias)
            y = k.qlinear(x, weight.data, weight.code)
            return y if bias is None else y.add_(bias)
        if k and x.dim() == 2 and x.dtype in _DTYPES and weight.dtype == x.dtype \
                and hasattr(k, "gemv"):
            if x.shape[0] == 1:
                return k.gemv(x, weight, bias)
            if 2 <= x.shape[0] <= small_m_rows(x.dtype) and weight.is_contiguous():
                return k.small_m_linear(x, weight, bias)
        return self.batched_linear(x, weight, bias)

    def batched_linear(self, x, weight, bias=None):
        """A plain weight's linear on many rows: fp32 on the prepacked weight where oneDNN was
        measured faster than torch's F.linear (onednn_fp32), else F.linear; bf16 on the
        prepacked weight where oneDNN has native bf16; where it has not, in fp32 on the weight
        widened a slice at a time: torch's bf16 GEMM there ran at 0.4x fp32's throughput.
        Where the packed copies would not fit (prepare), F.linear and the widened slices."""
        if x.dtype == weight.dtype == torch.float32 and x.dim() == 2 and self.packing \
                and onednn_fp32():
            return onednn_linear(x, self.prepacked(weight), bias)
        if x.dtype == weight.dtype == torch.bfloat16 and x.dim() == 2:
            if onednn_bf16():
                if not self.packing:
                    return torch.nn.functional.linear(x, weight, bias)
                return onednn_linear(x, self.prepacked(weight), bias)
            k = cpu_kernels.kernels()
            if k and hasattr(k, "widened_linear"):
                if self.packing and onednn_fp32() and x.shape[0] > widened_rows(k):
                    return self._widened(x, weight, bias)
                return _rounded(k.widened_linear(x.float(), weight), bias)
        return torch.nn.functional.linear(x, weight, bias)

    def _widened(self, x, weight, bias):
        """bf16 rows past widened_rows where oneDNN has no native bf16 but runs fp32
        (onednn_fp32): fp32 products on the weight widened once (exact) and packed, rounded
        to bf16 once: widened_linear's numbers at fp32's batched speed (its slices' GEMM,
        MKL's, ran the throughput workload at 0.68x fp32's on a Zen 5 capped as an Ice Lake).
        The cost: the weights in fp32 once more, as an fp32 model's are."""
        return _rounded(onednn_linear(x.float(), self.prepacked(weight, torch.float32), None),
                        bias)

    def prepacked(self, weight: torch.Tensor | PackedWeight,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
        """A bf16 or fp32 weight [N, K] (or a `bf16c` one, decoded) in oneDNN's blocked
        layout, in `dtype` (None: the weight's own, bf16 for bf16c), packed at its first
        batched use and kept in this ops object (a copy: the layer weights' bytes once more;
        the batch-1 kernels read the plain or bf16c layout). The weights do not change after
        loading; a weight changed in place would keep its old packing."""
        if dtype is None:
            dtype = torch.bfloat16 if isinstance(weight, PackedWeight) else weight.dtype
        held = self._onednn.get((id(weight), dtype))
        if held is None or held[0] is not weight:
            w = weight.dequantize(dtype) if isinstance(weight, PackedWeight) \
                else weight.detach().to(dtype)
            packed = onednn_packed([w])[0]
            self._pending = max(self._pending - w.numel() * w.element_size(), 0)
            held = self._onednn[(id(weight), dtype)] = (weight, packed)
        return held[1]

    def _dense_linear(self, x, weight: PackedWeight, bias):
        """The torch reference's numbers (TorchOps.linear) on weights dequantized once."""
        if weight.activation_bits == 8:
            return a8_linear(x, weight, bias, self.dense(weight, x.dtype))
        return self.linear(x, self.dense(weight, x.dtype), bias)

    _kernel_seen = False

    def _arrived(self) -> None:
        """The kernel is loaded: drop the weights dequantized while it built (the formats it
        has no path for here dequantize again, once, at their next use)."""
        self._kernel_seen = True
        self._dense.clear()
        small_m_rows(torch.float32)           # sets how many rows qlinear keeps packed

    def embedding(self, ids, weight, dtype):
        k = cpu_kernels.kernels()
        if k and isinstance(weight, PackedWeight) and dtype in (torch.float32, torch.bfloat16):
            return k.qembedding(ids, weight.data, weight.code, weight.shape[1],
                                dtype == torch.bfloat16)
        return super().embedding(ids, weight, dtype)

    _layers = None
    _weights: list | None = None

    def decode_layers(self, model, x, cos, sin, kv_caches, meta):
        """A step whose every token is a decode (`meta.rows`: a batch of up to DECODE_ROWS decodes,
        and speculative verify steps' few tokens on cached context) through every layer in one
        C++ call (`decode_layers` in csrc/cpu_ops.cpp), for fp32 or bf16 Llama layers without
        biases or q/k norms whose attention runs on this platform's kernels: the same kernels
        the layer loop calls for those rows (`linear`'s choice included), without the
        interpreter between them. Anything else runs the loop."""
        k = cpu_kernels.kernels()
        if k and not self._kernel_seen:
            self._arrived()
        rows, m = getattr(meta, "rows", None), x.shape[0]
        if not (k and rows is not None and m <= DECODE_ROWS and x.dtype in _DTYPES
                and isinstance(meta.backend, CpuAttention)):
            return None
        if self._layers is not model.layers:
            self._layers, self._weights = model.layers, _fusable_weights(model)
        if self._weights is None:
            return None
        weights, formats, linears = self._weights
        if (linears & TILED_CODES and not hasattr(k, "a8_linear")) \
                or (m > 1 and (FORMATS["bf16c"] in linears           # not linear's rows here
                               or (0 in linears and m > small_m_rows(x.dtype)))):
            return None
        attn = model.layers[0].self_attn
        return k.decode_layers(x, weights, formats, [c[0] for c in kv_caches],
                               [c[1] for c in kv_caches], cos, sin, *rows, meta.slot_mapping,
                               attn.num_heads, attn.num_kv_heads,
                               model.layers[0].input_layernorm.eps, attn.scale)

    def rms_norm(self, x, weight, eps):
        k = cpu_kernels.kernels()
        if k and x.dtype in _DTYPES and weight.dtype == x.dtype:
            return k.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        k = cpu_kernels.kernels()
        if k and x.dtype in _DTYPES and residual.dtype == weight.dtype == x.dtype:
            return tuple(k.add_rms_norm(x, residual, weight, eps))
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up):
        k = cpu_kernels.kernels()
        if k and gate_up.dtype in _DTYPES and gate_up.dim() == 2:
            return k.silu_and_mul(gate_up)
        return super().silu_and_mul(gate_up)

    def qk_rope(self, qk, cos, sin, num_q_heads, q_norm=None, k_norm=None, eps=0.0):
        k = cpu_kernels.kernels()
        if not (k and qk.dtype in _DTYPES and qk.stride(-1) == 1
                and cos.dtype == sin.dtype == qk.dtype):
            return super().qk_rope(qk, cos, sin, num_q_heads, q_norm, k_norm, eps)
        if q_norm is not None:
            q, kk = qk.split([num_q_heads, qk.shape[1] - num_q_heads], dim=1)
            qk = torch.cat((k.rms_norm(q, q_norm, eps), k.rms_norm(kk, k_norm, eps)), dim=1)
        return k.rope(qk, cos, sin)


def _rounded(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bf16 linear's fp32 product (+ its bias), rounded to bf16 once, as torch's bf16
    linear rounds its fp32 sums."""
    if bias is not None:
        y = y.add_(bias)
    return y.to(torch.bfloat16)


_AVX512_BUILD: bool | None = None


def widened_rows(k) -> int:
    """The most rows the kernel's bf16 and bf16c batched products (widened_linear, qlinear on
    fp32 rows) take from weights widened in L1 (16 on an AVX-512 build, the measured packed
    rows on a portable one); past them they multiply widened slices, which CpuOps._widened
    replaces where fp32 runs on oneDNN."""
    global _AVX512_BUILD
    if _AVX512_BUILD is None:
        _AVX512_BUILD = "avx512f" in k.isa().split()
    return 16 if _AVX512_BUILD else k.set_packed_rows(0)


def onednn_fp32() -> bool:
    """Whether fp32's batched linear is oneDNN on prepacked weights here: what the kernel build
    measured (SMALL_M_ROWS 'onednn') with the kernel loaded; F.linear until it has, and where
    the kernel is gone (the fallbacks are the torch reference's numbers)."""
    return bool(SMALL_M_ROWS and SMALL_M_ROWS.get("onednn")) and cpu_kernels.kernels() is not None


SMALL_M_ROWS: dict[str, int] | None = None
"""dtype name -> the most rows (2..cpu_choice.SMALL_M[-1]) that take the kernel's
`small_m_linear` (each weight row read once for all rows) instead of torch's batched linear
(0: never), 'onednn' -> 1 where fp32's batched linear is oneDNN's on prepacked weights (see
onednn_fp32), and 'packed' -> the most rows qlinear multiplies on packed weights' rows rather
than on dequantized slices (the kernel is told: set_packed_rows): measured once per kernel
build (cpu_choice.small_m_rows), read when the kernel arrives."""
MEASURE_SMALL_M_ROWS: Callable[[object], dict[str, int]] | None = None
"""What measures them, given the kernels: set by platforms/cpu.py (cpu_choice times CpuOps,
so this module does not import it); None: small_m_linear is never taken."""


def small_m_rows(dtype: torch.dtype) -> int:
    """The most rows of `dtype` that small_m_linear takes here (see SMALL_M_ROWS)."""
    global SMALL_M_ROWS
    if SMALL_M_ROWS is None:
        k = cpu_kernels.kernels()
        if not (k and hasattr(k, "small_m_linear")) or MEASURE_SMALL_M_ROWS is None:
            return 0
        SMALL_M_ROWS = MEASURE_SMALL_M_ROWS(k)
        k.set_packed_rows(SMALL_M_ROWS.get("packed", 16))
        if hasattr(k, "set_onednn_slices"):
            k.set_onednn_slices(bool(SMALL_M_ROWS.get("onednn")))
    return SMALL_M_ROWS.get(str(dtype).removeprefix("torch."), 0)


def _fusable_weights(model) -> tuple[list, list, set] | None:
    """Six weights a layer for decode_layers, each one's format (0: fp32, else the packed
    format's code) and the set of the linear layers' formats, or None where a layer has what
    it does not compute (biases, q/k norms, norms with different eps)."""
    out = []
    eps = model.layers[0].input_layernorm.eps
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if a.q_norm is not None or any(lin.bias is not None for lin in linears) \
                or any(n.eps != eps for n in norms):
            return None
        out += [norms[0].weight, a.qkv_proj.weight, a.o_proj.weight, norms[1].weight,
                m.gate_up_proj.weight, m.down_proj.weight]
    formats = [w.code if isinstance(w, PackedWeight) else 0 for w in out]
    return ([w.data if isinstance(w, PackedWeight) else w.detach() for w in out], formats,
            {f for i, f in enumerate(formats) if i % 6 not in (0, 3)})
