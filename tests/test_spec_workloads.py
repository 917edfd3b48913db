"""The speculative-decoding prompt sets (workbench/bench/spec_workloads.py): the same for a
seed, grounded passages of 300-600 tokens carried whole in their prompt, every task asked."""
from __future__ import annotations

import pytest

from workbench.bench.spec_workloads import (GROUNDED_TASKS, grounded_prompts, open_ended_prompts,
                                            prompt_token_ids, spec_prompts, workload)


def test_grounded_prompts_carry_a_passage_of_300_to_600_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ps = grounded_prompts(8, seed=1, tokenizer=tok)
    assert ps == grounded_prompts(8, seed=1, tokenizer=tok)
    assert [p.passage for p in ps] != [p.passage for p in grounded_prompts(8, 2, tok)]
    assert [p.task for p in ps] == [*GROUNDED_TASKS, *GROUNDED_TASKS]
    for p in ps:
        n = len(tok.encode(p.passage, add_special_tokens=False))
        assert 300 <= n <= 600, (p.source, n)
        assert p.passage in p.messages[0]["content"] and p.kind == "grounded"
        assert len(prompt_token_ids(tok, p)) > n
    assert any(p.source.endswith(".py") for p in ps) and any(p.source.endswith(".md") for p in ps)


def test_open_ended_prompts_ground_nothing():
    ps = open_ended_prompts(40, seed=3)
    assert ps == open_ended_prompts(40, seed=3) != open_ended_prompts(40, seed=4)
    assert len({p.messages[0]["content"] for p in ps}) == 40
    assert all(p.passage is None and len(p.messages[0]["content"]) < 200 for p in ps)
    assert spec_prompts("open-ended", 5, 3) == ps[:5] == spec_prompts("open", 5, 3)
    assert workload("open", None, 5, seed=3) == [p.messages for p in ps[:5]]
    with pytest.raises(ValueError, match="kind"):
        spec_prompts("closed", 1)
