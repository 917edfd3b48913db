"""Speculative decoding beside plain decoding (`workbench bench --speculative-config ...`):
the same requests through an engine without speculation and one with it, built with the
same knobs, in the same run, rounds interleaved (plain, speculative, plain, ...) so a noisy
machine moves both alike; each arm's best round is kept.

Workloads (bench/spec_workloads.py): 'grounded', chat prompts that carry a passage of
300-600 tokens (files of this repository, read locally) and ask to copy, summarise, extract
from or edit it, where prompt lookup finds long drafts; 'open', chat prompts that ground
nothing, where it finds few (a miss must cost nothing). Greedy, so the two arms must
produce the same tokens (checked).
"""
from __future__ import annotations

import time

from ..engine import Engine
from ..core.sampling_params import SamplingParams
from .spec_workloads import grounded_prompts, workload


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens a verify step keeps on average when each of its k drafts is accepted with
    probability alpha, independently, and the first rejection cuts the rest (Leviathan et al.
    2023): 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) (the accepted drafts,
    and the target's own token after them)."""
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"alpha must be in [0, 1] and k >= 0 (got {alpha}, {k})")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def check_tokens_per_step(answer, alpha: float, k: int) -> str:
    """Notebook 02's exercise: `answer`, the expected tokens per verify step from alpha and k,
    against the formula; a line starting 'right:' or 'not quite'."""
    want = expected_tokens_per_step(alpha, k)
    if answer is None:
        return "not answered yet: set answer_spec above, then run this cell"
    if isinstance(answer, (int, float)) and abs(answer - want) <= 1e-3 * want:
        return (f"right: {want:.2f} tokens a verify step (α = {alpha:.3f}, k = {k}: "
                f"1 + α + … + α^{k})")
    return (f"not quite: {answer} is not it. Hint: the target's own token always comes; draft "
            f"j is kept only if drafts 1..j all are, with probability α^j; add them up")


def timed_round(engine: Engine, prompts, params) -> tuple[float, list, dict]:
    """prompts through engine once: seconds, each request's tokens, and what its
    speculation did (steps, drafted tokens, acceptance, tokens a step)."""
    steps0, reqs0 = engine.telemetry.num_steps, engine.telemetry.num_requests
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    reqs = engine.telemetry.requests_since(reqs0)
    drafted = sum(r.num_draft_tokens for r in reqs)
    stats = {"steps": engine.telemetry.num_steps - steps0,
             "drafted": drafted,
             "acceptance_rate": (sum(r.num_accepted_tokens for r in reqs) / drafted
                                 if drafted else None),
             "tokens_per_step": (sum(r.output_tokens for r in reqs)
                                 / max(1, sum(r.num_token_steps for r in reqs)))}
    return dt, [o.token_ids for o in outs], stats


def run(model: str, speculative_config: dict, engine_kwargs: dict, batch_sizes=(1, 8, 32),
        kinds=("grounded", "open"), max_tokens: int = 128, rounds: int = 3, log=print) -> dict:
    kw = {k: v for k, v in engine_kwargs.items() if k != "speculative_config"}
    plain = Engine(model=model, **kw)
    spec = Engine(model=model, speculative_config=speculative_config, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    rows = []
    for kind in kinds:
        for b in batch_sizes:
            prompts = workload(kind, plain.tokenizer, b)
            plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm
            spec.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
            best = {"plain": None, "spec": None}
            for _ in range(rounds):
                for arm, e in (("plain", plain), ("spec", spec)):
                    dt, toks, st = timed_round(e, prompts, params)
                    if best[arm] is None or dt < best[arm][0]:
                        best[arm] = (dt, toks, st)
            (tp, kp, _), (ts, ks, ss) = best["plain"], best["spec"]
            n = sum(map(len, kp))
            row = {"workload": kind, "batch": len(prompts), "output_tokens": n,
                   "plain_tok_s": n / tp, "spec_tok_s": sum(map(len, ks)) / ts,
                   "ratio": (sum(map(len, ks)) / ts) / (n / tp), "same_tokens": kp == ks,
                   "acceptance_rate": ss["acceptance_rate"],
                   "tokens_per_step": ss["tokens_per_step"]}
            rows.append(row)
            log(format_row(row))
    return {"model": model, "speculative_config": speculative_config,
            "engine": plain.info().device_name, "rounds": rounds, "rows": rows}


def k_sweep(model: str, ks=(0, 2, 4), kinds=("grounded", "open"), max_tokens: int = 32,
            repeats: int = 2, engine_kwargs: dict | None = None, progress=None,
            passage: tuple[int, int] = (300, 600)) -> list[dict]:
    """Notebook 03's sweep of k: one request of each kind (the first of spec_workloads') decoded
    greedily by one engine per k (0: no speculation; else prompt lookup drafting k tokens
    whenever it finds them, the adaptive budget off so that k is what varies;
    a grounded prompt's passage of `passage` tokens, shorter than the benchmark's for a quick
    run),
    runs interleaved (steady.interleaved: a slow spell lands on every point alike). A row per
    (kind, k): the acceptance rate and tokens per step (RequestMetrics, the last run's: greedy
    runs repeat), decode tok/s (1 / TPOT) of every run as steady.Runs, and whether its tokens
    are k = 0's. `progress(done, total)` after each run."""
    from .steady import Runs, interleaved
    kw = dict(engine_kwargs or {})
    kw.pop("speculative_config", None)
    engines = {k: Engine(model=model, speculative_config={"method": "ngram",
                                                         "num_speculative_tokens": k,
                                                         "adaptive": False} if k else None,
                         **kw) for k in ks}
    tok = engines[ks[0]].tokenizer
    prompts = {kind: (grounded_prompts(1, 0, tok, *passage)[0].messages if kind == "grounded"
                      else workload(kind, tok, 1)[0]) for kind in kinds}
    for e in engines.values():                                   # first forwards: one-off costs
        e.generate([prompts[kinds[0]]], SamplingParams(temperature=0, max_tokens=2))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    points = [(kind, k) for kind in kinds for k in ks]
    done = [0]
    if progress is not None:
        progress(0, len(points) * repeats)

    def once(point):
        kind, k = point
        out = engines[k].generate([prompts[kind]], params)[0]
        done[0] += 1
        if progress is not None:
            progress(done[0], len(points) * repeats)
        m = out.metrics
        return 1 / m.tpot, m.acceptance_rate, m.mean_tokens_per_step, out.token_ids
    runs = interleaved(points, once, repeats)
    plain = {kind: r[-1][3] for (kind, k), r in zip(points, runs) if k == ks[0]}
    for e in engines.values():
        e.shutdown()
    return [{"workload": kind, "k": k, "tok_s": Runs([x[0] for x in r]),
             "acceptance_rate": r[-1][1], "tokens_per_step": r[-1][2],
             "output_tokens": len(r[-1][3]), "same_tokens": r[-1][3] == plain[kind]}
            for (kind, k), r in zip(points, runs)]


def format_row(r: dict) -> str:
    acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
    return (f"{r['workload']:>9} b={r['batch']:<3} plain {r['plain_tok_s']:7.1f} tok/s  "
            f"spec {r['spec_tok_s']:7.1f} tok/s  x{r['ratio']:.2f}  acceptance {acc}  "
            f"tokens/step {r['tokens_per_step']:.2f}  same tokens: {r['same_tokens']}")


def format_table(report: dict) -> str:
    head = (f"speculative decoding {report['speculative_config']} on {report['model']} "
            f"({report['engine']}), best of {report['rounds']} interleaved rounds")
    return "\n".join([head, *map(format_row, report["rows"])])
