"""A failure one request causes stays with that request (issue 27): its sampling, its
detokenizing; the other requests of the step finish as if it had never come. And every number
is checked before it reaches the engine: nothing hostile becomes an overflow in a step."""
from __future__ import annotations

import logging

import pytest

from conftest import random_prompts
from workbench import Engine, SamplingParams
from workbench.executor import sampler

POISON = 777
"""A top_k (below the vocabulary, so the sampler sees it) that the patched sampler below
refuses, as a stand-in for any parameter a sampler could fail on."""


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3"]
    return Engine(model=str(path), device="cpu", block_size=16, num_kv_blocks=128,
                  max_model_len=256)


def poisoned_draw(monkeypatch):
    real = sampler._draw

    def draw(logits, d):
        if d.truncated is not None and POISON in d.truncated.top_k:
            raise OverflowError("int too big to convert (a hostile parameter)")
        return real(logits, d)
    monkeypatch.setattr(sampler, "_draw", draw)


def _ordinary(n=8):
    return ([x for x in random_prompts(n, 5, 30, 1000, seed=4)],
            [SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=100 + i,
                            ignore_eos=True) for i in range(n)])


def test_a_request_that_breaks_the_sampler_fails_alone(engine, monkeypatch, caplog):
    """Eight seeded sampled requests, and a ninth whose sampling raises mid-batch: the ninth
    ends with 'error' (the log names it and the cause), the eight give exactly the tokens
    they give without it, and the engine serves on."""
    prompts, params = _ordinary()
    alone = [o.token_ids for o in engine.generate(prompts, params)]
    poisoned_draw(monkeypatch)
    hostile = SamplingParams(max_tokens=24, temperature=0.7, top_k=POISON, ignore_eos=True)
    with caplog.at_level(logging.ERROR, logger="workbench"):
        outs = engine.generate([*prompts[:4], [7, 8, 9], *prompts[4:]],
                               [*params[:4], hostile, *params[4:]])
    assert outs[4].finish_reason == "error" and outs[4].token_ids == []
    assert [o.token_ids for o in outs[:4] + outs[5:]] == alone
    assert all(o.finish_reason == "length" for o in outs[:4] + outs[5:])
    assert any(outs[4].request_id in r.getMessage() and r.exc_info for r in caplog.records)
    assert engine.stats().kv_blocks_used == 0
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
               .token_ids) == 5


def test_a_request_whose_detokenizer_breaks_fails_alone(engine, monkeypatch):
    """A failure while handing out one request's token (its detokenizer, stop strings,
    grammar or logprobs: here on its sixth token) ends that request with 'error'; the others
    in the same steps finish."""
    from workbench.engine.output_processor import OutputProcessor
    prompts, params = _ordinary(4)
    want = [o.token_ids for o in engine.generate(prompts, params)]
    victim = [4, 4, 4, 4, 4]
    real = OutputProcessor._append_token

    def append(self, r, tok, now, lp, *rest):       # the scheduler has taken the token in
        if r.seq.prompt_token_ids == victim and r.seq.num_output_tokens == 6:
            raise UnicodeError("a detokenizer fault")
        return real(self, r, tok, now, lp, *rest)
    monkeypatch.setattr(OutputProcessor, "_append_token", append)
    outs = engine.generate([*prompts[:2], victim, *prompts[2:]], [*params[:2], params[0],
                                                                   *params[2:]])
    # The scheduler took its sixth token in (update_from_output) before handing it out
    # failed: the output holds the six it generated, and ends there.
    assert outs[2].finish_reason == "error" and len(outs[2].token_ids) == 6
    assert [o.token_ids for o in outs[:2] + outs[3:]] == want
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("field,value", [
    ("temperature", 10 ** 400), ("temperature", 1e300), ("top_p", float("nan")),
    ("top_k", 2 ** 70), ("max_tokens", 2 ** 64 + 1), ("min_tokens", 2 ** 63),
    ("presence_penalty", float("inf")), ("repetition_penalty", 10 ** 400),
    ("seed", 2 ** 64 + 1), ("stop_token_ids", [2 ** 64]), ("logit_bias", {2 ** 70: 1.0}),
    ("logit_bias", {5: 10 ** 400}), ("truncate_prompt_tokens", 2 ** 63),
])
def test_numbers_out_of_their_type_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})
