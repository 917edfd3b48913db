"""Recorded traces: an engine run saved to one file and played back with no model loaded.

A trace holds, step by step, what the panels draw: the step's StepEvent, the tokens it handed
out (with their logprobs where asked for), every unfinished request's state after it (block
tables, progress) and the KV pool block by block; plus the finished requests' metrics, the
memory figures, the engine's EngineInfo and the device's roofs (so a replay can draw the
roofline too).

    trace = record(engine, prompts, SamplingParams(max_tokens=32))
    trace.save("run.trace.json.gz")
    Trace.load("run.trace.json.gz").frames[0].step.phase

The file is gzipped JSON (plain JSON is read too) tagged with FORMAT and VERSION; a file that
is not one, or one from a newer workbench, raises TraceError saying which.

A trace is shared, so it names no place on the recording machine: the model is named as asked
for (a checkpoint directory by its last component only) and identified by `model_sha256`, and
`info.model_path` is always None (traces recorded before this kept an absolute path there; it
is dropped when they are loaded).

`benchmarks/record_trace.py` records the trace that ships in docs/traces/: it first measures
the engine's time for each kind of step the recording makes (`calibrate`), then records, and
saves only if every step is within a stated factor of that (`check_steps`); what it was checked
against is kept in the trace (`Trace.calibration`).
"""
from __future__ import annotations

import gzip
import json
import statistics
import time
import zlib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import SimpleNamespace

from .config import EngineConfig
from .core.block_manager import KVBlockSnapshot
from .core.sampling_params import SamplingParams
from .engine import Engine, RequestState, TokenEvent
from .roofline import DeviceRoofs
from .telemetry import EngineInfo, MemoryStats, RequestMetrics, StepEvent

FORMAT = "workbench-trace"
VERSION = 1


class TraceError(ValueError):
    """A file that is not a workbench trace this version can read."""


@dataclass
class TraceFrame:
    """One engine step as recorded."""
    step: StepEvent
    tokens: list[TokenEvent] = field(default_factory=list)
    """Token events the step handed out."""
    states: list[RequestState] = field(default_factory=list)
    """Every unfinished request after the step."""
    kv: KVBlockSnapshot | None = None
    """The KV pool after the step (None where the recording skipped it)."""

    @property
    def time(self) -> float:
        """Seconds from the trace's start to the end of the step."""
        return self.step.start + self.step.duration


StepKind = tuple[str, int, int]
"""(phase, prefill tokens, decode tokens): steps of one kind cost about the same."""


def step_kind(step: StepEvent) -> StepKind:
    return step.phase, step.num_prefill_tokens, step.num_decode_tokens


@dataclass(slots=True)
class StepTime:
    """The calibration's time for one kind of step."""
    phase: str
    num_prefill_tokens: int
    num_decode_tokens: int
    median_s: float
    """The median of the calibration's steps of this kind: what a recorded one is held to."""
    min_s: float
    samples: int


@dataclass(slots=True)
class Calibration:
    """What a recording was checked against before it was saved: the same engine's time for
    each kind of step the recording makes, measured just before it on the same machine
    (`repeats` runs of the same workload), and how far the recorded steps strayed from it."""
    factor: float
    """Every recorded step took between median_s / factor and median_s * factor."""
    repeats: int
    step_times: list[StepTime]
    min_ratio: float
    """The recorded steps' smallest duration over their kind's median_s."""
    max_ratio: float
    """The recorded steps' largest duration over their kind's median_s."""
    load_average: list[float]
    """The machine's 1, 5 and 15 minute load averages before the recorder started."""
    cpu_count: int
    threads: int
    """torch's intra-op threads."""
    bench_batch1_tpot_s: float | None = None
    """Batch-1 TPOT as `workbench bench --num-requests 0` measured it on the same engine right
    after the recording (what tests/test_trace_recording.py holds `Trace.batch1_tpot()` to)."""


@dataclass
class Trace:
    info: EngineInfo
    """The engine that ran (model shape, KV pool, resolved knobs in `info.config`); its model
    is named portably and its model_path is None (see `portable_info`)."""
    frames: list[TraceFrame]
    requests: list[RequestMetrics] = field(default_factory=list)
    """Finished requests' metrics (times from the trace's start)."""
    prompts: dict[str, str] = field(default_factory=dict)
    """Request id -> the prompt, shortened to a label."""
    roofs: DeviceRoofs | None = None
    memory: MemoryStats | None = None
    notices: list[str] = field(default_factory=list)
    model_sha256: str | None = None
    """The weights' content hash (`Engine.model_sha256()`): the embedded model's GGUF, a
    checkpoint directory's files; None for random weights (their name and seed say what they
    are)."""
    calibration: Calibration | None = None
    """What `benchmarks/record_trace.py` checked the steps against (None for other traces)."""

    def __post_init__(self):
        self.info = portable_info(self.info)

    @property
    def duration(self) -> float:
        return self.frames[-1].time if self.frames else 0.0

    def batch1_tpot(self) -> tuple[float, int] | None:
        """TPOT at batch 1 as `workbench bench --num-requests 0` defines it (the time after a
        lone request's first token over the tokens after it), over the trace's longest stretch
        of consecutive steps in which one request decoded alone; with the stretch's token
        count. None where no request decoded alone for two steps running."""
        best: list[float] = []
        run: list[float] = []
        rid = None
        for f in self.frames:
            s = f.step
            alone = (s.phase == "decode" and s.num_decode_tokens == 1 and len(f.tokens) == 1
                     and not s.num_prefill_tokens)
            if not alone or f.tokens[0].request_id != rid:
                run = []
                rid = f.tokens[0].request_id if alone else None
            if alone:
                run.append(f.tokens[0].time)
                if len(run) > len(best):
                    best = run
        if len(best) < 2:
            return None
        return (best[-1] - best[0]) / (len(best) - 1), len(best)

    # ---- file format ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        def token(ev: TokenEvent) -> dict:
            d = {f.name: getattr(ev, f.name) for f in fields(ev)}
            if d.get("logprobs"):
                d["logprobs"] = [[tid, lp.logprob, lp.rank, lp.decoded_token]
                                 for tid, lp in d["logprobs"].items()]
            return d
        return {"format": FORMAT, "version": VERSION, "info": asdict(self.info),
                "roofs": asdict(self.roofs) if self.roofs else None,
                "memory": asdict(self.memory) if self.memory else None,
                "notices": self.notices, "prompts": self.prompts,
                "model_sha256": self.model_sha256,
                "calibration": asdict(self.calibration) if self.calibration else None,
                "requests": [asdict(r) for r in self.requests],
                "frames": [{"step": asdict(f.step), "tokens": [token(t) for t in f.tokens],
                            "states": [asdict(s) for s in f.states],
                            "kv": asdict(f.kv) if f.kv is not None else None}
                           for f in self.frames]}

    def save(self, path: str | Path) -> Path:
        """Write gzipped JSON (a .gz name) or plain JSON (any other)."""
        path = Path(path)
        data = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise TraceError(f"trace {path}: cannot read it ({e.strerror or e})") from None
        try:
            if raw[:2] == b"\x1f\x8b":
                raw = gzip.decompress(raw)
            d = json.loads(raw)
        except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
            raise TraceError(f"trace {path}: not a workbench trace (neither gzipped nor plain "
                             f"JSON: {e})") from None
        return cls.from_dict(d, str(path))

    @classmethod
    def from_dict(cls, d, where: str = "trace") -> "Trace":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise TraceError(f"{where}: not a workbench trace (its format tag is {got!r}, "
                             f"expected {FORMAT!r})")
        version = d.get("version")
        if version != VERSION:
            newer = isinstance(version, int) and version > VERSION
            raise TraceError(f"{where}: trace format version {version!r} "
                             f"{'is newer than' if newer else 'is not'} the one this workbench "
                             f"reads ({VERSION}){'; upgrade the workbench' if newer else ''}")
        try:
            return cls(
                info=_info(d["info"]),
                frames=[TraceFrame(_make(StepEvent, f["step"]),
                                   [_token(t) for t in f["tokens"]],
                                   [_make(RequestState, s) for s in f["states"]],
                                   _make(KVBlockSnapshot, f["kv"]) if f["kv"] else None)
                        for f in d["frames"]],
                requests=[_make(RequestMetrics, r) for r in d["requests"]],
                prompts=dict(d["prompts"]),
                roofs=_make(DeviceRoofs, d["roofs"]) if d.get("roofs") else None,
                memory=_make(MemoryStats, d["memory"]) if d.get("memory") else None,
                notices=list(d.get("notices") or []),
                model_sha256=d.get("model_sha256"),
                calibration=_calibration(d["calibration"]) if d.get("calibration") else None)
        except (KeyError, TypeError, AttributeError) as e:
            raise TraceError(f"{where}: a damaged workbench trace (version {VERSION}): "
                             f"{type(e).__name__}: {e}") from None


def _make(cls, d: dict):
    """cls from a dict, every field required present and no stray ones (a damaged file)."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__}: expected an object, got {type(d).__name__}")
    names = {f.name for f in fields(cls)}
    stray = set(d) - names
    if stray:
        raise TypeError(f"{cls.__name__}: unknown fields {sorted(stray)}")
    return cls(**d)


def _info(d: dict) -> EngineInfo:
    # A trace recorded before EngineConfig.quantization existed ran unquantized weights: its
    # config says so, rather than taking today's default ('auto': the GGUF's blocks on a CPU).
    config = _make(EngineConfig, {"quantization": None, **d["config"]})
    info = _make(EngineInfo, {**d, "config": config})
    return replace(info, capture_sizes=tuple(info.capture_sizes),
                   piecewise_sizes=tuple(info.piecewise_sizes),
                   weight_formats=tuple(info.weight_formats))


def _calibration(d: dict) -> Calibration:
    return _make(Calibration, {**d, "step_times": [_make(StepTime, t) for t in d["step_times"]]})


def portable_model_name(model: str) -> str:
    """The model as a trace names it: `smollm2` and `random:<shape>` as they are, a checkpoint
    directory by its last component (where it lives on the recording machine is nobody's
    business; `Trace.model_sha256` says which weights they were)."""
    if model == "smollm2" or model.startswith("random:"):
        return model
    return Path(model).name or model


def portable_info(info: EngineInfo) -> EngineInfo:
    """`info` with no path of the recording machine in it (model_path and gguf_path None)."""
    name = portable_model_name(info.model)
    config = info.config
    if isinstance(config, EngineConfig):
        config = replace(config, model=portable_model_name(config.model))
    if (name, config, info.model_path, info.gguf_path) == (info.model, info.config, None, None):
        return info
    return replace(info, model=name, model_path=None, gguf_path=None, config=config)


def _token(d: dict) -> TokenEvent:
    d = dict(d)
    lps = d.get("logprobs")
    if lps:
        make = _logprob_class()
        d["logprobs"] = {int(t): make(logprob=lp, rank=rank, decoded_token=text)
                         for t, lp, rank, text in lps}
    return _make(TokenEvent, d)


def _logprob_class():
    """The engine's Logprob where it has one, else an object with the same fields."""
    import workbench
    return getattr(workbench, "Logprob", SimpleNamespace)


# ---- recording ------------------------------------------------------------------------------
def record(engine: Engine, prompts: list, params: SamplingParams | list[SamplingParams] | None
           = None, *, kv_every: int = 1, roofs: bool = True, max_steps: int = 100_000) -> Trace:
    """Run `prompts` to the end on `engine` (stepping it in this thread; it must not run in the
    background) and record every step. kv_every: keep the KV pool every n-th step (and at
    the last one). roofs: include the device's roofs (probed once per machine). A trace
    counts from its own start, whatever the engine ran before: times from its first request,
    steps from 0, and requests named req-0, req-1, … in the order of `prompts`."""
    if engine.is_running_in_background:
        raise ValueError("engine: record() steps the engine itself; pass one that is not "
                         "running in the background")
    if engine.has_unfinished_requests():
        raise ValueError("engine: it already has unfinished requests; record on an idle engine")
    if kv_every < 1:
        raise ValueError(f"kv_every: must be >= 1 (got {kv_every})")
    if params is None or isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"params: {len(params)} for {len(prompts)} prompts")
    tel = engine.telemetry
    first_step = next_step = tel.num_steps
    next_request = tel.num_requests
    t0 = time.monotonic()
    labels = {engine.add_request(p, sp, f"req-{i}"): prompt_label(p)
              for i, (p, sp) in enumerate(zip(prompts, params))}
    frames: list[TraceFrame] = []
    while engine.has_unfinished_requests() and len(frames) < max_steps:
        tokens = engine.step()
        new = [replace(s, start=s.start - t0, step=s.step - first_step)
               for s in tel.steps_since(next_step) if s.phase != "idle"]
        next_step = tel.num_steps
        if not new:
            continue
        done = not engine.has_unfinished_requests()
        tokens = [replace(t, time=t.time - t0) for t in tokens]
        for s in new[:-1]:             # steps run inside one call (none today) carry no tokens
            frames.append(TraceFrame(s))
        kv = engine.kv_blocks() if done or len(frames) % kv_every == 0 else None
        frames.append(TraceFrame(new[-1], tokens, engine.request_states(),
                                 replace(kv, step=kv.step - first_step) if kv else None))
    reqs = [replace(m, arrival_time=m.arrival_time - t0, token_times=[x - t0 for x in
                                                                     m.token_times],
                    **{k: getattr(m, k) - t0 for k in ("first_scheduled_time",
                                                        "first_token_time", "finished_time")
                       if getattr(m, k) is not None})
            for m in tel.requests_since(next_request)]
    return Trace(engine.info(), frames, reqs, labels, engine.device_roofs() if roofs else None,
                 tel.memory, list(engine.telemetry.notices), engine.model_sha256())


def calibrate(engine: Engine, prompts: list, params: SamplingParams | list[SamplingParams] |
              None = None, repeats: int = 5) -> dict[StepKind, list[float]]:
    """Each kind of step's durations over `repeats` runs of `prompts` recorded as `record` does
    (after one run that is not counted: first calls allocate and warm caches), each from an
    empty prefix cache. Seeded sampling makes every run the same steps, so a recording made
    next (from an empty prefix cache too) meets only kinds measured here."""
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1 (got {repeats})")
    samples: dict[StepKind, list[float]] = {}
    for i in range(repeats + 1):
        engine.reset_prefix_cache()
        run = record(engine, prompts, params, roofs=False)
        for f in run.frames if i else ():
            samples.setdefault(step_kind(f.step), []).append(f.step.duration)
    return samples


def check_steps(trace: Trace, samples: dict[StepKind, list[float]], factor: float,
                repeats: int, load_average: list[float]) -> tuple[Calibration, list[str]]:
    """Hold each recorded step to the median of its kind in `samples` (from `calibrate`, with
    `repeats` runs; `load_average` as it started): within `factor` either way. Returns the
    figures checked (for `Trace.calibration`) and, one line each, the steps that were not (or
    whose kind the calibration never met); an empty list means the recording is
    representative."""
    import os

    import torch
    if not factor > 1:
        raise ValueError(f"factor: must be > 1 (got {factor})")
    medians = {k: statistics.median(v) for k, v in samples.items()}
    off, ratios = [], []
    for f in trace.frames:
        s, kind = f.step, step_kind(f.step)
        what = f"step {s.step} ({s.phase}, {s.num_prefill_tokens} prefill + " \
               f"{s.num_decode_tokens} decode tokens)"
        if kind not in medians:
            off.append(f"{what}: no step of this kind in the calibration")
            continue
        ratio = s.duration / medians[kind]
        ratios.append(ratio)
        if not 1 / factor <= ratio <= factor:
            off.append(f"{what}: {s.duration * 1e3:.1f} ms, {ratio:.2f}x the calibration's "
                       f"{medians[kind] * 1e3:.1f} ms")
    times = [StepTime(*k, medians[k], min(v), len(v)) for k, v in sorted(samples.items())]
    cal = Calibration(factor, repeats, times, min(ratios, default=0.0),
                      max(ratios, default=0.0), [round(x, 2) for x in load_average],
                      os.cpu_count() or 0, torch.get_num_threads())
    return cal, off


def prompt_label(prompt, width: int = 60) -> str:
    """A prompt in one short line: a chat's last message, a string, or a count of token ids."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        prompt = prompt[-1].get("content", "")
    elif isinstance(prompt, (list, tuple)):
        return f"{len(prompt)} token ids"
    text = " ".join(str(prompt).split())
    return text if len(text) <= width else text[:width - 1] + "…"
