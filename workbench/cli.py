"""`workbench generate|bench`: the command line."""
from __future__ import annotations

import argparse
import sys
import time

from .config import EngineConfig


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig.__dataclass_fields__
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (embedded), 'random:<shape>' or a local HF checkpoint dir")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=d["block_size"].default)
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    p.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"].default)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")


def _engine_kwargs(a) -> dict:
    return dict(device=a.device, dtype=a.dtype, block_size=a.block_size,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                num_kv_blocks=a.num_kv_blocks, enable_prefix_caching=not a.no_prefix_caching)


def cmd_generate(a) -> int:
    from . import Engine, SamplingParams
    t = time.perf_counter()
    print(f"loading {a.model} …", file=sys.stderr, flush=True)
    engine = Engine(model=a.model, **_engine_kwargs(a))
    print(f"ready in {time.perf_counter() - t:.1f} s on {engine.platform.name}", file=sys.stderr)
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


def cmd_bench(a) -> int:
    from .bench import format_table, run, save
    peers = tuple(x for x in a.peers.split(",") if x and x != "none")
    report = run(model=a.model, num_requests=a.num_requests, in_range=_range(a.input_len),
                 out_range=_range(a.output_len), seed=a.seed, peers=peers,
                 static_batch=a.static_batch, engine_kwargs=_engine_kwargs(a),
                 log=lambda s: print(s, file=sys.stderr))
    print(format_table(report))
    if a.output:
        save(report, a.output)
        print(f"wrote {a.output}", file=sys.stderr)
    return 0


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
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--input-len", default="16:256", help="prompt length range LO:HI")
    b.add_argument("--output-len", default="16:256", help="output length range LO:HI")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--peers", default="hf_static,hf_batch,b1",
                   help="comma list of hf_static, hf_batch, b1, or none")
    b.add_argument("--static-batch", type=int, default=16)
    b.add_argument("--output", default="bench.json", help="JSON report path ('' for none)")
    b.set_defaults(func=cmd_bench)
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
