"""The sampling lesson's arithmetic (workbench.bench.sampling.kept) is the engine's sampler:
the tokens the real engine draws, over many seeds, are the kept set, with the kept
probabilities; and the lesson's sliders show what they compute."""
from __future__ import annotations

import math
from collections import Counter

import pytest

from workbench import Engine, SamplingParams
from workbench.bench.sampling import HEAD, NextToken, draws, kept, next_token


@pytest.fixture(scope="module")
def tiny():
    e = Engine(model="random:tiny", device="cpu", seed=0, max_num_seqs=256)
    yield e
    e.close()


@pytest.mark.parametrize("settings", [
    dict(temperature=0.3), dict(top_k=3), dict(top_p=0.5), dict(min_p=0.6),
    dict(temperature=1.7, top_k=12, top_p=0.7, min_p=0.2)])
def test_the_kept_set_is_what_the_engine_draws(tiny, settings):
    prompt = [5, 6, 7, 8]
    dist = next_token(tiny, prompt)
    assert len(dist.probs) == HEAD and dist.probs == sorted(dist.probs, reverse=True)
    q = kept(dist, **settings)
    assert math.isclose(sum(q), 1.0) and q[0] > 0            # the likeliest always stays
    n = 400
    got = Counter(draws(tiny, prompt, SamplingParams(**{"temperature": 1.0, **settings}), n=n))
    where = {t: i for i, t in enumerate(dist.token_ids)}
    assert set(got) <= {dist.token_ids[i] for i, x in enumerate(q) if x > 0}, (got, q)
    for i, x in enumerate(q):             # each kept token's share within 4.5 sigma (+1 draw)
        share = got.get(dist.token_ids[i], 0) / n
        assert abs(share - x) <= 4.5 * math.sqrt(x * (1 - x) / n) + 1 / n, (i, share, x)
    assert all(t in where for t in got)


def test_seeded_draws_repeat_and_unseeded_ones_vary(tiny):
    p = SamplingParams(temperature=1.0)
    assert draws(tiny, [5, 6, 7, 8], p, n=20, seed=3) == draws(tiny, [5, 6, 7, 8], p, n=20, seed=3)
    assert draws(tiny, [5, 6, 7, 8], p, n=20, seed=3) != draws(tiny, [5, 6, 7, 8], p, n=20, seed=50)


def test_the_rules_on_a_known_distribution():
    d = NextToken([1, 2, 3, 4, 5], list("abcde"), [0.5, 0.2, 0.1, 0.05, 0.05])
    assert kept(d, temperature=0) == [1, 0, 0, 0, 0]
    assert kept(d, top_k=2) == pytest.approx([5 / 7, 2 / 7, 0, 0, 0])
    # top-p against the kept mass (0.9): the smallest prefix reaching 0.56 x 0.9 = 0.504 is
    # the first two; 0.55 x 0.9 = 0.495 the first alone.
    assert [x > 0 for x in kept(d, top_p=0.6)] == [True, True, False, False, False]
    assert [x > 0 for x in kept(d, top_p=0.56)] == [True, True, False, False, False]
    assert [x > 0 for x in kept(d, top_p=0.55)] == [True, False, False, False, False]
    assert [x > 0 for x in kept(d, min_p=0.3)] == [True, True, False, False, False]   # 0.2/0.5
    hot, cold = kept(d, temperature=2.0), kept(d, temperature=0.5)
    assert hot[0] < 0.5 / 0.9 < cold[0]                     # flatter / sharper than T = 1


def test_the_explorer_shows_what_the_rules_keep():
    from widgets.sampling import SamplingExplorer
    d = NextToken([1, 2, 3, 4, 5], list("abcde"), [0.5, 0.2, 0.1, 0.05, 0.05])
    x = SamplingExplorer(d)
    assert "Keeps <b>5</b>" in x.summary.value and x.probs == pytest.approx(kept(d))
    x.top_k.value = 2
    assert "Keeps <b>2</b>" in x.summary.value and "70% of the model" in x.summary.value
    assert x.probs == pytest.approx([5 / 7, 2 / 7, 0, 0, 0])
    raw, drawn = x.figure.data
    assert list(drawn.y) == pytest.approx([5 / 7, 2 / 7]) and len(raw.y) == 5
    assert list(raw.marker.color).count("#c8c8c8") == 3      # the dropped tokens, grey
    x.top_k.value, x.temperature.value = 0, 0.0
    assert "Keeps <b>1</b>" in x.summary.value
