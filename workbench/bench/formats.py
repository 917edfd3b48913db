"""Weight formats on the CPU, measured in one run: the engine with its weights in fp32, in the
GGUF's own blocks (quantization='gguf'), in int8, either of those with 8-bit activations
('gguf-a8', 'int8-a8'), or in bf16 (plain, or 'bf16c': the same numbers in 12.3 bits a
weight), and llama.cpp on the same GGUF file where
llama-cpp-python is installed (an optional peer, never a test dependency); with bf16,
llama.cpp on a BF16 copy of that file too (made by llama.cpp's quantizer).

Per format: the weights' bytes, batch-1 decode (TPOT, 128-token prompt, 128 new tokens),
the 128-token prefill, the offline throughput workload where asked, and quality against
fp32 (lm-eval's accuracy on a small local multiple-choice task where lm-eval is
installed, bench/lm_eval_local.py, and) the log-probability fp32's greedy continuation of each check prompt gets under the
format (teacher-forced, so one early difference does not change every later token), as mean
and max |difference| per token, and how many of those tokens the format's own argmax
agrees with. Ratios are against fp32 (and llama.cpp) measured in the same run, since only
figures from one run on one machine compare."""
from __future__ import annotations

import time

from ..core.sampling_params import SamplingParams
from ..engine import Engine

FORMATS = {"fp32": dict(dtype="float32", quantization=None), "gguf": dict(dtype="float32", quantization="gguf"),
           "int8": dict(dtype="float32", quantization="int8"),
           "gguf-a8": dict(dtype="float32", quantization="gguf-a8"),
           "int8-a8": dict(dtype="float32", quantization="int8-a8"),
           "bf16": dict(dtype="bfloat16", quantization=None),
           "bf16c": dict(dtype="bfloat16", quantization="bf16c")}
"""Name -> the engine knobs that give it."""
CHECK_PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
                 "Write a haiku about the sea.", "In 1905, Albert Einstein published",
                 "The three primary colors are", "To make a cup of tea, first"]
QUALITY_TOKENS = 32


def _prefill_ms(engine: Engine, prompt: list[int], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        engine.reset_prefix_cache()
        t = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        best = min(best, time.perf_counter() - t)
    return round(best * 1e3, 1)


def _continuations(engine: Engine) -> list[list[int]]:
    p = SamplingParams(max_tokens=QUALITY_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(CHECK_PROMPTS, p)]


def _scored(engine: Engine, prompts: list[list[int]], conts: list[list[int]]):
    """Per check prompt: (the logprob of each of `conts`' tokens, whether it is the argmax)."""
    p = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out = []
    for ids, cont in zip(prompts, conts):
        o = engine.generate([ids + cont], p)[0]
        rows = o.prompt_logprobs[len(ids):]
        out.append(([row[t].logprob for row, t in zip(rows, cont)],
                    [row[t].rank == 1 for row, t in zip(rows, cont)]))
    return out


def quality(engine: Engine, reference: list[tuple[list[float], list[bool]]],
            prompts: list[list[int]], conts: list[list[int]]) -> dict:
    got = _scored(engine, prompts, conts)
    diffs = [abs(a - b) for (la, _), (lb, _) in zip(got, reference) for a, b in zip(la, lb)]
    agree = sum(t for _, tops in got for t in tops)
    n = sum(len(c) for c in conts)
    return dict(logprob_err_mean=float(f"{sum(diffs) / len(diffs):.3g}"),
                logprob_err_max=float(f"{max(diffs):.3g}"), argmax_agree=f"{agree}/{n}")


def llama_cpp_b1(gguf_path: str, prompt: list[int], new_tokens: int, threads: int) -> dict:
    """llama.cpp (llama-cpp-python) on the GGUF file as is: the same batch-1 measurement."""
    from llama_cpp import Llama
    llm = Llama(model_path=gguf_path, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    try:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t
        times = []
        for _ in range(new_tokens):
            tok = llm.sample(temp=0.0)
            t = time.perf_counter()
            llm.eval([tok])
            times.append(time.perf_counter() - t)
        tpot = sum(times[1:]) / (len(times) - 1)
        return dict(tpot_ms=round(tpot * 1e3, 2), decode_tok_s=round(1 / tpot, 1),
                    prefill_ms=round(prefill * 1e3, 1))
    finally:
        llm.close() if hasattr(llm, "close") else None


def llama_cpp_bf16_copy(gguf_path: str, beside: str) -> str:
    """A BF16 copy of the GGUF file, made once (kept beside `beside`: the converted checkpoint
    in the model cache, EngineInfo.model_path) by llama.cpp's own quantizer: the peer for the
    engine in bf16. The shipped file is already quantized, so the quantizer is told it may requantize (it dequantizes each block to fp32,
    then rounds to bf16: the numbers of the engine's fp32 checkpoint cast to bf16). Written
    to a temporary name and renamed, so a copy is whole or absent."""
    import ctypes
    import os
    from pathlib import Path

    import llama_cpp

    src, near = Path(gguf_path), Path(beside)
    out = near.with_name(f"{near.name}.{src.stem}.BF16.gguf")
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
        params.allow_requantize = True
        params.nthread = 0
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                            ctypes.byref(params))
        if rc != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"llama_model_quantize to BF16 failed ({rc})")
        os.replace(tmp, out)
    return str(out)


def _has_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def run(formats=("fp32", "gguf", "int8"), model: str = "smollm2", b1_prompt: int = 128,
        b1_new: int = 128, workload=None, peers=("llama_cpp",), engine_kwargs: dict | None = None,
        log=print) -> dict:
    """Each format in turn (one engine at a time), fp32 first: it is the quality reference.
    `workload`: an offline.Workload to run through each format too (throughput)."""
    import torch

    from .offline import make_workload, run_engine, run_engine_b1
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"formats: unknown {unknown[0]!r} (one of {', '.join(FORMATS)})")
    formats = ("fp32", *[f for f in formats if f != "fp32"])
    res: dict = {}
    reference = prompts = conts = gguf = early = model_dir = None
    for name in formats:
        engine = Engine(model=model, device="cpu", **{**(engine_kwargs or {}), **FORMATS[name]})
        try:
            info = engine.info()
            gguf = gguf or info.gguf_path
            model_dir = model_dir or info.model_path
            prompt = make_workload(1, (b1_prompt, b1_prompt), (1, 1), info.vocab_size, 1).prompts[0]
            r = dict(weight_formats=list(info.weight_formats), weight_mb=round(info.weight_bytes / 1e6, 1),
                     b1=run_engine_b1(engine, prompt, b1_new), prefill_ms=_prefill_ms(engine, prompt))
            if engine.tokenizer is not None:
                if reference is None:
                    prompts = [engine.tokenizer.encode(p) for p in CHECK_PROMPTS]
                    conts = _continuations(engine)
                    reference = _scored(engine, prompts, conts)
                r["quality_vs_fp32"] = quality(engine, reference, prompts, conts)
                try:
                    from .lm_eval_local import accuracy
                    r["lm_eval_local_mc"] = accuracy(engine)
                except ImportError:
                    pass                      # lm-eval is optional (the dev extra has it)
            if workload is not None:
                r["throughput"] = run_engine(engine, workload)
            res[name] = r
            log(f"{name}: {r}")
            if early is None and gguf is not None and "llama_cpp" in peers and _has_llama_cpp():
                # llama.cpp first as well as last: on a shared machine the load changes
                # within a run; the faster of its two runs is the peer's figure.
                early = llama_cpp_b1(gguf, prompt, b1_new, torch.get_num_threads())
        finally:
            engine.shutdown()
    if "llama_cpp" in peers and gguf is not None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            log("llama.cpp peer skipped: llama-cpp-python is not installed")
        else:
            runs = [early] if early else []
            runs.append(llama_cpp_b1(gguf, prompt, b1_new, torch.get_num_threads()))
            res["llama_cpp_gguf"] = min(runs, key=lambda r: r["tpot_ms"])
            res["llama_cpp_gguf"]["tpot_ms_runs"] = [r["tpot_ms"] for r in runs]
            log(f"llama.cpp on the GGUF as is: {res['llama_cpp_gguf']}")
            if ("bf16" in res or "bf16c" in res) and model_dir is not None:
                res["llama_cpp_bf16"] = llama_cpp_b1(llama_cpp_bf16_copy(gguf, model_dir), prompt, b1_new,
                                                     torch.get_num_threads())
                log(f"llama.cpp on a BF16 copy of the GGUF: {res['llama_cpp_bf16']}")
    base = res["fp32"]
    ratios = {name: dict(tpot_vs_fp32=round(r["b1"]["tpot_ms"] / base["b1"]["tpot_ms"], 2),
                         prefill_vs_fp32=round(r["prefill_ms"] / base["prefill_ms"], 2),
                         **({"throughput_vs_fp32": round(r["throughput"]["out_tok_s"]
                                                         / base["throughput"]["out_tok_s"], 2)}
                            if "throughput" in r else {}))
              for name, r in res.items() if name in FORMATS and name != "fp32"}
    for name in ("gguf", "gguf-a8"):
        if "llama_cpp_gguf" in res and name in res:
            ratios[f"{name}_tpot_vs_llama_cpp"] = round(res[name]["b1"]["tpot_ms"]
                                                        / res["llama_cpp_gguf"]["tpot_ms"], 2)
    for name in ("bf16", "bf16c"):
        if "llama_cpp_bf16" in res and name in res:
            ratios[f"{name}_tpot_vs_llama_cpp_bf16"] = round(res[name]["b1"]["tpot_ms"]
                                                             / res["llama_cpp_bf16"]["tpot_ms"], 2)
    return dict(results=res, ratios=ratios, b1=dict(prompt=b1_prompt, new_tokens=b1_new))


def format_table(report: dict) -> str:
    res, ratios = report["results"], report["ratios"]
    lines = [f"{'weights':<16} {'MB':>7} {'TPOT ms':>8} {'prefill ms':>10} {'tok/s':>8} "
             f"{'|Δlogprob| mean/max':>20} {'argmax':>8} {'lm-eval acc':>11}", "-" * 96]
    for name, r in res.items():
        if name not in FORMATS:
            continue
        q = r.get("quality_vs_fp32", {})
        qs = f"{q.get('logprob_err_mean', '')}/{q.get('logprob_err_max', '')}" if q else ""
        tps = r.get("throughput", {}).get("out_tok_s", "")
        lines.append(f"{name + ' ' + '+'.join(r['weight_formats']):<16} {r['weight_mb']:>7} "
                     f"{r['b1']['tpot_ms']:>8} {r['prefill_ms']:>10} {tps:>8} {qs:>20} "
                     f"{q.get('argmax_agree', ''):>8} "
                     f"{r.get('lm_eval_local_mc', {}).get('acc', ''):>11}")
    if "llama_cpp_gguf" in res:
        r = res["llama_cpp_gguf"]
        lines.append(f"{'llama.cpp GGUF':<16} {'':>7} {r['tpot_ms']:>8} {r['prefill_ms']:>10}")
        for name in ("gguf", "gguf-a8"):
            if f"{name}_tpot_vs_llama_cpp" in ratios:
                lines.append(f"{name} TPOT ÷ llama.cpp's: {ratios[f'{name}_tpot_vs_llama_cpp']}")
    if "llama_cpp_bf16" in res:
        r = res["llama_cpp_bf16"]
        lines.append(f"{'llama.cpp BF16':<16} {'':>7} {r['tpot_ms']:>8} {r['prefill_ms']:>10}")
        lines.append(f"bf16 TPOT ÷ llama.cpp BF16's: {ratios.get('bf16_tpot_vs_llama_cpp_bf16')}")
    for name, r in ratios.items():
        if isinstance(r, dict):
            lines.append(f"{name} ÷ fp32: " + ", ".join(f"{k.split('_vs')[0]} {v}x" for k, v in r.items()))
    return "\n".join(lines)
