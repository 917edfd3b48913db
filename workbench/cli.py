"""`workbench dashboard|lab|serve|bench|generate`: the command line."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .config import EngineConfig


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}")


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig.__dataclass_fields__
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (embedded), 'random:<shape>' or a local HF checkpoint dir")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or npu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=d["block_size"].default)
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    p.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"].default)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=d["gpu_memory_utilization"].default,
                   help="share of the device's memory the engine may take (KV pool sizing)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--graph-mode", default=d["graph_mode"].default,
                   help="eager, decode (capture decode steps) or full (prefill too, piecewise)")
    p.add_argument("--cudagraph-capture-sizes", type=_int_list, default=None,
                   help="decode batch sizes to capture, e.g. 1,2,4,8,16")
    p.add_argument("--attention-backend", default=d["attention_backend"].default,
                   help="auto (the device's fused kernels) or reference (plain torch)")


def _engine_kwargs(a) -> dict:
    return dict(device=a.device, dtype=a.dtype, block_size=a.block_size,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                num_kv_blocks=a.num_kv_blocks, gpu_memory_utilization=a.gpu_memory_utilization,
                enable_prefix_caching=not a.no_prefix_caching, graph_mode=a.graph_mode,
                cudagraph_capture_sizes=a.cudagraph_capture_sizes,
                attention_backend=a.attention_backend)


def _say_notices(engine) -> None:
    for note in engine.notices:
        print(f"note: {note}", file=sys.stderr, flush=True)


def cmd_generate(a) -> int:
    from . import Engine, SamplingParams
    t = time.perf_counter()
    print(f"loading {a.model} …", file=sys.stderr, flush=True)
    engine = Engine(model=a.model, **_engine_kwargs(a))
    print(f"ready in {time.perf_counter() - t:.1f} s on {engine.platform.name}", file=sys.stderr)
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
    import json

    import httpx

    from .remote import RemoteError, bench, format_report
    try:
        report = bench(a.url, num_requests=a.num_requests, concurrency=a.concurrency,
                       request_rate=a.request_rate, input_words=_range(a.input_words),
                       output_len=_range(a.output_len), model=a.model, api_key=a.api_key,
                       seed=a.seed, chat=a.chat, ignore_eos=bool(a.ignore_eos), progress=True)
    except (RemoteError, httpx.HTTPError) as e:
        print(f"error: {a.url}: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.output}", file=sys.stderr)
    return 0 if report["failed"] == 0 else 1


def cmd_bench(a) -> int:
    if a.url:
        return cmd_bench_serving(a)
    if a.ignore_eos is not None:
        raise ValueError("--ignore-eos/--no-ignore-eos: only for a server (--url); the offline "
                         "benchmark always runs each request to its length")
    from .bench import format_table, run, save
    peers = tuple(x for x in a.peers.split(",") if x and x != "none")
    report = run(model=a.model or "smollm2", num_requests=a.num_requests, in_range=_range(a.input_len),
                 out_range=_range(a.output_len), seed=a.seed, peers=peers,
                 static_batch=a.static_batch, engine_kwargs=_engine_kwargs(a),
                 log=lambda s: print(s, file=sys.stderr))
    print(format_table(report))
    if a.output:
        save(report, a.output)
        print(f"wrote {a.output}", file=sys.stderr)
    return 0


def cmd_serve(a) -> int:
    import os

    from . import Engine
    try:
        from .server import serve
    except ImportError as e:
        print(f"error: workbench serve needs the 'serve' extra (pip install -e \".[serve]\"): {e}",
              file=sys.stderr)
        return 2
    api_key = a.api_key if a.api_key is not None else os.environ.get("WORKBENCH_API_KEY") or None
    t = time.perf_counter()
    print(f"loading {a.model} …", file=sys.stderr, flush=True)
    engine = Engine(model=a.model, max_model_len=a.max_model_len,
                    max_step_events=a.max_step_events, **_engine_kwargs(a))
    print(f"ready in {time.perf_counter() - t:.1f} s on {engine.platform.name}; "
          f"max_model_len {engine.max_model_len}, {engine.block_manager.num_blocks} KV blocks",
          file=sys.stderr, flush=True)
    _say_notices(engine)
    if api_key is None and a.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {a.host} without --api-key: anyone who can reach it can "
              "use it", file=sys.stderr)
    serve(engine, host=a.host, port=a.port, api_key=api_key, model_name=a.served_model_name,
          log_level=a.log_level)
    return 0


def notebooks_dir() -> Path:
    """The repository's notebooks/ (the dashboard and the lab open them from a checkout)."""
    d = Path(__file__).resolve().parents[1] / "notebooks"
    if not (d / "dashboard.ipynb").is_file():
        raise FileNotFoundError(f"{d / 'dashboard.ipynb'} not found: the dashboard and the lab "
                                "run from a source checkout (git clone …; pip install -e \".[ui]\")")
    return d


def _jupyter(module: str, args: list[str], env: dict[str, str], url: str) -> int:
    """Run a Jupyter server in the foreground (Ctrl-C stops it), after saying where it is."""
    import importlib.util
    import os
    import subprocess
    if importlib.util.find_spec(module) is None:
        print(f"error: {module} is not installed; pip install -e \".[ui]\"", file=sys.stderr)
        return 2
    print(f"{url}   (Ctrl-C stops it)", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", module, *args], env={**os.environ, **env})
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait(30)


def cmd_dashboard(a) -> int:
    nb = notebooks_dir() / "dashboard.ipynb"
    env = {"WORKBENCH_DEVICE": a.device}
    if a.model:
        env["WORKBENCH_MODEL"] = a.model
    if a.url:
        env["WORKBENCH_URL"] = a.url
        if a.api_key:
            env["WORKBENCH_API_KEY"] = a.api_key
    args = [str(nb), "--no-browser", f"--port={a.port}", f"--Voila.ip={a.host}",
            "--template=lab", "--strip_sources=True", "--show_tracebacks=True",
            "--Voila.port_retries=0"]
    if a.browser:
        args.remove("--no-browser")
    return _jupyter("voila", args, env, f"dashboard: http://{a.host}:{a.port}/")


def cmd_lab(a) -> int:
    import os
    d = notebooks_dir()
    args = [f"--notebook-dir={d}", f"--ServerApp.ip={a.host}", f"--port={a.port}"]
    if not a.browser:
        args.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")    # containers often run as root; Jupyter refuses without it
    return _jupyter("jupyterlab", args, {}, f"JupyterLab on {d}: http://{a.host}:{a.port}/lab")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

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
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--input-len", default="16:256", help="prompt length range LO:HI")
    b.add_argument("--output-len", default="16:256", help="output length range LO:HI")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--peers", default="hf_static,hf_batch,b1",
                   help="comma list of hf_static, hf_batch, b1, or none")
    b.add_argument("--static-batch", type=int, default=16)
    b.add_argument("--output", default="bench.json", help="JSON report path ('' for none)")
    serving = b.add_argument_group("serving benchmark (with --url, in the manner of vllm bench serve)")
    serving.add_argument("--url", default=None,
                         help="benchmark a running OpenAI-compatible server instead of the "
                              "engine in this process; --model then names the model to request "
                              "(default: the first the server lists)")
    serving.add_argument("--api-key", default=None)
    serving.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                         help="send vLLM's ignore_eos so each request runs to its length "
                              "(default: not sent; strict OpenAI servers refuse it)")
    serving.add_argument("--concurrency", type=int, default=16, help="most requests in flight")
    serving.add_argument("--request-rate", type=float, default=float("inf"),
                         help="Poisson arrivals, requests/s (default: all at once)")
    serving.add_argument("--input-words", default="16:256", help="prompt length range in words")
    serving.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    b.set_defaults(func=cmd_bench)

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
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("dashboard", help="the live dashboard, served with Voila (needs 'ui')")
    d.add_argument("--model", default=None,
                   help="'smollm2' (embedded, the default), 'random:<shape>' or a local HF "
                        "checkpoint dir; with --url, the model id to request (default: the "
                        "first the server lists)")
    d.add_argument("--device", default="auto", help="auto, cpu, cuda or npu")
    d.add_argument("--url", default=None,
                   help="watch and drive a running OpenAI-compatible server instead (vLLM, "
                        "vLLM-Ascend, workbench serve)")
    d.add_argument("--api-key", default=None, help="the --url server's API key")
    d.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    d.add_argument("--port", type=int, default=8866)
    d.add_argument("--browser", action="store_true", help="also open it in a browser")
    d.set_defaults(func=cmd_dashboard)

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
