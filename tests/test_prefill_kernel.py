"""The ragged paged prefill kernel (platforms/triton_attention.py), on the CPU under Triton's
interpreter: against dense causal attention over gathered contexts, and inside a whole
engine with chunked prefill and prefix-cache hits (and split-context decode at batch 1),
where greedy tokens must equal the plain-torch reference engine's, speculative decoding's
verify rows too."""
from __future__ import annotations

import json
import textwrap

import background
from triton_on_cpu import run_interpreted

KERNEL = textwrap.dedent('''
    import json, torch
    import torch.nn.functional as F
    from workbench.platforms.attention import CommonAttentionMetadata
    from workbench.platforms.triton_attention import (paged_prefill_attention, plan_prefill,
                                                      prefill_block_q)
    torch.manual_seed(0)
    res = []
    # (heads, kv heads, head_dim, block_size, pool blocks, dtype): MHA, GQA with G = 2, 3, 4
    cases = [(4, 2, 64, 16, 40, torch.float32), (6, 2, 48, 8, 60, torch.float32),
             (8, 8, 128, 32, 12, torch.float32), (9, 3, 64, 64, 9, torch.float32),
             (16, 8, 128, 16, 40, torch.float16)]
    for H, kvH, D, bs, NB, dt in cases:
        kc, vc = torch.randn(kvH, NB, bs, D, dtype=dt), torch.randn(kvH, NB, bs, D, dtype=dt)
        # (cached prefix, new tokens): fresh prompts, chunks that start and end mid-block,
        # a one-token chunk, a prefix hit of whole blocks
        chunks = [(0, 37), (21, 5), (2 * bs + 3, 50), (5, 1), (bs, 70)]
        perm, used, tables, refs, qs = torch.randperm(NB).tolist(), 0, [], [], 0
        T = sum(n for _, n in chunks)
        q = torch.randn(T, H + 2 * kvH, D, dtype=dt)[:, :H]       # a strided view, as the model passes
        for start, n in chunks:
            ctx = start + n
            t = perm[used:used + -(-ctx // bs)]
            used += len(t)
            tables.append(t + [perm[-1]] * 3)                  # tables wider than needed
            slots = [b * bs + o for b in t for o in range(bs)][:ctx]
            k, v = kc.view(kvH, -1, D)[:, slots].float(), vc.view(kvH, -1, D)[:, slots].float()
            mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
            refs.append(F.scaled_dot_product_attention(q[qs:qs + n].transpose(0, 1).float(), k, v,
                        attn_mask=mask, scale=D ** -0.5, enable_gqa=True).transpose(0, 1))
            qs += n
        assert used <= NB
        ref = torch.cat(refs)
        # The step's metadata as the runner builds it (here with no decodes)
        qsl = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)
        lens = torch.tensor([s + n for s, n in chunks])
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        common = CommonAttentionMetadata(qsl, lens, table, torch.zeros(T, dtype=torch.long), 0,
                                         query_start_loc_cpu=qsl, seq_lens_cpu=lens)
        plan = plan_prefill(common, prefill_block_q(H, kvH))
        out = torch.full((T, H, D), float("nan"), dtype=dt)   # every element must be written
        paged_prefill_attention(q, kc, vc, plan, D ** -0.5, out=out)
        res.append([str(dt), bool(out.isnan().any()), float((out.float() - ref).norm() / ref.norm())])
    print(json.dumps(res))
''')

ENGINE = textwrap.dedent('''
    import json, sys, torch
    import workbench.platforms.triton_attention as ta
    from triton_on_cpu import triton_on_cpu
    from workbench import Engine, SamplingParams

    shared = [(5 * j) % 400 + 3 for j in range(40)]          # a shared 40-token prefix
    prompts = [shared + [(7 * i + 3 * j) % 500 + 1 for j in range(9 + 13 * i)] for i in range(5)]
    prompts.append(shared[:33])                                 # a prefix hit mid-block
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    calls = []
    kernel = ta.paged_prefill_attention
    ta.paged_prefill_attention = lambda *x, **kw: calls.append(1) or kernel(*x, **kw)
    splits = []                                                 # batch-1 decodes split
    choose = ta.decode_splits
    ta.decode_splits = lambda *x: splits.append(choose(*x)) or splits[-1]
    out = {}
    for model in sys.argv[1:]:
        kw = dict(model=model, device="cpu", dtype="float16", num_kv_blocks=96, block_size=16,
                  max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=True)
        a = Engine(**kw)
        with triton_on_cpu():
            b = Engine(**kw)
        assert b.info().attention == "triton" and a.info().attention == "reference"
        calls.clear()
        splits.clear()
        want = [o.token_ids for o in a.generate(prompts[:1], p)]
        want += [o.token_ids for o in a.generate(prompts[1:], p)]
        got = [o.token_ids for o in b.generate(prompts[:1], p)]
        got += [o.token_ids for o in b.generate(prompts[1:], p)]
        steps = b.telemetry.snapshot()[0]
        out[model] = dict(equal=got == want, kernel_calls=len(calls),
                          cached=sum(s.num_cached_tokens for s in steps),
                          chunked=sum(1 for s in steps for k in s.kinds.values() if k == "chunk"),
                          split_decodes=sum(n > 1 for n in splits))
        # Speculative decoding's verify rows go through the same kernel (issue 40): n-gram
        # drafts from prompts that repeat themselves, every draft verified.
        rep = [prompts[i][40:][:12] * 3 for i in range(3)]
        q = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        with triton_on_cpu():
            c = Engine(**kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "adaptive": False})
        calls.clear()
        want = [o.token_ids for o in a.generate(rep, q)]
        got = [o.token_ids for o in c.generate(rep, q)]
        sd, steps = c.telemetry.spec_decode, c.telemetry.snapshot()[0]
        out[model].update(spec_equal=got == want, spec_kernel_calls=len(calls),
                          spec_kernel_steps=c.info().num_layers * sum(
                              1 for s in steps if s.num_prefill_tokens or s.num_draft_tokens),
                          spec_verify_steps=sum(1 for s in steps if s.num_draft_tokens),
                          spec_drafted=sd.num_draft_tokens, spec_accepted=sd.num_accepted_tokens)
    print(json.dumps(out))
''')


@background.job
def prefill_kernel_interpreted():
    """KERNEL under the interpreter (a background job: tests/background.py): its results."""
    return json.loads(run_interpreted(KERNEL).splitlines()[-1])


def _engine_job(model: str):
    def run():
        return json.loads(run_interpreted(ENGINE, None, model).splitlines()[-1])[model]
    run.__name__ = "prefill_engine_" + model.split(":")[1].replace("-", "_")
    run.__doc__ = f"ENGINE under the interpreter for {model} (a background job)."
    return background.job(run)


prefill_engine_tiny_qwen3 = _engine_job("random:tiny-qwen3")
prefill_engine_tiny = _engine_job("random:tiny")


def test_prefill_kernel_matches_dense_causal_attention_in_the_interpreter(
        prefill_kernel_interpreted):
    for dtype, has_nan, err in prefill_kernel_interpreted:
        assert not has_nan, dtype
        assert err < (1e-5 if dtype == "torch.float32" else 2e-3), (dtype, err)


def test_engine_with_the_prefill_kernel_gives_the_reference_tokens(prefill_engine_tiny_qwen3,
                                                                   prefill_engine_tiny):
    for model, r in (("random:tiny-qwen3", prefill_engine_tiny_qwen3),
                     ("random:tiny", prefill_engine_tiny)):
        assert r["equal"], (model, r)
        assert r["kernel_calls"] > 0 and r["cached"] > 0 and r["chunked"] > 0, (model, r)
        assert r["split_decodes"] > 0, (model, r)
        # every step with a prefill chunk or a verify called the kernel, once a layer
        assert r["spec_equal"] and r["spec_drafted"] > 0 and r["spec_verify_steps"] > 0, r
        assert r["spec_kernel_calls"] == r["spec_kernel_steps"], r
