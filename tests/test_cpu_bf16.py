"""bf16 on the CPU end to end (csrc/cpu_ops.cpp, csrc/cpu_attention.cpp in bf16): each
kernel against a float64 reference within bf16's rounding, and against the torch bf16
reference (platforms/ops.py, attention.py) to at most one bf16 unit, since the kernels round
where torch's bf16 ops round; then engines in bf16 on the fused path (the C++ attention,
batch-1 decode_layers) give the plain-torch bf16 reference's greedy tokens."""
from __future__ import annotations

import pytest
import torch

from workbench import Engine, SamplingParams
from workbench.platforms import cpu_kernels as cpu
from workbench.platforms.attention import decode_attention, pool_rows
from workbench.platforms.ops import TorchOps

BF = torch.bfloat16
U = 2.0 ** -8
"""bf16's unit roundoff (8 significant bits, round to nearest)."""


@pytest.fixture(scope="module")
def kern():
    k = cpu.load_cpu_kernels()
    if k is None:
        pytest.skip("no C++ compiler: the CPU kernels could not be built")
    return k


def rand(*shape, seed=0, lo=None):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g) if lo is None else torch.rand(*shape, generator=g) + lo
    return t.to(BF)


def within(got: torch.Tensor, want64: torch.Tensor, bound: torch.Tensor | float) -> bool:
    assert got.dtype == BF and got.shape == want64.shape
    return bool(((got.double() - want64).abs() <= bound).all())


def one_unit(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """At most one bf16 unit in the last place apart (2^-7 relative; exact zeros equal)."""
    assert got.dtype == ref.dtype == BF and got.shape == ref.shape
    return bool(((got.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs()).all())


@pytest.mark.parametrize("t,d", [(1, 576), (5, 96), (33, 17)])
def test_norms_and_silu_in_bf16(kern, t, d):
    x, r, w = rand(t, d, seed=1), rand(t, d, seed=2), rand(d, seed=3, lo=0.5)
    ref = TorchOps()
    # RMSNorm: the scaling rounds to bf16, then the weight multiply does: two roundings.
    x64 = x.double()
    want = w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    out = kern.rms_norm(x, w, 1e-5)
    assert within(out, want, 2.1 * U * want.abs() + 1e-30)
    assert one_unit(out, ref.rms_norm(x, w, 1e-5))
    normed, s = kern.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)                                   # one rounding, as torch's
    s64 = s.double()
    want = w.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert within(normed, want, 2.1 * U * want.abs() + 1e-30)
    assert one_unit(normed, ref.add_rms_norm(x, r, w, 1e-5)[0])
    gu = rand(t, 2 * d, seed=4) * 4
    g64, u64 = gu.double().chunk(2, dim=-1)
    want = g64 / (1 + torch.exp(-g64)) * u64
    out = kern.silu_and_mul(gu)
    assert within(out, want, 2.1 * U * want.abs() + 1e-30)
    assert one_unit(out, ref.silu_and_mul(gu))


@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_silu_and_mul_is_torchs_to_the_bit(kern, dtype):
    """silu(gate) is torch's own, so the product is the reference's exactly, not within a
    unit: with the compiler's exp, a few of these 100k bf16 elements came out one unit
    apart on a Sapphire Rapids VM, and one such element moved a tied greedy token of
    test_bf16_engine_gives_the_torch_references_greedy_tokens."""
    gu = (rand(64, 2 * 1536, seed=5) * 4).to(dtype)
    assert torch.equal(kern.silu_and_mul(gu), TorchOps().silu_and_mul(gu))
    assert torch.equal(kern.silu_and_mul(gu[:1]), TorchOps().silu_and_mul(gu[:1]))


@pytest.mark.parametrize("t,d", [(1, 64), (7, 48), (3, 16), (2, 40)])
def test_rope_and_kv_write_in_bf16(kern, t, d):
    from workbench.platforms.attention import write_kv
    qkv = rand(t, 5 + 2 * 3, d, seed=5)
    qk = qkv[:, :8]                                                   # a strided view
    cos, sin = rand(t, 1, d, seed=6), rand(t, 1, d, seed=7)
    x64 = qk.double()
    rolled = x64.roll(d // 2, dims=-1)
    want = x64 * cos.double() + rolled * sin.double()
    bound = 2.1 * U * ((x64 * cos.double()).abs() + (rolled * sin.double()).abs()) + 1e-30
    out = kern.rope(qk, cos, sin)
    assert within(out, want, bound)
    assert torch.equal(out, TorchOps().qk_rope(qk, cos, sin, 5))     # torch's three roundings
    pool = [torch.zeros(3, 7, 16, d, dtype=BF) for _ in range(2)]
    copy = [p.clone() for p in pool]
    slots = torch.randperm(7 * 16, generator=torch.Generator().manual_seed(t))[:t]
    kern.write_kv(pool[0], pool[1], qkv[:, 5:8], qkv[:, 8:], slots)
    write_kv(copy[0], copy[1], qkv[:, 5:8], qkv[:, 8:], slots)
    assert torch.equal(pool[0], copy[0]) and torch.equal(pool[1], copy[1])


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (37, 100), (3, 20), (9, 33), (1, 7)])
def test_bf16_gemv(kern, n, k):
    """vdpbf16ps sums exact products in fp32 and rounds once (after the bias): within one
    bf16 rounding of the float64 product plus fp32's sum error; K with a masked tail."""
    if not hasattr(kern, "gemv"):
        pytest.skip("no AVX-512 here")
    x, w, b = rand(1, k, seed=n), rand(n, k, seed=k), rand(n, seed=n + k)
    mag = x.double().abs() @ w.double().abs().T
    for bias in (None, b):
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        y = kern.gemv(x, w, bias)
        assert within(y, want, U * want.abs() + 1e-5 * (mag + (0 if bias is None else b.double().abs())))
        assert one_unit(y, torch.nn.functional.linear(x, w, bias)) or \
            within(y, torch.nn.functional.linear(x, w, bias).double(), 1e-5 * mag)
    from workbench.platforms.cpu_ops import CpuOps
    assert torch.equal(CpuOps().linear(x, w), kern.gemv(x, w, None))   # batch 1 takes it


@pytest.mark.parametrize("seed,g,bs,d", [(0, 3, 16, 64), (1, 1, 8, 48), (2, 4, 64, 32),
                                         (3, 2, 16, 16), (4, 3, 32, 40)])
def test_paged_decode_attention_over_a_bf16_pool(kern, seed, g, bs, d):
    """Shuffled block tables, lengths that end mid-block; against float64 attention over the
    same bf16 numbers, and the torch bf16 reference (decode_attention) to one unit."""
    gen = torch.Generator().manual_seed(seed)
    b, kv_heads, nb = 5, 2, 48
    k_cache = torch.randn(kv_heads, nb, bs, d, generator=gen).to(BF)
    v_cache = torch.randn(kv_heads, nb, bs, d, generator=gen).to(BF)
    lens = torch.randint(1, 200, (b,), generator=gen)
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(nb, generator=gen)[:width] for _ in range(b)])
    q = torch.randn(b, kv_heads * g, d, generator=gen).to(BF)
    scale = d ** -0.5
    out = kern.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == BF and out.shape == q.shape
    for i in range(b):
        n = int(lens[i])
        kc = k_cache[:, tables[i]].reshape(kv_heads, -1, d)[:, :n].double()
        vc = v_cache[:, tables[i]].reshape(kv_heads, -1, d)[:, :n].double()
        qi = q[i].double().view(kv_heads, g, d)
        p = torch.softmax(qi @ kc.transpose(1, 2) * scale, dim=-1)
        want = (p @ vc).reshape(-1, d)
        # bf16 rounds the scaled query, each score, each probability and the output: a
        # few units of the output's size (the bound a rigorous sum of |q||k| would give is
        # a hundred times looser than what any kernel error would show, a wrong scale too).
        bound = 4 * U * float(want.abs().max())
        assert within(out[i], want, bound), i
    pad = torch.arange(width * bs)[None, :] >= lens[:, None]
    bias = torch.zeros(pad.shape, dtype=BF).masked_fill_(pad, float("-inf"))
    ref = decode_attention(q, k_cache, v_cache, pool_rows(tables, kv_heads, nb),
                           bias.unsqueeze(1).repeat(kv_heads, 1, 1), scale)
    # Against torch's bf16 path: one unit where the kernel sums as it does (the AVX-512
    # build); a build that sums in another order (AVX2) may round a small output another way,
    # so there each output is within the two paths' bounds of each other (4 units of the
    # row's largest output each, as against float64 above).
    close = ((out.double() - ref.double()).abs()
             <= 8 * U * ref.double().abs().amax(-1, keepdim=True)).all()
    assert one_unit(out, ref) if hasattr(kern, "paged_prefill_attention") else close


def one_greedy_with_logprobs(engine, prompt, n=24):
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
    out = engine.generate([prompt], p)[0].outputs[0]
    return out.token_ids, out.logprobs


def same_until_a_bf16_tie(a, b, unit=0.25) -> bool:
    """Greedy runs a and b ((tokens, top-2 logprobs a step)) take the same tokens until
    the first step where they differ, and there each took the other's runner-up, its
    logit within a bf16 unit of the top one (0.25: the unit of logits in [16, 32), above
    SmolLM2's). A wrong kernel diverges with a clear winner, so fails this."""
    for i, (x, y) in enumerate(zip(a[0], b[0])):
        if x == y:
            continue
        return all(x in lp and y in lp and abs(lp[x].logprob - lp[y].logprob) <= unit
                   for lp in (a[1][i], b[1][i]))
    return True


def greedy(engine, prompts, n=24):
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, p)]


@pytest.mark.parametrize("model", ["smollm2", "random:tiny", "random:tiny-qwen2",
                                   "random:tiny-qwen3"])
def test_bf16_engine_gives_the_torch_references_greedy_tokens(kern, smollm2_dir, model, request):
    """dtype=bfloat16 on the CPU runs the C++ attention and ops (batch 1: decode_layers for
    Llama layers) and gives the plain-torch bf16 path's greedy tokens, batched and after a
    prefix-cache hit; alone, up to a tie (see there). They are the same numbers: in bf16 a
    logit's unit is 2^-8 of its size, so smollm2's top two often tie, and a sum taken in
    another order changes some of these tokens (prefill attention in fp32 did: both paths
    compute it in float64 and round once)."""
    if model == "smollm2" and not hasattr(kern, "paged_prefill_attention"):
        # Seen on an AVX2-only EPYC (12-05): token 18 of the first prompt parts from the
        # reference's, beyond a bf16 tie, with torch's bf16 linears on both sides; not yet
        # explained (issue 44). The random models agree exactly there.
        request.node.add_marker(pytest.mark.xfail(
            reason="AVX2 build: smollm2's bf16 greedy tokens part from the torch reference's "
                   "(issue 44, under investigation)", strict=False))
    kw = dict(model=model, device="cpu", num_kv_blocks=96, dtype="bfloat16", quantization=None)
    e, ref = Engine(**kw), Engine(**kw, attention_backend="reference")
    try:
        info = e.info()
        assert info.attention == "cpu" and info.ops == "cpu" and ref.info().ops == "torch"
        assert e.core.model.embed_tokens.weight.dtype == BF
        prompts = (["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.",
                    "In 1969, the first humans landed on the Moon. Describe what they saw and "
                    "how they felt when they stepped out onto the grey dust of the surface."]
                   if model == "smollm2" else [[1, 2, 3], [7] * 20, [5, 9, 200, 31],
                                               [(3 * j) % 300 + 1 for j in range(45)]])
        ran, prefills = [], []
        one_call = e.core.model.ops.decode_layers

        def decode_layers(model, x, cos, sin, kv_caches, meta):
            out = one_call(model, x, cos, sin, kv_caches, meta)
            if getattr(meta, "rows", None) is not None:             # a step of decode rows
                ran.append((x.shape[0], out is not None))
            return out
        e.core.model.ops.decode_layers = decode_layers
        # The C++ prefill attention exists where the build has AVX-512 (csrc/cpu_attention.cpp);
        # elsewhere prefill runs torch's attention and the rest is checked all the same.
        kernel = e.core.runner.backend._prefill_kernel()
        assert (kernel is not None) == hasattr(kern, "paged_prefill_attention")
        if kernel is not None:
            e.core.runner.backend._prefill_kernel = \
                lambda: lambda *a: prefills.append(a) or kernel(*a)
        tokens = greedy(e, prompts)
        assert tokens == greedy(ref, prompts)
        # Alone, batch-1 decode runs the GEMV and decode_layers, whose sums are in another
        # order than the batched matmul's: a logit can land one bf16 unit away, and where
        # the top two tie that picks the other token. Equal up to such a tie, then not
        # compared (the contexts differ from there on).
        alone, ref_alone = (one_greedy_with_logprobs(x, prompts[0]) for x in (e, ref))
        assert same_until_a_bf16_tie(alone, ref_alone)
        # Again: the long prompt's full blocks are cached now, so its prefill attends over
        # pool rows: the reference's masked path, and on the CPU backend a tail of at most
        # 16 tokens runs as decode rows (cpu_attention.SHORT_CHUNK); both engines had the
        # same cache hits.
        assert greedy(e, prompts[3:]) == greedy(ref, prompts[3:]) == tokens[3:]
        if kernel is not None:
            assert len(prefills) >= 3 and any(a[5].numel() > 1 for a in prefills)   # all at once
        # The steps whose tokens are all decode rows: the 23 decode steps of the batch of 4,
        # of the prompt alone and of the cached prompt again, and that prompt's short tail
        # after its cached blocks. Llama layers (smollm2, tiny) take one C++ call for each at
        # batch 1, and for more rows where this machine measured small_m_linear faster than
        # torch's bf16 linear at that count (cpu_ops.small_m_rows: 2 rows on a Zen 5 with
        # AVX512_BF16, whose oneDNN wins from 4); the other models run the layer loop.
        from workbench.platforms.cpu_ops import small_m_rows
        assert sorted(m for m, _ in ran).count(1) == 2 * 23 and [m for m, _ in ran].count(4) == 23
        llama, most = model in ("smollm2", "random:tiny"), small_m_rows(BF)
        assert [f for _, f in ran] == [llama and (m == 1 or m <= most) for m, _ in ran], (most, ran)
    finally:
        e.shutdown()
        ref.shutdown()


def test_bf16_batch_1_decode_in_one_call_equals_the_layer_loop(kern):
    """decode_layers in bf16 computes what the layer loop's kernels compute, bit for bit."""
    kw = dict(model="random:tiny", device="cpu", num_kv_blocks=64, dtype="bfloat16")
    fused, loop = Engine(**kw), Engine(**kw)
    try:
        loop.core.model.ops.decode_layers = lambda *a: None
        p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
        prompt = [(5 * j) % 200 + 1 for j in range(21)]
        a, b = fused.generate([prompt], p)[0], loop.generate([prompt], p)[0]
        assert a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    finally:
        fused.shutdown()
        loop.shutdown()


@pytest.mark.parametrize("seed,g,bs,d", [(0, 3, 16, 64), (1, 1, 8, 48), (2, 4, 64, 32),
                                         (4, 7, 32, 128), (5, 3, 16, 80)])
def test_paged_prefill_attention_over_a_bf16_pool_is_correctly_rounded(kern, seed, g, bs, d):
    """The bf16 prefill kernel computes in float64 and rounds once: float64 attention
    rounded to bf16, bit for bit, which is what the plain-torch path computes too (so the
    engine's greedy tokens can equal the reference's where logits tie in bf16)."""
    if not hasattr(kern, "paged_prefill_attention"):
        pytest.skip("no AVX-512: the CPU prefill kernel is not built")
    from test_attention import prefill_case, reference_prefill
    inputs, chunks, dense = prefill_case(BF, g, bs, d, seed)
    out = kern.paged_prefill_attention(*inputs)
    assert out.dtype == BF
    assert torch.equal(out, torch.cat(dense).to(BF))
    assert torch.equal(out, reference_prefill(inputs, chunks))


def wild_bf16(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights a trained model's rows resemble, and rows that no palette covers: one row of
    magnitudes from 1e-30 to 1e30, zeros of both signs, an infinity, subnormals."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(BF)
    if n > 2:
        m = len(range(0, k, 3))
        w[1, ::3] = (torch.randn(m, generator=g)
                     * 10.0 ** torch.randint(-30, 30, (m,), generator=g).double()).float().to(BF)
        w[2, :6] = torch.tensor([0.0, -0.0, float("inf"), 2.0 ** -130, -(2.0 ** -133), 1e-38])
    return w


@pytest.mark.parametrize("n,k", [(1, 64), (5, 128), (17, 576), (40, 1536), (203, 192)])
def test_bf16c_holds_the_bf16_weights_bit_for_bit(kern, n, k):
    """quantization='bf16c' is lossless: the torch decoder, the C++ dequantization and an
    embedding lookup of the packed rows give back every bf16 exactly (escapes included:
    the wild row holds far more distinct high bytes than a palette)."""
    from workbench.platforms.quant import bf16c_pack, bf16c_unpack
    w = wild_bf16(n, k)
    p = bf16c_pack(w, max_escape_bytes=1.0)
    assert p.format == "bf16c" and p.shape == (n, k)
    assert (p.escapes > 0) == (n > 2)
    bits = w.view(torch.int16)
    assert torch.equal(bf16c_unpack(p.data, k).view(torch.int16), bits)
    assert torch.equal(p.dequantize(BF).view(torch.int16), bits)
    assert torch.equal(kern.dequantize(p.data, p.code, k).to(BF).view(torch.int16), bits)
    ids = torch.tensor([n - 1, 0, min(1, n - 1), min(2, n - 1)])
    rows = kern.qembedding(ids, p.data, p.code, k, True)
    assert torch.equal(rows.view(torch.int16), bits[ids])
    # 12 bits a weight and a 32-byte header a row (escapes aside): 0.78 of bf16 at K = 576.
    assert p.nbytes == n * (32 + 1.5 * k + 2 * p.escapes)


def test_bf16c_refuses_what_does_not_pay():
    """Rows of K % 64 != 0, or a matrix whose escapes would need more room than 1/16 of
    its bytes, stay plain bf16 (bf16c_pack returns None); bad bytes are refused."""
    from workbench.platforms.quant import PackedWeight, bf16c_pack
    assert bf16c_pack(wild_bf16(4, 96)) is None
    assert bf16c_pack(wild_bf16(4, 576)) is None                  # the wild row
    assert bf16c_pack(wild_bf16(4, 576).float()) is None          # not bf16
    with pytest.raises(ValueError, match="multiple of 64"):
        PackedWeight(torch.zeros(2, 32 + 48, dtype=torch.uint8), "bf16c", (2, 32))
    with pytest.raises(ValueError, match="bf16c data"):
        PackedWeight(torch.zeros(2, 32 + 96 + 1, dtype=torch.uint8), "bf16c", (2, 64))
    with pytest.raises(ValueError, match="quantization: 'bf16c' keeps bf16 weights"):
        Engine(model="random:tiny", device="cpu", quantization="bf16c")


@pytest.mark.parametrize("n,k", [(1, 64), (7, 128), (17, 576), (40, 1536), (203, 192)])
def test_bf16c_gemv_gives_the_plain_bf16_gemvs_bits(kern, n, k):
    """The batch-1 kernel over bf16c rows computes the plain bf16 GEMV's sums in its order:
    the same bits, with and without a bias, through qlinear too (what decode_layers calls),
    for row counts that leave a partial group and rows that take the escape path."""
    if not hasattr(kern, "bf16c_fast"):
        pytest.skip("no AVX-512 BF16 and VBMI here: bf16c_gemv dequantizes instead")
    from workbench.platforms.quant import bf16c_pack
    w = wild_bf16(n, k, seed=n)
    p = bf16c_pack(w, max_escape_bytes=1.0)
    for seed in range(3):
        x, b = rand(1, k, seed=seed), rand(n, seed=seed + 10)
        same = lambda a, c: torch.equal(a.view(torch.int16), c.view(torch.int16))  # noqa: E731
        assert same(kern.bf16c_gemv(x, p.data, None), kern.gemv(x, w, None))
        assert same(kern.bf16c_gemv(x, p.data, b), kern.gemv(x, w, b))
        assert same(kern.qlinear(x, p.data, p.code), kern.gemv(x, w, None))


@pytest.mark.parametrize("model", ["smollm2", "random:tiny-qwen2"])
def test_bf16c_engine_gives_the_plain_bf16_engines_outputs(kern, smollm2_dir, model):
    """dtype=bfloat16 on a CPU whose kernel streams bf16c stores the weights that way by
    default ('auto'): a quarter fewer bytes, and the same tokens and logprobs as the plain
    bf16 engine, batched and alone (batch 1 runs decode_layers over the packed rows; qwen2's
    biases take bf16c_gemv's bias)."""
    if not hasattr(kern, "bf16c_fast"):
        pytest.skip("no AVX-512 BF16 and VBMI here: 'auto' keeps plain bf16")
    kw = dict(model=model, device="cpu", num_kv_blocks=96, dtype="bfloat16")
    packed, plain = Engine(**kw), Engine(**kw, quantization=None)
    try:
        assert packed.info().quantization == "bf16c" and plain.info().quantization is None
        assert packed.info().weight_formats == ("bf16c",)
        ratio = packed.info().weight_bytes / plain.info().weight_bytes
        assert ratio < (0.8 if model == "smollm2" else 1.0), ratio
        prompts = (["The capital of France is", "def fibonacci(n):",
                    "Write a haiku about the sea."] if model == "smollm2"
                   else [[1, 2, 3], [7] * 20, [5, 9, 200, 31]])
        p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
        for batch in (prompts, prompts[:1]):
            a, b = packed.generate(batch, p), plain.generate(batch, p)
            for x, y in zip(a, b):
                assert x.token_ids == y.token_ids
                assert x.outputs[0].logprobs == y.outputs[0].logprobs
    finally:
        packed.shutdown()
        plain.shutdown()
