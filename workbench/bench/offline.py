"""Offline throughput benchmark: our engine against HF transformers, measured in the same run.

Workload (default, the CPU benchmark): 64 requests, prompt lengths uniform in [16, 256],
output lengths uniform in [16, 256], EOS ignored, all submitted at once, token ids drawn from
random.Random(seed). Peers: HF `generate` in static batches (left-padded) and HF
`generate_batch` (continuous batching); plus batch-1 decode against HF `generate`.
Reports ratios, since only figures from one run on one machine compare.
"""
from __future__ import annotations

import platform
import random
import statistics
import time
from dataclasses import dataclass, replace

import torch

from ..engine import Engine
from ..core.sampling_params import SamplingParams
from ..telemetry import percentile


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def requests(self) -> list[tuple[list[int], int]]:
        return list(zip(self.prompts, self.output_lens))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int,
                  seed: int = 0) -> Workload:
    r = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        prompts.append([r.randrange(10, vocab) for _ in range(r.randint(*in_range))])
        outs.append(r.randint(*out_range))
    return Workload(prompts, outs)


def save_random_qwen3(path, layers: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """A small random Qwen3 checkpoint (safetensors and config), for correctness checks that
    load it like any local checkpoint, in our engine and in HF transformers alike."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      vocab_size=4096, max_position_embeddings=2048, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, initializer_range=0.1)
    cfg.eos_token_id = None
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(path)


SAMPLING_WORKLOADS = {
    "qwen3_defaults": dict(temperature=0.6, top_k=20, top_p=0.95),
    "t0.7_top_p0.9": dict(temperature=0.7, top_p=0.9),
    "greedy_stop_string": dict(temperature=0, stop=["\u2603\u2603\u2603"]),
    "greedy_logprobs5": dict(temperature=0, logprobs=5),
}
"""Real traffic beside the greedy workload, each the same requests: Qwen3's
generation_config.json defaults (what vLLM serves a request that leaves them out), a chat
UI's temperature 0.7 + top_p 0.9, greedy with a stop string that never matches (the text is
checked every token), greedy with 5 logprobs."""


def run_engine(engine: Engine, wl: Workload, progress=None, sampling: dict | None = None) -> dict:
    """The workload through the engine, EOS ignored; `sampling`: SamplingParams fields
    (default greedy)."""
    kw = {"temperature": 0, **(sampling or {})}
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **kw) for n in wl.output_lens]
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.reset_prefix_cache()
    first_step = engine.telemetry.num_steps
    t = time.perf_counter()
    outs = engine.generate(wl.prompts, params, progress=progress)
    dt = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == wl.output_tokens, "engine produced a different number of tokens"
    ttft = [o.metrics.ttft for o in outs]
    tpot = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    steps = engine.telemetry.steps_since(first_step)
    return dict(out_tok_s=round(tokens / dt, 1), seconds=round(dt, 2), tokens=tokens,
                steps=len(steps), preemptions=sum(s.num_preempted for s in steps),
                ttft_p50_s=round(percentile(ttft, 50), 3), ttft_p99_s=round(percentile(ttft, 99), 3),
                tpot_p50_ms=round(percentile(tpot, 50) * 1e3, 1), tpot_p99_ms=round(percentile(tpot, 99) * 1e3, 1),
                mean_decode_batch=round(statistics.mean(
                    [s.num_decode_tokens for s in steps if s.num_decode_tokens] or [0]), 1),
                kv_peak=round(max((s.kv_usage for s in steps), default=0.0), 3),
                kv_peak_blocks=max((s.kv_blocks_used for s in steps), default=0))


def run_engine_b1(engine: Engine, prompt: list[int], new_tokens: int,
                  sampling: dict | None = None) -> dict:
    """Batch-1 decode speed: tokens after the first over the time after the first."""
    p = SamplingParams(max_tokens=new_tokens, ignore_eos=True,
                       **{"temperature": 0, **(sampling or {})})
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.reset_prefix_cache()
    out = engine.generate([prompt], p)[0]
    m = out.metrics
    decode_s = m.token_times[-1] - m.token_times[0]
    return dict(tokens=len(out.token_ids), ttft_ms=round(m.ttft * 1e3, 1),
                tpot_ms=round(decode_s / (len(out.token_ids) - 1) * 1e3, 2),
                decode_tok_s=round((len(out.token_ids) - 1) / decode_s, 1))


TIMED = ("out_tok_s", "seconds", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms")
"""run_engine's figures that time the machine (the others count tokens, steps and blocks,
the same in every run of a point)."""


def sweep(grid: dict[str, list], wl: Workload, model: str = "smollm2",
          engine_kwargs: dict | None = None, progress=None, repeats: int = 1) -> list[dict]:
    """Every combination of the grid's knob values (EngineConfig names), one engine each, on
    the same workload: one row per point, the knobs beside `run_engine`'s figures.
    `graph_mode_run` says which graph mode really ran (the CPU runs eager). With `repeats`
    > 1 the points run that many rounds, interleaved (steady.interleaved; each run builds its
    point's engine again, as a device holds one engine at a time): each timed figure is the
    median, and `<figure>_runs` keeps every run's (out_tok_s_runs, tpot_p50_ms_runs, …)."""
    import itertools

    from .steady import interleaved
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    done = 0
    if progress is not None:            # the bar shows from the start, not after a first run
        progress(0, len(points) * repeats)

    def one(knobs: dict) -> dict:
        nonlocal done
        row = _run_point(model, engine_kwargs, knobs, wl)
        done += 1
        if progress is not None:
            progress(done, len(points) * repeats)
        return row

    rows = []
    for knobs, runs in zip(points, interleaved(points, one, repeats)):
        row = {**knobs, **runs[0]}
        if repeats > 1:
            for k in TIMED:
                row[f"{k}_runs"] = [r[k] for r in runs]
                row[k] = statistics.median(row[f"{k}_runs"])
        rows.append(row)
    return rows


def _run_point(model: str, engine_kwargs: dict | None, knobs: dict, wl: Workload) -> dict:
    """One engine with `knobs` over the common settings, run on `wl`, then closed (a device
    holds one engine at a time)."""
    engine = Engine(model=model, **{**(engine_kwargs or {}), **knobs})
    try:
        info = engine.info()
        return {"graph_mode_run": info.graph_mode, "device": info.device_name,
                **run_engine(engine, wl)}
    finally:
        engine.close()


AB_METRICS = {"ttft_p50_s": "TTFT p50 (s)", "ttft_p99_s": "TTFT p99 (s)",
              "tpot_p50_ms": "TPOT p50 (ms)", "tpot_p99_ms": "TPOT p99 (ms)",
              "out_tok_s": "throughput (out tok/s)", "preemptions": "preemptions",
              "kv_peak": "KV peak (fraction of the pool)"}
"""What an A/B run compares, with labels: lower is better for all but throughput."""


@dataclass
class ABResult:
    a: dict
    """Arm A: its knobs and `run_engine`'s figures."""
    b: dict
    knobs_a: dict
    knobs_b: dict
    device: str
    sequential: bool = True
    """The arms ran one after the other on one device, each alone (never at once)."""

    def deltas(self) -> dict[str, dict]:
        """Per metric: A, B, B − A and (B − A) / A (None where A is 0 or unknown)."""
        out = {}
        for k in AB_METRICS:
            a, b = self.a.get(k), self.b.get(k)
            d = None if a is None or b is None else b - a
            out[k] = {"a": a, "b": b, "delta": d,
                      "relative": d / a if d is not None and a else None}
        return out


def ab_run(knobs_a: dict, knobs_b: dict, wl: Workload, model: str = "smollm2",
           engine_kwargs: dict | None = None, progress=None) -> ABResult:
    """Two engine configurations (any EngineConfig knobs, over the common `engine_kwargs`)
    on the same workload, one after the other on this device: A is built, run and closed,
    then B. Compare with `result.deltas()`."""
    if not knobs_a and not knobs_b:
        raise ValueError("knobs_a, knobs_b: both empty; the two arms would be the same engine")
    from dataclasses import fields as dc_fields

    from ..config import EngineConfig
    names = {f.name for f in dc_fields(EngineConfig)}
    for which, knobs in (("knobs_a", knobs_a), ("knobs_b", knobs_b)):
        bad = sorted(set(knobs) - names)
        if bad:
            raise ValueError(f"{which}: not EngineConfig knobs: {', '.join(bad)}")
    rows = []
    if progress is not None:
        progress(0, 2)
    for i, knobs in enumerate((knobs_a, knobs_b)):
        rows.append(_run_point(model, engine_kwargs, knobs, wl))
        if progress is not None:
            progress(i + 1, 2)
    return ABResult(rows[0], rows[1], dict(knobs_a), dict(knobs_b), rows[0]["device"])


def latency_alone_vs_batched(engine: Engine, n: int = 32, prompt_len: int = 128,
                             new_tokens: int = 64, seed: int = 0, repeats: int = 1) -> list[dict]:
    """The classic table: TTFT and time per output token of one request alone, then of n
    requests sent at once (continuous batching), with the total throughput of each. With
    `repeats` > 1 the two run that many rounds, interleaved (steady.interleaved): each figure
    is the median, and `<figure>_runs` keeps every run's."""
    from .steady import interleaved
    vocab = engine.info().vocab_size

    def once(count: int) -> dict:
        wl = make_workload(count, (prompt_len, prompt_len), (new_tokens, new_tokens), vocab,
                           seed)
        r = run_engine(engine, wl)
        return dict(ttft_p50_ms=round(r["ttft_p50_s"] * 1e3, 1),
                    ttft_p99_ms=round(r["ttft_p99_s"] * 1e3, 1),
                    tpot_p50_ms=r["tpot_p50_ms"], tpot_p99_ms=r["tpot_p99_ms"],
                    out_tok_s=r["out_tok_s"])

    rows = []
    for count, runs in zip((1, n), interleaved([1, n], once, repeats)):
        row = {"requests": count}
        for k in runs[0]:
            row[k] = statistics.median(r[k] for r in runs)
            if repeats > 1:
                row[f"{k}_runs"] = [r[k] for r in runs]
        rows.append(row)
    return rows


def time_per_token_by_batch(engine: Engine, batch_sizes=(1, 2, 4, 8), prompt_len: int = 32,
                            decode_steps: int = 4, seed: int = 0, repeats: int = 1) -> list[dict]:
    """For each batch size b: b prompts of `prompt_len` tokens prefilled in one step, then
    `decode_steps` decode steps of b tokens. Time per token of each phase (the prefill step's
    duration over its tokens; the median decode step's over b), from the steps' telemetry;
    with `repeats` > 1 the batch sizes are run that many times interleaved (steady.interleaved)
    and each figure is the median, with every run kept (`prefill_runs`, `decode_runs`: Runs of
    seconds per token). The engine must admit b prompts in one step (max_num_seqs,
    max_num_batched_tokens)."""
    from .steady import Runs, interleaved
    vocab = engine.info().vocab_size

    def once(b: int) -> tuple[float, float]:
        wl = make_workload(b, (prompt_len, prompt_len), (decode_steps + 1,) * 2, vocab, seed + b)
        engine.reset_prefix_cache()
        first = engine.telemetry.num_steps
        engine.generate(wl.prompts, SamplingParams(max_tokens=decode_steps + 1, temperature=0,
                                                   ignore_eos=True))
        steps = [s for s in engine.telemetry.steps_since(first) if s.phase != "idle"]
        pre = [s for s in steps if s.phase == "prefill"]
        dec = [s for s in steps if s.phase == "decode"]
        if len(pre) != 1 or pre[0].num_prefill_tokens != b * prompt_len:
            raise ValueError(f"batch {b}: the prompts did not prefill in one step; raise "
                             f"max_num_seqs / max_num_batched_tokens")
        return pre[0].duration, percentile([s.duration for s in dec], 50)

    rows = []
    for b, runs in zip(batch_sizes, interleaved(list(batch_sizes), once, repeats)):
        pre = Runs([p / (b * prompt_len) for p, _ in runs])
        dec = Runs([d / b for _, d in runs])
        rows.append(dict(batch=b, prefill_s_per_token=pre.median,
                         decode_s_per_token=dec.median, prefill_step_s=pre.median * b * prompt_len,
                         decode_step_s=dec.median * b, prefill_runs=pre, decode_runs=dec))
    return rows


def recompute_vs_cache(engine: Engine, prompt: list[int], new_tokens: int,
                       repeats: int = 1) -> dict:
    """Generate `new_tokens` greedily twice: with the KV cache (one request), and without it,
    recomputing the whole sequence for every token (a fresh one-token request each time, the
    prefix cache reset so nothing is reused). Returns the cumulative seconds after each token
    for both (with `repeats` > 1: each position's median over the rounds, and every round's
    total in `with_cache_runs` / `without_cache_runs`), and the tokens (they must agree, in
    every round)."""
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rounds = []
    for _ in range(repeats):
        engine.reset_prefix_cache()
        out = engine.generate([prompt], replace(greedy, max_tokens=new_tokens))[0]
        m = out.metrics
        cached = [t - m.arrival_time for t in m.token_times]
        ids, elapsed, recomputed = list(prompt), 0.0, []
        for _ in range(new_tokens):
            engine.reset_prefix_cache()
            t = time.perf_counter()
            tok = engine.generate([ids], greedy)[0].token_ids[0]
            elapsed += time.perf_counter() - t
            recomputed.append(elapsed)
            ids.append(tok)
        rounds.append((cached, recomputed, out.token_ids, ids[len(prompt):]))
    med = lambda i: [statistics.median(col) for col in zip(*(r[i] for r in rounds))]  # noqa: E731
    same = all(r[2:] == rounds[0][2:] for r in rounds)
    return dict(with_cache_s=med(0), without_cache_s=med(1),
                with_cache_runs=[r[0][-1] for r in rounds],
                without_cache_runs=[r[1][-1] for r in rounds],
                tokens=rounds[0][2], tokens_recomputed=rounds[0][3] if same else None)


def machine() -> dict:
    import os

    import transformers
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(python=platform.python_version(), torch=torch.__version__,
                transformers=transformers.__version__, cpu=cpu, cores=os.cpu_count(),
                threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d"))


def run(model: str = "smollm2", num_requests: int = 64, in_range=(16, 256), out_range=(16, 256),
        seed: int = 0, peers=("hf_static", "hf_batch", "b1"), static_batch: int = 16,
        b1_prompt: int = 128, b1_new: int = 128, engine_kwargs: dict | None = None,
        log=print, sampling: tuple[str, ...] = ()) -> dict:
    """Run everything asked for in `peers` and return the report (also printed via log).
    `sampling`: names of SAMPLING_WORKLOADS to run beside greedy, on the same requests (and
    at batch 1 where b1 is asked for); greedy then runs again after them, and each ratio is
    against the mean of the two greedy runs, so drift of the machine cancels."""
    unknown = [s for s in sampling if s not in SAMPLING_WORKLOADS]
    if unknown:
        raise ValueError(f"sampling: unknown workload {unknown[0]!r} (one of "
                         f"{', '.join(SAMPLING_WORKLOADS)})")
    from tqdm.auto import tqdm

    engine = Engine(model=model, **(engine_kwargs or {}))
    wl = make_workload(num_requests, in_range, out_range, engine.info().vocab_size, seed)
    report = dict(machine=machine(), model=model,
                  workload=dict(requests=num_requests, prompt_len=list(in_range),
                                output_len=list(out_range), seed=seed,
                                prompt_tokens=sum(map(len, wl.prompts)),
                                output_tokens=wl.output_tokens),
                  engine_config=engine.info().config.to_dict(),
                  notices=list(engine.telemetry.notices),
                  results={})
    for note in engine.telemetry.notices:
        log(f"note: {note}")
    res = report["results"]
    if not num_requests:      # the batch-1 part alone (`workbench bench --num-requests 0`)
        peers = tuple(p for p in peers if p == "b1")
    else:
        def throughput(name: str, sampling: dict | None = None) -> dict:
            with tqdm(total=num_requests, desc=f"workbench {name}", unit="req") as bar:
                out = run_engine(engine, wl, lambda d, n: bar.update(d - bar.n), sampling)
            log(f"workbench {name}: {out}")
            return out
        res["workbench"] = throughput("greedy")
        if sampling:
            res["workbench_sampled"] = {s: throughput(s, SAMPLING_WORKLOADS[s]) for s in sampling}
            res["workbench_greedy_again"] = throughput("greedy (again)")
    b1_prompt_ids = make_workload(1, (b1_prompt, b1_prompt), (1, 1), engine.info().vocab_size, seed + 1).prompts[0]
    if "b1" in peers:
        res["workbench_b1"] = run_engine_b1(engine, b1_prompt_ids, b1_new)
        log(f"workbench b1: {res['workbench_b1']}")
        if sampling:
            res["workbench_b1_sampled"] = {s: run_engine_b1(engine, b1_prompt_ids, b1_new,
                                                            SAMPLING_WORKLOADS[s])
                                           for s in sampling}
            res["workbench_b1_again"] = run_engine_b1(engine, b1_prompt_ids, b1_new)
            log(f"workbench b1 sampled: {res['workbench_b1_sampled']}")
    model_path = engine.info().model_path
    del engine
    if model_path is not None and any(p in peers for p in ("hf_static", "hf_batch", "b1")):
        from . import hf_peers
        hf = hf_peers.load_hf_model(model_path)
        if "hf_static" in peers:
            res["hf_static"] = hf_peers.hf_generate_static(hf, wl.requests, batch=static_batch)
            log(f"hf static: {res['hf_static']}")
        if "hf_batch" in peers:
            res["hf_generate_batch"] = hf_peers.hf_generate_batch(hf, wl.requests)
            log(f"hf generate_batch: {res['hf_generate_batch']}")
        if "b1" in peers:
            res["hf_b1"] = hf_peers.hf_generate_b1(hf, b1_prompt_ids, b1_new)
            log(f"hf b1: {res['hf_b1']}")
    ours = res.get("workbench", {}).get("out_tok_s")
    ratios = {}
    if "hf_static" in res:
        ratios["vs_hf_static"] = round(ours / res["hf_static"]["out_tok_s"], 2)
    if "hf_generate_batch" in res:
        ratios["vs_hf_generate_batch"] = round(ours / res["hf_generate_batch"]["out_tok_s"], 2)
    if "hf_b1" in res and "workbench_b1" in res:
        ratios["b1_decode_vs_hf_generate"] = round(
            res["workbench_b1"]["decode_tok_s"] / res["hf_b1"]["decode_tok_s"], 2)
    if "workbench_sampled" in res:
        greedy = (ours + res["workbench_greedy_again"]["out_tok_s"]) / 2
        ratios["sampled_vs_greedy"] = {s: round(r["out_tok_s"] / greedy, 2)
                                       for s, r in res["workbench_sampled"].items()}
    if "workbench_b1_sampled" in res:
        tpot = (res["workbench_b1"]["tpot_ms"] + res["workbench_b1_again"]["tpot_ms"]) / 2
        ratios["b1_tpot_vs_greedy"] = {s: round(r["tpot_ms"] / tpot, 2)
                                       for s, r in res["workbench_b1_sampled"].items()}
    report["ratios"] = ratios
    return report


def format_table(report: dict) -> str:
    res = report["results"]
    rows = [("workbench (continuous batching)", res["workbench"]["out_tok_s"], "")] \
        if "workbench" in res else []
    if "hf_static" in res:
        rows.append(("HF generate, static batches", res["hf_static"]["out_tok_s"],
                     report["ratios"].get("vs_hf_static")))
    if "hf_generate_batch" in res:
        rows.append(("HF generate_batch", res["hf_generate_batch"]["out_tok_s"],
                     report["ratios"].get("vs_hf_generate_batch")))
    for name, r in res.get("workbench_sampled", {}).items():
        rows.append((f"workbench, {name}", r["out_tok_s"],
                     f"{report['ratios']['sampled_vs_greedy'][name]} of greedy"))
    lines = []
    if rows:
        lines = [f"{'system':<34} {'output tok/s':>12} {'ours ÷ it':>10}", "-" * 58]
        lines += [f"{name:<34} {tps:>12} {('' if r == '' else r if isinstance(r, str) else f'{r}x'):>10}"
                  for name, tps, r in rows]
        lines.append("")
    if "workbench_b1" in res:
        lines.append(f"{'batch-1 decode':<34} {'tok/s':>12} {'TPOT ms':>10}")
        lines.append(f"{'workbench':<34} {res['workbench_b1']['decode_tok_s']:>12} "
                     f"{res['workbench_b1']['tpot_ms']:>10}")
        for name, r in res.get("workbench_b1_sampled", {}).items():
            lines.append(f"{'workbench, ' + name:<34} {r['decode_tok_s']:>12} {r['tpot_ms']:>10}"
                         f"  ({report['ratios']['b1_tpot_vs_greedy'][name]}x greedy TPOT)")
        if "hf_b1" in res:
            lines.append(f"{'HF generate':<34} {res['hf_b1']['decode_tok_s']:>12} "
                         f"{res['hf_b1']['tpot_ms']:>10}")
            lines.append(f"ratio: {report['ratios']['b1_decode_vs_hf_generate']}x")
    return "\n".join(lines)


