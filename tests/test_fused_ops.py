"""The fused Triton ops (platforms/triton_ops.py) against the torch reference (platforms/ops.py),
run on the CPU under Triton's interpreter.

In fp16, SiLU-and-mul and RoPE must match bit for bit (the kernels round wherever torch
rounds) and the norms to one unit in the last place (a row's sum of squares is added in
another order). bf16 is checked to four units, because the interpreter truncates
fp32 -> bf16 where a GPU rounds to nearest (benchmarks/gpu.py checks bf16 logits on a real
GPU). The fused KV write must equal the reference's write_kv exactly. Then a whole engine in fp16
with every Triton kernel the CUDA platform uses (these ops, the KV write, paged decode
attention) must give the reference engine's greedy tokens, for a Qwen3 and a Llama.
"""
from __future__ import annotations

import textwrap

import pytest

import background
from triton_on_cpu import run_interpreted

CODE = textwrap.dedent('''
    import json, torch
    from workbench import Engine, SamplingParams
    from workbench.platforms.ops import TorchOps
    from workbench.platforms.triton_ops import TritonOps
    torch.manual_seed(0)
    ref, fused = TorchOps(), TritonOps()
    out = {}

    def diff(name, a, b):
        a, b = a.float(), b.float()
        scale = b.abs().max().clamp_min(1e-6)
        out[name] = [bool(torch.equal(a, b)), float(((a - b).abs() / scale).max())]

    for dt in (torch.float16, torch.bfloat16):
        t, h, hk, d, hidden, inter = 7, 6, 2, 64, 96, 80
        x, r = torch.randn(t, hidden, dtype=dt), torch.randn(t, hidden, dtype=dt)
        w = (torch.rand(hidden) + 0.5).to(dt)
        n = str(dt).split(".")[1]
        diff(f"rms_norm {n}", fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
        (a, ra), (b, rb) = fused.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6)
        diff(f"add_rms_norm {n}", a, b)
        diff(f"add_rms_norm residual {n}", ra, rb)
        gu = torch.randn(t, 2 * inter, dtype=dt)
        diff(f"silu_and_mul {n}", fused.silu_and_mul(gu), ref.silu_and_mul(gu))
        qkv = torch.randn(t, h + 2 * hk, d, dtype=dt)
        qk = qkv[:, :h + hk]                                  # a strided view, as in the model
        cos, sin = torch.randn(t, 1, d, dtype=dt), torch.randn(t, 1, d, dtype=dt)
        qn, kn = (torch.rand(d) + 0.5).to(dt), (torch.rand(d) + 0.5).to(dt)
        diff(f"rope {n}", fused.qk_rope(qk, cos, sin, h), ref.qk_rope(qk, cos, sin, h))
        diff(f"qk_norm_rope {n}", fused.qk_rope(qk, cos, sin, h, qn, kn, 1e-6),
             ref.qk_rope(qk, cos, sin, h, qn, kn, 1e-6))

    from workbench.platforms.attention import write_kv
    from workbench.platforms.triton_attention import write_kv_cache
    for dt in (torch.float32, torch.float16):
        kvh, nb, bs, d, t = 3, 10, 16, 48, 9
        pool = [torch.randn(kvh, nb, bs, d, dtype=dt) for _ in range(2)]
        pool += [p.clone() for p in pool]
        qkv = torch.randn(t, 4 + 2 * kvh, d, dtype=dt)        # k, v: strided views
        k, v = qkv[:, 4:4 + kvh], qkv[:, 4 + kvh:]
        slots = torch.randperm(nb * bs)[:t]
        write_kv(pool[0], pool[1], k, v, slots)
        write_kv_cache(pool[2], pool[3], k, v, slots)
        out[f"write_kv {str(dt).split('.')[1]} exact"] = [
            bool(torch.equal(pool[0], pool[2]) and torch.equal(pool[1], pool[3])), 0.0]

    import torch.nn.functional as F
    from workbench.platforms import triton_gemv
    for di, dt in enumerate((torch.float16, torch.bfloat16)):
        for si, (n, k) in enumerate(((37, 300), (64, 1024), (100, 2096))):
            x, w, b = torch.randn(1, k, dtype=dt), torch.randn(n, k, dtype=dt), torch.randn(n, dtype=dt)
            ref = F.linear(x.float(), w.float(), b.float())
            worst = max(float(((triton_gemv.gemv(x, w, b, c).float() - ref).abs()
                               / ref.abs().max()).max()) for c in triton_gemv.CONFIGS)
            worst_torch = float(((F.linear(x, w, b).float() - ref).abs() / ref.abs().max()).max())
            # Sums in another order, and the interpreter truncates to bf16 where a GPU
            # rounds: within twice cuBLAS's own error plus two units in the last place.
            units = 2 * (2 ** -10 if dt == torch.float16 else 2 ** -7)
            out[f"gemv {n}x{k} {str(dt).split('.')[1]}"] = [worst <= 2 * worst_torch + units, worst]
            gu = torch.randn(1, 2 * k, dtype=dt)          # SiLU-and-mul fused into the loads
            # configs 0-5 here, the rest in the engines below (triton_on_cpu.py)
            c = triton_gemv.CONFIGS[3 * di + si]
            out[f"gemv silu_mul {n}x{k} {str(dt).split('.')[1]} exact"] = [bool(torch.equal(
                triton_gemv.gemv(gu, w, b, c, silu_mul=True),
                triton_gemv.gemv(fused.silu_and_mul(gu), w, b, c))), 0.0]
            # RMSNorm (with and without the residual add) fused into the loads, against the
            # fused norm kernel, then the same GEMV: the residual stream exactly, the output
            # to what one unit of the normed row moves (its RMS is summed in another order).
            nw, r = (torch.rand(k) + 0.5).to(dt), torch.randn(1, k, dtype=dt)
            for res in (r, None):
                y, res_out = triton_gemv.norm_gemv(x, res, nw, 1e-6, w, b, c)
                normed, res_ref = (fused.add_rms_norm(x, res, nw, 1e-6) if res is not None
                                   else (fused.rms_norm(x, nw, 1e-6), x))
                want = triton_gemv.gemv(normed, w, b, c)
                rel = float(((y.float() - want.float()).abs() / want.float().abs().max()).max())
                tag = "add_" if res is not None else ""
                out[f"gemv {tag}rms_norm {n}x{k} {str(dt).split('.')[1]}"] = [
                    bool(torch.equal(res_out, res_ref)) and rel <= 2 * worst_torch + 2 * units, rel]

    # tune(): the choice per shape follows the timer, among configs that compute right. A
    # fake timer here: a call runs every weight of its shape; CONFIGS[6] is the fastest but
    # made to compute garbage, CONFIGS[3] the next, and cuBLAS wins on the widest shape.
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 48).half(), torch.nn.Linear(64, 48).half()
            self.c = torch.nn.Linear(64, 512, bias=False).half()
    ran, real_gemv, real_linear = [], triton_gemv.gemv, F.linear
    fast = triton_gemv.CONFIGS[3]                   # one with a strip no wider than 256
    broken = triton_gemv.CONFIGS[6]                 # "fastest", but computes garbage

    def fake_gemv(x, w, b, c, **kw):
        ran.append((c, w.shape[0]))
        y = real_gemv(x, w, b, c, **kw)
        return y + 1 if c == broken else y
    triton_gemv.gemv = fake_gemv
    F.linear = lambda x, w, b: ran.append(("torch", w.shape[0])) or real_linear(x, w, b)

    def timer(fn):
        ran.clear()
        fn()
        what, n = ran[0]
        assert len(ran) == (2 if n == 48 else 1) and all(r == ran[0] for r in ran)
        if what == "torch":
            return len(ran) * (1.0 if n == 512 else 9.0)
        return len(ran) * {fast: 2.0, broken: 1.0}.get(what, 5.0)
    tuning = triton_gemv.tune(Tiny(), timer)
    F.linear = real_linear
    triton_gemv.gemv = lambda x, w, b, c, **kw: (ran.append((c, w.shape[0]))   # records only
                                                 or real_gemv(x, w, b, c, **kw))
    t48 = tuning[(48, 64)]
    out["tune"] = [t48.weights == 2 and t48.best == fast and t48.use_gemv
                   and t48.best_us == 2.0 and "relative error" in t48.errors[str(broken)]
                   and not tuning[(512, 64)].use_gemv and tuning[(512, 64)].torch_us == 1.0]

    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)   # 4 decode steps each
    from triton_on_cpu import triton_on_cpu
    for model in ("random:tiny-qwen3", "random:tiny"):
        kw = dict(model=model, device="cpu", dtype="float16", num_kv_blocks=64)
        a = Engine(**kw)
        with triton_on_cpu():
            b = Engine(**kw)
        assert b.info().attention == "triton" and b.info().ops == TritonOps().name
        ran.clear()
        out[model] = [[o.token_ids for o in a.generate(prompts, p)] ==
                      [o.token_ids for o in b.generate(prompts, p)] and
                      a.generate(prompts[3:], p)[0].token_ids ==   # batch 1: the GEMV
                      b.generate(prompts[3:], p)[0].token_ids]
        out[model + " gemv ran"] = [len(ran) > 0 and bool(b.core.model.ops.gemv_plan)]
    print(json.dumps(out))
''')


@background.job
def fused_ops_interpreted():
    """CODE under the interpreter (a background job: tests/background.py): its results."""
    import json
    return json.loads(run_interpreted(CODE).splitlines()[-1])


@background.job
def gemv_launches():
    """benchmarks/launches.py under the interpreter: its rows."""
    import json
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "launches.py"
    return {d["setup"]: d for d in map(json.loads, run_interpreted(None, script).splitlines())}


def test_fused_ops_match_the_torch_reference_in_the_interpreter(fused_ops_interpreted):
    res = fused_ops_interpreted
    for name, (equal, worst) in ((k, v) for k, v in res.items() if len(v) == 2):
        if name.startswith("gemv"):                         # tolerances in CODE
            assert equal, (name, worst)
        elif name.endswith("exact"):
            assert equal, name
        elif name.endswith("bfloat16"):
            assert worst < 2 ** -5, (name, worst)           # up to four truncations: 4 units
        elif "norm" in name:                                # sums of squares add up in
            assert worst <= 2 ** -10, (name, worst)         # another order: <= 1 unit
        else:
            assert equal, (name, worst)                     # bit for bit
    assert res["random:tiny-qwen3"] == [True] and res["random:tiny"] == [True]
    for name in ("tune", "random:tiny-qwen3 gemv ran", "random:tiny gemv ran"):
        assert res[name] == [True], name


def test_cpu_ops_match_the_torch_reference():
    """The C++ small ops and batch-1 GEMV (platforms/cpu_ops.py) against the torch reference,
    fp32: the residual add, RoPE and the KV write bit for bit; norms, SiLU and the GEMV to a
    few units in the last place (sums in another order, another expf)."""
    import torch

    from workbench.platforms.attention import write_kv
    from workbench.platforms import cpu_kernels as cpu, get_platform
    from workbench.platforms.cpu_ops import CpuOps
    from workbench.platforms.ops import TorchOps
    kern = cpu.load_cpu_kernels()
    if kern is None:
        pytest.skip("no C++ compiler: the CPU kernels could not be built")
    assert isinstance(get_platform("cpu").model_ops(torch.float32), CpuOps)
    torch.manual_seed(0)
    ref, ops = TorchOps(), CpuOps()

    def close(a, b, units=4):
        assert a.shape == b.shape
        return float(((a - b).abs() / b.abs().max()).max()) <= units * 2 ** -23

    for t in (1, 5, 33):
        x, r, w = torch.randn(t, 96), torch.randn(t, 96), torch.rand(96) + 0.5
        out = ops.rms_norm(x, w, 1e-5)
        assert torch.equal(out, kern.rms_norm(x, w, 1e-5))         # the kernel, not a fallback
        assert close(out, ref.rms_norm(x, w, 1e-5))
        (a, ra), (b, rb) = ops.add_rms_norm(x, r, w, 1e-5), ref.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(ra, rb) and close(a, b)
        gu = torch.randn(t, 2 * 80)
        assert close(ops.silu_and_mul(gu), ref.silu_and_mul(gu))
        qkv = torch.randn(t, 6 + 2 * 2, 32)
        qk = qkv[:, :8]                                               # a strided view
        cos, sin = torch.randn(t, 1, 32), torch.randn(t, 1, 32)
        assert torch.equal(ops.qk_rope(qk, cos, sin, 6), ref.qk_rope(qk, cos, sin, 6))
        qn, kn = torch.rand(32) + 0.5, torch.rand(32) + 0.5
        assert close(ops.qk_rope(qk, cos, sin, 6, qn, kn, 1e-6),
                     ref.qk_rope(qk, cos, sin, 6, qn, kn, 1e-6))
        pool = [torch.randn(2, 10, 16, 32) for _ in range(2)]
        copy = [p.clone() for p in pool]
        slots = torch.randperm(160)[:t]
        kern.write_kv(pool[0], pool[1], qkv[:, 6:8], qkv[:, 8:], slots)
        write_kv(copy[0], copy[1], qkv[:, 6:8], qkv[:, 8:], slots)
        assert torch.equal(pool[0], copy[0]) and torch.equal(pool[1], copy[1])
    if hasattr(kern, "gemv"):                                         # AVX-512 machines
        for n, k in ((960, 576), (37, 100), (3, 20)):
            x, wt, bias = torch.randn(1, k), torch.randn(n, k), torch.randn(n)
            assert torch.equal(ops.linear(x, wt), kern.gemv(x, wt, None))
            assert close(ops.linear(x, wt), ref.linear(x, wt), 16)
            assert close(ops.linear(x, wt, bias), ref.linear(x, wt, bias), 16)
    from workbench.platforms.cpu_ops import small_m_rows
    x, wt = torch.randn(3, 64), torch.randn(8, 64)        # a few rows: small_m_linear where
    few = ops.linear(x, wt)                               # it measured faster than the batched
    assert torch.equal(few, kern.small_m_linear(x, wt, None) if small_m_rows(torch.float32) >= 3
                       else ops.batched_linear(x, wt))
    assert close(few, ref.linear(x, wt), 16)
    x = torch.randn(17, 64)                     # more: the batched linear (oneDNN or F.linear)
    assert torch.equal(ops.linear(x, wt), ops.batched_linear(x, wt))
    assert close(ops.linear(x, wt), ref.linear(x, wt), 16)


@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-qwen2", "random:tiny-qwen3"])
def test_cpu_batch_1_decode_in_one_call_equals_the_layer_loop(model):
    """Batch-1 decode through every layer in one C++ call (CpuOps.decode_layers) gives the
    layer loop's logprobs bit for bit where it applies (Llama), and Qwen2's biases and
    Qwen3's q/k norms, which it does not compute, run the loop."""
    import torch

    from workbench import Engine, SamplingParams
    from workbench.platforms import cpu_kernels as cpu
    if cpu.load_cpu_kernels() is None:
        pytest.skip("no C++ compiler: the CPU kernels could not be built")
    kw = dict(model=model, device="cpu", num_kv_blocks=64)
    fused, loop = Engine(**kw), Engine(**kw)
    ran = []
    one_call = fused.core.model.ops.decode_layers
    fused.core.model.ops.decode_layers = lambda *a: ran.append(one_call(*a)) or ran[-1]
    loop.core.model.ops.decode_layers = lambda *a: None
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    prompt = [(5 * j) % 200 + 1 for j in range(21)]
    a, b = fused.generate([prompt], p)[0], loop.generate([prompt], p)[0]
    assert a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    assert a.outputs[0].logprobs and len(a.outputs[0].logprobs) == 10
    used = [r is not None for r in ran]
    assert used.count(True) == (9 if model == "random:tiny" else 0), used
    assert fused.core.model.embed_tokens.weight.dtype == torch.float32


def test_a_batch_past_16_packed_decodes_runs_in_one_call_as_the_loop():
    """Packed weights (int8 rows) at 20 decodes a step: decode_layers takes every row (the
    packed rows' kernel has no 16-row bound), and its logprobs are the layer loop's, with
    qlinear on the packed rows and on dequantized slices alike."""
    from workbench import Engine, SamplingParams
    from workbench.platforms import cpu_kernels as cpu
    from workbench.platforms.quant import PackedWeight
    k = cpu.load_cpu_kernels()
    if k is None:
        pytest.skip("no C++ compiler: the CPU kernels could not be built")
    kw = dict(model="random:tiny", device="cpu", num_kv_blocks=256, quantization="int8")
    fused, loop = Engine(**kw), Engine(**kw)
    rows = []
    one_call = fused.core.model.ops.decode_layers

    def counted(m, x, *a):
        out = one_call(m, x, *a)
        rows.append((x.shape[0], out is not None))
        return out
    fused.core.model.ops.decode_layers = counted
    loop.core.model.ops.decode_layers = lambda *a: None
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[(5 * j + 7 * i) % 200 + 1 for j in range(5 + i)] for i in range(20)]
    old = k.set_packed_rows(0)
    try:
        for most in ((1, 256) if old else (old,)):
            k.set_packed_rows(most)
            rows.clear()
            a, b = fused.generate(prompts, p), loop.generate(prompts, p)
            assert [o.token_ids for o in a] == [o.token_ids for o in b], most
            assert [o.outputs[0].logprobs for o in a] == [o.outputs[0].logprobs for o in b]
            assert (20, True) in rows, rows
    finally:
        k.set_packed_rows(old)
    assert isinstance(fused.core.model.layers[0].mlp.down_proj.weight, PackedWeight)


def test_batch_1_decode_launches_fewer_kernels_with_the_gemv(gemv_launches):
    """benchmarks/launches.py counts a batch-1 decode step's device launches on the CUDA path
    (under the interpreter). As it runs now, no norm, SiLU-and-mul or KV-write launches of
    their own remain (fused into the GEMVs and the decode kernel), every linear layer is one
    GEMV launch, and the step launches at least three fewer kernels per layer than before
    (cuBLAS, separate norms and write, no split)."""
    rows = gemv_launches
    before, after = rows["before"], rows["gemv+kv+split"]
    layers = before["layers"]
    ops = after["by_op"]
    assert "triton._rms_norm_kernel" not in ops and "triton._silu_and_mul_kernel" not in ops, ops
    assert "torch.linear" not in ops and ops["triton._gemv_kernel"] == 4 * layers + 1, ops
    assert "triton._write_kv_kernel" not in ops, ops        # the decode kernel writes K/V
    assert ops["triton._merge_splits_kernel"] == layers, ops        # batch 1 splits here
    assert after["total"] <= before["total"] - 3 * layers, (before, after)
