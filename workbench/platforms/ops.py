"""The decoder's fusable ops, in plain torch with HF's numerics: the reference.

A layer spends most of its small kernels here: RMSNorm alone is eight kernels in bf16 (cast,
square, mean, add, rsqrt, multiply, cast back, scale), and Qwen3 runs it three times per
layer. Where one decode step is a few hundred microseconds of weights to read, that many
launches set the pace, even inside a graph. So the model calls these through an object
(`LlamaForCausalLM.ops`) that a platform can replace with fused kernels computing the same
thing (`platforms/triton_ops.py` on CUDA for bf16/fp16), as vLLM's custom ops do.

Every method here is exactly what the model did inline before: these are the numbers that
match HF transformers, and the fused versions are tested against them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import PackedWeight, a8_linear


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, D]; cos/sin_signed: [T, 1, D].

    HF writes it as x * cos + cat(-x2, x1) * sin. The sign is folded into the table
    (sin_signed = cat(-sin1, sin2)), so the rotation is one roll: cat(x2, x1) * sin_signed.
    Negation is exact, so the result is bitwise the same in four ops instead of six.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class TorchOps:
    name = "torch"

    def prepare(self, model, platform) -> None:
        """Called once the weights are on the device, before any graph is captured: where a
        platform picks its kernels by measuring them on the model's own shapes."""

    def notices(self) -> list[str]:
        """What the engine should say once about how these ops run the model (what `prepare`
        decided against, and why)."""
        return []

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T (+ bias); a PackedWeight is dequantized first (the reference: the
        kernels that stream packed rows are tested against it)."""
        if isinstance(weight, PackedWeight):
            if weight.activation_bits == 8:
                return a8_linear(x, weight, bias)
            weight = weight.dequantize(x.dtype)
        return F.linear(x, weight, bias)

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the embedding table, in the model's dtype."""
        if isinstance(weight, PackedWeight):
            return weight.rows(ids, dtype)
        return F.embedding(ids, weight)

    def decode_layers(self, model, x, cos, sin, kv_caches, meta):
        """Every layer of a step at once, where a platform has that fused: (the last layer's
        output, the residual stream), as the layer loop returns them; None to run the loop."""
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:   # HF's steps, minus its no-op casts: five ops
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add, then RMSNorm: returns (normed, x + residual)."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate, then up) -> silu(gate) * up, [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def add_rms_norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                            norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                            bias: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm (after the residual add, when there is a residual), then a linear layer:
        (linear(normed), the residual stream: x + residual, or x itself in the first layer,
        where residual is None). For a platform that fuses the norm into the projection."""
        if residual is None:
            return self.linear(self.rms_norm(x, norm_weight, eps), weight, bias), x
        normed, residual = self.add_rms_norm(x, residual, norm_weight, eps)
        return self.linear(normed, weight, bias), residual

    def silu_and_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
        """linear(silu_and_mul(gate_up), weight, bias): the MLP's tail, for a platform that
        fuses the two."""
        return self.linear(self.silu_and_mul(gate_up), weight, bias)

    def qk_rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                eps: float = 0.0) -> torch.Tensor:
        """qk: [T, Hq + Hk, D], query heads first. Per-head RMSNorm with q_norm / k_norm
        when given (Qwen3), then RoPE. Returns a new [T, Hq + Hk, D] tensor."""
        if q_norm is not None:
            q, k = qk.split([num_q_heads, qk.shape[1] - num_q_heads], dim=1)
            qk = torch.cat((self.rms_norm(q, q_norm, eps), self.rms_norm(k, k_norm, eps)), dim=1)
        return apply_rope(qk, cos, sin)
