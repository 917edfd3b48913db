"""Draw gpu.py's concurrency part (throughput and TTFT p99 against requests in flight) as
one self-contained SVG, with no plotting library: `python benchmarks/plot_concurrency.py
gpu.jsonl docs/gpu-concurrency.svg`."""
from __future__ import annotations

import json
import math
import sys


def panel(x0: float, title: str, pts: list[tuple[int, float]], unit: str, color: str) -> str:
    """One log-x line chart, 300 x 200, its origin at (x0, 40)."""
    w, h, top = 300, 200, 40
    xs = [math.log2(c) for c, _ in pts]
    ymax = max(v for _, v in pts) * 1.15
    px = lambda lx: x0 + 40 + (lx - min(xs)) / ((max(xs) - min(xs)) or 1) * (w - 60)  # noqa: E731
    py = lambda v: top + h - v / ymax * h                                              # noqa: E731
    out = [f'<text x="{x0 + w / 2}" y="{top - 16}" text-anchor="middle" font-weight="bold">'
           f'{title}</text>',
           f'<line x1="{x0 + 30}" y1="{top + h}" x2="{x0 + w}" y2="{top + h}" stroke="#888"/>',
           f'<line x1="{x0 + 30}" y1="{top}" x2="{x0 + 30}" y2="{top + h}" stroke="#888"/>',
           f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
           + " ".join(f"{px(lx):.1f},{py(v):.1f}" for lx, (_, v) in zip(xs, pts)) + '"/>']
    for lx, (c, v) in zip(xs, pts):
        out.append(f'<circle cx="{px(lx):.1f}" cy="{py(v):.1f}" r="3.5" fill="{color}"/>')
        out.append(f'<text x="{px(lx):.1f}" y="{py(v) - 8:.1f}" text-anchor="middle">'
                   f'{v:,.0f}</text>')
        out.append(f'<text x="{px(lx):.1f}" y="{top + h + 16}" text-anchor="middle">{c}</text>')
    out.append(f'<text x="{x0 + w / 2 + 15}" y="{top + h + 34}" text-anchor="middle">'
               f'requests in flight ({unit})</text>')
    return "\n".join(out)


def main(src: str, dst: str) -> None:
    rows = [json.loads(line) for line in open(src)]
    rows = sorted((r for r in rows if r["part"].startswith("concurrency_")),
                  key=lambda r: r["concurrency"])
    env = next((r for r in map(json.loads, open(src)) if r["part"] == "env"), {})
    tput = [(r["concurrency"], r["out_tok_s"]) for r in rows]
    ttft = [(r["concurrency"], r["ttft_p99_ms"]) for r in rows]
    svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="680" height="300" '
           'font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           panel(10, "output tokens/s", tput, "log scale", "#1f77b4"),
           panel(350, "TTFT p99, ms", ttft, "log scale", "#ff7f0e"),
           f'<text x="10" y="292" fill="#666">workbench, W1 requests, random:qwen3-0.6b bf16, '
           f'{env.get("name", "?")}, {env.get("date", "?")} (benchmarks/gpu.py)</text>',
           '</svg>']
    with open(dst, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
