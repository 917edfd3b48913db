"""The platform issue's GPU checks and timings, in one call on a lent CUDA machine.

    python benchmarks/gpu.py --anchor path/to/gpu_anchor.py [--out DIR]
    python benchmarks/gpu.py --small          # the same steps at toy sizes, any device (CPU too)

Each part is time-guarded and prints one JSON line (also appended to DIR/gpu.jsonl); a table
of our figures beside the HF peers, measured in this same call, comes last.

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
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workbench import Engine, SamplingParams  # noqa: E402
from workbench.bench import Workload, run_engine, run_engine_b1  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RESULTS: dict[str, dict] = {}
OUT: Path | None = None


def emit(part: str, **kw) -> None:
    RESULTS[part] = kw
    line = json.dumps({"part": part, **kw})
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / "gpu.jsonl", "a") as f:
            f.write(line + "\n")


def guarded(part: str, fn, *a, **k) -> None:
    t = time.perf_counter()
    try:
        fn(*a, **k)
    except Exception as e:
        emit(part + "_error", error=f"{type(e).__name__}: {e}"[:800])
        traceback.print_exc(limit=6)
    print(f"# {part}: {time.perf_counter() - t:.1f} s", flush=True)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def free_engine(e: Engine) -> None:
    e.shutdown()
    del e
    if DEV == "cuda":
        torch.cuda.empty_cache()


# ---- 1. correctness -------------------------------------------------------------------------
def random_qwen3(path: Path, small: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2 if small else 4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                      vocab_size=4096, max_position_embeddings=2048, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, initializer_range=0.1)
    cfg.eos_token_id = None
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def correctness(small: bool) -> None:
    from transformers import Qwen3ForCausalLM
    tmp = Path(tempfile.mkdtemp(prefix="wb-qwen3-"))
    random_qwen3(tmp, small)
    hf = Qwen3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(DEV).eval()
    r = random.Random(1)
    prompts = [[r.randrange(10, 4096) for _ in range(r.randint(20, 200))] for _ in range(6)]
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
        e = Engine(model=str(tmp), device=DEV, dtype="float32", graph_mode=mode, max_num_seqs=8,
                   num_kv_blocks=256)
        got = [o.token_ids for o in e.generate(prompts, params)]
        steps = e.telemetry.snapshot()[0]
        emit(f"correctness_fp32_{mode}", equal=got == want,
             prompts_equal=sum(g == w for g, w in zip(got, want)), of=len(prompts),
             graph_mode_run=e.graph_mode, graph_steps=sum(s.graph for s in steps),
             piecewise_steps=sum(s.graph_kind == "piecewise" for s in steps), notices=e.notices)
        free_engine(e)
    # bf16: first-step logits of a prompt, against HF fp32, beside HF bf16's own error.
    p = prompts[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([p], device=DEV)).logits[0, -1].float()
        hf16 = hf.to(torch.bfloat16)(torch.tensor([p], device=DEV)).logits[0, -1].float()
    e = Engine(model=str(tmp), device=DEV, dtype="bfloat16", graph_mode="eager", max_num_seqs=8,
               num_kv_blocks=256)
    e.add_request(p, SamplingParams(max_tokens=1, temperature=0))
    e._drain_inbox()
    ours = e.runner.execute(e.scheduler.schedule())[0][0].float()

    def rel(x):
        return float((x - ref).norm() / ref.norm())
    emit("correctness_bf16_logits", ours_rel_err=round(rel(ours), 5), hf_bf16_rel_err=round(rel(hf16), 5),
         ok=rel(ours) <= max(2 * rel(hf16), 2e-2), argmax_equal=int(ours.argmax()) == int(ref.argmax()))
    free_engine(e)


# ---- 2. batch-1 decode ----------------------------------------------------------------------
def device_kernels_per_decode_step(e: Engine, prompt: list[int]) -> int | None:
    """Kernels one batch-1 decode step launches (from the profiler), or None off CUDA."""
    if DEV != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    e.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    e.step()                                                  # the prefill
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        e.step()
    e.generate([[1, 2]], SamplingParams(max_tokens=1))          # drains the rest
    return sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)


def batch1(small: bool) -> None:
    model = "random:tiny" if small else "random:qwen3-0.6b"
    new = 32 if small else 256
    rows = {}
    for mode in ("eager", "decode"):
        e = Engine(model=model, device=DEV, graph_mode=mode, max_num_seqs=8, max_model_len=2048,
                   num_kv_blocks=512)
        prompt = [random.Random(2).randrange(10, e.vocab_size) for _ in range(128)]
        r = run_engine_b1(e, prompt, new)
        rows[mode] = r
        kernels = None
        if mode == "eager":
            try:
                kernels = device_kernels_per_decode_step(e, prompt)
            except Exception as ex:                           # a diagnostic, never fatal
                kernels = f"{type(ex).__name__}: {ex}"[:200]
        emit(f"b1_{mode}", model=model, graph_mode_run=e.graph_mode, ops=e.model.ops.name,
             kernels_per_decode_step=kernels, **r)
        free_engine(e)
    emit("b1_ratio", eager_over_decode=round(rows["eager"]["tpot_ms"] / rows["decode"]["tpot_ms"], 2))


# ---- 3. W1 ----------------------------------------------------------------------------------
def anchor_workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Exactly gpu_anchor.py's draw: per request a length, then its token ids."""
    r = random.Random(seed)
    return [[r.randrange(10, vocab) for _ in range(r.randint(lo, hi))] for _ in range(n)]


def w1_shape(small: bool) -> tuple[int, int, int, int]:
    """(requests, shortest prompt, longest prompt, new tokens)."""
    return (16, 100, 200, 16) if small else (256, 100, 1024, 512)


def w1(small: bool, mode: str) -> None:
    model = "random:tiny" if small else "random:qwen3-0.6b"
    n, lo, hi, new = w1_shape(small)
    t = time.perf_counter()
    e = Engine(model=model, device=DEV, graph_mode=mode, max_num_seqs=256,
               max_num_batched_tokens=8192, max_model_len=2048)
    build_s = time.perf_counter() - t
    wl = Workload(anchor_workload(n, lo, hi, e.vocab_size), [new] * n)
    r = run_engine(e, wl)
    steps = e.telemetry.snapshot()[0]
    emit("w1_ours" + ("" if mode == "decode" else f"_{mode}"), model=model, graph_mode=mode,
         requests=n, prompt_len=[lo, hi], new=new, build_s=round(build_s, 1),
         kv_blocks=e.block_manager.num_blocks, graph_steps=sum(s.graph for s in steps),
         piecewise_steps=sum(s.graph_kind == "piecewise" for s in steps),
         decode_steps=sum(s.phase == "decode" for s in steps), **r)
    free_engine(e)


# ---- 4. peers -------------------------------------------------------------------------------
def peers(anchor: str, small: bool) -> None:
    n, lo, hi, new = w1_shape(small)
    env = {**os.environ, "ANCHOR_N": str(n), "ANCHOR_IN_LO": str(lo), "ANCHOR_IN_HI": str(hi),
           "ANCHOR_OUT": str(new), **({"ANCHOR_SMALL": "1"} if small else {})}
    p = subprocess.run([sys.executable, anchor], capture_output=True, text=True, env=env,
                       timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            emit("anchor_" + d.pop("part"), **d)
    if p.returncode != 0:
        emit("anchor_failed", rc=p.returncode, stderr=p.stderr[-1500:])


def table() -> None:
    g = lambda part, key: RESULTS.get(part, {}).get(key)   # noqa: E731
    rows = [("batch-1 TPOT ms, eager", g("b1_eager", "tpot_ms")),
            ("batch-1 TPOT ms, decode graphs", g("b1_decode", "tpot_ms")),
            ("  eager / graphs (target >= 3)", g("b1_ratio", "eager_over_decode")),
            ("HF generate batch-1 TPOT ms", g("anchor_hf_generate_b1", "tpot_ms")),
            ("W1 ours, output tok/s", g("w1_ours", "out_tok_s")),
            ("W1 ours, graph_mode full", g("w1_ours_full", "out_tok_s")),
            ("W1 HF generate, static 64", g("anchor_hf_generate_static", "out_tok_s")),
            ("W1 HF generate_batch", g("anchor_hf_generate_batch", "out_tok_s"))]
    ours, cb = g("w1_ours", "out_tok_s"), g("anchor_hf_generate_batch", "out_tok_s")
    st = g("anchor_hf_generate_static", "out_tok_s")
    if ours and cb:
        rows.append(("  ours / generate_batch (target >= 10)", round(ours / cb, 2)))
    if ours and st:
        rows.append(("  ours / static", round(ours / st, 2)))
    for part in ("correctness_fp32_eager", "correctness_fp32_decode", "correctness_fp32_full"):
        rows.append((part, g(part, "equal")))
    rows.append(("bf16 logits ok", g("correctness_bf16_logits", "ok")))
    print("\n" + "\n".join(f"{k:<42} {v}" for k, v in rows))


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchor", default=None, help="gpu_anchor.py, for the HF peers")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--parts", default="correctness,b1,w1,peers,w1full")
    a = ap.parse_args()
    if a.out:
        OUT = Path(a.out)
        OUT.mkdir(parents=True, exist_ok=True)
    import transformers
    emit("env", device=DEV, name=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
         torch=torch.__version__, transformers=transformers.__version__, date=time.strftime("%F"))
    parts = a.parts.split(",")
    if "correctness" in parts:
        guarded("correctness", correctness, a.small)
    if "b1" in parts:
        guarded("b1", batch1, a.small)
    if "w1" in parts:
        guarded("w1", w1, a.small, "decode")
    if "peers" in parts and a.anchor:
        guarded("peers", peers, a.anchor, a.small)
    if "w1full" in parts:                   # last: an extra, if the call's time allows
        guarded("w1full", w1, a.small, "full")
    table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
