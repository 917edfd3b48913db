"""Weights kept in a low-bit format, and their reference arithmetic.

A decode step at batch 1 reads every weight once, so on a CPU its time is the weights' bytes
over memory bandwidth: SmolLM2-135M is 540 MB in fp32 and 98 MB in the formats its GGUF file
ships (Q4_1 layers, a Q8_0 embedding). A `PackedWeight` holds such a matrix as it is, one
packed row per output row, and the model's ops take it wherever they take a weight
(`ops.linear`, `ops.embedding`): the reference here dequantizes it and multiplies in torch;
the CPU's kernels (csrc/cpu_quant.cpp) stream the packed rows.

Formats (a row of K weights; ggml's block layouts, so a GGUF's tensors load byte for byte):
- `q4_1`: K/32 blocks of 20 bytes: fp16 scale d, fp16 min m, 16 bytes holding 32 nibbles
  (weight j in the low nibble of byte j, weight j+16 in its high nibble); w = d*q + m.
- `q8_0`: K/32 blocks of 34 bytes: fp16 scale d, 32 int8; w = d*q.
- `int8`: a 4-byte fp32 scale, then K int8 (symmetric, one scale per output row: what
  `quantization="int8"` makes of any checkpoint); w = scale*q.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = {"q4_1": 1, "q8_0": 2, "int8": 3}
"""Format name -> the code the C++ kernels take."""
GGML_TYPES = {3: "q4_1", 8: "q8_0"}
"""ggml's type ids (GGMLQuantizationType) of the formats kept packed."""
BITS = {"q4_1": 5.0, "q8_0": 8.5}
"""Bits a weight, scales included (int8: 8 + 32/K)."""


def row_bytes(fmt: str, k: int) -> int:
    if fmt == "q4_1":
        return k // 32 * 20
    if fmt == "q8_0":
        return k // 32 * 34
    if fmt == "int8":
        return k + 4
    raise ValueError(f"quantization: unknown weight format {fmt!r}")


@dataclass(eq=False)
class PackedWeight:
    """A [N, K] weight matrix as `data`, uint8 [N, row_bytes(format, K)] (module docstring)."""
    data: torch.Tensor
    format: str
    shape: tuple[int, int]

    def __post_init__(self):
        n, k = self.shape
        if self.format != "int8" and k % 32:
            raise ValueError(f"quantization: {self.format} needs rows of a multiple of 32 "
                             f"weights (got {k})")
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (n, row_bytes(self.format, k)):
            raise ValueError(f"quantization: {self.format} data for [{n}, {k}] is uint8 "
                             f"[{n}, {row_bytes(self.format, k)}] (got {self.data.dtype} "
                             f"{list(self.data.shape)})")
        self.data = self.data.contiguous()

    @property
    def code(self) -> int:
        return FORMATS[self.format]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: computed in fp32 as ggml and gguf's numpy reference do (the
        same numbers bit for bit), then cast."""
        return dequantize_rows(self.data, self.format, self.shape[1]).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` dequantized: an embedding lookup, [len(ids), K]."""
        return dequantize_rows(self.data.index_select(0, ids), self.format, self.shape[1]).to(dtype)

    def select_rows(self, index: torch.Tensor) -> "PackedWeight":
        """A PackedWeight of these rows, in this order (rows are independent in every format:
        fusing q/k/v or reordering heads moves packed rows as they are)."""
        return PackedWeight(self.data.index_select(0, index), self.format,
                            (len(index), self.shape[1]))


def dequantize_rows(data: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """uint8 [N, row bytes] -> fp32 [N, K], in plain torch."""
    n = data.shape[0]
    if fmt == "int8":
        scale = data[:, :4].contiguous().view(torch.float32)                  # [N, 1]
        return data[:, 4:].contiguous().view(torch.int8).float() * scale
    size = 20 if fmt == "q4_1" else 34
    blocks = data.reshape(n, k // 32, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()               # [N, nb, 1]
    if fmt == "q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        qs = blocks[..., 4:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()                     # [N, nb, 32]
        return (d * q + m).reshape(n, k)
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(n, k)


def quantize_int8(w: torch.Tensor) -> PackedWeight:
    """A float [N, K] weight -> `int8` PackedWeight: one symmetric scale per output row
    (max |w| / 127), weights rounded to nearest."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    data = torch.cat((scale.contiguous().view(torch.uint8), q.view(torch.uint8)), dim=1)
    return PackedWeight(data, "int8", tuple(w.shape))


def packed_weights(model: torch.nn.Module) -> list[PackedWeight]:
    """Every PackedWeight a model's modules hold (as their `weight`), each once."""
    seen, out = set(), []
    for mod in model.modules():
        w = mod.__dict__.get("weight")
        if isinstance(w, PackedWeight) and id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def set_weight(module: torch.nn.Module, weight) -> None:
    """Put a PackedWeight where a module had its `weight` Parameter (the ops read
    `module.weight` either way)."""
    if "weight" in module._parameters:
        del module._parameters["weight"]
    module.__dict__["weight"] = weight
