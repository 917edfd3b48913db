"""The platform issue's GPU checks and timings, in one call on a lent CUDA machine.

    python benchmarks/gpu.py --anchor path/to/gpu_anchor.py [--out DIR]
    python benchmarks/gpu.py --small          # the same steps at toy sizes, any device (CPU too)

Each part is guarded and prints its JSON lines as it measures (also appended to
DIR/gpu.jsonl); a part that raises adds `<part>_error` and the call goes on. A table of our
figures beside the HF peers, measured in this same call, comes last. The harness (lines,
guards, timer, workloads) is workbench/bench/device_run.py, shared with benchmarks/npu.py.

1. correctness: a random Qwen3 checkpoint (saved as safetensors, loaded like any local
   checkpoint). Greedy tokens of our engine in fp32, eager, with decode graphs and with
   'full' (decode graphs plus piecewise prefill graphs), against
   HF `generate` one prompt at a time; in bf16, the first step's logits against HF fp32,
   beside HF bf16's own error.
2. batch-1 decode: `random:qwen3-0.6b` in bf16, time per output token, eager vs decode graphs.
3. W1: 256 requests, prompts uniform in [100, 1024] tokens drawn exactly as gpu_anchor.py
   draws them (random.Random(0)), 512 new tokens each, EOS ignored: output tokens/s, with
   graph_mode 'decode' and 'full'.
4. peers: gpu_anchor.py (HF `generate` batch 1 and static batches of 64, HF
   `generate_batch`) in a subprocess, in this same call.
5. ceilings: this card's copy bandwidth (bytes read + written) and bf16 matmul rate,
   measured here; every speed figure is also given as a fraction of its physical limit.
6. prefill: prompt tokens/s on 8k-token steps (64 prompts of 1024 tokens, one new token).
7. release: build -> close -> build three times at gpu_memory_utilization 0.9, then an
   engine dropped without close() (garbage collector off): is its memory back?
8. concurrency: W1's requests through a closed-loop client holding 1, 16, 64 or 256 in
   flight (4x that many requests, at most W1's 256): throughput and TTFT against concurrency.
9. vllm: the workload of a published vLLM run (Qwen3-0.6B shape, 500 prompts of 512 random
   ids, 128 new tokens, EOS ignored): requests/s, greedy (as vLLM's client sends) and with
   Qwen3's generation defaults.
10. sampled: W1 and batch 1 with real traffic's sampling (Qwen3's defaults, 0.7 + top_p 0.9,
   a stop string, logprobs 5) beside greedy in one engine, as ratios.
11. spec: speculative decoding's A/B (issue 40): batch 1 and W1, greedy, plain beside n-gram
   (k = 4) with the engine's budget and with every draft verified (adaptive off), engines
   built alike; the tokens must equal plain's. Each verify step's cost against a plain
   decode step of the same batch says what acceptance pays on this card.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workbench import Engine, SamplingParams  # noqa: E402
from workbench.bench.device_run import (DeviceRun, anchor_workload, b1_prompt,  # noqa: E402
                                        random_prompts, rel_err, w1_shape, within_bf16_error)
from workbench.bench.offline import (SAMPLING_WORKLOADS, Workload, run_engine,  # noqa: E402
                                     run_engine_b1, save_random_qwen3)
from workbench.bench.speculative import timed_round  # noqa: E402
from workbench.telemetry import percentile  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RUN = DeviceRun("gpu", DEV)


def ceiling(key: str):
    return RUN.get("ceilings", key)


def free_engine(e: Engine) -> None:
    e.close()                       # frees the KV pool, graphs and weights now


# ---- 1. correctness -------------------------------------------------------------------------
def correctness(small: bool) -> None:
    from transformers import Qwen3ForCausalLM
    tmp = Path(tempfile.mkdtemp(prefix="wb-qwen3-"))
    save_random_qwen3(tmp, layers=2 if small else 4, heads=8, kv_heads=4, head_dim=64)
    hf = Qwen3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(DEV).eval()
    prompts = anchor_workload(6, 20, 200, 4096, seed=1)
    prompts.append(prompts[5][:70] + [11, 12, 13])          # a prefix-cache hit, mid-block
    new = 24
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=DEV)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for mode in ("eager", "decode", "full"):
        # A 256-token step budget: prompts are chunked, and 'full' replays its steps
        # piecewise (buckets up to 512 tokens).
        e = Engine(model=str(tmp), device=DEV, dtype="float32", graph_mode=mode, max_num_seqs=8,
                   num_kv_blocks=256, max_num_batched_tokens=256)
        got = [o.token_ids for o in e.generate(prompts[:6], params)]
        got += [o.token_ids for o in e.generate(prompts[6:], params)]   # hits prompt 5's cache
        steps = e.telemetry.snapshot()[0]
        RUN.emit(f"correctness_fp32_{mode}", equal=got == want,
                 prompts_equal=sum(g == w for g, w in zip(got, want)), of=len(prompts),
                 graph_mode_run=e.info().graph_mode, graph_steps=sum(s.graph for s in steps),
                 piecewise_steps=sum(s.graph_kind == "PIECEWISE" for s in steps),
                 ahead_steps=sum(s.scheduled_ahead for s in steps),
                 cached_tokens=sum(s.num_cached_tokens for s in steps),
                 notices=e.telemetry.notices)
        free_engine(e)
    # bf16: first-step logits of a prompt, against HF fp32, beside HF bf16's own error.
    p = prompts[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([p], device=DEV)).logits[0, -1].float()
        hf16 = hf.to(torch.bfloat16)(torch.tensor([p], device=DEV)).logits[0, -1].float()
    e = Engine(model=str(tmp), device=DEV, dtype="bfloat16", graph_mode="eager", max_num_seqs=8,
               num_kv_blocks=256)
    ours = e.core.prompt_logits(p)
    err, hf_err = rel_err(ours, ref), rel_err(hf16, ref)
    RUN.emit("correctness_bf16_logits", ours_rel_err=round(err, 5),
             hf_bf16_rel_err=round(hf_err, 5), ok=within_bf16_error(err, hf_err),
             argmax_equal=int(ours.argmax()) == int(ref.argmax()))
    free_engine(e)
    # bf16 batch-1 decode, replayed from decode graphs: the path of the batch-1 work (the
    # GEMV as tuned at start with the norms and SiLU-and-mul fused into it, split-context
    # attention writing its own K/V). Each step's top-20 logprobs against HF fp32 on the
    # same tokens (teacher-forced), beside HF bf16's own error on the same entries.
    e = Engine(model=str(tmp), device=DEV, dtype="bfloat16", graph_mode="decode",
               max_num_seqs=8, num_kv_blocks=256)
    out = e.generate([p], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                         logprobs=20))[0]
    gemv = gemv_tuning(e)
    free_engine(e)
    full = torch.tensor([p + out.token_ids], device=DEV)
    with torch.inference_mode():
        lp16 = hf(full).logits[0].float().log_softmax(-1)           # hf is bf16 by now
        del hf
        hf = Qwen3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(DEV).eval()
        lp32 = hf(full).logits[0].float().log_softmax(-1)
    ours_err = hf16_err = 0.0
    for i, top in enumerate(out.outputs[0].logprobs):
        row = len(p) - 1 + i                                        # predicts output token i
        for tok, lp in top.items():
            ours_err = max(ours_err, abs(lp.logprob - float(lp32[row, tok])))
            hf16_err = max(hf16_err, abs(float(lp16[row, tok]) - float(lp32[row, tok])))
    greedy = [int(lp32[len(p) - 1 + i].argmax()) for i in range(len(out.token_ids))]
    RUN.emit("correctness_bf16_decode_b1", ours_max_abs_err=round(ours_err, 4),
             hf_bf16_max_abs_err=round(hf16_err, 4),
             ok=within_bf16_error(ours_err, hf16_err, 0.05),
             tokens_equal_fp32_argmax=sum(a == b for a, b in zip(out.token_ids, greedy)),
             of=len(greedy), gemv_chosen={str(t["shape"]): t["chosen"] for t in gemv or []})


# ---- 2. batch-1 decode ----------------------------------------------------------------------
def device_kernels_per_decode_step(e: Engine, prompt: list[int]) -> dict | None:
    """Kernels one eager batch-1 decode step launches (from the profiler), the device time
    they take, and the kernels that take most of it; None off CUDA."""
    if DEV != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    e.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    e.step()                                                  # the prefill
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        e.step()
    e.generate([[1, 2]], SamplingParams(max_tokens=1))          # drains the rest
    return kernel_summary(prof, 8)


def kernel_summary(prof, top_n: int) -> dict:
    """A profile's device kernels: how many, their total device time, and the top_n names
    by time (count and µs each)."""
    kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for ev in kernels:
        by_name.setdefault(ev.name[:70], []).append(ev.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top_n]
    return dict(kernels=len(kernels), device_ms=round(sum(ev.device_time for ev in kernels) / 1e3, 3),
                top=[[name, len(t), round(sum(t), 1)] for name, t in top])


def graph_replay_kernels(e: Engine, size: int) -> dict | None:
    """The kernels of one replay of the decode graph for `size` requests, from the profiler:
    how many, their device time (the rest of graph_replay_ms is the gaps between them) and
    the kernels that take most of it; None off CUDA."""
    graphs = e.core.runner.graphs
    if DEV != "cuda" or graphs is None or size not in graphs.graphs:
        return None
    from torch.profiler import ProfilerActivity, profile
    graph = graphs.graphs[size]
    graph.replay()
    RUN.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        RUN.sync()
    return kernel_summary(prof, 10)


def graph_replay_ms(e: Engine, size: int) -> float | None:
    """One replay of the decode graph for `size` requests, launched and waited for, best of
    50 (the roofline's measurement): no host work of the engine's."""
    graphs = e.core.runner.graphs                  # a device-time diagnostic: the core itself
    if DEV != "cuda" or graphs is None or size not in graphs.graphs:
        return None
    return round(RUN.timed(graphs.graphs[size].replay, 50) * 1e3, 3)


def gemv_tuning(e: Engine) -> list[dict] | None:
    """What the engine measured at start for its batch-1 linear layers: cuBLAS and the
    Triton GEMV per weight shape, in µs per call inside a graph, and what it chose."""
    ops = e.core.model.ops
    tuning = getattr(ops, "gemv_tuning", None)
    if not tuning:
        return None
    size = next(e.core.model.parameters()).element_size()
    return [t.as_dict(size) for t in tuning.values()]


def batch1(small: bool) -> None:
    """Batch-1 decode: eager, decode graphs with the GEMV as tuned at start, and decode
    graphs on cuBLAS alone (the GEMV's A/B, same call)."""
    model = "random:tiny" if small else "random:qwen3-0.6b"
    new = 32 if small else 256
    rows = {}
    for mode in ("eager", "decode", "decode_cublas"):
        TritonOps = None
        if mode == "decode_cublas":
            if DEV != "cuda":
                continue
            try:
                from workbench.platforms.triton_ops import TritonOps
                TritonOps.tune_gemv = False
            except ImportError:
                continue
        try:
            e = Engine(model=model, device=DEV, graph_mode=mode.split("_")[0], max_num_seqs=8,
                       max_model_len=2048, num_kv_blocks=512)
        finally:
            if TritonOps is not None:
                TritonOps.tune_gemv = True
        prompt = b1_prompt(e.info().vocab_size)
        r = run_engine_b1(e, prompt, new)
        rows[mode] = r
        kernels = None
        if mode == "eager":
            try:
                kernels = device_kernels_per_decode_step(e, prompt)
            except Exception as ex:                           # a diagnostic, never fatal
                kernels = f"{type(ex).__name__}: {ex}"[:200]
        try:
            replay_kernels = graph_replay_kernels(e, 1)
        except Exception as ex:                               # a diagnostic, never fatal
            replay_kernels = f"{type(ex).__name__}: {ex}"[:200]
        RUN.emit(f"b1_{mode}", model=model, graph_mode_run=e.info().graph_mode, ops=e.info().ops,
                 eager_decode_step=kernels, graph_replay_ms=graph_replay_ms(e, 1),
                 graph_replay_kernels=replay_kernels,
                 gemv=gemv_tuning(e) if mode == "decode" else None, **r)
        free_engine(e)
    ratio = dict(eager_over_decode=round(rows["eager"]["tpot_ms"] / rows["decode"]["tpot_ms"], 2))
    if "decode_cublas" in rows:
        ratio["cublas_over_gemv"] = round(rows["decode_cublas"]["tpot_ms"]
                                          / rows["decode"]["tpot_ms"], 3)
    RUN.emit("b1_ratio", **ratio)


# ---- 3. W1 ----------------------------------------------------------------------------------
def w1(small: bool, mode: str) -> None:
    model = "random:tiny" if small else "random:qwen3-0.6b"
    n, lo, hi, new = w1_shape(small)
    t = time.perf_counter()
    e = Engine(model=model, device=DEV, graph_mode=mode, max_num_seqs=256,
               max_num_batched_tokens=8192, max_model_len=2048)
    build_s = time.perf_counter() - t
    prompts = anchor_workload(n, lo, hi, e.info().vocab_size)
    # The first run of a fresh engine compiles kernels for its new shapes inside its first
    # prefill steps (the 2026-11-30 W1 had TTFT p99 926 ms where the same 256 requests took
    # 558 ms later in that session): it is kept as cold_*, and the second run is W1.
    cold = run_engine(e, Workload(prompts, [new] * n))
    e.reset_prefix_cache()
    first = e.telemetry.num_steps
    r = run_engine(e, Workload(prompts, [new] * n))
    steps = e.telemetry.steps_since(first)
    # The physical floor: every decode token reads its request's whole context once, every
    # decode step the weights (at least new - 1 steps), at the copy bandwidth measured here;
    # prefill at the matmul peak (its linear layers only: a lower bound too).
    mn = model_numbers(e)
    kv = sum(sum(len(p) + j + 1 for j in range(1, new)) for p in prompts) * mn["kv_bytes_per_token"]
    bw, peak = ceiling("copy_TBps"), ceiling("bf16_TFLOPs")
    bound = None
    if bw and peak:
        bound = ((kv + (new - 1) * mn["weight_bytes"]) / (bw * 1e12)
                 + 2 * mn["layer_params"] * sum(map(len, prompts)) / (peak * 1e12))
    RUN.emit("w1_ours" + ("" if mode == "decode" else f"_{mode}"), model=model, graph_mode=mode,
             requests=n, prompt_len=[lo, hi], new=new, build_s=round(build_s, 1),
             kv_blocks=e.info().num_kv_blocks, graph_steps=sum(s.graph for s in steps),
             piecewise_steps=sum(s.graph_kind == "PIECEWISE" for s in steps),
             decode_steps=sum(s.phase == "decode" for s in steps),
             bound_tok_s=round(n * new / bound) if bound else None,
             fraction_of_bound=round(bound / r["seconds"], 3) if bound else None,
             cold_ttft_p99_s=cold["ttft_p99_s"], cold_out_tok_s=cold["out_tok_s"], **r)
    free_engine(e)


def sampled(small: bool) -> None:
    """Real traffic beside greedy (issue 21): W1 and batch 1 with each of
    bench.offline.SAMPLING_WORKLOADS in one engine (decode graphs, async scheduling), each
    ratio against the mean of a greedy run before them and one after (targets: >= 0.9x greedy
    W1, batch-1 TPOT within 5 %)."""
    model = "random:tiny" if small else "random:qwen3-0.6b"
    n, lo, hi, new = w1_shape(small)
    e = Engine(model=model, device=DEV, graph_mode="decode", max_num_seqs=256,
               max_num_batched_tokens=8192, max_model_len=2048)
    wl = Workload(anchor_workload(n, lo, hi, e.info().vocab_size), [new] * n)
    prompt = b1_prompt(e.info().vocab_size)
    b1_new = 32 if small else 256
    w1_rows, b1_rows = {"greedy": run_engine(e, wl)}, {"greedy": run_engine_b1(e, prompt, b1_new)}
    for name, kw in SAMPLING_WORKLOADS.items():
        w1_rows[name] = run_engine(e, wl, sampling=kw)
        b1_rows[name] = run_engine_b1(e, prompt, b1_new, kw)
    w1_rows["greedy_again"] = run_engine(e, wl)
    b1_rows["greedy_again"] = run_engine_b1(e, prompt, b1_new)
    tok_s = (w1_rows["greedy"]["out_tok_s"] + w1_rows["greedy_again"]["out_tok_s"]) / 2
    tpot = (b1_rows["greedy"]["tpot_ms"] + b1_rows["greedy_again"]["tpot_ms"]) / 2
    steps = e.telemetry.snapshot()[0]
    RUN.emit("sampled", model=model, requests=n, new=new,
             steps_ahead=sum(s.scheduled_ahead for s in steps), steps=len(steps),
             w1_tok_s={k: r["out_tok_s"] for k, r in w1_rows.items()},
             w1_vs_greedy={k: round(r["out_tok_s"] / tok_s, 3) for k, r in w1_rows.items()},
             b1_tpot_ms={k: r["tpot_ms"] for k, r in b1_rows.items()},
             b1_tpot_vs_greedy={k: round(r["tpot_ms"] / tpot, 3) for k, r in b1_rows.items()})
    free_engine(e)


SPEC = {"plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "ngram_every_draft": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        "draft_self": {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False}}
"""spec's arms: plain decoding, n-gram as it ships (it drafts where the step's measured costs
say drafts pay), n-gram verifying every draft it finds (what a verify costs here), and the
target's own weights as its draft model (every draft kept: the draft model's batched passes
and graphs on this card, checked, not a speed-up)."""


def _spec_run(e: Engine, prompts: list[list[int]], new: int) -> dict:
    """prompts through e, greedy, EOS ignored (a warm-up first): output tok/s, the tokens,
    the acceptance, and the median decode and verify step by decode rows (telemetry)."""
    import statistics
    e.generate([prompts[0][:8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    e.reset_prefix_cache()
    steps0 = e.telemetry.num_steps
    dt, tokens, st = timed_round(e, prompts, SamplingParams(max_tokens=new, temperature=0,
                                                            ignore_eos=True))
    kinds: dict[str, list[float]] = {"decode": [], "verify": []}
    rows: dict[str, list[int]] = {"decode": [], "verify": []}
    for s in e.telemetry.steps_since(steps0):
        if s.num_prefill_tokens == 0 and s.num_decode_tokens:
            kind = "verify" if s.num_draft_tokens else "decode"
            kinds[kind].append(s.duration * 1e3)
            rows[kind].append(s.num_decode_tokens)
    acceptance = st["acceptance_rate"]
    return dict(out_tok_s=round(sum(map(len, tokens)) / dt, 1), seconds=round(dt, 2),
                tokens=tokens, drafted=st["drafted"],
                acceptance=None if acceptance is None else round(acceptance, 3),
                steps={k: len(v) for k, v in kinds.items()},
                step_ms={k: round(statistics.median(v), 3) if v else None
                         for k, v in kinds.items()},
                step_rows={k: round(statistics.median(v), 1) if v else None
                           for k, v in rows.items()})


def spec(small: bool) -> None:
    """Speculative decoding beside plain decoding (the docstring's part 11). Random weights
    write no text a passage grounds, so the acceptance is this model's (its greedy text
    repeats itself, which prompt lookup drafts from), printed beside each ratio; the step
    costs are the card's, whatever the weights."""
    model = "random:tiny" if small else "random:qwen3-0.6b"
    n, lo, hi, new = w1_shape(small)
    b1_new = 32 if small else 256
    got: dict[str, dict] = {}
    for arm, cfg in SPEC.items():
        if cfg is not None and cfg["method"] == "draft_model":
            cfg = {**cfg, "model": model}
        e = Engine(model=model, device=DEV, graph_mode="decode", max_num_seqs=256,
                   max_num_batched_tokens=8192, max_model_len=2048, speculative_config=cfg)
        vocab = e.info().vocab_size
        got[arm] = {"b1": _spec_run(e, [b1_prompt(vocab)], b1_new),
                    "w1": _spec_run(e, anchor_workload(n, lo, hi, vocab), new),
                    "draft_graph_mode": getattr(e.core.pipeline.spec.proposer, "graph_mode",
                                                None) if cfg else None}
        free_engine(e)
    for shape in ("b1", "w1"):
        plain = got["plain"][shape]
        for arm in SPEC:
            r = dict(got[arm][shape])
            toks = r.pop("tokens")
            r["tokens_equal"] = toks == plain["tokens"]
            # bf16 may part where a verify's rows and a decode's round differently: how many
            # requests' tokens are plain's, whole.
            r["requests_equal"] = sum(a == b for a, b in zip(toks, plain["tokens"]))
            r["vs_plain"] = round(r["out_tok_s"] / plain["out_tok_s"], 3)
            verify, decode = r["step_ms"]["verify"], plain["step_ms"]["decode"]
            r["verify_over_plain_step"] = round(verify / decode, 2) if verify and decode else None
            RUN.emit(f"spec_{shape}_{arm}", model=model, speculative_config=SPEC[arm],
                     draft_graph_mode=got[arm].get("draft_graph_mode"), **r)


# ---- 5. ceilings ----------------------------------------------------------------------------
def ceilings(small: bool) -> None:
    """This card's copy bandwidth (bytes read + written) and bf16 matmul rate, each the best
    of 10 timed runs (the roofline's measurement, RUN.timed)."""
    n = (1 << 20) if small else (1 << 30)                       # 2 GiB of bf16 per buffer
    a = torch.randn(n, dtype=torch.bfloat16, device=DEV)
    b = torch.empty_like(a)
    copy = 2 * a.numel() * 2 / RUN.timed(lambda: b.copy_(a), 10)
    m = 256 if small else 8192
    x, y = (torch.randn(m, m, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    mm = 2 * m ** 3 / RUN.timed(lambda: x @ y, 10)
    RUN.emit("ceilings", copy_TBps=round(copy / 1e12, 3), bf16_TFLOPs=round(mm / 1e12, 1))


def model_numbers(e: Engine) -> dict:
    """Weight bytes read by one forward (the embedding is gathered, not read whole, unless
    it is the tied LM head), linear-layer params, and KV bytes per token."""
    i = e.info()
    return dict(weight_bytes=i.weight_bytes, layer_params=i.num_layer_params,
                kv_bytes_per_token=i.kv_bytes_per_token, heads=i.num_attention_heads,
                head_dim=i.head_dim, layers=i.num_layers)


# ---- 6. prefill -----------------------------------------------------------------------------
def prefill(small: bool) -> None:
    model = "random:tiny" if small else "random:qwen3-0.6b"
    n, length, budget = (8, 128, 256) if small else (64, 1024, 8192)
    e = Engine(model=model, device=DEV, graph_mode="eager", max_num_seqs=256,
               max_num_batched_tokens=budget, max_model_len=2048)
    prompts = random_prompts(n, length, e.info().vocab_size, seed=3)
    p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    e.generate(prompts[:2], p)                                  # warm-up (kernel compiles)
    e.reset_prefix_cache()
    first = e.telemetry.num_steps
    RUN.sync()
    t = time.perf_counter()
    e.generate(prompts, p)
    RUN.sync()
    dt = time.perf_counter() - t
    steps = e.telemetry.steps_since(first)
    full = [s.duration for s in steps if s.num_prefill_tokens == budget]
    mn = model_numbers(e)
    # FLOPs: the linear layers (2 per param per token), causal attention (QK and PV: 2 * 2 *
    # heads * head_dim * L^2 / 2 per layer), the LM head on the one sampled row per prompt.
    flops = (2 * mn["layer_params"] * n * length
             + 2 * mn["heads"] * mn["head_dim"] * length ** 2 * mn["layers"] * n)
    peak = ceiling("bf16_TFLOPs")
    RUN.emit("prefill", model=model, prompts=n, prompt_len=length, step_budget=budget,
             prompt_tok_s=round(n * length / dt), seconds=round(dt, 3), steps=len(steps),
             full_step_ms_median=round(percentile(full, 50) * 1e3, 2) if full else None,
             tflops=round(flops / dt / 1e12, 1),
             fraction_of_matmul_peak=round(flops / dt / 1e12 / peak, 3) if peak else None)
    free_engine(e)


# ---- 7. release -----------------------------------------------------------------------------
def release(small: bool) -> None:
    import gc
    model = "random:tiny" if small else "random:qwen3-0.6b"
    kw = dict(model=model, device=DEV, gpu_memory_utilization=0.9, graph_mode="decode",
              cudagraph_capture_sizes=[1, 2, 4], max_num_seqs=8, max_model_len=2048)
    if DEV == "cuda":
        torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0] if DEV == "cuda" else None
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    built = []
    for _ in range(3):
        e = Engine(**kw)
        e.generate([[5, 6, 7, 8]] * 3, p)
        built.append(e.info().num_kv_blocks)
        e.close()
        del e
    gc.collect()
    gc.disable()                       # an engine dropped without close(): refcounting alone
    try:
        e = Engine(**kw)
        e.generate([[5, 6, 7, 8]] * 3, p)
        del e
        if DEV == "cuda":
            torch.cuda.empty_cache()
        free1 = torch.cuda.mem_get_info()[0] if DEV == "cuda" else None
    finally:
        gc.enable()
    back = None if free0 is None else round((free0 - free1) / 2**30, 2)
    RUN.emit("release", builds=len(built), kv_blocks=built, dropped_engine_gib_still_held=back,
             ok=len(built) == 3 and (back is None or back < 1.0))


# ---- 8. concurrency -------------------------------------------------------------------------
def closed_loop(e: Engine, prompts: list[list[int]], new: int, c: int) -> dict:
    """Keep c requests in flight until every prompt has run; TTFT counts from submission."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    pending, inflight, rids = list(prompts), set(), set()
    first = len(e.telemetry.requests)
    RUN.sync()
    t = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < c:
            rid = e.add_request(pending.pop(0), params)
            inflight.add(rid)
            rids.add(rid)
        for ev in e.step():
            if ev.finished:
                inflight.discard(ev.request_id)
    dt = time.perf_counter() - t
    done = [m for m in list(e.telemetry.requests)[first:] if m.request_id in rids]
    ttft = [m.ttft for m in done]
    tpot = [m.tpot for m in done]                      # percentile skips the Nones
    return dict(requests=len(prompts), out_tok_s=round(len(prompts) * new / dt, 1),
                seconds=round(dt, 2), ttft_p50_ms=round(percentile(ttft, 50) * 1e3, 1),
                ttft_p99_ms=round(percentile(ttft, 99) * 1e3, 1),
                tpot_p50_ms=round(percentile(tpot, 50) * 1e3, 2))


def concurrency(small: bool) -> None:
    model = "random:tiny" if small else "random:qwen3-0.6b"
    n, lo, hi, new = w1_shape(small)
    e = Engine(model=model, device=DEV, graph_mode="decode", max_num_seqs=256,
               max_num_batched_tokens=8192, max_model_len=2048)
    wl = anchor_workload(n, lo, hi, e.info().vocab_size)
    e.generate(wl[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for c in ((1, 4) if small else (1, 16, 64, 256)):
        e.reset_prefix_cache()
        RUN.emit(f"concurrency_{c}", concurrency=c, **closed_loop(e, wl[:min(n, 4 * c)], new, c))
    free_engine(e)


# ---- 9. the published vLLM workload ---------------------------------------------------------
def vllm_workload(small: bool, max_num_seqs: int, budget: int) -> None:
    model = "random:tiny" if small else "random:qwen3-0.6b"
    n, length, new = (16, 32, 8) if small else (500, 512, 128)
    e = Engine(model=model, device=DEV, graph_mode="decode", max_num_seqs=max_num_seqs,
               max_num_batched_tokens=budget, max_model_len=2048)
    prompts = random_prompts(n, length, e.info().vocab_size, seed=5)
    res = run_engine(e, Workload(prompts, [new] * n))
    # vLLM's benchmark client samples greedily, so its published figure compares with the
    # greedy row; Qwen3's generation defaults are what a served request gets beside it.
    qwen3 = run_engine(e, Workload(prompts, [new] * n), sampling=SAMPLING_WORKLOADS["qwen3_defaults"])
    RUN.emit(f"vllm_{max_num_seqs}_{budget}", model=model, requests=n, prompt_len=length, new=new,
             max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
             # from the output rate (each request writes `new` tokens), not the rounded
             # seconds: a toy run on the CPU can round to 0.0 s
             req_s=round(res["out_tok_s"] / new, 1),
             total_tok_s=round(res["out_tok_s"] * (length + new) / new),
             qwen3_defaults_req_s=round(qwen3["out_tok_s"] / new, 1), **res)
    free_engine(e)


# ---- 4. peers -------------------------------------------------------------------------------
def peers(anchor: str, small: bool, anchor_parts: str) -> None:
    n, lo, hi, new = w1_shape(small)
    env = {**os.environ, "ANCHOR_PARTS": anchor_parts, "ANCHOR_N": str(n), "ANCHOR_IN_LO": str(lo), "ANCHOR_IN_HI": str(hi),
           "ANCHOR_OUT": str(new), **({"ANCHOR_SMALL": "1"} if small else {})}
    p = subprocess.run([sys.executable, anchor], capture_output=True, text=True, env=env,
                       timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            RUN.emit("anchor_" + d.pop("part"), **d)
    if p.returncode != 0:
        RUN.emit("anchor_failed", rc=p.returncode, stderr=p.stderr[-1500:])


def table() -> None:
    g = RUN.get
    rows = [("copy TB/s, bf16 matmul TFLOP/s (ceilings)",
             f"{g('ceilings', 'copy_TBps')}, {g('ceilings', 'bf16_TFLOPs')}"),
            ("prefill prompt tok/s, 8k steps (>= 200k)", g("prefill", "prompt_tok_s")),
            ("  fraction of matmul peak", g("prefill", "fraction_of_matmul_peak")),
            ("batch-1 TPOT ms, eager", g("b1_eager", "tpot_ms")),
            ("batch-1 TPOT ms, decode graphs (<= 1.2)", g("b1_decode", "tpot_ms")),
            ("  eager / graphs", g("b1_ratio", "eager_over_decode")),
            ("batch-1 TPOT ms, decode graphs, cuBLAS only", g("b1_decode_cublas", "tpot_ms")),
            ("  cuBLAS only / with the GEMV", g("b1_ratio", "cublas_over_gemv")),
            ("HF generate batch-1 TPOT ms", g("anchor_hf_generate_b1", "tpot_ms")),
            ("W1 ours, output tok/s (>= 26k)", g("w1_ours", "out_tok_s")),
            ("  fraction of the physical bound", g("w1_ours", "fraction_of_bound")),
            ("W1 ours, graph_mode full", g("w1_ours_full", "out_tok_s")),
            ("W1 HF generate, static 64", g("anchor_hf_generate_static", "out_tok_s")),
            ("W1 HF generate_batch", g("anchor_hf_generate_batch", "out_tok_s"))]
    for shape in ("b1", "w1"):
        for arm in list(SPEC)[1:]:
            d = RUN.results.get(f"spec_{shape}_{arm}")
            if d:
                rows.append((f"spec {shape} {arm} (x, kept, verify/step, =)",
                             f"{d['vs_plain']}, {d['acceptance']}, "
                             f"{d['verify_over_plain_step']}, {d['tokens_equal']}"))
    ours, cb = g("w1_ours", "out_tok_s"), g("anchor_hf_generate_batch", "out_tok_s")
    st = g("anchor_hf_generate_static", "out_tok_s")
    if ours and cb:
        rows.append(("  ours / generate_batch (>= 34)", round(ours / cb, 2)))
    if ours and st:
        rows.append(("  ours / static", round(ours / st, 2)))
    for part, d in RUN.results.items():
        if part.startswith("vllm_"):
            rows.append((f"vLLM workload req/s ({part})", d.get("req_s")))
        if part.startswith("concurrency_"):
            rows.append((f"concurrency {d['concurrency']}: tok/s, TTFT p99 ms",
                         f"{d['out_tok_s']}, {d['ttft_p99_ms']}"))
    for part in ("correctness_fp32_eager", "correctness_fp32_decode", "correctness_fp32_full"):
        rows.append((part, g(part, "equal")))
    rows.append(("bf16 logits ok", g("correctness_bf16_logits", "ok")))
    rows.append(("bf16 batch-1 decode logprobs ok", g("correctness_bf16_decode_b1", "ok")))
    rows.append(("release ok (3 rebuilds at 0.9, drop frees)", g("release", "ok")))
    RUN.print_table(rows, 46)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchor", default=None, help="gpu_anchor.py, for the HF peers")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--parts", default="ceilings,correctness,prefill,b1,w1,sampled,spec,vllm,"
                                       "concurrency,release,peers,w1full")
    ap.add_argument("--anchor-parts", default="b1,static,cb",
                    help="gpu_anchor.py's parts (HF static batching alone takes ~2 minutes)")
    ap.add_argument("--vllm-configs", default="256:8192,512:16384",
                    help="max_num_seqs:max_num_batched_tokens pairs for the vLLM workload")
    a = ap.parse_args()
    RUN.write_to(a.out)
    import transformers
    RUN.emit("env", device=DEV, name=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
             torch=torch.__version__, transformers=transformers.__version__,
             date=time.strftime("%F"))
    parts = a.parts.split(",")
    steps = [("ceilings", ceilings), ("correctness", correctness), ("prefill", prefill),
             ("b1", batch1), ("w1", lambda small: w1(small, "decode")), ("sampled", sampled),
             ("spec", spec)]
    steps += [("vllm", lambda small, c=c: vllm_workload(small, *map(int, c.split(":"))))
              for c in a.vllm_configs.split(",")]
    steps += [("concurrency", concurrency), ("release", release)]
    if a.anchor:
        steps.append(("peers", lambda small: peers(a.anchor, small, a.anchor_parts)))
    steps.append(("w1full", lambda small: w1(small, "full")))   # last: an extra
    for name, fn in steps:
        if name in parts:
            RUN.guarded(name, fn, a.small)
    table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
