"""Prometheus metrics of a served engine, under vLLM's metric names, so dashboards and
benchmarks made for vLLM read `workbench serve` unchanged."""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..engine import Engine

# Histogram buckets, seconds. Wide enough for a CPU (slow) and a GPU (fast) alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

FINISH_REASONS = ("stop", "length", "abort", "error")


class _Hist:
    """A cumulative-bucket histogram (what Prometheus wants), fed one value at a time."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # last: +Inf
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.sum += v
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((repr(float(b)), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


class EngineMetrics:
    """A prometheus_client collector over one Engine.

    Gauges are read live from the scheduler and the block manager at scrape time. Counters
    and histograms are fed from the engine's telemetry: every RequestMetrics the engine
    recorded since the last scrape (finished, stopped or aborted requests) is folded in once.
    So token counters and latencies advance when a request ends, not token by token.
    """

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self._lock = threading.Lock()
        self._seen = 0                                # telemetry request records folded in
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = _Hist(TTFT_BUCKETS)
        self.itl = _Hist(ITL_BUCKETS)
        self.tpot = _Hist(ITL_BUCKETS)
        self.e2e = _Hist(E2E_BUCKETS)
        self.queue = _Hist(E2E_BUCKETS)

    def _ingest(self) -> None:
        tel = self.engine.telemetry
        new = tel.requests_since(self._seen)
        self._seen += len(new)
        for m in new:
            self.prompt_tokens += m.prompt_tokens
            self.generation_tokens += m.output_tokens
            reason = m.finish_reason or "abort"
            self.success[reason] = self.success.get(reason, 0) + 1
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            for gap in m.itl:
                self.itl.observe(gap)
            if m.tpot is not None:
                self.tpot.observe(m.tpot)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.e2e is not None and reason in ("stop", "length"):
                self.e2e.observe(m.e2e)

    def live(self) -> dict[str, float]:
        st, block_size = self.engine.stats(), self.engine.info().block_size
        return {"running": st.num_running, "waiting": st.num_waiting, "kv_usage": st.kv_usage,
                "preemptions": st.num_preemptions,
                "prefix_queries": st.prefix_cache_queries * block_size,
                "prefix_hits": st.prefix_cache_hits * block_size}

    def collect(self):
        with self._lock:
            self._ingest()
            live = self.live()
            lbl, name = ["model_name"], [self.model_name]

            def gauge(metric, doc, value):
                g = GaugeMetricFamily(metric, doc, labels=lbl)
                g.add_metric(name, value)
                return g

            def counter(metric, doc, value):
                c = CounterMetricFamily(metric, doc, labels=lbl)
                c.add_metric(name, value)
                return c

            def hist(metric, doc, h: _Hist):
                f = HistogramMetricFamily(metric, doc, labels=lbl)
                f.add_metric(name, h.buckets(), h.sum)
                return f

            yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                        live["running"])
            yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                        live["waiting"])
            yield gauge("vllm:kv_cache_usage_perc",
                        "Fraction of KV-cache blocks in use by live requests (1 = full).",
                        live["kv_usage"])
            info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                     labels=["model_name", "block_size", "num_gpu_blocks"])
            ei = self.engine.info()
            info.add_metric([self.model_name, str(ei.block_size), str(ei.num_kv_blocks)], 1)
            yield info
            yield counter("vllm:num_preemptions", "Preemptions (by recompute) since start.",
                          live["preemptions"])
            yield counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                          self.prompt_tokens)
            yield counter("vllm:generation_tokens", "Generated tokens of finished requests.",
                          self.generation_tokens)
            yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          live["prefix_queries"])
            yield counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.",
                          live["prefix_hits"])
            ok = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                     labels=["model_name", "finished_reason"])
            for reason, n in self.success.items():
                ok.add_metric([self.model_name, reason], n)
            yield ok
            yield hist("vllm:time_to_first_token_seconds", "Time to first token.", self.ttft)
            yield hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens.",
                       self.itl)
            yield hist("vllm:request_time_per_output_token_seconds",
                       "Mean time per output token after the first, per request.", self.tpot)
            yield hist("vllm:e2e_request_latency_seconds",
                       "Arrival to last token, requests that finished (stop or length).", self.e2e)
            yield hist("vllm:request_queue_time_seconds", "Arrival to first scheduling.",
                       self.queue)
            if self.engine.info().config.speculative_config is not None:
                yield from self._spec_decode(counter)

    def _spec_decode(self, counter):
        """Speculative decoding's counters (vLLM's names), from the engine's totals."""
        sd = self.engine.telemetry.spec_decode
        yield counter("vllm:spec_decode_num_drafts", "Drafts verified (one per request per "
                      "verify step).", sd.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      sd.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      sd.num_accepted_tokens)
        per = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft.",
                                  labels=["model_name", "position"])
        k = self.engine.info().config.speculative().num_speculative_tokens
        counts = list(sd.accepted_per_pos) + [0] * k
        for pos in range(max(k, len(sd.accepted_per_pos))):
            per.add_metric([self.model_name, str(pos)], counts[pos])
        yield per

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)

