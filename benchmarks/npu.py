"""The Ascend path's checks and timings, in one call on an Ascend A2/A3 host.

    source /usr/local/Ascend/ascend-toolkit/set_env.sh; source /usr/local/Ascend/nnal/atb/set_env.sh
    python benchmarks/npu.py [--out DIR] [--parts doctor,correctness,b1,w1,w1full]
    python benchmarks/npu.py --small      # the same steps at toy sizes (minutes, not an hour)

What to send back: every line this prints that starts with `{` (also appended to
DIR/npu.jsonl). Each part prints exactly one, `{"part": ..., "ok": ..., ...}`, whether it
passed, failed its own checks (`failed` names them) or raised (`error`, `traceback`, and
whatever it had measured before), so one run gives the whole picture; a table comes last.
The doctor's line always comes first, even when --parts leaves it out.

0. doctor: what NpuPlatform found (torch_npu, CANN, chip, head sizes, how graphs get their
   lengths) and one tiny op of each kind, ran or failed with the fix, as `workbench doctor
   --device npu` prints them.
1. correctness, against the torch reference on the same device: a random Qwen3 checkpoint
   with head size 128 (safetensors, loaded like any local checkpoint) and HF transformers
   on the NPU. Our engine runs bf16 (the fused ops take no fp32), so: first-step logits of
   each graph mode against HF fp32, beside HF bf16's own error; greedy tokens of 'full'
   (the NPU's default: piecewise, fused attention eager) and 'decode' (paged-attention
   decode graphs, opt-in) equal to our eager ones (same dtype: any difference is the graph
   path, e.g. a replay that kept its capture-time lengths); greedy tokens beside HF bf16's.
2. batch-1 decode: `random:qwen3-0.6b` in bf16, time per output token, eager vs the default
   ('full') vs decode graphs.
3. W1: 256 requests, prompts uniform in [100, 1024] tokens (random.Random(0), as
   benchmarks/gpu.py draws them), 512 new tokens each, EOS ignored: output tokens/s with
   graph_mode 'decode' (part w1), then 'full', the default (part w1full).

The harness (lines, guards, workloads, the bf16 rule) is workbench/bench/device_run.py,
shared with benchmarks/gpu.py.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workbench import Engine, SamplingParams  # noqa: E402
from workbench.bench.device_run import (DeviceRun, anchor_workload, b1_prompt,  # noqa: E402
                                        rel_err, w1_shape, within_bf16_error)
from workbench.bench.offline import Workload, run_engine, run_engine_b1, save_random_qwen3  # noqa: E402

REF_DEVICE = "npu"
"""Where HF's reference runs: the NPU itself (the CPU smoke test sets 'cpu')."""


def doctor(out: dict) -> None:
    from workbench.platforms.npu_doctor import as_json, doctor as run
    report, checks = run()
    out.update(as_json(report, checks))
    out["checks"] = ["ok"]


def correctness(out: dict, small: bool) -> None:
    from transformers import Qwen3ForCausalLM
    tmp = Path(tempfile.mkdtemp(prefix="wb-qwen3-d128-"))
    save_random_qwen3(tmp, layers=2 if small else 4, heads=4, kv_heads=2, head_dim=128)
    prompts = anchor_workload(2 if small else 6, 20, 200, 4096, seed=1)
    new = 8 if small else 24
    hf = Qwen3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(REF_DEVICE).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]], device=REF_DEVICE)
        ref = hf(ids).logits[0, -1].float()
        hf.to(torch.bfloat16)
        hf16 = hf(ids).logits[0, -1].float()
        hf_tokens = []
        for p in prompts:
            ids = torch.tensor([p], device=REF_DEVICE)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)
            hf_tokens.append(gen[0, len(p):].tolist())
    del hf
    hf_err = rel_err(hf16, ref)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    eager_tokens, out["modes"], out["checks"] = None, {}, []
    for mode in ("eager", "full", "decode"):
        e = Engine(model=str(tmp), device="npu", dtype="bfloat16", graph_mode=mode,
                   max_num_seqs=8, num_kv_blocks=64, max_num_batched_tokens=512 if small else 2048,
                   cudagraph_capture_sizes=[1, 2] if small else [1, 2, 4, 8])
        got = [o.token_ids for o in e.generate(prompts, params)]
        eager_tokens = eager_tokens or got
        steps = e.telemetry.snapshot()[0]
        ours = e.core.prompt_logits(prompts[0])
        err = rel_err(ours, ref)
        out["modes"][mode] = dict(
            logits_rel_err=round(err, 5), hf_bf16_rel_err=round(hf_err, 5),
            logits_ok=within_bf16_error(err, hf_err),
            argmax_equal=int(ours.argmax()) == int(ref.argmax()),
            tokens_equal_eager=got == eager_tokens,
            prompts_equal_hf_bf16=sum(g == w for g, w in zip(got, hf_tokens)), of=len(prompts),
            graph_mode_run=e.info().graph_mode, graph_steps=sum(s.graph for s in steps),
            full_steps=sum(s.graph_kind == "FULL" for s in steps),
            piecewise_steps=sum(s.graph_kind == "PIECEWISE" for s in steps),
            notices=e.telemetry.notices)
        out["checks"] += [f"modes.{mode}.logits_ok", f"modes.{mode}.tokens_equal_eager"]
        e.shutdown()


def batch1(out: dict, model: str, new: int) -> None:
    for mode in ("eager", "full", "decode"):
        e = Engine(model=model, device="npu", graph_mode=mode, max_num_seqs=8,
                   max_model_len=2048, num_kv_blocks=64)
        out[mode] = dict(graph_mode_run=e.info().graph_mode,
                         **run_engine_b1(e, b1_prompt(e.info().vocab_size), new))
        e.shutdown()
    out["model"] = model
    tpot = {m: out[m]["tpot_ms"] for m in ("eager", "full", "decode")}
    out["eager_over_full"] = round(tpot["eager"] / tpot["full"], 2)
    out["eager_over_decode"] = round(tpot["eager"] / tpot["decode"], 2)


def w1(out: dict, model: str, small: bool, mode: str) -> None:
    n, lo, hi, new = w1_shape(small, toy=8)
    t = time.perf_counter()
    e = Engine(model=model, device="npu", graph_mode=mode, max_num_seqs=8 if small else 256,
               max_num_batched_tokens=8192, max_model_len=2048,
               num_kv_blocks=64 if small else None)   # else sized from the NPU's memory
    out.update(model=model, graph_mode=mode, requests=n, prompt_len=[lo, hi], new=new,
               build_s=round(time.perf_counter() - t, 1), kv_blocks=e.info().num_kv_blocks)
    prompts = anchor_workload(n, lo, hi, e.info().vocab_size)
    res = run_engine(e, Workload(prompts, [new] * n))
    steps = e.telemetry.snapshot()[0]
    out.update(graph_steps=sum(s.graph for s in steps),
               full_steps=sum(s.graph_kind == "FULL" for s in steps),
               piecewise_steps=sum(s.graph_kind == "PIECEWISE" for s in steps), **res)
    e.shutdown()


def table(run: DeviceRun) -> None:
    g = run.get
    rows = [("chip", g("doctor", "device_name")),
            ("torch_npu / CANN", f"{g('doctor', 'torch_npu')} / {g('doctor', 'cann')}"),
            ("doctor ops", ", ".join(
                f"{c['name']}: {'ran' if c['ran'] else 'skipped' if c['skipped'] else 'FAILED'}"
                for c in g("doctor", "ops") or []))]
    for mode in ("eager", "full", "decode"):
        rows.append((f"batch-1 TPOT ms, {mode}", g("b1", mode, "tpot_ms")))
    rows += [("W1 output tok/s, decode graphs", g("w1", "out_tok_s")),
             ("W1 output tok/s, full (default)", g("w1full", "out_tok_s"))]
    for mode in ("eager", "full", "decode"):
        rows.append((f"correctness {mode}: logits ok / tokens = eager",
                     f"{g('correctness', 'modes', mode, 'logits_ok')} / "
                     f"{g('correctness', 'modes', mode, 'tokens_equal_eager')}"))
    rows.append(("parts ok", ", ".join(f"{p}: {r.get('ok')}" for p, r in run.results.items())))
    run.print_table(rows, 48)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for npu.jsonl")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--parts", default="doctor,correctness,b1,w1,w1full")
    a = ap.parse_args(argv)
    run = DeviceRun("npu", "npu")
    run.write_to(a.out)
    parts = a.parts.split(",")
    unknown = set(parts) - {"doctor", "correctness", "b1", "w1", "w1full"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}")
    # --small: the correctness checkpoint stands in for qwen3-0.6b (head size 128 too).
    model = "random:qwen3-0.6b"
    if a.small:
        model = tempfile.mkdtemp(prefix="wb-qwen3-d128-small-")
        save_random_qwen3(Path(model), layers=2, heads=4, kv_heads=2, head_dim=128)
    run.checked("doctor", doctor)            # first, whatever --parts says
    if "correctness" in parts:
        run.checked("correctness", correctness, a.small)
    if "b1" in parts:
        run.checked("b1", batch1, model, 16 if a.small else 256)
    if "w1" in parts:
        run.checked("w1", w1, model, a.small, "decode")
    if "w1full" in parts:
        run.checked("w1full", w1, model, a.small, "full")
    table(run)
    print(f"# send back the {len(run.results)} JSON lines above"
          + (f" (or {run.path})" if run.path else ""), flush=True)
    return 0 if all(r.get("ok") for r in run.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
