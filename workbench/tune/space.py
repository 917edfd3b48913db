"""The search space: EngineConfig knobs and the values a tuning run may give each.

Knobs are EngineConfig fields under their own names. Where a knob has a fixed set of values,
its domain is read from where the engine defines it: block sizes from the device's attention
backends (`platforms.block_sizes`), graph modes from `config.GRAPH_MODES` where the device
captures graphs (`platforms.graph_modes`: 'eager' alone on the CPU), preemption modes from
`config.PREEMPTION_MODES`, switches as True/False, speculative decoding
(`speculative_config`, vLLM's dict) as off or prompt lookup with k = 2, 4 or 8 drafted tokens
(a draft model needs its source: give those values yourself, e.g. `--knob
'speculative_config=None,{"method": "draft_model", "model": "smollm2", "quantization":
"gguf-a8", "num_speculative_tokens": 4}'`). On a modelled device ('model:h200') the
domains are those of the kind of device it models (CUDA's for the H200; speculative decoding
off: it is not modelled). Numeric knobs have no fixed set: their
default ladders double up and down from EngineConfig's own default (max_num_seqs 64 ->
8..128), which a caller narrows or replaces (`Space({"max_num_seqs": (8, 16, 32)})`).

    space = Space.default("cpu", knobs=("max_num_seqs", "max_num_batched_tokens"))
    space.sample(6, seed=0)          # distinct points, the EngineConfig defaults first
"""
from __future__ import annotations

import ast
import itertools
import json
import random
from dataclasses import MISSING, fields

from ..config import PREEMPTION_MODES, TUNABLE, EngineConfig
from ..modelled.profiles import get_profile, parse_device
from ..platforms import block_sizes, graph_modes

FIXED = ("model", "device")
"""Fields a space may not vary: they say what is tuned, on what."""

WAITING_TIMEOUT_LADDER_MS = (0.0, 2.0, 5.0, 10.0, 20.0)
"""waiting_timeout_ms's default is 0 (no wait), so it has no default to double from."""

SPEC_K_LADDER = (2, 4, 8)
"""num_speculative_tokens tried with prompt lookup (speculative_config's default domain)."""


def _hashable(v):
    """A knob value as a key (speculative_config's values are dicts)."""
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v


def _split_values(text: str) -> list[str]:
    """`v1,v2,...` split at the commas outside brackets and quotes (a dict value has its own)."""
    out, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    return out + [text[start:]]


def _literal(text: str):
    """A value as written: a Python literal, JSON (a dict with true/null), else the word."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def _default(name: str):
    f = EngineConfig.__dataclass_fields__[name]
    return f.default if f.default is not MISSING else f.default_factory()


def _ladder(default: int, down: int, up: int) -> tuple[int, ...]:
    """default halved `down` times and doubled `up` times (integers >= 1)."""
    vals = {max(1, default >> i) for i in range(down + 1)} | {default << i for i in range(up + 1)}
    return tuple(sorted(vals))


def real_kind(device: str) -> str:
    """The real device whose knob domains apply: the device itself, or for a modelled one
    ('model:<name>') the kind of device its profile models ('cpu', 'cuda' or 'npu')."""
    name = parse_device(device)
    if name is None:
        return device
    return "cpu" if name == "cpu" else get_profile(name).kind


def knob_domain(name: str, device: str) -> tuple:
    """A knob's default domain on `device` (see the module's docstring)."""
    if name == "block_size":
        return block_sizes(real_kind(device))
    if name == "graph_mode":
        return graph_modes(real_kind(device))
    if name == "preemption_mode":
        return PREEMPTION_MODES
    if name in ("enable_chunked_prefill", "enable_prefix_caching"):
        return (True, False)
    if name == "max_num_seqs":
        return _ladder(_default(name), 3, 1)
    if name == "max_num_batched_tokens":
        return _ladder(_default(name), 3, 1)
    if name == "prefill_interval":
        return _ladder(_default(name), 0, 3)
    if name == "waiting_timeout_ms":
        return WAITING_TIMEOUT_LADDER_MS
    if name == "speculative_config":
        if parse_device(device) is not None:
            return (None,)                    # a modelled device does not model drafting
        return (None, *({"method": "ngram", "num_speculative_tokens": k} for k in SPEC_K_LADDER))
    raise ValueError(f"space: {name!r} has no default domain; give its values "
                     f"(knobs with one: {', '.join(TUNABLE)})")


class Space:
    """Knob name -> the values to try (in order). Every name must be an EngineConfig field
    (not model or device) and every value one EngineConfig accepts for it."""

    def __init__(self, knobs: dict[str, list | tuple]):
        if not isinstance(knobs, dict) or not knobs:
            raise ValueError("space: is empty; give at least one knob with values to try")
        names = {f.name for f in fields(EngineConfig)}
        self.knobs: dict[str, tuple] = {}
        for name, values in knobs.items():
            if name not in names:
                raise ValueError(f"space: {name!r} is not an EngineConfig field")
            if name in FIXED:
                raise ValueError(f"space: {name!r} says what is tuned and where; set it on the "
                                 f"base config, not in the space")
            distinct: dict = {}
            for v in values if isinstance(values, (list, tuple)) else [values]:
                distinct.setdefault(_hashable(v), v)
            values = tuple(distinct.values())
            if not values:
                raise ValueError(f"space: {name!r} has no values to try")
            for v in values:
                try:
                    EngineConfig(**self._alone(name, v))
                except ValueError as e:
                    raise ValueError(f"space: {name}={v!r}: {e}") from None
            self.knobs[name] = values

    @staticmethod
    def _alone(name: str, v) -> dict:
        """Kwargs that check one value on its own (a large max_num_seqs needs a token budget
        at least as large, which another knob may give)."""
        kw = {name: v}
        if name == "max_num_seqs" and isinstance(v, int):
            kw["max_num_batched_tokens"] = max(v, _default("max_num_batched_tokens"))
        return kw

    @classmethod
    def default(cls, device: str = "auto", knobs: tuple[str, ...] = TUNABLE) -> "Space":
        """Each knob's default domain on `device` (module docstring)."""
        return cls({k: knob_domain(k, device) for k in knobs})

    @classmethod
    def parse(cls, specs: list[str], device: str = "auto") -> "Space":
        """From `name=v1,v2,...` strings (Python literals, a bare word a string); a bare
        `name` takes its default domain (the CLI's --knob)."""
        out = {}
        for spec in specs:
            name, eq, rest = spec.partition("=")
            name = name.strip()
            if not eq:
                out[name] = knob_domain(name, device)
                continue
            vals = [_literal(text.strip()) for text in _split_values(rest) if text.strip()]
            if not vals:
                raise ValueError(f"space: {name!r} has no values to try (write {name}=v1,v2)")
            out[name] = vals
        return cls(out)

    @property
    def size(self) -> int:
        n = 1
        for v in self.knobs.values():
            n *= len(v)
        return n

    def valid(self, point: dict, base: EngineConfig) -> bool:
        """Whether EngineConfig accepts `point` over `base` (the device may still refuse it)."""
        try:
            EngineConfig(**{**base.to_dict(), **point})
            return True
        except ValueError:
            return False

    def defaults(self, base: EngineConfig) -> dict:
        """The base config's value of every knob (the point a tuning run must beat)."""
        return {k: getattr(base, k) for k in self.knobs}

    def sample(self, n: int, base: EngineConfig | None = None, seed: int = 0,
               include_defaults: bool = True) -> list[dict]:
        """Up to n distinct points EngineConfig accepts over `base`, drawn at random from
        the product (not a grid walk); the base config's own values first when
        `include_defaults` (they need not be in the domains).

        A small space is shuffled whole. A large one is drawn as a Latin hypercube over the
        knobs' discrete domains (McKay, Beckman and Conover, 1979): each knob's column of the
        draw goes through its domain in a shuffled order, over and over, so that n points
        try every value of a knob that has at most n of them (independent uniform draws
        would leave some out: five draws from five values miss one 2 times in 3), and a
        small first rung still sees the whole range of each knob. Points EngineConfig refuses
        are skipped and the draw goes on."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n_trials: must be an integer >= 1 (got {n!r})")
        base = base or EngineConfig()
        rng = random.Random(seed)
        out: list[dict] = []
        seen = set()

        def take(p: dict) -> None:
            key = tuple(sorted((k, _hashable(v)) for k, v in p.items()))
            if key not in seen and self.valid(p, base):
                seen.add(key)
                out.append(p)

        if include_defaults:
            take(self.defaults(base))
        names = list(self.knobs)
        if self.size <= 4 * n:        # small: shuffle the whole product
            points = [dict(zip(names, vs)) for vs in itertools.product(*self.knobs.values())]
            rng.shuffle(points)
            for p in points:
                if len(out) >= n:
                    break
                take(p)
        else:
            for _ in range(50):
                want = n - len(out)
                if want <= 0:
                    break
                columns = {k: _latin_column(v, want, rng) for k, v in self.knobs.items()}
                for i in range(want):
                    take({k: col[i] for k, col in columns.items()})
        if not out:
            raise ValueError("space: no point of it is a valid EngineConfig over the base config")
        return out[:n]

    def __repr__(self) -> str:
        return f"Space({self.knobs!r})"


def _latin_column(values: tuple, m: int, rng: random.Random) -> list:
    """m values: the domain shuffled, again and again, as many times as it takes."""
    out: list = []
    while len(out) < m:
        perm = list(values)
        rng.shuffle(perm)
        out.extend(perm)
    return out[:m]
