"""The decoder's fusable ops as Triton kernels, for bf16/fp16 on CUDA (see platforms/ops.py).

Counted from the torch code, a Qwen3 layer's 41 small kernels become 4 (a Llama layer's 24
become 4): RMSNorm with the residual add before it (8 + 1 -> 1, twice), SiLU-and-mul
(2 -> 1), and the per-head q/k norms, their concatenation and RoPE (8 + 8 + 1 + 4 -> 1).
Each kernel computes what the torch reference computes, rounding where it rounds: every
value that torch stores in bf16/fp16 between ops is rounded to that dtype here too, and the
rest runs in fp32 as torch's own kernels do. What can still differ is the order of a
row's sum of squares, so a normed value may land one unit in the last place away.

At batch 1 the linear layers, and the norms and SiLU-and-mul that feed them, can run as one
Triton GEMV each (platforms/triton_gemv.py), for the weight shapes where `prepare` measured
it faster than cuBLAS.

fp32 keeps the torch path: it is the dtype of the exact checks against HF, and launch
counts matter only for speed, which is measured in bf16.

Under TRITON_INTERPRET=1 the kernels also run on CPU tensors (the CPU tests do that). The
interpreter truncates fp32 -> bf16 instead of rounding to nearest, so the CPU tests check
fp16 exactly and bf16 to one unit in the last place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_gemv
from .ops import TorchOps


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r,
                     stride_o, stride_ro, n, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = (x + r).to(dt).to(tl.float32)                     # torch rounds the sum
        tl.store(res_out_ptr + row * stride_ro + cols, x.to(dt), mask=ok)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * inv).to(dt).to(tl.float32)                       # normed, back in the model dtype
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(dt), mask=ok)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dt), mask=ok)


@triton.jit
def _qk_rope_kernel(qk_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, out_ptr, stride_t, stride_h,
                    stride_c, stride_ot, stride_oh, num_q_heads, d, eps,
                    HAS_NORM: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < d
    rolled = (cols + d // 2) % d                              # x.roll(d // 2)[i] = x[rolled[i]]
    dt = out_ptr.dtype.element_ty
    base = qk_ptr + t * stride_t + h * stride_h
    x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    xr = tl.load(base + rolled, mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
        if h < num_q_heads:
            w = tl.load(qw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            wr = tl.load(qw_ptr + rolled, mask=ok, other=0.0).to(tl.float32)
        else:
            w = tl.load(kw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            wr = tl.load(kw_ptr + rolled, mask=ok, other=0.0).to(tl.float32)
        x = (w * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xr = (wr * (xr * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_c + cols, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_c + cols, mask=ok, other=0.0).to(tl.float32)
    a = (x * cos).to(dt).to(tl.float32)
    b = (xr * sin).to(dt).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, (a + b).to(dt), mask=ok)


class TritonOps(TorchOps):
    """Fused kernels for bf16/fp16 rows; anything else goes to the torch reference."""
    name = "triton"
    tune_gemv = True
    """Whether `prepare` measures the batch-1 GEMV against cuBLAS (benchmarks/gpu.py turns
    it off for its A/B run)."""

    def __init__(self):
        self.gemv_plan: dict[tuple[int, int], triton_gemv.GemvConfig] = {}
        """Weight shapes whose one-row calls run the Triton GEMV, and its config for each."""
        self.gemv_tuning: dict[tuple[int, int], triton_gemv.ShapeTuning] = {}
        """What `prepare` measured, per weight shape."""

    def prepare(self, model, platform):
        """Time the batch-1 GEMV against cuBLAS on the model's weights, where the platform can
        time kernels inside a graph (CUDA), and keep it for the shapes where it wins."""
        timer = platform.kernel_timer()
        if not (self.tune_gemv and timer):
            return
        self.gemv_tuning = triton_gemv.tune(model, timer)
        self.gemv_plan = {s: t.best for s, t in self.gemv_tuning.items() if t.use_gemv}

    def linear(self, x, weight, bias=None):
        cfg = self.gemv_plan.get(tuple(weight.shape)) if self.gemv_plan else None
        if cfg is not None and triton_gemv.usable(x, weight):
            return triton_gemv.gemv(x, weight, bias, cfg)
        return super().linear(x, weight, bias)

    def add_rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        cfg = self.gemv_plan.get(tuple(weight.shape)) if self.gemv_plan else None
        if (cfg is not None and triton_gemv.usable(x, weight)
                and (residual is None or (residual.shape == x.shape and residual.is_contiguous()
                                          and residual.dtype == x.dtype))):
            return triton_gemv.norm_gemv(x, residual, norm_weight, eps, weight, bias, cfg)
        return super().add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)

    def silu_and_mul_linear(self, gate_up, weight, bias=None):
        cfg = self.gemv_plan.get(tuple(weight.shape)) if self.gemv_plan else None
        if (cfg is not None and triton_gemv.usable(gate_up, weight)
                and gate_up.shape[1] == 2 * weight.shape[1]):
            return triton_gemv.gemv(gate_up, weight, bias, cfg, silu_mul=True)
        return super().silu_and_mul_linear(gate_up, weight, bias)

    @staticmethod
    def _fused(x: torch.Tensor) -> bool:
        return x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1

    def rms_norm(self, x, weight, eps):
        if not self._fused(x) or x.dim() != 2:
            return super().rms_norm(x, weight, eps)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if x.shape[0]:
            _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, out, x.stride(0), 0, out.stride(0),
                                            0, x.shape[1], eps, HAS_RESIDUAL=False,
                                            BLOCK=triton.next_power_of_2(x.shape[1]))
        return out

    def add_rms_norm(self, x, residual, weight, eps):
        if not (self._fused(x) and self._fused(residual)) or x.dim() != 2:
            return super().add_rms_norm(x, residual, weight, eps)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res = torch.empty_like(out)
        if x.shape[0]:
            _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, res, x.stride(0),
                                            residual.stride(0), out.stride(0), res.stride(0),
                                            x.shape[1], eps, HAS_RESIDUAL=True,
                                            BLOCK=triton.next_power_of_2(x.shape[1]))
        return out, res

    def silu_and_mul(self, gate_up):
        if not self._fused(gate_up) or gate_up.dim() != 2:
            return super().silu_and_mul(gate_up)
        t, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, triton.next_power_of_2(n))
        if t:
            _silu_and_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0),
                                                             out.stride(0), n, BLOCK=block)
        return out

    def qk_rope(self, qk, cos, sin, num_q_heads, q_norm=None, k_norm=None, eps=0.0):
        if not self._fused(qk) or cos.dtype != qk.dtype:
            return super().qk_rope(qk, cos, sin, num_q_heads, q_norm, k_norm, eps)
        t, heads, d = qk.shape
        out = torch.empty(t, heads, d, dtype=qk.dtype, device=qk.device)
        cos, sin = cos.reshape(t, d), sin.reshape(t, d)
        norm = q_norm is not None
        if t:
            _qk_rope_kernel[(t, heads)](qk, cos, sin, q_norm if norm else cos,
                                        k_norm if norm else cos, out, qk.stride(0), qk.stride(1),
                                        cos.stride(0), out.stride(0), out.stride(1), num_q_heads,
                                        d, eps, HAS_NORM=norm, BLOCK=triton.next_power_of_2(d))
        return out
