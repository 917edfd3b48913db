"""Shared fixtures: the embedded model, HF reference generations, tiny random checkpoints."""
from __future__ import annotations

import random

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "In 1969, the first humans landed on the Moon. Describe what they saw and how they felt "
    "when they stepped out of the lunar module onto the grey dust of the surface.",
    "Hi",
    "Explain, step by step, how a paged KV cache lets an inference engine serve many requests "
    "at once without reserving memory for the longest possible sequence. Mention blocks, "
    "block tables and what happens when the pool runs out of free blocks during decoding.",
    "Translate to French: good morning, my friend.",
]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' own greedy generation for one prompt (batch of 1: no padding)."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def smollm2_dir():
    from workbench.executor.models.loader import smollm2_checkpoint_dir
    return smollm2_checkpoint_dir()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # compare whole lengths; tests cut at EOS
    return model


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def make_tiny_checkpoint(path, kind: str, seed: int = 0, head_dim: int = 48, **shape):
    """A small random HF checkpoint of the given family, saved as safetensors, with the HF
    model returned for reference. Weights are drawn wider than HF's default init so that
    logits are peaked and greedy choices are not near-ties. head_dim: Qwen3's (the NPU's
    fused attention takes only a few sizes); `shape` overrides config fields (vocab_size...)."""
    import transformers
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.25)
    common.update(shape)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=False)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "llama3":
        cfg = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(kind)
    cfg.eos_token_id = None
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():   # biases are zero-initialised by HF; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    out = {}
    for kind in ("qwen2", "qwen3", "llama3"):
        path = tmp_path_factory.mktemp(kind)
        out[kind] = (path, make_tiny_checkpoint(path, kind))
    return out


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(r.randint(lo, hi))] for _ in range(n)]


def stop_tree(proc, timeout: float = 30.0) -> list[int]:
    """Stop a `workbench` command the way a service manager does (SIGTERM; it stops its own
    children), then kill whatever of its process tree survived. Returns the survivors' pids,
    so a test can assert there were none; nothing is left running either way."""
    import psutil
    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        proc.terminate()
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    kill_all(alive)
    proc.wait(10)
    return [p.pid for p in alive]


def kill_all(procs: list) -> None:
    """The test's own clean-up, whatever the code under test did."""
    import psutil
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
