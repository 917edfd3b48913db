"""The Ascend path's checks and timings, in one call on an Ascend A2/A3 host.

    source /usr/local/Ascend/ascend-toolkit/set_env.sh; source /usr/local/Ascend/nnal/atb/set_env.sh
    python benchmarks/npu.py [--out DIR] [--parts doctor,correctness,b1,w1,w1full]
    python benchmarks/npu.py --small      # the same steps at toy sizes (minutes, not an hour)

Each part is time-guarded and prints one JSON line (also appended to DIR/npu.jsonl); a table
comes last.

0. doctor: what NpuPlatform found (torch_npu, CANN, chip, head sizes, how decode graphs get
   their lengths), as `workbench doctor --device npu` prints it.
1. correctness, against the torch reference on the same device: a random Qwen3 checkpoint
   with head size 128 (safetensors, loaded like any local checkpoint) and HF transformers
   on the NPU. Our engine runs bf16 (the fused ops take no fp32), so: first-step logits of
   each graph mode against HF fp32, beside HF bf16's own error; greedy tokens of 'decode'
   and 'full' equal to our eager ones (same ops, same dtype: any difference is the graph
   path, e.g. a replay that kept its capture-time lengths); greedy tokens beside HF bf16's.
2. batch-1 decode: `random:qwen3-0.6b` in bf16, time per output token, eager vs decode graphs.
3. W1: 256 requests, prompts uniform in [100, 1024] tokens (random.Random(0), as
   benchmarks/gpu.py draws them), 512 new tokens each, EOS ignored: output tokens/s with
   graph_mode 'decode', then 'full'.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workbench import Engine, SamplingParams  # noqa: E402
from workbench.bench.offline import Workload, run_engine, run_engine_b1, save_random_qwen3  # noqa: E402

REF_DEVICE = "npu"
"""Where HF's reference runs: the NPU itself (the CPU smoke test sets 'cpu')."""
RESULTS: dict[str, dict] = {}
OUT: Path | None = None


def emit(part: str, **kw) -> None:
    RESULTS[part] = kw
    line = json.dumps({"part": part, **kw}, default=str)
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / "npu.jsonl", "a") as f:
            f.write(line + "\n")


def guarded(part: str, fn, *a) -> None:
    t = time.perf_counter()
    try:
        fn(*a)
    except Exception as e:
        emit(part + "_error", error=f"{type(e).__name__}: {e}"[:800])
        traceback.print_exc(limit=6)
    print(f"# {part}: {time.perf_counter() - t:.1f} s", flush=True)


def doctor() -> None:
    from workbench.platforms.npu import import_torch_npu, probe
    r = probe(import_torch_npu())
    emit("doctor", torch=torch.__version__, torch_npu=r.torch_npu, cann=r.cann,
         soc_version=r.soc_version, device_name=r.device_name, chip=r.chip,
         head_sizes=list(r.head_sizes), graphs=r.graphs, graph_update=r.graph_update,
         refusal=r.refusal)


def correctness(small: bool) -> None:
    from transformers import Qwen3ForCausalLM
    tmp = Path(tempfile.mkdtemp(prefix="wb-qwen3-d128-"))
    save_random_qwen3(tmp, layers=2 if small else 4, heads=4, kv_heads=2, head_dim=128)
    r = random.Random(1)
    prompts = [[r.randrange(10, 4096) for _ in range(r.randint(20, 200))]
               for _ in range(2 if small else 6)]
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
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)
            hf_tokens.append(out[0, len(p):].tolist())
    del hf

    def rel(x):
        return round(float((x.to(ref.device) - ref).norm() / ref.norm()), 5)

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    eager_tokens = None
    for mode in ("eager", "decode", "full"):
        e = Engine(model=str(tmp), device="npu", dtype="bfloat16", graph_mode=mode,
                   max_num_seqs=8, num_kv_blocks=64, max_num_batched_tokens=512 if small else 2048,
                   cudagraph_capture_sizes=[1, 2] if small else [1, 2, 4, 8])
        got = [o.token_ids for o in e.generate(prompts, params)]
        eager_tokens = eager_tokens or got
        steps = e.telemetry.snapshot()[0]
        ours = e.core.prompt_logits(prompts[0])
        emit(f"correctness_{mode}", logits_rel_err=rel(ours), hf_bf16_rel_err=rel(hf16),
             logits_ok=rel(ours) <= max(2 * rel(hf16), 2e-2),
             argmax_equal=int(ours.argmax()) == int(ref.argmax()),
             tokens_equal_eager=got == eager_tokens,
             prompts_equal_hf_bf16=sum(g == w for g, w in zip(got, hf_tokens)), of=len(prompts),
             graph_mode_run=e.info().graph_mode, graph_steps=sum(s.graph for s in steps),
             piecewise_steps=sum(s.graph_kind == "PIECEWISE" for s in steps), notices=e.notices)
        e.shutdown()


def batch1(model: str, new: int) -> None:
    rows = {}
    for mode in ("eager", "decode"):
        e = Engine(model=model, device="npu", graph_mode=mode, max_num_seqs=8,
                   max_model_len=2048, num_kv_blocks=64)
        prompt = [random.Random(2).randrange(10, e.info().vocab_size) for _ in range(128)]
        rows[mode] = run_engine_b1(e, prompt, new)
        emit(f"b1_{mode}", model=model, graph_mode_run=e.info().graph_mode, **rows[mode])
        e.shutdown()
    emit("b1_ratio", eager_over_decode=round(rows["eager"]["tpot_ms"] / rows["decode"]["tpot_ms"], 2))


def w1(model: str, small: bool, mode: str) -> None:
    n, lo, hi, new = (8, 100, 200, 8) if small else (256, 100, 1024, 512)
    t = time.perf_counter()
    e = Engine(model=model, device="npu", graph_mode=mode, max_num_seqs=8 if small else 256,
               max_num_batched_tokens=8192, max_model_len=2048,
               num_kv_blocks=64 if small else None)   # else sized from the NPU's memory
    build_s = time.perf_counter() - t
    r = random.Random(0)
    prompts = [[r.randrange(10, e.info().vocab_size) for _ in range(r.randint(lo, hi))] for _ in range(n)]
    res = run_engine(e, Workload(prompts, [new] * n))
    steps = e.telemetry.snapshot()[0]
    emit(f"w1_{mode}", model=model, requests=n, prompt_len=[lo, hi], new=new,
         build_s=round(build_s, 1), kv_blocks=e.info().num_kv_blocks,
         graph_steps=sum(s.graph for s in steps),
         piecewise_steps=sum(s.graph_kind == "PIECEWISE" for s in steps), **res)
    e.shutdown()


def table() -> None:
    g = lambda part, key: RESULTS.get(part, {}).get(key)   # noqa: E731
    rows = [("chip", g("doctor", "device_name")), ("torch_npu / CANN",
             f"{g('doctor', 'torch_npu')} / {g('doctor', 'cann')}"),
            ("batch-1 TPOT ms, eager", g("b1_eager", "tpot_ms")),
            ("batch-1 TPOT ms, decode graphs", g("b1_decode", "tpot_ms")),
            ("  eager / graphs", g("b1_ratio", "eager_over_decode")),
            ("W1 output tok/s, decode graphs", g("w1_decode", "out_tok_s")),
            ("W1 output tok/s, full", g("w1_full", "out_tok_s"))]
    for mode in ("eager", "decode", "full"):
        rows.append((f"correctness {mode}: logits ok / tokens = eager",
                     f"{g(f'correctness_{mode}', 'logits_ok')} / "
                     f"{g(f'correctness_{mode}', 'tokens_equal_eager')}"))
    print("\n" + "\n".join(f"{k:<48} {v}" for k, v in rows))


def main(argv: list[str] | None = None) -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for npu.jsonl")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--parts", default="doctor,correctness,b1,w1,w1full")
    a = ap.parse_args(argv)
    if a.out:
        OUT = Path(a.out)
        OUT.mkdir(parents=True, exist_ok=True)
    parts = a.parts.split(",")
    unknown = set(parts) - {"doctor", "correctness", "b1", "w1", "w1full"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}")
    # --small: the correctness checkpoint stands in for qwen3-0.6b (head size 128 too).
    model = "random:qwen3-0.6b"
    if a.small:
        model = tempfile.mkdtemp(prefix="wb-qwen3-d128-small-")
        save_random_qwen3(Path(model), layers=2, heads=4, kv_heads=2, head_dim=128)
    if "doctor" in parts:
        guarded("doctor", doctor)
    if "correctness" in parts:
        guarded("correctness", correctness, a.small)
    if "b1" in parts:
        guarded("b1", batch1, model, 16 if a.small else 256)
    if "w1" in parts:
        guarded("w1", w1, model, a.small, "decode")
    if "w1full" in parts:
        guarded("w1full", w1, model, a.small, "full")
    table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
