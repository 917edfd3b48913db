"""What the lessons claim of the figures they measure, checked on those figures
(steady.Relation, said by steady.verdict): a notebook prints the claim with its figures where
they show it on a quiet machine, and says otherwise where they do not."""
from __future__ import annotations

from .steady import Relation


def batch_scaling_relations(rows: list[dict]) -> list:
    """What notebook 02 says of `time_per_token_by_batch`'s figures, checked on them:
    decode's time per token falls with batch size, and much more than prefill's."""
    one, big = rows[0], rows[-1]
    dec = [r["decode_s_per_token"] for r in rows]
    d = dec[-1] / dec[0]
    p = big["prefill_s_per_token"] / one["prefill_s_per_token"]
    ms = lambda s: f"{s * 1e3:.2f} ms"                                   # noqa: E731
    falls = all(b < 0.95 * a for a, b in zip(dec, dec[1:]))
    return [
        Relation("decode's time per token falls as the batch grows", falls,
                 "decode " + ", ".join(f"{ms(x)} a token at batch {r['batch']}"
                                       for r, x in zip(rows, dec))),
        Relation("prefill's falls much less", p > d,
                 f"{ms(one['prefill_s_per_token'])} a token at batch {one['batch']}, "
                 f"{ms(big['prefill_s_per_token'])} at batch {big['batch']} ({p:.2f}x)")]


def batch_size_relations(rows: list[dict], knob: str = "max_num_seqs") -> list:
    """What notebook 03 says of its batch-size sweep, checked on it: throughput climbs with
    the batch."""
    lo, hi = rows[0], rows[-1]
    climbs = all(b["out_tok_s"] > a["out_tok_s"] for a, b in zip(rows, rows[1:]))
    return [Relation("throughput climbs with the batch", climbs, ", ".join(
        f"{r['out_tok_s']:.1f} tok/s at {knob} {r[knob]}" for r in rows)
        + f" ({hi['out_tok_s'] / lo['out_tok_s']:.1f}x)")]


def alone_vs_batched_relations(table: list[dict]) -> list:
    """What notebook 03 says of `latency_alone_vs_batched`'s table, checked on it: n requests
    at once serve more tokens a second than one alone."""
    alone, batched = table
    gain = batched["out_tok_s"] / alone["out_tok_s"]
    return [Relation(f"{batched['requests']} requests at once serve more tokens a second than "
                     "one alone", gain > 1.0,
                     f"{batched['out_tok_s']:.1f} against {alone['out_tok_s']:.1f} tok/s "
                     f"({gain:.1f}x)")]


def kv_cache_relations(kv: dict) -> list:
    """What notebook 02 says of `recompute_vs_cache`'s figures, checked on them: recomputing
    the whole sequence for every token takes longer than decoding with the KV cache."""
    n, cached, again = len(kv["with_cache_s"]), kv["with_cache_s"][-1], kv["without_cache_s"][-1]
    return [Relation("recomputing the sequence for every token takes longer than the cache",
                     again > cached, f"{n} tokens in {cached:.2f} s with the cache, {again:.2f} s "
                     f"recomputing ({again / cached:.1f}x)")]


def sampling_cost_relations(greedy: dict, sampled: dict, what: str) -> list:
    """What notebook 02 says of the sampler's cost (steady.Runs in ms by batch size, for
    greedy and for `what`), checked on it: `what` costs a step more than greedy's argmax."""
    more = all(sampled[b].median > greedy[b].median for b in greedy)
    return [Relation(f"{what} costs a step more than greedy", more, ", ".join(
        f"{sampled[b].median:.2f} against {greedy[b].median:.2f} ms at batch {b}" for b in greedy))]


def formats_relations(rows: list[tuple[str, int, object]]) -> list:
    """What notebook 02 says of the weight formats' batch-1 decode, checked on it: `rows` are
    (format, weight bytes, steady.Runs of TPOT in seconds); fewer bytes of weights take less
    time a token, format by format in order of their bytes."""
    by_bytes = sorted(rows, key=lambda r: -r[1])
    fewer_faster = all(b[2].median < a[2].median for a, b in zip(by_bytes, by_bytes[1:]))
    return [Relation("fewer bytes of weights take less time a token", fewer_faster, ", ".join(
        f"{name} {size / 1e6:.0f} MB in {runs.median * 1e3:.1f} ms" for name, size, runs in by_bytes))]
