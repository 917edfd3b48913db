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
"""
from __future__ import annotations

import gzip
import json
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


@dataclass
class Trace:
    info: EngineInfo
    """The engine that ran (model shape, KV pool, resolved knobs in `info.config`)."""
    frames: list[TraceFrame]
    requests: list[RequestMetrics] = field(default_factory=list)
    """Finished requests' metrics (times from the trace's start)."""
    prompts: dict[str, str] = field(default_factory=dict)
    """Request id -> the prompt, shortened to a label."""
    roofs: DeviceRoofs | None = None
    memory: MemoryStats | None = None
    notices: list[str] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.frames[-1].time if self.frames else 0.0

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
                notices=list(d.get("notices") or []))
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
    info = _make(EngineInfo, {**d, "config": _make(EngineConfig, d["config"])})
    return replace(info, capture_sizes=tuple(info.capture_sizes),
                   piecewise_sizes=tuple(info.piecewise_sizes))


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
    the last one). roofs: include the device's roofs (probed once per machine)."""
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
    t0 = time.monotonic()
    labels = {engine.add_request(p, sp): prompt_label(p) for p, sp in zip(prompts, params)}
    frames: list[TraceFrame] = []
    tel = engine.telemetry
    next_step, next_request = tel.num_steps, tel.num_requests
    while engine.has_unfinished_requests() and len(frames) < max_steps:
        tokens = engine.step()
        new = [replace(s, start=s.start - t0) for s in tel.steps_since(next_step)
               if s.phase != "idle"]
        next_step = tel.num_steps
        if not new:
            continue
        done = not engine.has_unfinished_requests()
        tokens = [replace(t, time=t.time - t0) for t in tokens]
        for s in new[:-1]:             # steps run inside one call (none today) carry no tokens
            frames.append(TraceFrame(s))
        frames.append(TraceFrame(new[-1], tokens, engine.request_states(),
                                 engine.kv_blocks() if done or len(frames) % kv_every == 0
                                 else None))
    reqs = [replace(m, arrival_time=m.arrival_time - t0, token_times=[x - t0 for x in
                                                                     m.token_times],
                    **{k: getattr(m, k) - t0 for k in ("first_scheduled_time",
                                                        "first_token_time", "finished_time")
                       if getattr(m, k) is not None})
            for m in tel.requests_since(next_request)]
    return Trace(engine.info(), frames, reqs, labels, engine.device_roofs() if roofs else None,
                 tel.memory, list(engine.notices))


def prompt_label(prompt, width: int = 60) -> str:
    """A prompt in one short line: a chat's last message, a string, or a count of token ids."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        prompt = prompt[-1].get("content", "")
    elif isinstance(prompt, (list, tuple)):
        return f"{len(prompt)} token ids"
    text = " ".join(str(prompt).split())
    return text if len(text) <= width else text[:width - 1] + "…"
