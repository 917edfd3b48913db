"""Split-context decode (platforms/triton_attention.py): the paged decode kernel with each
request's context cut into num_splits ranges and the partials merged, on the CPU under
Triton's interpreter, against attention over each request's context gathered through its
block table; and the host's choice of num_splits."""
from __future__ import annotations

import json
import textwrap

import pytest

import background
from triton_on_cpu import run_interpreted

CODE = textwrap.dedent('''
    import json, numpy as np, torch, triton.language as tl
    from triton.runtime import interpreter
    from workbench.platforms.triton_attention import decode_splits, paged_decode_attention
    torch.manual_seed(0)

    # Triton 3's interpreter keeps bf16 as its uint16 bits and tl.dot multiplies those bits
    # as integers: widen bf16 operands to fp32 (exact) before its matmul.
    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, *rest):
        a, b = [interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32),
                                         tl.float32) if x.dtype == tl.bfloat16 else x
                for x in (a, b)]
        return dot(self, a, b, *rest)

    interpreter.InterpreterBuilder.create_dot = create_dot

    def reference(q, kc, vc, tables, lens):
        kvH, _, bs, D = kc.shape
        g = q.shape[1] // kvH
        out = []
        for i, n in enumerate(lens.tolist()):
            slots = [int(tables[i, t // bs]) * bs + t % bs for t in range(n)]
            k = kc.view(kvH, -1, D)[:, slots].double().repeat_interleave(g, 0)    # [H, n, D]
            v = vc.view(kvH, -1, D)[:, slots].double().repeat_interleave(g, 0)
            s = torch.einsum("hd,hnd->hn", q[i].double(), k) * D ** -0.5
            out.append(torch.einsum("hn,hnd->hd", s.softmax(-1), v))
        return torch.stack(out)

    res = []
    # (heads, kv heads, head_dim, block_size, pool blocks, dtype, context lengths): G = 1, 2,
    # 8; length 1; shorter than splits x 64; split edges mid-block (block 128: 130 and 500
    # cut at multiples of 64); several hundred tokens. The last row is a graph's padding row:
    # length 1 in the scratch block 0.
    cases = [(4, 4, 64, 16, 64, torch.float32, [1, 100, 457, 1]),
             (8, 4, 48, 128, 12, torch.float32, [130, 500, 1, 1]),
             (16, 2, 128, 16, 40, torch.float16, [77, 333, 1]),
             (16, 2, 64, 128, 8, torch.bfloat16, [5, 260, 1])]
    for H, kvH, D, bs, NB, dt, lens in cases:
        kc, vc = torch.randn(kvH, NB, bs, D, dtype=dt), torch.randn(kvH, NB, bs, D, dtype=dt)
        B = len(lens)
        q = torch.randn(B, H + 2 * kvH, D, dtype=dt)[:, :H]   # a strided view, as the model passes
        lens = torch.tensor(lens)
        perm, used = torch.randperm(NB - 1) + 1, 0
        width = -(-int(lens.max()) // bs) + 1                   # tables wider than needed
        tables = torch.zeros(B, width, dtype=torch.int32)
        for i in range(B - 1):
            nb = -(-int(lens[i]) // bs)
            tables[i, :nb] = perm[used:used + nb]
            used += nb
        assert used <= NB - 1
        ref = reference(q, kc, vc, tables, lens)
        outs = {}
        for splits in (1, 3, 8, None):
            out = torch.full_like(q, float("nan"))              # every element must be written
            paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, out=out, num_splits=splits)
            outs[splits] = out
            res.append(dict(dtype=str(dt), splits=splits, nan=bool(out.isnan().any()),
                            err=float((out.double() - ref).norm() / ref.norm())))
        # new_kv: each row's last token handed in, its pool slot holding garbage; the kernel
        # must attend with the handed-in K/V and write them to the pool.
        last = (lens - 1).tolist()
        slots = torch.tensor([int(tables[i, n // bs]) * bs + n % bs for i, n in enumerate(last)])
        kn = kc.view(kvH, -1, D)[:, slots].transpose(0, 1).clone()       # [B, kvH, D]
        vn = vc.view(kvH, -1, D)[:, slots].transpose(0, 1).clone()
        for splits in (1, 3):
            kc2, vc2 = kc.clone(), vc.clone()
            kc2.view(kvH, -1, D)[:, slots] = 7
            vc2.view(kvH, -1, D)[:, slots] = -7
            out = paged_decode_attention(q, kc2, vc2, tables, lens, D ** -0.5, num_splits=splits,
                                         new_kv=(kn, vn, slots))
            res.append(dict(dtype=str(dt), splits=splits,
                            new_kv_equal=bool(torch.equal(out, outs[splits])),
                            written=bool(torch.equal(kc2, kc) and torch.equal(vc2, vc))))
        for splits in (3, 8):
            a, b = outs[splits].double(), outs[1].double()
            again = paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, num_splits=splits)
            res.append(dict(dtype=str(dt), splits=splits,
                            vs_single=float((a - b).norm() / b.norm()),
                            deterministic=bool(torch.equal(again, outs[splits]))))
    # Batch 1 with 2 KV heads: the automatic choice splits on the CPU stand-in's 8 SMs.
    B, H, kvH, D, bs, NB = 1, 4, 2, 32, 16, 30
    kc, vc = torch.randn(kvH, NB, bs, D), torch.randn(kvH, NB, bs, D)
    q, lens = torch.randn(B, H, D), torch.tensor([421])
    tables = torch.randperm(NB)[None, :27].to(torch.int32)
    out = paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
    ref = reference(q, kc, vc, tables, lens)
    res.append(dict(dtype="auto batch 1", splits=decode_splits(1, kvH, q.device), nan=False,
                    err=float((out.double() - ref).norm() / ref.norm())))
    print(json.dumps(res))
''')


@background.job
def split_decode_interpreted():
    """CODE under the interpreter (a background job: tests/background.py): its results."""
    return json.loads(run_interpreted(CODE).splitlines()[-1])


def test_split_decode_matches_the_reference_in_the_interpreter(split_decode_interpreted):
    res = split_decode_interpreted
    assert res[-1]["splits"] > 1, res[-1]
    for r in res:
        fp32 = r["dtype"] in ("torch.float32", "auto batch 1")
        if "new_kv_equal" in r:                 # the new token handed in, then written
            assert r["new_kv_equal"] and r["written"], r
        elif "err" in r:
            assert not r["nan"], r
            assert r["err"] < (1e-5 if fp32 else 5e-3), r
        else:                                    # the split path against the single pass
            assert r["deterministic"], r
            assert r["vs_single"] < (1e-6 if fp32 else 2e-3), r


def test_split_count_depends_on_batch_kv_heads_and_sms_only(monkeypatch):
    pytest.importorskip("triton")
    import torch

    import workbench.platforms.triton_attention as ta
    cpu = torch.device("cpu")
    assert ta.decode_splits(1, 2, cpu) == ta.CPU_SM_COUNT // 2
    monkeypatch.setattr(ta, "_sm_count", lambda device: 132)          # an H200
    assert ta.decode_splits(1, 8, cpu) == ta.MAX_DECODE_SPLITS          # Qwen3-0.6B, batch 1
    assert ta.decode_splits(4, 8, cpu) == 4
    assert ta.decode_splits(16, 8, cpu) == 1                           # 128 programs already
    assert ta.decode_splits(64, 8, cpu) == 1
