"""Telemetry as data: one StepEvent per engine step, one RequestMetrics per finished request.

The engine appends; anyone reads: the timeline widget, the server's /metrics, the bench
report, a JSON file. Reads from other threads go through `steps_since`/`snapshot`, which copy
under a lock.
"""
from __future__ import annotations

import json
import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

FULL, PIECEWISE = "FULL", "PIECEWISE"
"""StepEvent.graph_kind values (vLLM's CUDAGraphMode names)."""


@dataclass(slots=True)
class StepEvent:
    step: int
    start: float
    """time.monotonic() when the step began."""
    duration: float
    """Seconds, schedule + forward + sample + bookkeeping."""
    phase: str
    """'prefill', 'decode', 'mixed' or 'idle'."""
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_tokens: int
    """Prompt tokens served by the prefix cache for requests admitted in this step."""
    tokens_per_request: dict[str, int]
    kinds: dict[str, str]
    """What each scheduled request did: 'prefill' (its prompt's last chunk; it got a token),
    'chunk' (a prompt chunk that did not reach the end; no token), 'decode', or 'verify' (a
    decode with drafted tokens, speculative decoding)."""
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    num_preempted: int
    preempted: list[str]
    graph: bool = False
    """Whether captured graphs ran this step (always False in eager mode)."""
    graph_size: int | None = None
    """The captured size replayed: a decode batch size (FULL) or a token bucket
    (PIECEWISE); padding fills the rest."""
    graph_kind: str | None = None
    """vLLM's CUDAGraphMode names: 'FULL', the whole step was one graph (decode steps);
    'PIECEWISE', graphs between eagerly run attention (graph_mode 'full', prefill and mixed
    steps); None: eager."""
    finished: list[str] = field(default_factory=list)
    scheduled_ahead: bool = False
    """Launched before the previous step's tokens reached the host (async scheduling): its
    input ids came from that step's sampled ids on the device."""
    held_back: dict[str, str] = field(default_factory=dict)
    """Requests that kept this step from running the next one ahead (async scheduling on, a
    captured decode step), and why ('grammar': its next mask needs this step's token)."""
    context_lens: dict[str, int] = field(default_factory=dict)
    """Tokens each scheduled request already had in the KV cache before the step (its
    attention read them besides its new tokens; see roofline.step_cost)."""
    drafts: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: the tokens drafted for each verified request."""
    accepted: dict[str, int] = field(default_factory=dict)
    """How many of each request's drafts the target accepted (its first ones; the rest were
    rejected, and the target's own token followed the accepted ones)."""

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.drafts.values()))

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted.values())

    @property
    def accepted_per_pos(self) -> list[int]:
        """Accepted drafts by position (0: the first draft), over the step's requests."""
        out = [0] * max(map(len, self.drafts.values()), default=0)
        for n in self.accepted.values():
            for j in range(n):
                out[j] += 1
        return out

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def graph_label(self) -> str:
        """How the step ran, in words: 'eager', 'graph replay @4' (a whole decode step at
        batch 4) or 'piecewise replay @64 tokens'."""
        if not self.graph:
            return "eager"
        if self.graph_kind == PIECEWISE:
            return f"piecewise replay @{self.graph_size} tokens"
        return f"graph replay @{self.graph_size}"

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool referenced by live requests after the step."""
        total = self.kv_blocks_used + self.kv_blocks_free
        return self.kv_blocks_used / total if total else 0.0


# ---- request latencies, defined once (as vLLM's benchmarks define them) ---------------------
# TTFT: arrival (or send) -> first output token. ITL: the gaps between consecutive output
# tokens. TPOT: the mean of those gaps, (last token - first token) / (tokens - 1). E2E:
# arrival -> the request's end. The engine's records, the remote client's and every panel
# and benchmark report use these.
def time_per_output_token(ttft: float | None, last_token: float | None,
                          num_tokens: int) -> float | None:
    """TPOT from the latencies of the first and the last output token (both seconds from
    the same start); None below two tokens."""
    if ttft is None or last_token is None or num_tokens < 2:
        return None
    return (last_token - ttft) / (num_tokens - 1)


def percentile(xs, q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics (numpy's
    default, which vLLM's benchmarks use); None for no data. Nones in xs are skipped."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def distribution(xs) -> dict:
    """mean, p50, p90 and p99 of xs (Nones skipped; all None for no data)."""
    xs = [x for x in xs if x is not None]
    return {"mean": sum(xs) / len(xs) if xs else None,
            **{f"p{q}": percentile(xs, q) for q in (50, 90, 99)}}


@dataclass(slots=True)
class RequestMetrics:
    request_id: str
    arrival_time: float
    prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    num_token_steps: int = 0
    """Steps that handed it tokens (several each, with speculative decoding)."""
    num_draft_tokens: int = 0
    """Speculative decoding: tokens drafted for it, and below, how many were accepted."""
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / drafted ones; None where nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_tokens_per_step(self) -> float | None:
        """Output tokens per step that gave it any (1 without speculation)."""
        return self.output_tokens / self.num_token_steps if self.num_token_steps else None

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Every inter-token gap, seconds."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, seconds."""
        t = self.token_times
        return time_per_output_token(t[0] if t else None, t[-1] if t else None, len(t))

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e, itl=self.itl,
                 acceptance_rate=self.acceptance_rate,
                 mean_tokens_per_step=self.mean_tokens_per_step)
        return d


@dataclass(slots=True)
class MemoryStats:
    weights_bytes: int
    kv_cache_bytes: int
    """The whole KV pool (num_kv_blocks, its null block included)."""
    peak_bytes: int
    """Device peak allocation where the platform tracks it, else the process's peak RSS."""
    kv_bytes_per_block: int
    num_kv_blocks: int


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, as built: fixed for its life (Engine.info())."""
    model: str
    """The model as asked for (`smollm2`, `random:<shape>` or a checkpoint directory)."""
    model_path: str | None
    device: str
    """The platform's name ('cpu', 'cuda', 'npu')."""
    device_name: str
    """The device in words: the CPU's model and cores, or the GPU's name (what a per-device
    figure such as the roofline's probe is keyed by)."""
    dtype: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_block: int
    graph_mode: str
    """As run: what the config asked for, or 'eager' where it cannot (see notices)."""
    capture_sizes: tuple[int, ...]
    """Decode batch sizes captured as whole-step graphs."""
    piecewise_sizes: tuple[int, ...]
    """Token buckets captured piecewise (graph_mode 'full')."""
    attention: str
    """The attention backend: 'reference' (plain torch), 'cpu' (C++ decode kernel),
    'triton' or 'npu' (torch_npu's fused ops)."""
    ops: str
    """The decoder's fusable ops in use (RMSNorm, SiLU-and-mul, RoPE)."""
    async_scheduling: bool
    vocab_size: int
    num_params: int
    num_layer_params: int
    """Parameters of the decoder layers: a token's matmuls in them cost twice this in FLOPs
    (the LM head adds 2 * hidden_size * vocab_size per sampled row)."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int
    """Weight bytes one forward reads: every layer plus the LM head (the embedding is
    gathered row by row, not read whole, unless it is the tied head)."""
    kv_bytes_per_token: int
    """K and V of every layer for one token."""
    config: Any
    """The EngineConfig as run (block_size and graph_mode resolved for the device)."""
    quantization: str | None = None
    """How the weights are stored: None (in `dtype`), 'gguf' or 'int8' (EngineConfig)."""
    quantization_choice: str | None = None
    """Why `quantization` is what it is, in a sentence, with the figure that decided it
    ('auto' on the CPU: a GEMV per candidate format measured once per kernel build), or what
    a format asked for by name costs here; None where there was nothing to choose."""
    kernels: str | None = None
    """The device's compiled kernels: 'built', 'building', 'not built' or 'failed: <error>'
    (the CPU's C++ kernels; None on a device with none to build)."""
    gguf_path: str | None = None
    """The GGUF file the weights come from, where they come from one (the embedded smollm2):
    what a peer such as llama.cpp runs for the same weights."""
    weight_formats: tuple[str, ...] = ()
    """The formats the weights are held in, e.g. ('float32', 'q4_1', 'q8_0'): what the
    dashboard header and `workbench info` name."""
    generation_defaults: dict = field(default_factory=dict)
    """The sampling defaults in force for fields a request leaves out (SamplingParams' names:
    the checkpoint's generation_config.json with generation_config='auto'; {}: SamplingParams'
    own)."""
    modelled: dict | None = None
    """None on a real device. On a modelled one (`device="model:<name>"`): its profile,
    whether it is calibrated, where its figures come from, its roofs and coefficients, and
    its measured error ({'max_abs_pct', 'workloads', ...}; {} where never measured): every
    time this engine records is modelled, every token random."""


@dataclass(frozen=True)
class EngineStats:
    """Where an engine stands now (Engine.stats())."""
    num_running: int
    num_waiting: int
    """In the scheduler's queue or not yet picked up by the step loop."""
    num_kv_blocks: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    """Free blocks that still hold a reusable prefix."""
    num_preemptions: int
    prefix_cache_hits: int
    """Blocks served from the prefix cache since start."""
    prefix_cache_queries: int
    """Full prompt blocks looked up in the prefix cache since start."""
    num_steps: int
    num_finished: int

    @property
    def kv_usage(self) -> float:
        """Fraction of the blocks requests can hold that are in use (the pool's null block
        is neither used nor free)."""
        usable = self.kv_blocks_used + self.kv_blocks_free
        return self.kv_blocks_used / usable if usable else 0.0


def _tail(d: deque, n: int) -> list:
    """The last n items of a deque (all of it if n is larger), without walking the rest."""
    n = min(max(n, 0), len(d))
    return [d[i] for i in range(len(d) - n, len(d))]


@dataclass(slots=True)
class SpecDecodeCounts:
    """Speculative decoding's counters, vLLM's (vllm:spec_decode_*)."""
    num_drafts: int = 0
    """Drafts verified: one per request per verify step."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_asked: int = 0
    """Requests the proposer was asked to draft for (one per request per step; not one of
    vLLM's counters), and below, how many of them it gave a draft: an n-gram lookup that
    finds no earlier occurrence drafts nothing, and the request decodes plainly."""
    num_drafted: int = 0

    def add(self, ev: StepEvent) -> None:
        self.num_drafts += len(ev.drafts)
        self.num_draft_tokens += ev.num_draft_tokens
        self.num_accepted_tokens += ev.num_accepted_tokens
        per = ev.accepted_per_pos
        self.accepted_per_pos += [0] * (len(per) - len(self.accepted_per_pos))
        for j, n in enumerate(per):
            self.accepted_per_pos[j] += n


class Telemetry:
    def __init__(self, max_steps: int = 100_000, max_requests: int = 100_000):
        self._lock = threading.Lock()
        self.steps: deque[StepEvent] = deque(maxlen=max_steps)
        self.requests: deque[RequestMetrics] = deque(maxlen=max_requests)
        self.num_steps = 0
        self.num_requests = 0
        """Finished request records ever added (RequestMetrics are numbered from 0)."""
        self.memory: MemoryStats | None = None
        self.notices: list[str] = []
        """What the engine does differently from what was asked (e.g. graph mode on a CPU)."""
        self.spec_decode = SpecDecodeCounts()
        """Speculative decoding's totals since start (Prometheus reads them)."""

    def add_step(self, ev: StepEvent) -> None:
        with self._lock:
            self.steps.append(ev)
            self.num_steps += 1
            if ev.drafts:
                self.spec_decode.add(ev)

    def add_request(self, m: RequestMetrics) -> None:
        with self._lock:
            self.requests.append(m)
            self.num_requests += 1

    def requests_since(self, n: int) -> list[RequestMetrics]:
        """Request records numbered >= n (for pollers that remember where they were)."""
        with self._lock:
            return _tail(self.requests, self.num_requests - n)

    def steps_since(self, step: int) -> list[StepEvent]:
        """Step events with index >= step (for pollers that remember where they were)."""
        with self._lock:
            return _tail(self.steps, self.num_steps - step)

    def snapshot(self) -> tuple[list[StepEvent], list[RequestMetrics]]:
        with self._lock:
            return list(self.steps), list(self.requests)

    def clear(self) -> None:
        with self._lock:
            self.steps.clear()
            self.requests.clear()

    def to_dict(self) -> dict:
        steps, reqs = self.snapshot()
        return {"memory": asdict(self.memory) if self.memory else None,
                "notices": list(self.notices),
                "steps": [asdict(s) for s in steps],
                "requests": [r.to_dict() for r in reqs]}

    def to_json(self, path: str | None = None, indent: int | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text
