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

And one lossless format, for a bf16 model's weights (`bf16c`, 12.3 bits a weight where bf16
takes 16; what 'auto' stores a bf16 model's weights as on a CPU whose kernels run it). A
bf16's high byte (sign and seven exponent bits) takes few values in a row: trained weights
span a dozen binades. So a row keeps a palette of its 15 commonest high bytes, each weight's
palette code (4 bits, 0 for a weight outside it) and its low byte as it is; the rare weights
outside the palette are kept whole at the row's end. The batch-1 kernel rebuilds each bf16
in registers (a byte lookup and an interleave: csrc/cpu_quant.cpp) and multiplies exactly
what the plain bf16 kernel does, in its order: the same bits for a quarter fewer bytes. K is
a multiple of 64; a row of `bf16c`:
- 32 bytes of header: bytes 1..15 the palette (code c's high byte), bytes 16..19 the row's
  escape count (int32); the rest 0.
- K/64 superblocks of 96 bytes, weights 64s..64s+63 (A: the first 32, B: the last 32):
  64 low bytes, byte 16j+i the low byte of A[8j+i] and byte 16j+8+i that of B[8j+i]
  (i < 8: the order AVX-512's byte interleave restores), then 32 bytes of codes, byte q's
  low nibble for low byte q and its high nibble for low byte 32+q.
- E bf16 escapes (the matrix's most in a row; a row's own first, in weight order, then 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = {"q4_1": 1, "q8_0": 2, "int8": 3, "q4_1x16": 4, "q8_0x16": 5, "int8x16": 6, "bf16c": 7}
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


def row_bytes(fmt: str, k: int, escapes: int = 0) -> int:
    if fmt == "bf16c":
        return 32 + k // 64 * 96 + 2 * escapes
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
        block = 64 if self.format == "bf16c" else 32
        if self.format not in ("int8", "int8x16") and k % block:
            raise ValueError(f"quantization: {self.format} needs rows of a multiple of {block} "
                             f"weights (got {k})")
        rb = row_bytes(self.format, k, self.escapes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (n, rb):
            raise ValueError(f"quantization: {self.format} data for [{n}, {k}] is uint8 "
                             f"[{n}, {rb}] (got {self.data.dtype} {list(self.data.shape)})")
        self.data = self.data.contiguous()

    @property
    def code(self) -> int:
        return FORMATS[self.format]

    @property
    def escapes(self) -> int:
        """bf16c: the escapes a row has room for (its bytes beyond the codes); else 0."""
        if self.format != "bf16c":
            return 0
        return max(0, (self.data.shape[-1] - row_bytes("bf16c", self.shape[1])) // 2)

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
    if fmt == "bf16c":
        return bf16c_unpack(data, k).float()
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


def a8_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
              dense: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of 8-bit-activation formats: x quantized per 32-block and dequantized,
    times the dequantized weight, in x's dtype (the kernel sums the same products exactly in
    int32 per block, then scales them in fp32). `dense`: w dequantized already, in x's
    dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq = dequantize_activations(*quantize_activations(x2), shape[-1]).to(x.dtype)
    y = torch.nn.functional.linear(xq, w.dequantize(x.dtype) if dense is None else dense, bias)
    return y.view(*shape[:-1], y.shape[-1])


def quantize_int8(w: torch.Tensor) -> PackedWeight:
    """A float [N, K] weight -> `int8` PackedWeight: one symmetric scale per output row
    (max |w| / 127), weights rounded to nearest."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    data = torch.cat((scale.contiguous().view(torch.uint8), q.view(torch.uint8)), dim=1)
    return PackedWeight(data, "int8", tuple(w.shape))


_SRC = torch.tensor([8 * (p // 16) + p % 16 if p % 16 < 8 else 32 + 8 * (p // 16) + p % 16 - 8
                     for p in range(64)])
"""bf16c: the weight (within its superblock of 64) whose low byte is at byte p."""


def bf16c_pack(w: torch.Tensor, max_escape_bytes: float = 1 / 16) -> PackedWeight | None:
    """A bf16 [N, K] weight -> a `bf16c` PackedWeight holding the same numbers (module
    docstring); None where it does not pay: K not a multiple of 64, or a row with so many
    weights outside its palette that their room would exceed `max_escape_bytes` of the
    row's bf16 bytes."""
    n, k = w.shape
    if w.dtype != torch.bfloat16 or k % 64:
        return None
    bits = w.detach().contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    high = (bits >> 8).long()           # int64: the index dtype torch < 2.9 scatters and gathers by
    counts = torch.zeros(n, 256, dtype=torch.int32).scatter_add_(
        1, high, torch.ones(high.shape, dtype=torch.int32))
    palette = counts.topk(15, dim=1).indices                                    # [N, 15]
    code_of = torch.zeros(n, 256, dtype=torch.uint8)
    code_of.scatter_(1, palette, torch.arange(1, 16, dtype=torch.uint8).expand(n, 15))
    codes = code_of.gather(1, high)                                             # [N, K]
    outside = codes == 0
    per_row = outside.sum(1)
    e = int(per_row.max())
    if 2 * e > max_escape_bytes * 2 * k:
        return None
    sb = k // 64
    low = (bits & 0xFF).to(torch.uint8).view(n, sb, 64)[..., _SRC]
    c = codes.view(n, sb, 64)[..., _SRC]
    body = torch.cat((low, c[..., :32] | (c[..., 32:] << 4)), dim=2).view(n, sb * 96)
    header = torch.zeros(n, 32, dtype=torch.uint8)
    header[:, 1:16] = palette.to(torch.uint8)
    header[:, 16:20] = per_row.to(torch.int32).unsqueeze(1).view(torch.uint8)
    esc = torch.zeros(n, e, dtype=torch.int16)
    if e:
        rows, cols = outside.nonzero(as_tuple=True)                             # row-major
        rank = outside.cumsum(1)[rows, cols] - 1
        esc[rows, rank] = bits[rows, cols].to(torch.int16)
    data = torch.cat((header, body, esc.view(torch.uint8).view(n, 2 * e)), dim=1)
    return PackedWeight(data, "bf16c", (n, k))


def bf16c_unpack(data: torch.Tensor, k: int) -> torch.Tensor:
    """`bf16c` bytes [N, row bytes] -> the bf16 [N, K] they hold (the reference decoder)."""
    n, sb = data.shape[0], k // 64
    body = data[:, 32:32 + sb * 96].reshape(n, sb, 96)
    cb = body[..., 64:]
    c = torch.cat((cb & 0x0F, cb >> 4), dim=2)                                  # [N, sb, 64]
    high = data[:, :16].gather(1, c.reshape(n, -1).long()).view(n, sb, 64)
    out = torch.empty(n, sb, 64, dtype=torch.int32)
    out[..., _SRC] = (high.to(torch.int32) << 8) | body[..., :64].to(torch.int32)
    outside = torch.empty(n, sb, 64, dtype=torch.bool)
    outside[..., _SRC] = c == 0
    out, outside = out.view(n, k), outside.view(n, k)
    if outside.any():
        esc = data[:, 32 + sb * 96:].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        rows, cols = outside.nonzero(as_tuple=True)
        out[rows, cols] = esc[rows, outside.cumsum(1)[rows, cols] - 1]
    return out.to(torch.int16).view(torch.bfloat16)


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
