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

import os
import subprocess
import sys
import textwrap

import pytest

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

    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    from triton_on_cpu import triton_on_cpu
    for model in ("random:tiny-qwen3", "random:tiny"):
        kw = dict(model=model, device="cpu", dtype="float16", num_kv_blocks=64)
        a = Engine(**kw)
        with triton_on_cpu():
            b = Engine(**kw)
        assert b.info().attention == "triton" and b.info().ops == TritonOps().name
        out[model] = [[o.token_ids for o in a.generate(prompts, p)] ==
                      [o.token_ids for o in b.generate(prompts, p)]]
    print(json.dumps(out))
''')


def test_fused_ops_match_the_torch_reference_in_the_interpreter():
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TRITON_INTERPRET": "1",
                            "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                                       os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (equal, worst) in ((k, v) for k, v in res.items() if " " in k):
        if name.endswith("exact"):
            assert equal, name
        elif name.endswith("bfloat16"):
            assert worst < 2 ** -5, (name, worst)           # up to four truncations: 4 units
        elif "norm" in name:                                # sums of squares add up in
            assert worst <= 2 ** -10, (name, worst)         # another order: <= 1 unit
        else:
            assert equal, (name, worst)                     # bit for bit
    assert res["random:tiny-qwen3"] == [True] and res["random:tiny"] == [True]
