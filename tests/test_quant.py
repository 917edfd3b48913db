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
from workbench.platforms import cpu_kernels as cpu
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
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12, 17, 40])
def test_each_kernel_against_float64(kernels, fmt, n, k, m):
    """qlinear on every path (one row: qgemv; more: the packed rows' kernel, or GEMM on
    dequantized slices: both, whichever set_packed_rows says), row counts that take one pass
    of the packed rows' kernel (up to 8) or two (12, 8 and 4) and rows that fill no tile of 4
    or 8, K with a masked tail (int8)."""
    w = random_packed(fmt, n, k, seed=n * k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ w.dequantize().double().T
    tol = 1e-5 * (x.abs().double() @ w.dequantize().abs().double().T).max().item()
    xb = x.bfloat16()          # bf16 activations: within bf16's rounding of the same sums
    ref_b = xb.double() @ w.dequantize().double().T
    mag = (xb.abs().double() @ w.dequantize().abs().double().T).max().item()
    old = kernels.set_packed_rows(0)                 # 0: a build without the choice
    try:
        for most in ((1, 256) if old and m > 1 else (old,)):
            kernels.set_packed_rows(most)
            y = kernels.qlinear(x, w.data, w.code)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert (y.double() - ref).abs().max().item() <= tol, most
            yb = kernels.qlinear(xb, w.data, w.code)
            assert yb.dtype == torch.bfloat16
            assert (yb.double() - ref_b).abs().max().item() <= 2 ** -7 * mag, most
    finally:
        kernels.set_packed_rows(old)


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
        assert e.info().config.quantization == "auto"   # resolved again by a rebuild with another model
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


# 8-bit activations over 16-row interleaved weights ('gguf-a8', 'int8-a8'; csrc/cpu_a8.cpp)

@pytest.fixture(scope="module")
def a8_kernels(kernels):
    if not hasattr(kernels, "a8_linear"):
        pytest.skip("the a8 kernel needs AVX-512 VNNI")
    return kernels


@pytest.mark.parametrize("fmt,n,k", [("q4_1", 37, 96), ("q4_1", 16, 32), ("q4_1", 5, 64),
                                     ("q8_0", 19, 160), ("q8_0", 64, 576), ("int8", 13, 75),
                                     ("int8", 8, 7), ("int8", 33, 1536)])
def test_tiles_hold_the_same_weights(fmt, n, k):
    """The tiled form is a permutation (and, for signed bytes, an offset) of the row format:
    same bytes a row, the same matrix dequantized, rows looked up through their tiles, and
    back to the file's bytes exactly; the layout the kernel reads, spelled out for one row."""
    w = random_packed(fmt, n, k, seed=n + k)
    t = w.tiled()
    assert t.format == fmt + "x16" and t.activation_bits == 8 and t.shape == (n, k)
    assert t.data.shape == (n, row_bytes(t.format, k))
    assert torch.equal(t.untiled().data, w.data)
    assert torch.equal(t.dequantize(), w.dequantize())
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(t.rows(ids), w.dequantize()[ids])
    if fmt == "q4_1":      # row r of the last tile (R rows), block 0: its 16 GGUF bytes
        r0 = (n - 1) // 16 * 16
        rr, r = n - r0, n - 1 - r0
        tile = t.data[r0:].reshape(-1)
        got = torch.stack([tile[4 * rr + c * 4 * rr + 4 * r + j] for c in range(4) for j in range(4)])
        assert torch.equal(got, w.data[n - 1, 4:20])


def test_activation_quantization_kernel_equals_reference(a8_kernels):
    from workbench.platforms.quant import dequantize_activations, quantize_activations
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 100, generator=g) * torch.logspace(-3, 2, 7)[:, None]
    x[2, 32:64] = 0                           # a block of zeros: scale 0, q 0
    x[3, 5] = 1e3                             # an outlier
    q, d = quantize_activations(x)
    kq, kd = a8_kernels.a8_quantize(x)
    assert q.shape == (7, 128) and d.shape == (7, 4)
    assert torch.equal(kq, q) and torch.equal(kd, d)
    assert q.abs().max() <= 127 and (q[:, 100:] == 0).all() and (d[2, 1] == 0)
    err = (dequantize_activations(q, d, 100) - x).abs()
    assert (err <= d.repeat_interleave(32, 1)[:, :100] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("fmt,n,k", [("q4_1", 37, 96), ("q4_1", 5, 32), ("q4_1", 48, 1536),
                                     ("q8_0", 19, 160), ("q8_0", 64, 576), ("int8", 13, 75),
                                     ("int8", 8, 7), ("int8", 33, 1536)])
@pytest.mark.parametrize("m", [1, 3, 4, 9, 40])
def test_a8_kernel_against_float64(a8_kernels, fmt, n, k, m):
    """a8_linear (through qlinear, as the model and decode_layers call it) against the
    float64 product of the quantized activations and the weights: N that fills no tile,
    K with a padded block (int8), activation rows that fill no pass of 4 (VNNI) or of 16
    (40 rows: AMX where the CPU has it); bf16 rows too."""
    from workbench.platforms.quant import a8_linear, dequantize_activations, quantize_activations
    w = random_packed(fmt, n, k, seed=n * k + m).tiled()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    xd = dequantize_activations(*quantize_activations(x), k).double()
    wd = w.dequantize().double()
    ref = xd @ wd.T
    y = a8_kernels.qlinear(x, w.data, w.code)
    assert y.shape == (m, n) and y.dtype == torch.float32
    tol = 1e-5 * (xd.abs() @ wd.abs().T).max().item()
    assert (y.double() - ref).abs().max().item() <= tol
    assert (a8_linear(x, w).double() - ref).abs().max().item() <= tol   # the torch reference
    yb = a8_kernels.qlinear(x.bfloat16(), w.data, w.code)
    assert yb.dtype == torch.bfloat16
    xbd = dequantize_activations(*quantize_activations(x.bfloat16().float()), k).double()
    assert (yb.double() - xbd @ wd.T).abs().max().item() <= 2 ** -7 * (xbd.abs() @ wd.abs().T).max().item()
    ids = torch.tensor([0, n - 1, n // 3])
    assert torch.equal(a8_kernels.qembedding(ids, w.data, w.code, k, False), wd.float()[ids])


@pytest.mark.parametrize("fmt,n,k", [("q4_1", 37, 96), ("q4_1", 64, 1536), ("q8_0", 19, 160),
                                     ("q8_0", 48, 576), ("int8", 13, 75), ("int8", 33, 1536)])
def test_a8_amx_gives_the_vnni_kernels_bits(a8_kernels, fmt, n, k):
    """AMX-INT8 (several activation rows) sums the same int32 block products as VNNI and
    scales them with the same fp32 operations in the same order: equal bits, whichever
    path the row count picks, over rows that fill no 16-row pass, a last tile of fewer
    than 16 weight rows (VNNI's, in the same call) and odd block counts."""
    if not a8_kernels.a8_amx():
        pytest.skip("no AMX-INT8 on this CPU (or the OS refused its tile state)")
    w = random_packed(fmt, n, k, seed=n + k).tiled()
    for m in (2, 16, 17, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
        amx = a8_kernels.a8_linear(x, w.data, w.code, 1)
        assert torch.equal(amx, a8_kernels.a8_linear(x, w.data, w.code, 0)), (fmt, m)
        assert torch.equal(amx, a8_kernels.a8_linear(x, w.data, w.code)), (fmt, m)


def test_a8_quantization_is_refused_where_it_cannot_load():
    with pytest.raises(ValueError, match="quantization: 'gguf-a8'"):
        Engine(model="random:tiny", device="cpu", quantization="gguf-a8")


A8_MARGIN = 0.3
"""Log-probability within which the reference's top token may stand above the engine's
greedy one. Quantizing activations to int8 makes a forward pass chaotic at the last-bit
level: an activation that lands on a rounding boundary moves by a whole step, so ops that
differ from torch by an ulp (the C++ norms, SiLU and attention) move a logprob by up to
~0.1 (measured: scaling the reference's activations by 1 + 1e-7 moved one by 0.099). Exact
greedy equality with the torch reference holds only where margins exceed that."""


@pytest.mark.parametrize("quantization,model", [("gguf-a8", "smollm2"), ("int8-a8", "smollm2"),
                                                ("int8-a8", "random:tiny-qwen2")])
def test_a8_engines_agree_with_their_torch_reference(smollm2_dir, a8_kernels, quantization,
                                                     model):
    """The engine's greedy continuations (batched, and batch 1, which runs decode_layers)
    teacher-forced through the same format's torch reference (attention_backend=
    'reference': quant.a8_linear in every linear): every token is the reference's argmax or
    within A8_MARGIN of it, and the engine's own logprobs of its tokens match the
    reference's to within that sensitivity (a wrong tile layout, scale or min term would
    put them nats apart)."""
    kw = dict(model=model, device="cpu", num_kv_blocks=96, quantization=quantization)
    e, ref = Engine(**kw), Engine(**kw, attention_backend="reference")
    try:
        info = e.info()
        assert info.quantization == quantization and info.ops == "cpu"
        assert info.weight_formats[0].endswith("x16")
        assert all(f.endswith("x16") for f in info.weight_formats if f != "float32")
        prompts = ([e.tokenizer.encode(p) for p in PROMPTS] if model == "smollm2"
                   else [[1, 2, 3], [7] * 20, [5, 9]])
        p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
        outs = e.generate(prompts, p) + e.generate(prompts[:1], p)     # the last: batch 1
        diffs, ranked = [], 0
        for ids, o in zip(prompts + prompts[:1], outs):
            forced = ref.generate([ids + o.token_ids], SamplingParams(
                max_tokens=1, temperature=0, prompt_logprobs=1))[0].prompt_logprobs[len(ids):]
            for row, own, t in zip(forced, o.outputs[0].logprobs, o.token_ids):
                top = max(v.logprob for v in row.values())
                # Or a tie the noise flipped: the engine's own logprobs put the reference's top
                # token within the margin of its pick (int8-a8 on a Zen 5 with torch 2.13: 0.02
                # apart in the engine, 0.32 in the reference, each token's own logprob moved
                # by under 0.2).
                ref_top = max(row, key=lambda k: row[k].logprob)
                tied = ref_top in own and own[t].logprob - own[ref_top].logprob <= A8_MARGIN
                assert row[t].logprob >= top - A8_MARGIN or tied, (o.token_ids, row, own, t)
                ranked += row[t].rank == 1
                diffs.append(abs(row[t].logprob - own[t].logprob))
        assert ranked >= 0.9 * len(diffs), (ranked, len(diffs))
        assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < A8_MARGIN, diffs
    finally:
        e.shutdown()
        ref.shutdown()
