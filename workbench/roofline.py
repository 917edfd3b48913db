"""The roofline of a step: how much arithmetic it did per byte it read, against what the device
can do.

Two numbers describe the device: its peak matmul throughput (FLOP/s) and its memory bandwidth
(byte/s). Their ratio, the machine *balance* (FLOP/byte), splits work in two: a step whose
arithmetic intensity (FLOPs over bytes read) is below the balance cannot go faster than
bandwidth × intensity (memory-bound: a decode step reads every weight to produce one token per
request), one above it is capped by the peak (compute-bound: a long prefill reuses each weight
for thousands of tokens).

`probe_roofs` measures both once per machine, device and dtype (cached in the workbench cache
dir); `step_cost` counts a step's FLOPs and bytes from its StepEvent and the EngineInfo.
"""
from __future__ import annotations

import hashlib
import json
import socket
import time
from dataclasses import asdict, dataclass

import torch

from .cache import cache_root
from .telemetry import EngineInfo, StepEvent


@dataclass(slots=True, frozen=True)
class StepCost:
    flops: float
    weight_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte read."""
        return self.flops / self.bytes if self.bytes else 0.0


def step_cost(ev: StepEvent, info: EngineInfo) -> StepCost:
    """FLOPs a step computed and bytes it read, counted from its scheduled tokens and the
    engine's shape (EngineInfo, or a recorded trace's copy of it).

    - Matmuls: 2 FLOPs per decoder-layer parameter per token fed; the LM head (hidden ×
      vocab) only for the rows that sample (a prompt chunk that does not end its prompt
      samples nothing; a verify samples each of its positions).
    - Attention: a request feeding q tokens after c tokens already in the cache scores
      q·c + q(q+1)/2 (query, key) pairs (causal); each pair costs 2·head_dim FLOPs for QKᵀ and
      as many for PV, per query head and layer.
    - Bytes: the weights one forward reads (`info.weight_bytes`: whatever the batch, which is
      why batching decode is nearly free), plus each request's K and V over its c + q tokens.
    Norms, RoPE and activations are left out: they are small next to these.
    """
    tokens = sum(ev.tokens_per_request.values())
    sampled = sum(1 + len(ev.drafts.get(r, ())) for r, k in ev.kinds.items() if k != "chunk")
    pairs = kv_tokens = 0
    for rid, q in ev.tokens_per_request.items():
        c = ev.context_lens.get(rid, 0)
        pairs += q * c + q * (q + 1) // 2
        kv_tokens += c + q
    flops = (2 * tokens * info.num_layer_params + 2 * sampled * info.hidden_size * info.vocab_size
             + 4 * info.num_layers * info.num_attention_heads * info.head_dim * pairs)
    return StepCost(float(flops), float(info.weight_bytes),
                    float(kv_tokens * info.kv_bytes_per_token))


def verify_step(batch: int, k: int, context: int) -> StepEvent:
    """A step of `batch` requests that each decode after `context` cached tokens and verify k
    drafted tokens with it (k = 0: a plain decode): k + 1 positions a request in one pass,
    every one sampled. For step_cost: what verifying costs against decoding, at any batch."""
    ids = [f"r{i}" for i in range(batch)]
    return StepEvent(step=0, start=0.0, duration=0.0, phase="decode", num_prefill_tokens=0,
                     num_decode_tokens=batch * (k + 1), num_cached_tokens=0,
                     tokens_per_request={r: k + 1 for r in ids},
                     kinds={r: "verify" if k else "decode" for r in ids}, num_running=batch,
                     num_waiting=0, kv_blocks_used=0, kv_blocks_free=0, kv_blocks_cached=0,
                     num_preempted=0, preempted=[], context_lens={r: context for r in ids},
                     drafts={r: [0] * k for r in ids} if k else {})


# ---- the device's two roofs ---------------------------------------------------------------------
FORMAT_VERSION = 1


@dataclass(slots=True, frozen=True)
class DeviceRoofs:
    device: str
    """The device as the platform names it (CPU model and cores, GPU name)."""
    dtype: str
    peak_flops: float
    """Measured dense matmul throughput, FLOP/s."""
    bandwidth: float
    """Measured memory bandwidth, byte/s (a large copy or sum, whichever moved more)."""

    @property
    def balance(self) -> float:
        """FLOPs per byte above which work is compute-bound on this device."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """The roofline: the most FLOP/s a kernel of this intensity can reach here."""
        return min(self.peak_flops, intensity * self.bandwidth)

    def least_time(self, cost: StepCost) -> float:
        """The shortest a step of this cost can take here, seconds: its FLOPs at the peak or
        its bytes at the bandwidth, whichever takes longer."""
        return max(cost.flops / self.peak_flops, cost.bytes / self.bandwidth)

    @classmethod
    def modelled(cls, info: EngineInfo) -> "DeviceRoofs":
        """A modelled engine's roofs: its profile's, never the host's."""
        m = info.modelled
        return cls(f"{m['device_name']} (modelled)", info.dtype, m["peak_flops"], m["bandwidth"])


def measure_roofs(platform, dtype: torch.dtype) -> DeviceRoofs:
    """Time a large copy and a square matmul on `platform`'s device (Platform.best_time, the
    one measurement of device work: best of a few runs; about a second on a CPU, less on a
    GPU). Small sizes on the CPU keep it short; an accelerator
    gets sizes large enough to reach its peak."""
    accel = platform.name != "cpu"
    n_copy = (1 << 30 if accel else 1 << 28) // torch.tensor([], dtype=dtype).element_size()
    n_mm = 8192 if accel else 1024
    dev = platform.device
    src = torch.empty(n_copy, dtype=dtype, device=dev).fill_(1)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    # A copy reads and writes; a sum only reads (often faster): the better of the two is
    # the bandwidth a step that streams its weights can reach.
    t_copy = platform.best_time(lambda: dst.copy_(src), 5)
    t_read = platform.best_time(lambda: src.sum(), 5)
    bandwidth = max(2 * nbytes / t_copy, nbytes / t_read)
    del src, dst
    a = torch.randn(n_mm, n_mm, device=dev).to(dtype)
    b = torch.randn(n_mm, n_mm, device=dev).to(dtype)
    t_mm = platform.best_time(lambda: a @ b, 10 if accel else 5)
    del a, b
    platform.empty_cache()
    return DeviceRoofs(platform.device_name(), str(dtype).replace("torch.", ""),
                       2 * n_mm ** 3 / t_mm, bandwidth)


def probe_roofs(platform, dtype: torch.dtype, refresh: bool = False) -> DeviceRoofs:
    """The device's roofs, measured once per machine, device and dtype and then read from the
    cache (`refresh=True` measures again)."""
    name = str(dtype).replace("torch.", "")
    key = hashlib.sha256("|".join([socket.gethostname(), platform.name, platform.device_name(),
                                   name, torch.__version__]).encode()).hexdigest()[:16]
    path = cache_root() / "roofline" / f"{key}.json"
    if not refresh:
        try:
            d = json.loads(path.read_text())
            if d.pop("version", None) == FORMAT_VERSION:
                return DeviceRoofs(**d)
        except (OSError, ValueError, TypeError):
            pass                       # absent or unreadable: measure
    roofs = measure_roofs(platform, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
    tmp.write_text(json.dumps({"version": FORMAT_VERSION, **asdict(roofs)}))
    tmp.replace(path)                  # atomic: a reader never sees half a file
    return roofs


@dataclass(slots=True)
class RooflinePoint:
    step: int
    phase: str
    batch: int
    """Requests in the step."""
    tokens: int
    """Tokens fed."""
    intensity: float
    flops_per_s: float
    duration: float


def roofline_points(steps, info: EngineInfo) -> list[RooflinePoint]:
    """One point per step that fed tokens: its intensity and achieved FLOP/s."""
    out = []
    for ev in steps:
        if not ev.tokens_per_request or ev.duration <= 0:
            continue
        c = step_cost(ev, info)
        out.append(RooflinePoint(ev.step, ev.phase, len(ev.tokens_per_request),
                                 sum(ev.tokens_per_request.values()), c.intensity,
                                 c.flops / ev.duration, ev.duration))
    return out
