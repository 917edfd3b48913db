"""The model's generation_config.json sampling defaults apply to whatever a request leaves out
(as vLLM does), unless EngineConfig.generation_config is 'none'; info(), /v1/models and the
server's requests say and use the same defaults."""
from __future__ import annotations

import json
import shutil

import pytest

from workbench import Engine, EngineConfig, SamplingParams

QWEN3_LIKE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7,
              "do_sample": True, "bos_token_id": 1}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("with-generation-config")
    shutil.copytree(tiny_checkpoints["qwen3"][0], path, dirs_exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(QWEN3_LIKE))
    return path


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine(model=str(checkpoint), device="cpu", num_kv_blocks=64, max_model_len=256)


def test_the_checkpoint_defaults_are_in_force_and_said(engine):
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    assert engine.info().generation_defaults == want
    d = engine.default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens) == (0.6, 0.95, 20, 7)
    out = engine.generate([[5, 6, 7, 8]])[0]              # no SamplingParams: the defaults
    assert len(out.token_ids) <= 7
    # An explicit SamplingParams is taken as given (vLLM's offline API does the same).
    g = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0,
                                                         ignore_eos=True))[0]
    assert len(g.token_ids) == 12


def test_none_keeps_samplingparams_own_defaults(checkpoint):
    e = Engine(model=str(checkpoint), device="cpu", num_kv_blocks=32, max_model_len=128,
               generation_config="none")
    assert e.info().generation_defaults == {}
    assert e.default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config="vllm-ish")


def test_the_server_fills_what_a_request_leaves_out(engine):
    from workbench.serving.protocol import resolve_max_tokens, sampling_params_from
    d = engine.info().generation_defaults
    p, which = sampling_params_from({"prompt": "x"}, "completion", defaults=d)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 20, None)
    resolve_max_tokens(p, which, "completion", d["max_tokens"], 1, 256)
    assert p.max_tokens == 7                        # min(16, the model's max_new_tokens)
    p, which = sampling_params_from({"prompt": "x", "temperature": 0, "top_k": -1,
                                     "max_tokens": 30}, "completion", defaults=d)
    resolve_max_tokens(p, which, "completion", d["max_tokens"], 1, 256)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0, 0.95, -1, 30)
    p, _ = sampling_params_from({"prompt": "x"}, "completion")   # no defaults
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)


def test_models_lists_the_defaults_and_their_max_tokens_caps_a_reply(engine):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from workbench.serving.app import create_app
    with TestClient(create_app(engine, allow_missing_model=True)) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["generation_defaults"] == engine.info().generation_defaults
        r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 7       # min(16, max_new_tokens)
