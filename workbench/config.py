"""EngineConfig: every knob of the engine, validated in one place, named as in vLLM."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

# The knobs' domains, listed once: the CLI's choices and the knob panel's options read them.
# A device's attention backend narrows them (AttentionBackend.supported_block_sizes and
# supported_dtypes; the knob panel offers what platforms.block_sizes(device) says).
DEVICES = ("auto", "npu", "cuda", "cpu")
"""'auto' tries the others in this order."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
GRAPH_MODES = ("eager", "decode", "full")
"""vLLM-Ascend's meanings (see executor/graphs.py)."""
ATTENTION_BACKENDS = ("auto", "reference")
QUANTIZATIONS = ("auto", "gguf", "int8", "gguf-a8", "int8-a8", "bf16c")
"""Low-bit weight storage (platforms/quant.py), on the CPU; None for none."""
PREEMPTION_MODES = ("newest", "oldest", "largest")
GENERATION_CONFIGS = ("auto", "none")
TOOL_CALL_PARSERS = ("hermes",)
"""How `workbench serve` reads a model's tool calls under tool_choice auto (serving/tools.py)."""
REASONING_PARSERS = ("qwen3", "deepseek_r1")
"""How `workbench serve` splits a reasoning model's thinking from its answer (vLLM's names;
serving/reasoning.py)."""


def field_checker(obj):
    """`bad(name, why)` for obj's validate(): raises the ValueError every knob and sampling
    check raises, naming the field, saying why and showing the value."""
    def bad(name: str, why: str):
        raise ValueError(f"{name}: {why} (got {getattr(obj, name)!r})")
    return bad


@dataclass
class EngineConfig:
    model: str = "smollm2"
    """'smollm2' (embedded), 'random:<shape>', or a local Hugging Face checkpoint directory."""
    device: str = "auto"
    """'auto' (npu, then cuda, then cpu), 'cpu', 'cuda' or 'npu'; or a modelled device,
    'model:<profile>' ('model:cpu', 'model:h200', 'model:h100', 'model:a100', 'model:910b',
    'model:910c'): the real scheduler and telemetry with each step's time from a cost model
    and random tokens (workbench/modelled/)."""
    dtype: str = "auto"
    """'auto' (fp32 on CPU), 'float32', 'bfloat16' or 'float16'."""
    quantization: str | None = "auto"
    """How the weights are stored (vLLM's knob): 'gguf', a GGUF model's own low-bit blocks
    as the file holds them (the embedded smollm2: Q4_1 layers and a Q8_0 embedding, 97 MB
    against 538 MB in fp32, and the same numbers: the fp32 checkpoint is their
    dequantization); 'int8', any checkpoint's linear weights and embedding quantized at
    load, one scale per output row; 'gguf-a8' and 'int8-a8', the same weights interleaved 16
    rows at a time and multiplied with the activations quantized to int8 per 32-block (as
    llama.cpp does; AVX-512 VNNI integer dot products, the batch-1 speed of the file's
    bytes, at a small cost in accuracy that docs/benchmarks.md measures); 'bf16c', a bf16
    model's weights kept losslessly in 12.3 bits instead of 16 (the same numbers and the same
    outputs, a quarter fewer bytes for batch-1 decode to read; needs dtype='bfloat16'); None,
    in `dtype`. 'auto': the checkpoint's own format where the device runs it, as vLLM reads a
    GGUF's ('gguf' for smollm2 on the CPU in fp32), 'bf16c' for bf16 on a CPU whose kernel
    streams it (AVX-512 BF16 and VBMI), else None. CPU only: its kernels stream the packed
    rows."""
    seed: int = 0
    """Seeds random weights and the generator that requests without a seed of their own
    draw from."""
    generation_config: str = "auto"
    """Where a request's sampling defaults come from, as in vLLM: 'auto' takes temperature,
    top_p, top_k, min_p, repetition_penalty and max_new_tokens from the checkpoint's
    generation_config.json for every field a request leaves out (Engine.default_sampling_params,
    the server's requests); 'none' uses SamplingParams' own defaults. info().generation_defaults
    says which are in force."""

    attention_backend: str = "auto"
    """'auto': the platform's fused kernels where it has them: paged attention (on CPU, a
    C++ kernel built on first use) and, on CUDA in bf16/fp16, fused norms, SiLU-and-mul and
    RoPE; else the plain-torch reference. 'reference': plain torch throughout."""

    # KV cache
    block_size: int | None = None
    """Tokens per KV block: a power of two from 8 to 256. None: the device's choice (16; 128
    on the NPU, whose fused prefill pages in blocks of 128)."""
    num_kv_blocks: int | None = None
    """Blocks in the KV pool, its reserved null block included (requests hold the others);
    None sizes it from kv_cache_memory_gb or, on a GPU/NPU, from gpu_memory_utilization."""
    kv_cache_memory_gb: float | None = None
    """Memory for the KV pool when num_kv_blocks is None. None: on a device that reports its
    memory, what gpu_memory_utilization leaves; on the CPU, 1 GiB."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the device's memory this engine may take (weights, activations and KV
    pool together), as in vLLM; the KV pool gets what is left after the weights and an
    activation reserve. Only used when neither num_kv_blocks nor kv_cache_memory_gb is set."""
    enable_prefix_caching: bool = True

    # Graph capture
    graph_mode: str | None = None
    """'eager', 'decode' (capture decode steps; vLLM-Ascend's FULL_DECODE_ONLY) or 'full'
    (also prefill and mixed steps, piecewise around attention; see graphs.py). None: the
    platform's choice (Platform.default_graph_mode), made by graphs.plan_graphs:
    on CUDA 'decode' where whole decode steps can be captured (its fused paged attention),
    else 'eager'; on the NPU 'full', which there runs every step piecewise, decode included
    (vLLM-Ascend's default, see pa_shape_list); on the CPU 'eager'. A mode asked for by name
    that cannot run as asked runs eager (or piecewise only) and says so in
    Engine.telemetry.notices."""
    cudagraph_capture_sizes: list[int] | None = None
    """Decode batch sizes to capture; None: 1, 2, 4, 8, then every 16 up to max_num_seqs."""
    pa_shape_list: list[int] | None = None
    """NPU only: the decode batch sizes captured as whole-step graphs with
    _npu_paged_attention (vLLM-Ascend's additional_config `pa_shape_list`, empty there by
    default); every other step runs piecewise or eager with the fused infer-attention op.
    None: none under graph_mode 'full' (the NPU's default), cudagraph_capture_sizes (or its
    default) when graph_mode 'decode' is asked for by name. Other devices ignore it."""

    # Scheduler
    async_scheduling: bool | None = None
    """Overlap the host's work with the device (vLLM's async scheduling): a decode step
    replayed as a graph is followed by the next one, launched from the sampled ids still
    on the device, before the host hands out the first one's tokens. Applies to every
    request but one with a grammar (sampled, seeded, penalised, with stop strings or
    logprobs); a request that ends by EOS or a stop string costs one dropped row. None:
    on where the device runs behind the host (CUDA) and decode graphs are captured."""
    max_num_seqs: int = 64
    """Most requests running at once (the batch size)."""
    max_num_batched_tokens: int = 2048
    """Most tokens (prefill + decode) one step may process."""
    max_model_len: int | None = None
    """Longest prompt + output a request may have; None takes the model's limit (capped at 8192)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the step's token budget over several steps."""
    prefill_interval: int = 1
    """Admit new prefills at most every N-th step while requests are decoding (ATB's prefill
    interval): 1 lets prefill join every step; larger values protect decode latency (TPOT)
    at the cost of queueing delay (TTFT)."""
    waiting_timeout_ms: float = 0.0
    """While fewer than max_num_seqs run, hold a new prefill back up to this long so that more
    requests can join its batch (ATB's batch waiting time); 0 runs at once."""
    preemption_mode: str = "newest"
    """Which running request gives its blocks back when the pool is full: 'newest' (vLLM's
    choice), 'oldest', or 'largest' (the one holding the most blocks)."""

    speculative_config: dict | None = None
    """Speculative decoding, in vLLM's shape (SpeculativeConfig.from_dict checks it):
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    "prompt_lookup_max": b} drafts from the request's own tokens (prompt lookup);
    {"method": "draft_model", "model": <source>, "num_speculative_tokens": k} from a smaller
    model (optional "dtype", "quantization"). Each decode step then verifies up to k drafted
    tokens in one forward pass (workbench/spec_decode/). None: off."""

    # Telemetry
    max_step_events: int = 100_000
    """Step records kept in memory (oldest dropped first)."""
    max_request_records: int = 10_000
    """Finished-request records kept in memory (each holds every token's timestamp)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        bad = field_checker(self)

        if not isinstance(self.model, str) or not self.model:
            bad("model", "must be a non-empty string")
        if self.device not in DEVICES and not (isinstance(self.device, str)
                                               and self.device.startswith("model:")
                                               and len(self.device) > len("model:")):
            bad("device", f"must be one of {DEVICES} or 'model:<profile>' (a modelled "
                "device, workbench/modelled/)")
        if self.generation_config not in GENERATION_CONFIGS:
            bad("generation_config", f"must be one of {GENERATION_CONFIGS}")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            bad("quantization", f"must be one of {QUANTIZATIONS} or None (unquantized)")
        if self.graph_mode is not None and self.graph_mode not in GRAPH_MODES:
            bad("graph_mode", f"must be one of {GRAPH_MODES}")
        if self.cudagraph_capture_sizes is not None and isinstance(self.max_num_seqs, int):
            validate_capture_sizes(self.cudagraph_capture_sizes, self.max_num_seqs)
        if self.pa_shape_list is not None and isinstance(self.max_num_seqs, int):
            validate_capture_sizes(self.pa_shape_list, self.max_num_seqs, "pa_shape_list")
        if self.async_scheduling not in (None, True, False):
            bad("async_scheduling", "must be True, False or None")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            bad("block_size", f"must be one of {BLOCK_SIZES} or None (the device's choice)")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 2):
            bad("num_kv_blocks", "must be an integer >= 2 (one block is the pool's reserved "
                "null block) or None")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            bad("kv_cache_memory_gb", "must be > 0 or None")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", "must be in (0, 1]")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            bad("max_num_seqs", "must be an integer >= 1")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "must be an integer >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            bad("max_num_batched_tokens", f"must be >= max_num_seqs ({self.max_num_seqs}) so "
                "every running request can decode in one step")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 2):
            bad("max_model_len", "must be an integer >= 2 or None")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_model_len > self.max_num_batched_tokens):
            bad("max_model_len", "must be <= max_num_batched_tokens when chunked prefill is off")
        if not isinstance(self.prefill_interval, int) or self.prefill_interval < 1:
            bad("prefill_interval", "must be an integer >= 1")
        if not self.waiting_timeout_ms >= 0:
            bad("waiting_timeout_ms", "must be >= 0")
        if self.preemption_mode not in PREEMPTION_MODES:
            bad("preemption_mode", f"must be one of {PREEMPTION_MODES}")
        if not isinstance(self.max_step_events, int) or self.max_step_events < 1:
            bad("max_step_events", "must be an integer >= 1")
        if not isinstance(self.max_request_records, int) or self.max_request_records < 1:
            bad("max_request_records", "must be an integer >= 1")
        spec = self.speculative()
        if spec is not None and self.device.startswith("model:"):
            if spec.method != "ngram":
                raise ValueError(
                    f"speculative_config.method: a modelled device runs only 'ngram' (its "
                    f"lookup is host work, in the step's modelled time); a draft model's own "
                    f"forward passes are not modelled: run {spec.method!r} on a real device")
            if spec.acceptance is None:
                raise ValueError(
                    "speculative_config.acceptance: required on a modelled device. It draws "
                    "random tokens, so it cannot tell how many drafts the target would accept, "
                    "and it does not assume a rate. Measure it on the workload: run its prompts "
                    "on a real engine with the same speculative_config (Engine(model, "
                    "speculative_config=...).generate(prompts, params)) and pass "
                    "workbench.modelled.acceptance_of(that engine) as "
                    "speculative_config['acceptance'] (or acceptance_of(Trace.load(path)): a "
                    "recorded trace's steps)")
        elif spec is not None and spec.acceptance is not None:
            logging.getLogger("workbench").warning(
                "speculative_config.acceptance: ignored on a real device (it measures its own; "
                "only a modelled device reads it)")

    def speculative(self) -> "SpeculativeConfig | None":
        """speculative_config, checked and typed (None: off)."""
        return SpeculativeConfig.from_dict(self.speculative_config)

    def to_dict(self) -> dict:
        return asdict(self)


SPEC_METHODS = ("ngram", "draft_model")
"""speculative_config's methods (vLLM's names)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """EngineConfig.speculative_config, checked (vLLM's SpeculativeConfig fields)."""
    method: str
    num_speculative_tokens: int
    """k: most tokens drafted per request per step."""
    prompt_lookup_min: int = 1
    """ngram: the shortest suffix n-gram looked up in the request's earlier tokens."""
    prompt_lookup_max: int = 4
    """ngram: the longest (tried first)."""
    model: str | None = None
    """draft_model: the draft's source (any the engine loads)."""
    disable_by_batch_size: int | None = None
    """No drafts while this many requests or more run (vLLM's knob): where a batch is large
    a decode step is no longer bound by reading the weights, and verifying costs what it
    computes. None: always draft."""
    dtype: str | None = None
    quantization: str | None = None
    acceptance: "Acceptance | None" = None
    """A modelled device's (device='model:<name>') drafts are accepted at this rate,
    measured on the workload by a real run of the same proposer (not one of vLLM's fields;
    a real device ignores it). Given as a dict, {"num_draft_tokens": N,
    "num_accepted_tokens": A, "source": "<where it was measured>"} and, where the run
    counted them, "num_drafts" (verifies: the drafts' mean length) and "num_asked",
    "num_drafted" (how often the proposer found a draft), as
    workbench.modelled.acceptance_of returns it."""
    adaptive: bool = True
    """Each step drafts only as many tokens as pay for the rows they add, by the step costs
    this engine measured and the acceptance of recent verifies (engine/speculative.py): none
    where a step's extra rows cost as much as a decode (a large batch on a CPU), all k where
    they are nearly free. Not one of vLLM's fields; false: every decoding request drafts k,
    as vLLM does."""

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        """The dict as vLLM takes it, each refusal a ValueError naming the field; an unknown
        field is accepted, warned about and named, as vLLM does."""
        if d is None:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config: must be a dict (got {d!r})")
        known = set(cls.__dataclass_fields__)
        extra = sorted(set(d) - known)
        if extra:
            logging.getLogger("workbench").warning(
                "speculative_config: ignoring unknown field(s) %s", ", ".join(extra))
        method = d.get("method", "draft_model" if d.get("model") else None)
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method: must be one of {SPEC_METHODS} "
                             f"(got {method!r})")
        ints = {}
        for name, default in (("num_speculative_tokens", None), ("prompt_lookup_min", None),
                              ("prompt_lookup_max", None), ("disable_by_batch_size", None)):
            v = d.get(name, default)
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name}: must be an integer >= 1 "
                                 f"(got {v!r})")
            ints[name] = v
        if "num_speculative_tokens" not in ints:
            raise ValueError("speculative_config.num_speculative_tokens: required, an integer "
                             ">= 1 (got None)")
        lo = ints.get("prompt_lookup_min")
        hi = ints.get("prompt_lookup_max")
        lo = 1 if lo is None else lo
        hi = max(4, lo) if hi is None else hi      # (vLLM's defaults differ; any lo <= hi works)
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min: must be <= "
                             f"prompt_lookup_max (got {lo} > {hi})")
        model = d.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config.model: the draft model's source is required "
                             f"for method 'draft_model' (got {model!r})")
        if d.get("dtype") is not None and d["dtype"] not in DTYPES:
            raise ValueError(f"speculative_config.dtype: must be one of {DTYPES} (got "
                             f"{d['dtype']!r})")
        q = d.get("quantization")
        if q is not None and q not in QUANTIZATIONS:
            raise ValueError(f"speculative_config.quantization: must be one of {QUANTIZATIONS} "
                             f"or None (got {q!r})")
        adaptive = d.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive: must be true or false (got "
                             f"{adaptive!r})")
        return cls(method, ints["num_speculative_tokens"], lo, hi, model,
                   ints.get("disable_by_batch_size"), d.get("dtype"), q,
                   Acceptance.from_dict(d.get("acceptance")), adaptive)


@dataclass(frozen=True)
class Acceptance:
    """Speculative decoding's acceptance as a real run measured it (SpeculativeConfig's
    `acceptance`): the counts, so the rate's sample size is known, and where they came
    from."""
    num_draft_tokens: int
    num_accepted_tokens: int
    source: str
    """Where it was measured: the run (model, device, proposer, prompts) or the trace."""
    num_drafts: int | None = None
    """Drafts verified (vLLM's num_drafts): num_draft_tokens / num_drafts is their mean
    length. None: not measured (the modelled proposer then drafts k)."""
    num_asked: int | None = None
    """Requests the proposer was asked to draft for, and below, how many it gave a draft
    (SpecDecodeCounts). None: not measured (a trace's steps do not say; the modelled
    proposer then drafts for every request it is asked about)."""
    num_drafted: int | None = None

    @property
    def mean_draft_length(self) -> float | None:
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else None

    @property
    def draft_share(self) -> float | None:
        """The share of requests asked that got a draft."""
        return self.num_drafted / self.num_asked if self.num_asked else None

    @property
    def rate(self) -> float:
        """Accepted drafts / drafted ones (vLLM's acceptance rate)."""
        return self.num_accepted_tokens / self.num_draft_tokens

    @classmethod
    def from_dict(cls, d) -> "Acceptance | None":
        if d is None:
            return None
        where = "speculative_config.acceptance"
        if not isinstance(d, dict):
            raise ValueError(f"{where}: must be a dict with num_draft_tokens, "
                             f"num_accepted_tokens and source (got {d!r})")
        n, a, src = d.get("num_draft_tokens"), d.get("num_accepted_tokens"), d.get("source")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{where}.num_draft_tokens: must be an integer >= 1, the drafted "
                             f"tokens the rate was measured over (got {n!r})")
        if not isinstance(a, int) or isinstance(a, bool) or not 0 <= a <= n:
            raise ValueError(f"{where}.num_accepted_tokens: must be an integer in [0, "
                             f"num_draft_tokens={n}] (got {a!r})")
        if not isinstance(src, str) or not src.strip():
            raise ValueError(f"{where}.source: must say where the counts were measured (got "
                             f"{src!r})")
        opt = {}
        for name in ("num_drafts", "num_asked", "num_drafted"):
            v = d.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{where}.{name}: must be an integer >= 0 or absent (got {v!r})")
            opt[name] = v
        if opt["num_drafts"] is not None and not 1 <= opt["num_drafts"] <= n:
            raise ValueError(f"{where}.num_drafts: must be in [1, num_draft_tokens={n}] (got "
                             f"{opt['num_drafts']!r})")
        if (opt["num_asked"] is None) != (opt["num_drafted"] is None):
            raise ValueError(f"{where}.num_drafted: num_asked and num_drafted come together "
                             f"(got {opt['num_asked']!r} and {opt['num_drafted']!r})")
        if opt["num_asked"] is not None and not 0 < opt["num_drafted"] <= opt["num_asked"]:
            raise ValueError(f"{where}.num_drafted: must be in [1, num_asked="
                             f"{opt['num_asked']}] (got {opt['num_drafted']!r})")
        extra = sorted(set(d) - {"num_draft_tokens", "num_accepted_tokens", "source", *opt})
        if extra:
            logging.getLogger("workbench").warning("%s: ignoring unknown field(s) %s", where,
                                                   ", ".join(extra))
        return cls(n, a, src, **opt)


def validate_capture_sizes(sizes: list[int], max_num_seqs: int,
                           name: str = "cudagraph_capture_sizes") -> list[int]:
    if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise ValueError(f"{name}: must be positive integers (got {sizes!r})")
    if max(sizes) > max_num_seqs:
        raise ValueError(f"{name}: {max(sizes)} exceeds max_num_seqs "
                         f"({max_num_seqs}); a batch that large never runs")
    return sorted(set(sizes))


TUNABLE = ("max_num_seqs", "max_num_batched_tokens", "block_size", "graph_mode",
           "prefill_interval", "waiting_timeout_ms", "preemption_mode",
           "enable_chunked_prefill", "enable_prefix_caching", "speculative_config")
"""The knobs the tuner searches by default (issues 26 and 40), all EngineConfig fields
(speculative_config: off, or a method and its k; tune/space.py)."""
