"""Graph-mode policy: capture sizes, padding and bad graph knobs (what the CPU does with the
knob is in test_graph_capture.py)."""
from __future__ import annotations

import pytest

from workbench import EngineConfig
from workbench.executor.graphs import default_capture_sizes, default_piecewise_sizes, padded_size


def test_default_capture_sizes():
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_capture_sizes(3) == [1, 2, 3]


@pytest.mark.parametrize("batch,expect", [(1, 1), (3, 4), (8, 8), (9, 16), (33, 48), (64, 64), (65, None)])
def test_padding_goes_to_the_next_captured_size(batch, expect):
    assert padded_size(batch, default_capture_sizes(64)) == expect


def test_piecewise_buckets_stop_at_512_or_the_token_budget():
    assert default_piecewise_sizes(2048) == [16, 32, 64, 128, 192, 256, 384, 512]
    assert default_piecewise_sizes(512) == [16, 32, 64, 128, 192, 256, 384, 512]
    assert default_piecewise_sizes(300) == [16, 32, 64, 128, 192, 256, 300]
    assert default_piecewise_sizes(8) == [8]
    sizes = default_piecewise_sizes(2048)
    assert [padded_size(t, sizes) for t in (1, 17, 200, 512, 513)] == [16, 32, 256, 512, None]


@pytest.mark.parametrize("kw,field", [
    (dict(graph_mode="piecewise"), "graph_mode"),
    (dict(cudagraph_capture_sizes=[0, 4]), "cudagraph_capture_sizes"),
    (dict(cudagraph_capture_sizes=[4, 128], max_num_seqs=64), "cudagraph_capture_sizes"),
])
def test_bad_graph_knobs(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)
