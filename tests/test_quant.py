"""Low-bit weights on the CPU (EngineConfig.quantization): the GGUF's own Q4_1 and Q8_0
blocks, kept packed, and int8 per output row for any checkpoint. The loader against gguf's
reference dequantization bit for bit, each kernel against a float64 reference on every
format and awkward sizes, and engines in each format against the same format's torch
reference (and, for 'gguf', the fp32 engine: its checkpoint is the same numbers)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench import Engine, EngineConfig, SamplingParams
from workbench.platforms import cpu
from workbench.platforms.quant import PackedWeight, dequantize_rows, quantize_int8, row_bytes

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def kernels():
    k = cpu.load_cpu_kernels()
    if k is None or not hasattr(k, "qgemv"):
        pytest.skip("the CPU kernel (AVX-512) is not available here")
    return k


@pytest.fixture(scope="module")
def gguf_tensors(smollm2_dir):
    from workbench.executor.models.loader import read_gguf, smollm2_gguf_path
    return read_gguf(smollm2_gguf_path())[1]


def random_packed(fmt: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    """Random blocks of `fmt` with sane fp16 scales (random bytes would hold NaNs)."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "int8":
        return quantize_int8(torch.randn(n, k, generator=g))
    data = torch.randint(0, 256, (n, row_bytes(fmt, k)), generator=g, dtype=torch.uint8)
    size = 20 if fmt == "q4_1" else 34
    blocks = data.view(n, k // 32, size)
    blocks[..., 0:2] = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half() \
        .view(torch.uint8)
    if fmt == "q4_1":
        blocks[..., 2:4] = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().view(torch.uint8)
    return PackedWeight(data, fmt, (n, k))


def test_the_gguf_blocks_load_as_they_are_and_dequantize_bit_for_bit(gguf_tensors, kernels):
    """PackedWeight holds the file's bytes; its torch reference and the C++ dequantization
    give gguf's numpy reference numbers exactly, for both formats the file has."""
    from gguf import GGMLQuantizationType, dequantize
    seen = set()
    for name in ("blk.0.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"):
        kind, shape, raw = gguf_tensors[name]
        w = PackedWeight(torch.from_numpy(raw.copy()), {3: "q4_1", 8: "q8_0"}[kind], tuple(shape))
        seen.add(w.format)
        assert w.nbytes == raw.size and np.array_equal(w.data.numpy(), raw)
        ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType(kind)).reshape(shape).copy())
        assert torch.equal(w.dequantize(), ref)
        assert torch.equal(kernels.dequantize(w.data, w.code, shape[1]), ref)
        ids = torch.tensor([0, 3, shape[0] - 1])
        assert torch.equal(w.rows(ids), ref[ids])
        assert torch.equal(kernels.qembedding(ids, w.data, w.code, shape[1], False), ref[ids])
    assert seen == {"q4_1", "q8_0"}


@pytest.mark.parametrize("fmt,n,k", [("q4_1", 37, 96), ("q4_1", 5, 32), ("q8_0", 19, 160),
                                     ("q8_0", 64, 576), ("int8", 13, 75), ("int8", 8, 7),
                                     ("int8", 33, 1536)])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 17, 40])
def test_each_kernel_against_float64(kernels, fmt, n, k, m):
    """qlinear on every path (one row: qgemv; up to 16: the register kernel; more: GEMM on
    dequantized slices), rows that fill no tile of 4 or 8, K with a masked tail (int8)."""
    w = random_packed(fmt, n, k, seed=n * k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ w.dequantize().double().T
    y = kernels.qlinear(x, w.data, w.code)
    assert y.shape == (m, n) and y.dtype == torch.float32
    tol = 1e-5 * (x.abs().double() @ w.dequantize().abs().double().T).max().item()
    assert (y.double() - ref).abs().max().item() <= tol
    xb = x.bfloat16()          # bf16 activations: within bf16's rounding of the same sums
    yb = kernels.qlinear(xb, w.data, w.code)
    assert yb.dtype == torch.bfloat16
    ref_b = xb.double() @ w.dequantize().double().T
    mag = (xb.abs().double() @ w.dequantize().abs().double().T).max().item()
    assert (yb.double() - ref_b).abs().max().item() <= 2 ** -7 * mag


def test_int8_quantization_is_per_output_row():
    w = torch.randn(6, 40) * torch.arange(1, 7).float()[:, None]     # rows of different scale
    q = quantize_int8(w)
    scales = q.data[:, :4].contiguous().view(torch.float32).squeeze(1)
    assert torch.allclose(scales, w.abs().amax(1) / 127)
    assert ((q.dequantize() - w).abs() <= scales[:, None] / 2 + 1e-6).all()
    assert torch.equal(dequantize_rows(q.data, "int8", 40), q.dequantize())


def test_bad_packed_weights_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedWeight(torch.zeros(2, 20, dtype=torch.uint8), "q4_1", (2, 33))
    with pytest.raises(ValueError, match=r"uint8 \[2, 40\]"):
        PackedWeight(torch.zeros(2, 41, dtype=torch.uint8), "q4_1", (2, 64))
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="q3_k")
    with pytest.raises(ValueError, match="quantization: 'gguf'"):
        Engine(model="random:tiny", device="cpu", quantization="gguf")


def greedy(engine, n=24):
    prompts = PROMPTS if engine.info().model == "smollm2" else [[1, 2, 3], [7] * 20, [5, 9]]
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=n,
                                                                         temperature=0,
                                                                         ignore_eos=True))]


@pytest.fixture(scope="module")
def fp32_run(smollm2_dir):
    """The unquantized engine's greedy tokens and lm-eval accuracy on the local task."""
    from workbench.bench.lm_eval_local import accuracy
    e = Engine(model="smollm2", device="cpu", num_kv_blocks=96, quantization=None)
    try:
        assert e.info().weight_formats == ("float32",)
        return greedy(e), accuracy(e)
    finally:
        e.shutdown()


def test_gguf_weights_end_to_end(smollm2_dir, kernels, fp32_run):
    """The engine on the file's own blocks (the CPU default for smollm2): 97 MB of weights,
    not 538; greedy tokens equal the same format's torch reference and the fp32 engine's
    (the fp32 checkpoint is these blocks dequantized), and so does lm-eval's accuracy on the
    local task; batch 1 goes through decode_layers on packed rows."""
    pytest.importorskip("lm_eval")
    from workbench.bench.lm_eval_local import accuracy
    fp32_tokens, fp32_acc = fp32_run
    e = Engine(model="smollm2", device="cpu", num_kv_blocks=96)
    ref = Engine(model="smollm2", device="cpu", num_kv_blocks=96, quantization="gguf",
                 attention_backend="reference")
    try:
        info = e.info()
        assert info.quantization == "gguf" and info.weight_formats == ("q4_1", "q8_0")
        assert e.config.quantization == "auto"   # resolved again by a rebuild with another model
        assert 90e6 < info.weight_bytes < 110e6 and info.num_params > 130e6
        assert info.ops == "cpu" and ref.info().ops == "torch"
        tokens = greedy(e)
        assert tokens == greedy(ref) == fp32_tokens
        one = e.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0,
                                                       ignore_eos=True))[0].token_ids
        assert one == fp32_tokens[0]               # batch 1 (decode_layers) too
        acc = accuracy(e)
        assert acc == fp32_acc and acc["n"] == 40 and acc["acc"] > 0.5, (acc, fp32_acc)
    finally:
        e.shutdown()
        ref.shutdown()


@pytest.mark.parametrize("model", ["random:tiny-qwen2", "smollm2"])
def test_int8_weights_end_to_end(smollm2_dir, kernels, model):
    """Any checkpoint quantized at load (biases and untied heads included: tiny-qwen2 has
    q/k/v biases and a tied head); greedy tokens equal the int8 torch reference's."""
    kw = dict(model=model, device="cpu", num_kv_blocks=96, quantization="int8")
    e, ref = Engine(**kw), Engine(**kw, attention_backend="reference")
    try:
        assert e.info().weight_formats[0] == "int8"
        assert greedy(e, 16) == greedy(ref, 16)
    finally:
        e.shutdown()
        ref.shutdown()
