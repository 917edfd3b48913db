"""Device profiles: what a modelled device is (its roofs, memory and graph rules) and the
coefficients of its cost model (cost.py), with where each figure comes from.

- 'cpu': this machine. Roofs measured by roofline.probe_roofs; coefficients fitted (fit.py)
  to a short run of the real CPU engine on the same model, then cached (calibrated).
- 'h200': roofs as measured on an H200 (docs/gpu-2026-11-30.jsonl, `ceilings`), coefficients
  fitted to that file's W1, concurrency-sweep, batch-1 and prefill figures
  (calibration.json, written by `benchmarks/modelled_accuracy.py --h200-fit`; calibrated).
- 'h100', 'a100', '910b', '910c': roofs from their spec sheets, scaled by the fractions of
  its spec sheet the H200 reached, and the H200's launch and host costs: guesses, marked
  uncalibrated (info().modelled says so, and the UI shows no error figure for them).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from importlib import resources

from ..platforms import platform_class
from ..telemetry import percentile

CALIBRATION_FILE = "calibration.json"
ACCURACY_FILE = "accuracy.json"


@dataclass(slots=True, frozen=True)
class Coefficients:
    """The cost model's free numbers (cost.py says how each enters a step's time)."""
    launch_eager_per_layer: float = 0.0
    """Seconds of kernel launches per decoder layer in an eagerly run step."""
    launch_prefill_per_layer: float = 0.0
    """Extra seconds per decoder layer in a step that runs a prompt (its attention's own
    kernels and metadata: a prefill step launches more than a decode step)."""
    launch_graph: float = 0.0
    """Seconds to replay one whole-step graph (a decode step, graph_mode 'decode'/'full')."""
    host_step: float = 0.0
    """Host seconds per step: scheduling, input preparation, sampling, output handling."""
    host_per_request: float = 0.0
    """Host seconds per request in the step (its bookkeeping, its row of sampling)."""
    host_per_token: float = 0.0
    """Host seconds per token fed (input preparation, embedding gather)."""
    matmul_scale: float = 1.0
    """The linear layers' time over their roofline bound (1 / the fraction of the roof they
    reach); on the CPU, over their FLOPs' time at the peak."""
    attention_scale: float = 1.0
    """Attention's time over its roofline bound (the KV it reads, the FLOPs it does); on the
    CPU, over its FLOPs' time at the peak."""
    weight_scale: float = 1.0
    """The CPU only: the weights' read time over its time at the bandwidth. Weight bytes are
    the same every step, so this is also the CPU's per-step intercept (host_step stays 0
    there: the same cores do both)."""
    rows_log2: float = 0.0
    """The CPU only: seconds per doubling of the rows (tokens) a step feeds, beyond their
    FLOPs' time (a GEMM's rows get cheaper as there are more of them)."""
    attention_per_context_token: float = 0.0
    """Seconds per token of the longest context in the step: a floor under attention's
    time where one request's attention walks its context with too little parallelism to
    reach the bandwidth (batch-1 decode on a GPU). 0: none (the CPU's fit)."""

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Coefficients":
        names = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in d.items() if k in names})


@dataclass(slots=True, frozen=True)
class DeviceProfile:
    name: str
    """What follows `model:` in the device name."""
    device_name: str
    """The device in words (what info().device_name says, with 'modelled')."""
    kind: str
    """Whose rules it follows: 'cpu' (eager only, host and device in turn), 'cuda' (decode
    graphs by default, async scheduling) or 'npu' (graph_mode 'full' by default)."""
    peak_flops: float
    """Dense matmul throughput in the default dtype reached on the device, FLOP/s."""
    bandwidth: float
    """Memory bandwidth reached on the device (a large copy), byte/s."""
    memory_bytes: int | None
    """Device memory the KV pool is sized from (gpu_memory_utilization); None: the CPU's
    rule (1 GiB unless kv_cache_memory_gb or num_kv_blocks says otherwise)."""
    dtype: str
    """What dtype 'auto' means on it."""
    coefficients: Coefficients
    calibrated: bool
    """Whether its coefficients were fitted to measurements on that device."""
    source: str
    """Where the figures come from, in words."""
    error: dict = field(default_factory=dict)
    """Its measured error against the real device (accuracy.json): {'max_abs_pct': ...,
    'workloads': ...}; empty where it was never measured."""

    @property
    def supports_graphs(self) -> bool:
        return self.kind != "cpu"

    @property
    def default_graph_mode(self) -> str:
        return {"cpu": "eager", "cuda": "decode", "npu": "full"}[self.kind]

    def decode_graph_sizes(self, config, mode: str) -> list[int] | None:
        """Its kind's platform's rule (Platform.decode_graph_sizes), for graphs.plan_graphs."""
        return platform_class(self.kind).decode_graph_sizes(config, mode)

    def piecewise_graph_sizes(self, config, num_layers: int, decode_graphs: int
                              ) -> list[int] | None:
        """Its kind's platform's rule (Platform.piecewise_graph_sizes)."""
        return platform_class(self.kind).piecewise_graph_sizes(config, num_layers, decode_graphs)

    @property
    def runs_async(self) -> bool:
        """The device runs behind the host's launches (async scheduling's default)."""
        return self.kind != "cpu"

    @property
    def default_block_size(self) -> int:
        return 128 if self.kind == "npu" else 16

    def summary(self) -> dict:
        """What info().modelled carries: the profile, whether it is calibrated, its error."""
        return {"profile": self.name, "device_name": self.device_name, "kind": self.kind,
                "calibrated": self.calibrated, "source": self.source,
                "peak_flops": self.peak_flops, "bandwidth": self.bandwidth,
                "coefficients": self.coefficients.as_dict(), "error": dict(self.error)}


# ---- spec sheets --------------------------------------------------------------------------------
# (dense bf16/fp16 FLOP/s, HBM byte/s, memory bytes) as the vendors publish them.
SPECS = {
    "h200": ("NVIDIA H200 SXM", 989e12, 4.8e12, 141e9, "cuda"),
    "h100": ("NVIDIA H100 SXM", 989e12, 3.35e12, 80e9, "cuda"),
    "a100": ("NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80e9, "cuda"),
    "910b": ("Huawei Ascend 910B", 313e12, 1.6e12, 64e9, "npu"),
    "910c": ("Huawei Ascend 910C", 780e12, 3.2e12, 128e9, "npu"),
}
H200_MEASURED = (781.8e12, 4.205e12)
"""docs/gpu-2026-11-30.jsonl, `ceilings`: a bf16 matmul and a large copy on the H200."""


GPU_GUESS = Coefficients(launch_eager_per_layer=4.5e-4, launch_prefill_per_layer=2e-4,
                         launch_graph=1.0e-3, host_step=1e-3, host_per_request=5e-6,
                         host_per_token=0.0, matmul_scale=1.5, attention_scale=1.3,
                         attention_per_context_token=1.3e-6)
"""A GPU's coefficients before any fit: where the H200's fit starts (and what the other
profiles would borrow were there no H200 fit)."""


def _package_json(name: str) -> dict:
    try:
        return json.loads(resources.files(__package__).joinpath(name).read_text())
    except (OSError, ValueError):
        return {}


def calibration_data() -> dict:
    """calibration.json: fitted coefficients per profile, with what they were fitted to."""
    return _package_json(CALIBRATION_FILE)


def accuracy_data() -> dict:
    """accuracy.json: each calibrated profile's measured error (modelled_accuracy.py)."""
    return _package_json(ACCURACY_FILE)


def profile_error(name: str) -> dict:
    """A profile's measured error summary, {} if never measured."""
    d = dict(accuracy_data().get(name) or {})
    if "median_abs_pct" not in d and d.get("workloads"):
        d["median_abs_pct"] = percentile([abs(r["err_pct"]) for r in d["workloads"]], 50)
    return {k: d[k] for k in ("max_abs_pct", "median_abs_pct", "within_target_share",
                              "max_abs_pct_held_out", "target_pct", "within_target",
                              "workloads", "measured_on", "loaded") if k in d}


def profile_names() -> tuple[str, ...]:
    return ("cpu", *SPECS)


def _h200_coefficients() -> Coefficients | None:
    d = calibration_data().get("h200")
    return Coefficients.from_dict(d["coefficients"]) if d else None


def spec_profile(name: str) -> DeviceProfile:
    """A GPU/NPU profile: the H200's from its calibration, the others from spec sheets."""
    label, peak, bw, mem, kind = SPECS[name]
    fitted = _h200_coefficients()
    if name == "h200" and fitted is not None:
        return DeviceProfile(name, label, kind, *H200_MEASURED, int(mem), "bfloat16", fitted,
                             True, "roofs measured on an H200, coefficients fitted to its "
                             "recorded figures (docs/gpu-2026-11-30.jsonl)",
                             profile_error(name))
    # Reach the same fractions of the spec sheet as the H200 did; borrow its launch and
    # host costs (same host software; an NPU's eager launches are dearer, unknown by how much).
    frac_f, frac_b = H200_MEASURED[0] / SPECS["h200"][1], H200_MEASURED[1] / SPECS["h200"][2]
    coeffs = fitted if fitted is not None else GPU_GUESS
    return DeviceProfile(name, label, kind, peak * frac_f, bw * frac_b, int(mem), "bfloat16",
                         coeffs, False, "spec sheet (roofs scaled by the fractions an H200 "
                         "reached of its own), the H200's launch and host costs: uncalibrated",
                         {})


def cpu_profile(roofs, coefficients: Coefficients, source: str) -> DeviceProfile:
    """This machine's profile from its probed roofs and coefficients fitted to a real run."""
    return DeviceProfile("cpu", f"{roofs.device}", "cpu", roofs.peak_flops, roofs.bandwidth,
                         None, roofs.dtype, coefficients, True, source, profile_error("cpu"))


def parse_device(device: str) -> str | None:
    """'model:h200' -> 'h200'; None for a real device. An unknown profile is a ValueError
    naming the field."""
    if not isinstance(device, str) or not device.startswith("model:"):
        return None
    name = device.split(":", 1)[1].lower()
    if name not in profile_names():
        raise ValueError(f"device: unknown modelled device profile {name!r}; choose from "
                         f"{', '.join('model:' + n for n in profile_names())} "
                         f"(got {device!r})")
    return name


def get_profile(name: str) -> DeviceProfile:
    """A GPU/NPU profile by name (the CPU's needs a calibration run: engine/modelled.py)."""
    name = parse_device(f"model:{name}")
    if name == "cpu":
        raise ValueError("device: the 'cpu' profile is calibrated against a model by a real "
                         "run; build Engine(device='model:cpu') to get it")
    return spec_profile(name)
