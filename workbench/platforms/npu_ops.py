"""The decoder's fusable ops on Ascend NPUs, through torch_npu's fused kernels (written from
their documented signatures, like npu_attention.py; not yet run on NPU hardware).

`npu_rms_norm(x, gamma, epsilon)` -> (y, rstd), `npu_add_rms_norm(x1, x2, gamma, epsilon)`
-> (y, rstd, x1 + x2) and `npu_swiglu(x, dim=-1)` = silu(first half) * second half: one
kernel each instead of eight, nine and two (vLLM-Ascend uses the same ops). Qwen3's q/k
norms go through npu_rms_norm as well; RoPE stays on torch (npu_apply_rotary_pos_emb takes
only head sizes 64 and 128 on A2/A3). The fused norms round to bf16 once, at the end, where
HF rounds before the weight multiply too, so a bf16 value may differ from HF's by one unit in
the last place.
"""
from __future__ import annotations

from .ops import TorchOps


class NpuOps(TorchOps):
    name = "npu"

    def __init__(self, ops):
        self.npu = ops
        """The torch_npu module (or, in tests, something with the same functions)."""

    def rms_norm(self, x, weight, eps):
        return self.npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        y, _, residual = self.npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
        return y, residual

    def silu_and_mul(self, gate_up):
        return self.npu.npu_swiglu(gate_up, dim=-1)
