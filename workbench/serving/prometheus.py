"""Prometheus text exposition, read: the samples of a /metrics page, and the summary of
vLLM's metric names that the remote client, the serving benchmark and the tests read (the
same names `workbench serve` writes, serving/metrics.py)."""
from __future__ import annotations

import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(v: str) -> str:
    return re.sub(r'\\(.)', lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), v)


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}. Comments, HELP
    and TYPE lines are skipped; lines that do not parse are ignored."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels_text, value = m.groups()
        labels = {k: _unescape(v) for k, v in _LABEL.findall(labels_text or "")}
        try:
            out.setdefault(name, []).append((labels, float(value)))
        except ValueError:
            continue
    return out


def _total(samples, name: str, **match) -> float | None:
    rows = samples.get(name)
    if rows is None:
        return None
    return sum(v for labels, v in rows if all(labels.get(k) == w for k, w in match.items()))


def _histogram(samples, base: str) -> dict | None:
    if base + "_count" not in samples:
        return None
    buckets: dict[float, float] = {}
    for labels, v in samples.get(base + "_bucket", []):
        le = float(labels.get("le", "inf").replace("+Inf", "inf"))
        buckets[le] = buckets.get(le, 0.0) + v
    count, total = _total(samples, base + "_count"), _total(samples, base + "_sum")
    return {"count": count, "sum": total,
            "mean": total / count if count else None,
            "buckets": sorted(buckets.items())}


HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_time_per_output_token_seconds",
              "request_queue_time_seconds")


def summarize_metrics(samples: dict) -> dict:
    """The vLLM metrics a dashboard wants, summed over label sets (several engines or models
    behind one server add up). Missing metrics are None. KV usage falls back to the older
    `vllm:gpu_cache_usage_perc` name."""
    kv = _total(samples, "vllm:kv_cache_usage_perc")
    if kv is None:
        kv = _total(samples, "vllm:gpu_cache_usage_perc")
    n_kv = len(samples.get("vllm:kv_cache_usage_perc") or samples.get("vllm:gpu_cache_usage_perc") or [])
    if kv is not None and n_kv > 1:
        kv /= n_kv   # a fraction per engine: report the mean, not the sum
    reasons: dict[str, float] = {}
    for labels, v in samples.get("vllm:request_success_total", []):
        r = labels.get("finished_reason", "")
        reasons[r] = reasons.get(r, 0.0) + v
    return {
        "num_requests_running": _total(samples, "vllm:num_requests_running"),
        "num_requests_waiting": _total(samples, "vllm:num_requests_waiting"),
        "kv_cache_usage_perc": kv,
        "num_preemptions_total": _total(samples, "vllm:num_preemptions_total"),
        "prompt_tokens_total": _total(samples, "vllm:prompt_tokens_total"),
        "generation_tokens_total": _total(samples, "vllm:generation_tokens_total"),
        "request_success_total": reasons,
        "histograms": {h: _histogram(samples, "vllm:" + h) for h in HISTOGRAMS},
    }
