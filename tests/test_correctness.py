"""Greedy tokens must equal HF transformers' for the same checkpoint, however we batch."""
from __future__ import annotations

import pytest

from conftest import TEXTS, hf_greedy, random_prompts
from workbench import Engine, SamplingParams

NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)

ENGINE_VARIANTS = {
    "bs16-prefix": dict(block_size=16, enable_prefix_caching=True),
    "bs64-prefix": dict(block_size=64, enable_prefix_caching=True),
    "bs16-noprefix": dict(block_size=16, enable_prefix_caching=False),
    "bs64-noprefix": dict(block_size=64, enable_prefix_caching=False),
    # A pool of 12 blocks of 16 tokens cannot hold eight requests: preemption must happen.
    "bs16-tinypool": dict(block_size=16, num_kv_blocks=13, max_model_len=192),   # 12 + null
    # The plain-torch attention path (the default uses the platform's fused kernel).
    "bs16-reference": dict(block_size=16, attention_backend="reference"),
    # Small step budget: long prompts are prefilled in chunks next to decodes.
    "bs16-chunked": dict(block_size=16, max_num_batched_tokens=32, max_num_seqs=8),
}


@pytest.fixture(scope="module")
def smollm2_refs(hf_smollm2, smollm2_tokenizer):
    prompts = [smollm2_tokenizer.encode(t) for t in TEXTS]
    return prompts, [hf_greedy(hf_smollm2, p, NEW) for p in prompts]


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_smollm2_batch_of_8_matches_hf(variant, smollm2_refs):
    prompts, refs = smollm2_refs
    kw = dict(num_kv_blocks=256) | ENGINE_VARIANTS[variant]
    engine = Engine(model="smollm2", device="cpu", **kw)
    outs = engine.generate(prompts, GREEDY)
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert o.token_ids == ref, f"prompt {i} diverged from HF"
    steps, _ = engine.telemetry.snapshot()
    if variant == "bs16-tinypool":
        assert sum(s.num_preempted for s in steps) > 0, "the tiny pool should force preemption"
    if variant == "bs16-chunked":
        assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) <= 32
        assert any(s.phase == "mixed" for s in steps)
    assert engine.stats().kv_blocks_used == 0


def test_smollm2_batch_of_1_matches_hf(smollm2_refs):
    prompts, refs = smollm2_refs
    engine = Engine(model="smollm2", device="cpu", num_kv_blocks=64)
    for p, ref in zip(prompts[:3], refs[:3]):
        assert engine.generate([p], GREEDY)[0].token_ids == ref


def test_smollm2_text_and_chat_prompts(hf_smollm2, smollm2_tokenizer):
    engine = Engine(model="smollm2", device="cpu", num_kv_blocks=64)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    out = engine.generate(messages, SamplingParams(max_tokens=16, temperature=0))[0]
    assert out.prompt_token_ids == ids
    ref = hf_greedy(hf_smollm2, ids, 16)
    eos = smollm2_tokenizer.eos_token_id
    ref = ref[:ref.index(eos) + 1] if eos in ref else ref
    assert out.token_ids == ref
    assert out.text == smollm2_tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == ("stop" if out.token_ids[-1] == eos else "length")


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama3"])
@pytest.mark.parametrize("block_size,prefix", [(16, True), (64, False)])
def test_random_checkpoints_match_hf(kind, block_size, prefix, tiny_checkpoints):
    path, hf = tiny_checkpoints[kind]
    prompts = random_prompts(8, 3, 150, hf.config.vocab_size, seed=1)
    prompts[3] = prompts[0][:40] + prompts[3][:20]   # a shared prefix across the batch
    refs = [hf_greedy(hf, p, NEW) for p in prompts]
    engine = Engine(model=str(path), device="cpu", block_size=block_size,
                    enable_prefix_caching=prefix, num_kv_blocks=128)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    assert engine.generate([prompts[0]], GREEDY)[0].token_ids == refs[0]   # batch of 1


def test_random_checkpoint_preemption_matches_hf(tiny_checkpoints):
    path, hf = tiny_checkpoints["qwen3"]
    prompts = random_prompts(8, 10, 60, hf.config.vocab_size, seed=2)
    refs = [hf_greedy(hf, p, 40) for p in prompts]
    engine = Engine(model=str(path), device="cpu", block_size=16, num_kv_blocks=11,
                    max_model_len=160)
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert engine.stats().num_preemptions > 0
    assert engine.stats().kv_blocks_used == 0
