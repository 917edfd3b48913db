"""Batch-1 linear layers as a Triton GEMV, used per weight shape where it beats cuBLAS.

At batch 1 a decode step reads every weight once and does almost no arithmetic with it, so
its speed is how fast the weights stream from memory. On the H200 (issue 10), cuBLAS ran
Qwen3-0.6B's M = 1 GEMMs at about 1.4 TB/s, a third of the copy bandwidth: its kernels for
these shapes split K over a second reduction kernel, and tile for a matrix product, not for
one row.

`_gemv_kernel` is written for the one row. A program owns BLOCK_N output features and walks K
in BLOCK_K-wide strips of their weight rows, each strip one wide load, keeping a
[BLOCK_N, BLOCK_K] fp32 tile of partial products; the tile is summed across K once, at the
end (not once per strip), and the bias added. Nothing is split across programs, so there is
one launch per layer and no atomics: the result does not depend on timing.

Which is faster depends on the shape and the chip, and nothing here can be trusted without
measuring it there. So `tune` measures, at engine start on the device, for each distinct
weight shape of the model: cuBLAS and every config in CONFIGS, each inside a captured graph
(as a decode step runs them) over all of the model's weights of that shape in turn (so the
weights come from memory, not the L2 cache). A shape gets the GEMV only where its best
config beats cuBLAS; the measurements stay on the ops object (`TritonOps.gemv_tuning`) for
benchmarks/gpu.py to print. The first start on a machine also compiles the configs (Triton
keeps them in its on-disk cache for the next).

Where a shape's GEMV reads SiLU-and-mul's output (the MLP's down projection), it computes
that itself from the gate and up rows as it loads them (`silu_mul`), rounding where the
separate kernel rounds, so the MLP's tail is one launch.

Where it reads a normed row (the q/k/v and gate/up projections, and the LM head after the
final norm), it computes the RMSNorm
itself, with the residual add before it, and program 0 stores the residual stream
(`norm_gemv`): each program first reads the whole row (a few KiB, from the L2 cache) for
its RMS. So a batch-1 layer has two fewer launches.

fp32 stays on cuBLAS (the exact checks against HF run in fp32), and so does every call with
more than one row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, norm_w_ptr, res_out_ptr, N, K,
                 stride_wn, eps, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    if NORM:
        # The row's RMS first (every program reads the row: K values from the L2 cache);
        # program 0 also stores the residual stream x + residual.
        squares = tl.zeros([BLOCK_K], tl.float32)
        first = (k * 0 + pid) == 0                            # program 0, as a lane mask
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            k_ok = kk < K
            h = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h += tl.load(res_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                h = h.to(dt).to(tl.float32)                   # torch rounds the sum
                tl.store(res_out_ptr + kk, h.to(dt), mask=k_ok & first)
            squares += h * h
        inv = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        w = tl.load(rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        if SILU_MUL:        # x_ptr is [gate | up]: what _silu_and_mul_kernel would store
            up = tl.load(x_ptr + K + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = (x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32)
            x = (x * up).to(dt).to(tl.float32)
        if NORM:            # what _rms_norm_kernel would store
            if HAS_RESIDUAL:
                x += tl.load(res_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                x = x.to(dt).to(tl.float32)
            x = (x * inv).to(dt).to(tl.float32)
            nw = tl.load(norm_w_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = (nw * x).to(dt).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(dt), mask=n_ok)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int

    def __str__(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}"


CONFIGS = (
    GemvConfig(2, 1024, 4), GemvConfig(4, 512, 4), GemvConfig(4, 1024, 4),
    GemvConfig(8, 256, 4), GemvConfig(8, 512, 4), GemvConfig(8, 1024, 8),
    GemvConfig(16, 256, 4), GemvConfig(16, 512, 8), GemvConfig(32, 256, 8),
)
"""The candidates `tune` measures: tiles of 2-32 features by 256-1024 of K, so that a
program's strip is one 4-32 KiB load and the small shapes (N = 1024) still make a few
hundred programs."""


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         config: GemvConfig, silu_mul: bool = False) -> torch.Tensor:
    """F.linear for x [1, K] (contiguous) and a weight [N, K] with unit stride along K.
    silu_mul: x is [1, 2K], gate then up, and the product is taken with SiLU(gate) * up
    (TorchOps.silu_and_mul, fused into the GEMV's loads: one launch instead of two)."""
    out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, None, None, None, 0.0, config, silu_mul=silu_mul)
    return out


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
              eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
              config: GemvConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchOps.add_rms_norm_linear for one row in one launch: (F.linear(RMSNorm(x +
    residual)), x + residual), or with residual None (F.linear(RMSNorm(x)), x)."""
    out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    _launch(x, weight, bias, out, residual, norm_weight, res_out, eps, config, norm=True)
    return out, res_out


def _launch(x, weight, bias, out, residual, norm_weight, res_out, eps, config,
            silu_mul=False, norm=False) -> None:
    n, k = weight.shape
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight if bias is None else bias, out,
        x if residual is None else residual, x if norm_weight is None else norm_weight,
        x if res_out is None else res_out, n, k, weight.stride(0), eps,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm,
        HAS_RESIDUAL=residual is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` can run this call: one contiguous bf16/fp16 row, a row-major weight."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and x.is_contiguous() and weight.dtype == x.dtype and weight.stride(1) == 1)


@dataclass
class ShapeTuning:
    """What `tune` measured for one weight shape [N, K], in µs per call inside a graph."""
    shape: tuple[int, int]
    weights: int
    """How many of the model's weights have this shape (each timed call used all of them)."""
    torch_us: float
    best: GemvConfig | None
    best_us: float
    per_config_us: dict[str, float]
    errors: dict[str, str]
    """Configs that failed to compile or run here, and why."""

    @property
    def chosen(self) -> str:
        return str(self.best) if self.use_gemv else "torch"

    @property
    def use_gemv(self) -> bool:
        return self.best is not None and self.best_us < self.torch_us

    def bytes_per_call(self, element_size: int) -> int:
        return self.shape[0] * self.shape[1] * element_size

    def as_dict(self, element_size: int) -> dict:
        b = self.bytes_per_call(element_size)
        return dict(shape=list(self.shape), weights=self.weights, chosen=self.chosen,
                    torch_us=round(self.torch_us, 2), gemv_us=round(self.best_us, 2),
                    torch_tb_s=round(b / self.torch_us / 1e6, 2),
                    gemv_tb_s=round(b / self.best_us / 1e6, 2),
                    per_config_us={k: round(v, 2) for k, v in self.per_config_us.items()},
                    errors=self.errors or None)


def linear_weights(model) -> dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """Every (weight, bias) a decode step passes to ops.linear, grouped by weight shape: the
    model's nn.Linear layers and, with tied embeddings, the embedding matrix as LM head."""
    groups: dict[tuple[int, int], list] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            groups.setdefault(tuple(module.weight.shape), []).append((module.weight, module.bias))
    if getattr(model, "lm_head", None) is None and hasattr(model, "embed_tokens"):
        w = model.embed_tokens.weight
        groups.setdefault(tuple(w.shape), []).append((w, None))
    return groups


@torch.inference_mode()
def tune(model, timer) -> dict[tuple[int, int], ShapeTuning]:
    """Measure cuBLAS and each of CONFIGS for every weight shape of `model` at one row.
    timer(fn) -> µs per call of fn (the platform's graph timer; a test may pass its own).
    A config that fails to compile or run is left out (and named in `errors`); the engine
    then runs that shape on whatever else measured best."""
    results = {}
    for shape, pairs in linear_weights(model).items():
        w0 = pairs[0][0]
        if w0.dtype not in (torch.bfloat16, torch.float16):
            continue
        x = torch.randn(1, shape[1], dtype=w0.dtype, device=w0.device)

        def run_all(fn):
            return lambda: [fn(x, w, b) for w, b in pairs]

        n = len(pairs)
        torch_us = timer(run_all(F.linear)) / n
        per, errors = {}, {}
        for cfg in CONFIGS:
            if cfg.block_k > max(256, triton.next_power_of_2(shape[1])):
                continue                            # a strip wider than the row: a waste
            try:
                per[cfg] = timer(run_all(lambda x, w, b, c=cfg: gemv(x, w, b, c))) / n
            except Exception as e:                  # noqa: BLE001 - measured, not trusted
                errors[str(cfg)] = f"{type(e).__name__}: {e}"[:200]
        best = None
        for cfg in sorted(per, key=per.get):        # the fastest config that computes right
            why = _verify(cfg, pairs[0], x)
            if why is None:
                best = cfg
                break
            errors[str(cfg)] = why
        results[shape] = ShapeTuning(shape, n, torch_us, best,
                                     per[best] if best else float("inf"),
                                     {str(c): t for c, t in per.items()}, errors)
    return results


@torch.inference_mode()
def _verify(cfg: GemvConfig, pair, x: torch.Tensor) -> str | None:
    """Run `cfg` in every form the model may call (plain, norm with and without the
    residual add, SiLU-and-mul) on a real weight, against torch in fp32; None if all agree
    to within bf16 rounding, else why not. On a toolchain nobody has tried, a config that
    miscompiles or fails to build a fused form must not reach the model."""
    w, b = pair
    k = w.shape[1]
    torch.manual_seed(0)
    r, nw = torch.randn_like(x), torch.rand(k, dtype=x.dtype, device=x.device) + 0.5
    gu = torch.randn(1, 2 * k, dtype=x.dtype, device=x.device)
    f32 = lambda t: None if t is None else t.float()             # noqa: E731

    def ref_linear(row):
        return F.linear(row.float(), w.float(), f32(b))

    def normed(h):
        h = h.float()
        return (nw.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
                .to(x.dtype).float()).to(x.dtype)

    gate, up = gu.float().chunk(2, dim=-1)
    cases = {"plain": (lambda: gemv(x, w, b, cfg), ref_linear(x)),
             "add_rms_norm": (lambda: norm_gemv(x, r, nw, 1e-6, w, b, cfg)[0],
                              ref_linear(normed((x.float() + r.float()).to(x.dtype)))),
             "rms_norm": (lambda: norm_gemv(x, None, nw, 1e-6, w, b, cfg)[0],
                          ref_linear(normed(x))),
             "silu_mul": (lambda: gemv(gu, w, b, cfg, silu_mul=True),
                          ref_linear((F.silu(gate).to(x.dtype).float() * up).to(x.dtype)))}
    for name, (run, want) in cases.items():
        try:
            got = run().float()
        except Exception as e:                      # noqa: BLE001
            return f"{name}: {type(e).__name__}: {e}"[:200]
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
        if not err <= 2 ** -6:                      # a few bf16 units; NaN fails too
            return f"{name}: relative error {err:.3g} against torch fp32"
    return None
