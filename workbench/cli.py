"""`workbench dashboard|lab|serve|bench|generate|tune|doctor`: the command line."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .launch import run_dashboard, run_lab
from .config import (ATTENTION_BACKENDS, BLOCK_SIZES, DEVICES, DTYPES, GENERATION_CONFIGS,
                     GRAPH_MODES, QUANTIZATIONS, REASONING_PARSERS, TOOL_CALL_PARSERS,
                     EngineConfig)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")


def _positive_int(text: str) -> int:
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {text!r}")


def _json_dict(text: str) -> dict:      # its fields are checked by EngineConfig
    try:
        return dict(json.loads(text))
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")


def _device(text: str) -> str:      # a modelled profile's name is checked by EngineConfig
    if text in DEVICES or text.startswith("model:"):
        return text
    raise argparse.ArgumentTypeError(f"expected one of {DEVICES} or model:<profile>: {text!r}")


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig.__dataclass_fields__
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (embedded), 'random:<shape>' or a local HF checkpoint dir")
    p.add_argument("--device", default="auto", type=_device, metavar="|".join(DEVICES),
                   help="auto tries npu, then cuda, then cpu; model:<profile> (model:h200, "
                        "model:cpu, ...) is a modelled device (workbench/modelled/)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--quantization", default=d["quantization"].default,
                   choices=(*QUANTIZATIONS, "none"),
                   help="low-bit weights on the CPU: gguf (the GGUF's own Q4_1/Q8_0 blocks), "
                        "int8 (any checkpoint, per output row) or none; auto (default): the "
                        "checkpoint's own format where the device runs it (gguf for smollm2 "
                        "on the CPU)")
    p.add_argument("--block-size", type=int, default=d["block_size"].default, choices=BLOCK_SIZES,
                   help="tokens per KV block; default: the device's choice")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    p.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"].default)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"]
                   .default, help="share of the device's memory the engine may take (KV pool)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--graph-mode", default=d["graph_mode"].default, choices=GRAPH_MODES,
                   help="eager, decode (capture decode steps) or full (prefill too, piecewise); "
                        "default: decode where the device captures graphs, else eager")
    p.add_argument("--cudagraph-capture-sizes", type=_int_list, default=None,
                   help="decode batch sizes to capture, e.g. 1,2,4,8,16")
    p.add_argument("--pa-shape-list", type=_int_list, default=None,
                   help="NPU: decode batch sizes captured whole with _npu_paged_attention (vLLM-"
                        "Ascend's pa_shape_list; default none)")
    p.add_argument("--generation-config", default=d["generation_config"].default,
                   choices=GENERATION_CONFIGS,
                   help="auto: sampling defaults from the model's generation_config.json for "
                        "fields a request leaves out (as vLLM); none: SamplingParams' own")
    p.add_argument("--attention-backend", default=d["attention_backend"].default,
                   choices=ATTENTION_BACKENDS,
                   help="auto (the device's fused kernels) or reference (plain torch)")
    p.add_argument("--speculative-config", type=_json_dict, default=None,
                   help='speculative decoding as vllm serve takes it, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def _engine_kwargs(a) -> dict:
    return dict(device=a.device, dtype=a.dtype,
                quantization=None if a.quantization == "none" else a.quantization,
                block_size=a.block_size,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                num_kv_blocks=a.num_kv_blocks, gpu_memory_utilization=a.gpu_memory_utilization,
                enable_prefix_caching=not a.no_prefix_caching, graph_mode=a.graph_mode,
                cudagraph_capture_sizes=a.cudagraph_capture_sizes, pa_shape_list=a.pa_shape_list,
                attention_backend=a.attention_backend, generation_config=a.generation_config,
                speculative_config=a.speculative_config)


def _say_notices(engine) -> None:
    for note in engine.telemetry.notices:
        print(f"note: {note}", file=sys.stderr, flush=True)


def cmd_build_kernels(a) -> int:
    from .platforms.cpu_kernels import ensure_kernel_built, kernel_dir
    ok = ensure_kernel_built(lambda s: print(s, file=sys.stderr), retry=True)
    print(f"{'built' if ok else 'unavailable'}: {kernel_dir()}")
    return 0 if ok else 1


def cmd_generate(a) -> int:
    from . import Engine, SamplingParams
    t = time.perf_counter()
    print(f"loading {a.model} …", file=sys.stderr, flush=True)
    engine = Engine(model=a.model, **_engine_kwargs(a))
    print(f"ready in {time.perf_counter() - t:.1f} s on {engine.info().device}", file=sys.stderr)
    _say_notices(engine)
    prompt = a.prompt
    if not a.raw and engine.tokenizer is not None and engine.tokenizer.chat_template:
        prompt = [{"role": "user", "content": a.prompt}]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed)
    last = None
    for ev in engine.stream(prompt, params):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        last = ev
    m = engine.telemetry.requests[-1]
    tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot is not None else "n/a"
    print(f"\n\n[{m.output_tokens} tokens, finish: {last.finish_reason}; "
          f"TTFT {m.ttft * 1e3:.0f} ms, TPOT {tpot}]", file=sys.stderr)
    return 0


def cmd_bench_serving(a) -> int:

    import httpx

    from .bench.serving import bench, format_report
    from .serving.client import RemoteError
    try:
        report = bench(a.url, num_requests=a.num_requests, concurrency=a.concurrency,
                       request_rate=a.request_rate, input_words=_range(a.input_words),
                       output_len=_range(a.output_len), model=a.model, api_key=a.api_key,
                       seed=a.seed, endpoint="chat" if a.chat else a.endpoint,
                       ignore_eos=bool(a.ignore_eos), progress=True)
    except (RemoteError, httpx.HTTPError) as e:
        print(f"error: {a.url}: {e}", file=sys.stderr)
        return 2
    _report(format_report(report), report, a.output)
    return 0 if report["failed"] == 0 else 1


def _report(table: str, report: dict, output: str | None) -> None:
    """A benchmark's table on stdout, and its JSON report where --output names a file."""
    print(table)
    if output:
        with open(output, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {output}", file=sys.stderr)


def cmd_bench(a) -> int:
    if a.url:
        return cmd_bench_serving(a)
    if a.ignore_eos is not None:
        raise ValueError("--ignore-eos/--no-ignore-eos: only for a server (--url); the offline "
                         "benchmark always runs each request to its length")
    if a.speculative_config:      # the A/B beside plain decoding (bench/speculative.py)
        from .bench import speculative
        kw = _engine_kwargs(a)
        report = speculative.run(a.model or "smollm2", kw["speculative_config"], kw,
                                 tuple(a.spec_batches), log=lambda s: print(s, file=sys.stderr))
        _report(speculative.format_table(report), report, a.output)
        return 0
    from .bench.offline import SAMPLING_WORKLOADS, format_table, make_workload, run
    from .platforms import auto_device
    if (auto_device() if a.device in (None, "auto") else a.device) == "cpu":
        from .platforms.cpu_kernels import ensure_kernel_built    # measure the kernel, never the fallback
        ensure_kernel_built(lambda s: print(s, file=sys.stderr))
    if a.formats:
        from .bench import formats
        kw = {k: v for k, v in _engine_kwargs(a).items() if k not in ("dtype", "quantization", "device")}
        wl = (make_workload(a.num_requests, _range(a.input_len), _range(a.output_len), 49152,
                            a.seed) if a.num_requests else None)
        report = formats.run(tuple(x for x in a.formats.split(",") if x), a.model or "smollm2",
                             workload=wl, engine_kwargs=kw, log=lambda s: print(s, file=sys.stderr))
        _report(formats.format_table(report), report, a.output)
        return 0
    sampling = (tuple(SAMPLING_WORKLOADS) if a.sampling == "all"
                else tuple(x for x in a.sampling.split(",") if x and x != "none"))
    peers = tuple(x for x in a.peers.split(",") if x and x != "none")
    report = run(model=a.model or "smollm2", num_requests=a.num_requests, in_range=_range(a.input_len),
                 out_range=_range(a.output_len), seed=a.seed, peers=peers,
                 static_batch=a.static_batch, engine_kwargs=_engine_kwargs(a),
                 log=lambda s: print(s, file=sys.stderr), sampling=sampling)
    _report(format_table(report), report, a.output)
    return 0


def cmd_serve(a) -> int:
    from . import Engine
    try:
        from .serving.app import serve
    except ImportError as e:
        print(f"error: workbench serve needs the 'serve' extra (pip install -e \".[serve]\"): {e}",
              file=sys.stderr)
        return 2
    api_key = a.api_key if a.api_key is not None else os.environ.get("WORKBENCH_API_KEY") or None
    t = time.perf_counter()
    print(f"loading {a.model} …", file=sys.stderr, flush=True)
    engine = Engine(model=a.model, max_model_len=a.max_model_len,
                    max_step_events=a.max_step_events, **_engine_kwargs(a))
    print(f"ready in {time.perf_counter() - t:.1f} s on {engine.info().device}; "
          f"max_model_len {engine.info().max_model_len}, {engine.info().num_kv_blocks} KV blocks",
          file=sys.stderr, flush=True)
    _say_notices(engine)
    if api_key is None and a.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {a.host} without --api-key: anyone who can reach it can "
              "use it", file=sys.stderr)
    chat_template = None
    if a.chat_template is not None:     # a file, or the template's text itself (as vLLM)
        path = os.path.expanduser(a.chat_template)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                chat_template = f.read()
        elif any(c in a.chat_template for c in "{}"):
            chat_template = a.chat_template
        else:
            print(f"error: --chat-template: {a.chat_template!r} is neither a file nor a Jinja "
                  "template text", file=sys.stderr)
            return 2
    limits = {k: v for k, v in (("header_timeout", a.header_timeout),
                                ("limit_concurrency", a.limit_concurrency)) if v is not None}
    try:
        serve(engine, host=a.host, port=a.port, api_key=api_key, model_name=a.served_model_name,
              log_level=a.log_level, allow_missing_model=a.allow_missing_model,
              strict_fields=a.strict_fields, chat_template=chat_template,
              tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser,
              **limits)
    finally:
        engine.close()       # the KV pool, graphs and weights, freed before the process ends
    return 0


def cmd_dashboard(a) -> int:
    env = {"WORKBENCH_DEVICE": a.device}
    if a.replay:
        if a.url or a.model:
            raise ValueError("--replay plays a recorded trace; it takes no --url or --model")
        if not 0 < a.speed <= 1000:
            raise ValueError(f"--speed: must be in (0, 1000] (got {a.speed})")
        from .trace import Trace
        Trace.load(a.replay)                    # a bad file fails here (TraceError), not in the page
        env["WORKBENCH_REPLAY"] = os.path.realpath(a.replay)
        env["WORKBENCH_REPLAY_SPEED"] = str(a.speed)
        if a.paused:
            env["WORKBENCH_REPLAY_PAUSED"] = "1"
    elif a.paused:
        raise ValueError("--paused: only with --replay")
    if a.model:
        env["WORKBENCH_MODEL"] = a.model
    if a.speculative_config is not None:
        if a.url or a.replay:
            raise ValueError("--speculative-config: for an engine built here; a server's is set "
                             "where it runs, and a replay loads no model")
        from .config import SpeculativeConfig
        SpeculativeConfig.from_dict(a.speculative_config)   # a bad one fails here, not in the page
        env["WORKBENCH_SPECULATIVE_CONFIG"] = json.dumps(a.speculative_config)
    if a.url:
        env["WORKBENCH_URL"] = a.url
        if a.api_key:
            env["WORKBENCH_API_KEY"] = a.api_key
    return run_dashboard(env, a.host, a.port, a.kernel_idle_timeout, a.browser)


def cmd_lab(a) -> int:
    return run_lab(a.host, a.port, a.browser)


def cmd_doctor(a) -> int:
    """The device's checks (cpu.doctor_lines, npu_doctor.run_doctor); 1 on a refusal/failure."""
    if a.device == "cpu":
        from .platforms.cpu import doctor_lines
        lines, ok = doctor_lines()
        print("\n".join(lines))
        return 0 if ok else 1
    from .platforms.npu_doctor import run_doctor
    return run_doctor(a.report)


def build_parser() -> argparse.ArgumentParser:
    from .tune.cli import add_parser as add_tune_parser
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("build-kernels", help="build the CPU kernel now (else the first engine "
                                             "builds it in a detached process)")
    k.set_defaults(func=cmd_build_kernels)

    g = sub.add_parser("generate", help="stream a reply in the terminal")
    g.add_argument("prompt")
    _engine_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send the prompt as is, not as a chat turn")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="offline throughput benchmark against HF transformers")
    _engine_args(b)
    b.set_defaults(model=None)   # smollm2 here; with --url, the model id to request
    b.add_argument("--num-requests", type=int, default=64,
                   help="requests of the throughput workload; 0 runs the batch-1 part alone")
    b.add_argument("--input-len", default="16:256", help="prompt length range LO:HI")
    b.add_argument("--output-len", default="16:256", help="output length range LO:HI")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--peers", default="hf_static,hf_batch,b1",
                   help="comma list of hf_static, hf_batch, b1, or none")
    b.add_argument("--static-batch", type=int, default=16)
    b.add_argument("--spec-batches", type=_int_list, default=[1, 8, 32],
                   help="with --speculative-config: the batch sizes of the A/B (comma list)")
    b.add_argument("--sampling", default="all",
                   help="sampled workloads to run beside greedy on the same requests: all, "
                        "none, or a comma list of bench.offline.SAMPLING_WORKLOADS' names "
                        "(qwen3_defaults, t0.7_top_p0.9, greedy_stop_string, greedy_logprobs5)")
    b.add_argument("--formats", default=None,
                   help="compare weight formats on the CPU instead (comma list of fp32, gguf, int8, "
                        "gguf-a8, int8-a8, bf16, bf16c): weight bytes, batch-1 TPOT, prefill, quality "
                        "against fp32, the --num-requests workload, and llama.cpp on the same GGUF")
    b.add_argument("--output", default="bench.json", help="JSON report path ('' for none)")
    serving = b.add_argument_group("serving benchmark (with --url, in the manner of vllm bench serve)")
    serving.add_argument("--url", default=None,
                         help="benchmark a running OpenAI-compatible server instead of the "
                              "engine in this process; --model then names the model to request "
                              "(default: the first the server lists)")
    serving.add_argument("--api-key", default=None)
    serving.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                         help="send vLLM's ignore_eos so each request runs to its length (default: not sent)")
    serving.add_argument("--concurrency", type=int, default=16, help="most requests in flight")
    serving.add_argument("--request-rate", type=float, default=float("inf"),
                         help="Poisson arrivals, requests/s (default: all at once)")
    serving.add_argument("--input-words", default="16:256", help="prompt length range in words")
    serving.add_argument("--endpoint", default="completions",
                         choices=("completions", "chat", "responses"),
                         help="the API to send the requests to: /v1/completions (default), /v1/"
                              "chat/completions, or /v1/responses (a Responses-only server)")
    serving.add_argument("--chat", action="store_true", help="the same as --endpoint chat")
    b.set_defaults(func=cmd_bench)

    add_tune_parser(sub, _engine_args, _engine_kwargs)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'serve' extra)")
    _engine_args(s)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-step-events", type=int, default=10_000,
                   help="step records kept in memory (a long-running server needs few)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $WORKBENCH_API_KEY)")
    s.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: --model)")
    s.add_argument("--allow-missing-model", action="store_true",
                   help="a request without 'model' gets the served one (default: 400)")
    s.add_argument("--strict-fields", action="store_true",
                   help="refuse (400) request fields this server does not know (default: ignore "
                        "them, warned in the log and a response header, as vLLM)")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="the Jinja chat template for chat requests that send none (default: "
                        "the tokenizer's)")
    s.add_argument("--tool-call-parser", default="hermes", choices=TOOL_CALL_PARSERS,
                   help="how tool_choice auto reads the model's calls (hermes: <tool_call> "
                        "JSON blocks, as Hermes, Qwen2.5/3 and SmolLM3 write them)")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a reasoning model's <think> block from its answer: chat's reasoning_"
                        "content, the Responses API's reasoning items (qwen3: Qwen3; deepseek_r1: "
                        "models whose template opens the block); default: no split")
    s.add_argument("--header-timeout", type=float, default=None, metavar="S",
                   help="close a connection that has not sent a whole request head in S "
                        "seconds (default 10)")
    s.add_argument("--limit-concurrency", type=_positive_int, default=None, metavar="N",
                   help="answer 503 past N open connections or requests in flight (default 512)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("dashboard", help="the live dashboard, served with Voila (needs 'ui')")
    d.add_argument("--model", default=None,
                   help="'smollm2' (embedded, the default), 'random:<shape>' or a local HF checkpoint "
                        "dir; with --url, the model id to request (default: the first listed)")
    d.add_argument("--device", default="auto", help="auto, cpu, cuda or npu")
    d.add_argument("--speculative-config", type=_json_dict, default=None,
                   help="the engine's speculative decoding, as for serve (the page's knobs "
                        "start from it)")
    d.add_argument("--url", default=None,
                   help="watch and drive a running OpenAI-compatible server instead (vLLM, "
                        "vLLM-Ascend, workbench serve)")
    d.add_argument("--api-key", default=None, help="the --url server's API key")
    d.add_argument("--replay", default=None, metavar="FILE",
                   help="play a recorded trace back (workbench.trace) with no model loaded, "
                        "from when the page opens; docs/traces/ has one")
    d.add_argument("--speed", type=float, default=1.0,
                   help="with --replay: times real time (default 1)")
    d.add_argument("--paused", action="store_true",
                   help="with --replay: wait for the Play button (default: play when the page "
                        "opens)")
    d.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    d.add_argument("--port", type=int, default=8866)
    d.add_argument("--browser", action="store_true", help="also open it in a browser")
    d.add_argument("--kernel-idle-timeout", type=_positive_int, default=60, metavar="S",
                   help="shut down a page's kernel once it has been idle S seconds with no page "
                        "connected: after its page closes, or if its page never connects "
                        "(default 60; a page that takes longer than S to load loses its kernel)")
    d.set_defaults(func=cmd_dashboard)

    doc = sub.add_parser("doctor", help="check a device without loading a model: versions, chip, "
                         "head sizes, graph updates, one tiny op of each kind (ran / failed, the fix)")
    doc.add_argument("--device", required=True, choices=["cpu", "npu"],
                     help="the device to check (cpu: the CPU's ISA, its C++ kernel's build "
                          "and what 'auto' measured)")
    doc.add_argument("--report", metavar="FILE",
                     help="npu: also write everything found and every check's outcome as JSON")
    doc.set_defaults(func=cmd_doctor)

    lab = sub.add_parser("lab", help="JupyterLab on the notebooks (needs 'ui')")
    lab.add_argument("--host", default="127.0.0.1")
    lab.add_argument("--port", type=int, default=8888)
    lab.add_argument("--browser", action="store_true", help="also open it in a browser")
    lab.set_defaults(func=cmd_lab)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
