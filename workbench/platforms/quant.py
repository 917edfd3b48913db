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

The same three, interleaved 16 rows at a time for 8-bit activations ('gguf-a8', 'int8-a8';
csrc/cpu_a8.cpp): `q4_1x16`, `q8_0x16`, `int8x16`. The activation row is quantized per
32-block to int8 with one fp32 scale (`quantize_activations`) and each block's dot product
is summed in int32 by AVX-512 VNNI (vpdpbusd: unsigned bytes times signed bytes, four per
32-bit lane). So that one zmm register accumulates 16 output rows, a tile of 16 rows stores
each block's 32 weights as 8 groups of 4 consecutive weights, the 16 rows' groups side by
side (64 bytes: lane r holds row r's 4 weights). Per tile of R rows (16, the last N % 16):
- `q4_1x16`, per block: R fp16 d, R fp16 m, then 4 chunks of 4R bytes; chunk c, bytes
  4r..4r+3 are row r's GGUF bytes 4c..4c+3 unchanged (low nibbles: weights 4c..4c+3, high:
  16+4c..16+4c+3). R * 20 bytes a block, as Q4_1.
- `q8_0x16`, per block: R fp16 d, then 8 chunks of 4R bytes (group g: weights 4g..4g+3),
  each weight stored as q + 128 (unsigned, for vpdpbusd; the kernel takes 128 * sum(x_q)
  back off in int32, exactly). R * 34 bytes a block.
- `int8x16`: R fp32 scales, then per 32-block (K padded with zero weights to a multiple of
  32) 8 chunks of 4R bytes as in q8_0x16. R * (K_pad + 4) bytes.
Row bytes are the row formats' (int8: K_pad + 4), so a tiled weight's `data` has one row of
bytes per output row and the same size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = {"q4_1": 1, "q8_0": 2, "int8": 3, "q4_1x16": 4, "q8_0x16": 5, "int8x16": 6}
"""Format name -> the code the C++ kernels take."""
TILED = {"q4_1": "q4_1x16", "q8_0": "q8_0x16", "int8": "int8x16"}
"""Row format -> its 16-row interleaved form for 8-bit activations."""
UNTILED = {v: k for k, v in TILED.items()}
TILE = 16
"""Output rows a tile interleaves (one zmm register of int32 sums)."""
GGML_TYPES = {3: "q4_1", 8: "q8_0"}
"""ggml's type ids (GGMLQuantizationType) of the formats kept packed."""
BITS = {"q4_1": 5.0, "q8_0": 8.5}
"""Bits a weight, scales included (int8: 8 + 32/K)."""


def row_bytes(fmt: str, k: int) -> int:
    if fmt in ("q4_1", "q4_1x16"):
        return k // 32 * 20
    if fmt in ("q8_0", "q8_0x16"):
        return k // 32 * 34
    if fmt == "int8":
        return k + 4
    if fmt == "int8x16":
        return padded(k) + 4
    raise ValueError(f"quantization: unknown weight format {fmt!r}")


def padded(k: int) -> int:
    """K rounded up to whole 32-blocks (the activations' quantization blocks)."""
    return (k + 31) // 32 * 32


@dataclass(eq=False)
class PackedWeight:
    """A [N, K] weight matrix as `data`, uint8 [N, row_bytes(format, K)] (module docstring)."""
    data: torch.Tensor
    format: str
    shape: tuple[int, int]

    def __post_init__(self):
        n, k = self.shape
        if self.format not in FORMATS:
            raise ValueError(f"quantization: unknown weight format {self.format!r}")
        if self.format not in ("int8", "int8x16") and k % 32:
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

    @property
    def activation_bits(self) -> int:
        """8 where the activations are quantized to int8 per 32-block before the product
        (the tiled formats), else 32 (fp32 activations)."""
        return 8 if self.format in UNTILED else 32

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: computed in fp32 as ggml and gguf's numpy reference do (the
        same numbers bit for bit), then cast."""
        rows = self.untiled()
        if rows is not self:   # the torch reference of a tiled weight keeps its row form
            rows = self.__dict__.setdefault("_rows", rows)   # (the kernels never ask for it)
        return dequantize_rows(rows.data, rows.format, self.shape[1]).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` dequantized: an embedding lookup, [len(ids), K]."""
        if self.format in UNTILED:       # each tile that holds some, untiled on its own
            n, k = self.shape
            ids = ids.reshape(-1).long()
            out = torch.empty(len(ids), k)
            tile_of = torch.div(ids, TILE, rounding_mode="floor")
            for t in torch.unique(tile_of).tolist():
                r = min(TILE, n - t * TILE)
                rows = PackedWeight(self.data[t * TILE:t * TILE + r], self.format, (r, k))
                sel = (tile_of == t).nonzero().squeeze(1)
                out[sel] = rows.dequantize()[ids[sel] - t * TILE]
            return out.to(dtype)
        return dequantize_rows(self.data.index_select(0, ids), self.format, self.shape[1]).to(dtype)

    def tiled(self) -> "PackedWeight":
        """This matrix in its 16-row interleaved form for 8-bit activations (module
        docstring); a tiled one as it is."""
        if self.format in UNTILED:
            return self
        return PackedWeight(_retile(self.data, self.format, self.shape, True), TILED[self.format],
                            self.shape)

    def untiled(self) -> "PackedWeight":
        """The row format this tiled matrix came from (an untiled one as it is)."""
        if self.format not in UNTILED:
            return self
        return PackedWeight(_retile(self.data, UNTILED[self.format], self.shape, False),
                            UNTILED[self.format], self.shape)

    def select_rows(self, index: torch.Tensor) -> "PackedWeight":
        """A PackedWeight of these rows, in this order (rows are independent in every format:
        fusing q/k/v or reordering heads moves packed rows as they are)."""
        if self.format in UNTILED:
            return self.untiled().select_rows(index).tiled()
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


def _retile(data: torch.Tensor, fmt: str, shape: tuple[int, int], forward: bool) -> torch.Tensor:
    """Row format `fmt` bytes [N, row bytes] <-> its tiled form's bytes (forward: to tiles).
    Full tiles of 16 rows, then one of N % 16 rows, each by `_tile_group`."""
    n, k = shape
    full = n // TILE * TILE
    parts = [_tile_group(data[:full], fmt, k, TILE, forward)] if full else []
    if n > full:
        parts.append(_tile_group(data[full:], fmt, k, n - full, forward))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _tile_group(data: torch.Tensor, fmt: str, k: int, r: int, forward: bool) -> torch.Tensor:
    """T tiles of r rows each (data [T * r, bytes]): row layout -> tiled layout, or back."""
    t = data.shape[0] // r
    nb = padded(k) // 32
    if fmt == "int8":
        if forward:
            x = data.view(t, r, 4 + k)
            scales = x[..., :4].reshape(t, 4 * r)
            q = torch.full((t, r, nb * 32), 0x80, dtype=torch.uint8)
            q[..., :k] = x[..., 4:] ^ 0x80
            q = q.view(t, r, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, nb * 32 * r)
            return torch.cat((scales, q), dim=1).view(t * r, -1)
        x = data.reshape(t, r * (nb * 32 + 4))
        scales = x[:, :4 * r].reshape(t, r, 4)
        q = x[:, 4 * r:].reshape(t, nb, 8, r, 4).permute(0, 3, 1, 2, 4).reshape(t, r, nb * 32)
        return torch.cat((scales, q[..., :k] ^ 0x80), dim=2).view(t * r, 4 + k)
    size, head, groups = (20, 4, 4) if fmt == "q4_1" else (34, 2, 8)
    flip = 0 if fmt == "q4_1" else 0x80
    if forward:
        x = data.view(t, r, nb, size)
        heads = [x[..., i:i + 2].permute(0, 2, 1, 3).reshape(t, nb, 2 * r) for i in range(0, head, 2)]
        q = x[..., head:].reshape(t, r, nb, groups, 4).permute(0, 2, 3, 1, 4).reshape(t, nb, -1)
        return torch.cat((*heads, q ^ flip), dim=2).reshape(t * r, nb * size)
    x = data.reshape(t, nb, r * size)
    heads = [x[..., i * r:(i + 2) * r].reshape(t, nb, r, 2).permute(0, 2, 1, 3)
             for i in range(0, head, 2)]
    q = (x[..., head * r:] ^ flip).reshape(t, nb, groups, r, 4).permute(0, 3, 1, 2, 4) \
        .reshape(t, r, nb, groups * 4)
    return torch.cat((*heads, q), dim=3).reshape(t * r, nb * size)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> (int8 [M, K_pad], fp32 scales [M, K_pad / 32]): per 32-block, d =
    max|x| * (1/127), q = round-half-even(x * (1/d)) (0 where the block is 0), K padded with
    zeros. The C++ kernel's quantization gives these numbers bit for bit."""
    m, k = x.shape
    xb = torch.nn.functional.pad(x.float(), (0, padded(k) - k)).view(m, -1, 32)
    d = xb.abs().amax(-1) * torch.tensor(1 / 127, dtype=torch.float32)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(m, -1), d


def dequantize_activations(q: torch.Tensor, d: torch.Tensor, k: int) -> torch.Tensor:
    """quantize_activations' (q, d) -> the fp32 [M, K] the product sees."""
    m = q.shape[0]
    return (q.float().view(m, -1, 32) * d[..., None]).view(m, -1)[:, :k]


def a8_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of 8-bit-activation formats: x quantized per 32-block and dequantized,
    times the dequantized weight, in x's dtype (the kernel sums the same products exactly in
    int32 per block, then scales them in fp32)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq = dequantize_activations(*quantize_activations(x2), shape[-1]).to(x.dtype)
    y = torch.nn.functional.linear(xq, w.dequantize(x.dtype), bias)
    return y.view(*shape[:-1], y.shape[-1])


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
