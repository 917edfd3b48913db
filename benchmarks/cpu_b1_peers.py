"""Batch-1 TPOT of every weight format against fp32, HF transformers' `generate` and
llama.cpp (llama-cpp-python, where installed) on the same files, measured so that the
machine's drift hits all of them: one after the other in rounds, in one process, each round
the same 128-token prompt and 128 new tokens; the median of the rounds is each one's figure.
It prints the CPU's ISA flags, the ISA the kernel was built for, and what `auto` chose
(and the GEMV figures it chose by) first.

    flock /tmp/bench.lock python benchmarks/cpu_b1_peers.py [--rounds 3] [--output FILE]
        [--formats auto,fp32,gguf,...] [--torch-path]

Other ISAs on this machine: `WORKBENCH_CPU_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2` (an AVX2-only CPU: the kernel built
without AVX-512, torch's oneDNN, ATen and MKL limited to AVX2);
`WORKBENCH_CPU_MARCH=icelake-server ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI` (an AVX-512 Xeon
without AVX512_BF16 or AMX, from a newer CPU).
`--torch-path`: the kernel unavailable (a compiler that does not exist, a fresh cache), what
a machine without a compiler serves for good and a first start serves while it builds.

Targets (issue 23, 44): bf16 TPOT <= 0.6x fp32's, bf16c <= bf16's; the default (`auto`)
<= llama.cpp's on the shipped Q4_1 file, <= fp32's and <= 0.8x HF generate's; on the torch
path the default <= 1.1x fp32's there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--formats", default="auto,fp32,gguf,gguf-a8,int8,bf16,bf16c")
    ap.add_argument("--no-hf", action="store_true", help="leave HF generate out")
    ap.add_argument("--torch-path", action="store_true",
                    help="measure the plain-torch path: no kernel (CXX=/nonexistent, a fresh "
                         "kernel cache)")
    ap.add_argument("--output", default="")
    a = ap.parse_args()
    if a.torch_path:                            # before workbench looks at either
        os.environ["CXX"] = "/nonexistent"
        from workbench.cache import cache_root
        models = cache_root()
        fresh = tempfile.mkdtemp(prefix="wb-torch-path-")
        os.environ["WORKBENCH_CACHE"] = fresh
        for sub in models.iterdir():          # the converted models, not the kernels
            if sub.name != "kernels":
                os.symlink(sub, os.path.join(fresh, sub.name))

    import torch

    from workbench import Engine
    from workbench.bench.formats import FORMATS, llama_cpp_b1
    from workbench.bench.offline import make_workload, run_engine_b1
    from workbench.platforms.cpu import describe
    from workbench.platforms.cpu_kernels import ensure_kernel_built

    knobs = {"auto": dict(dtype="float32", quantization="auto"), **FORMATS}
    names = [n for n in a.formats.split(",") if n]
    unknown = [n for n in names if n not in knobs]
    if unknown:
        ap.error(f"--formats: unknown {unknown[0]!r} (one of {', '.join(knobs)})")
    ensure_kernel_built(lambda s: print(s, file=sys.stderr))
    load0 = os.getloadavg()
    engines = {n: Engine(model="smollm2", device="cpu", **knobs[n]) for n in names}
    cpu = describe()
    cpu["auto_chose"] = {n: e.info().quantization_choice for n, e in engines.items()
                         if n == "auto"}
    for k, v in cpu.items():
        print(f"{k}: {v}", flush=True)
    try:
        info = next(iter(engines.values())).info()
        prompt = make_workload(1, (128, 128), (1, 1), info.vocab_size, 1).prompts[0]
        threads = torch.get_num_threads()
        peers = {}
        try:
            import llama_cpp  # noqa: F401
            peers["llama.cpp Q4_1"] = lambda: llama_cpp_b1(info.gguf_path, prompt,
                                                           a.new_tokens, threads)
        except ImportError:
            print("llama.cpp: llama-cpp-python is not installed; left out", flush=True)
        if not a.no_hf:
            from transformers import AutoModelForCausalLM

            from workbench.bench.hf_peers import hf_generate_b1
            hf = AutoModelForCausalLM.from_pretrained(info.model_path,
                                                      dtype=torch.float32).eval()
            peers["HF generate fp32"] = lambda: hf_generate_b1(hf, prompt, a.new_tokens)
        for e in engines.values():
            run_engine_b1(e, prompt, 16)                                # warm
        runs: dict[str, list[float]] = {k: [] for k in (*engines, *peers)}
        for r in range(a.rounds):
            for name in runs:
                m = (run_engine_b1(engines[name], prompt, a.new_tokens) if name in engines
                     else peers[name]())
                runs[name].append(m["tpot_ms"])
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()),
                  flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    median = {k: statistics.median(v) for k, v in runs.items()}
    print("median TPOT ms: " + ", ".join(f"{k} {v:.2f}" for k, v in median.items()))
    ratios = {}
    for base in ("fp32", "bf16", "HF generate fp32", "llama.cpp Q4_1"):
        if base in median:
            ratios[base] = {n: round(median[n] / median[base], 3) for n in engines if n != base}
            print(f"/ {base}: " + ", ".join(f"{n} {r:.2f}" for n, r in ratios[base].items()))
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    report = {"cpu": cpu, "torch_path": a.torch_path, "threads": threads, "rounds": a.rounds,
              "new_tokens": a.new_tokens, "load_before": load0, "load_after": os.getloadavg(),
              "tpot_ms_runs": runs, "tpot_ms_median": median, "ratios": ratios}
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
