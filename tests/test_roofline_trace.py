"""The roofline's FLOP/byte model (a hand-computed step), the device probe's cache, and the
trace format (round trip, a damaged file, a foreign file, another version)."""
from __future__ import annotations

import gzip
import json

import pytest

from workbench.config import EngineConfig
from workbench.roofline import DeviceRoofs, probe_roofs, roofline_points, step_cost
from workbench.telemetry import EngineInfo, StepEvent
from workbench.trace import FORMAT, VERSION, Trace, TraceError

# A 2-layer model, hidden 4, 2 query heads and 1 KV head of 2 dims, MLP 8, vocab 10, 2-byte
# weights. One layer's matmuls: qkv 4×(4+2+2) = 32, o 4×4 = 16, gate/up/down 3×4×8 = 96 -> 144.
SHAPE = EngineInfo(
    model="hand", model_path=None, device="cpu", device_name="by hand", dtype="bfloat16",
    max_model_len=64, block_size=16, num_kv_blocks=8, kv_bytes_per_block=16 * 16,
    graph_mode="eager", capture_sizes=(), piecewise_sizes=(), attention="reference",
    ops="torch", async_scheduling=False, vocab_size=10, num_params=2 * 144 + 40,
    num_layer_params=2 * 144, num_layers=2, hidden_size=4, intermediate_size=8,
    num_attention_heads=2, num_kv_heads=1, head_dim=2,
    weight_bytes=(2 * 144 + 40) * 2,          # the layers and the (untied) LM head
    kv_bytes_per_token=2 * 2 * 1 * 2 * 2,     # K and V × 2 layers × 1 head × 2 dims × 2 bytes
    config=EngineConfig(model="hand"))


def event(**kw) -> StepEvent:
    base = dict(step=7, start=0.0, duration=0.5, phase="mixed", num_prefill_tokens=3,
                num_decode_tokens=1, num_cached_tokens=0,
                tokens_per_request={"a": 3, "b": 1}, kinds={"a": "prefill", "b": "decode"},
                num_running=2, num_waiting=0, kv_blocks_used=2, kv_blocks_free=6,
                kv_blocks_cached=0, num_preempted=0, preempted=[], context_lens={"a": 0, "b": 5})
    base.update(kw)
    return StepEvent(**base)


def test_step_cost_by_hand():
    c = step_cost(event(), SHAPE)
    # Matmuls: 2 FLOPs × 4 tokens × 2 layers × 144 = 2304. LM head (4×10) for the 2 rows that
    # sample: 2 × 2 × 40 = 160. Attention: a scores 0·3 + 3·4/2 = 6 pairs, b 1·5 + 1 = 6;
    # 4 × 2 layers × 2 heads × 2 head_dim × 12 pairs = 384.
    assert c.flops == 2304 + 160 + 384
    # Weights: (2 × 144 + 40) × 2 bytes = 656. KV: a reads 3 tokens, b 6; per token K and V
    # of 2 layers × 1 head × 2 dims × 2 bytes = 16 -> 144.
    assert (c.weight_bytes, c.kv_bytes) == (656, 144)
    assert c.intensity == pytest.approx(2848 / 800)
    # A prompt chunk that does not end its prompt samples nothing: no LM head row.
    chunk = step_cost(event(kinds={"a": "chunk", "b": "decode"}), SHAPE)
    assert c.flops - chunk.flops == 2 * 40


def test_decode_is_less_intense_than_prefill_and_points_say_so():
    decode = event(step=1, tokens_per_request={"a": 1}, kinds={"a": "decode"},
                   context_lens={"a": 20}, phase="decode")
    prefill = event(step=0, tokens_per_request={"a": 512}, kinds={"a": "prefill"},
                    context_lens={"a": 0}, phase="prefill")
    idle = event(step=2, tokens_per_request={}, kinds={}, context_lens={}, phase="idle")
    pts = roofline_points([prefill, decode, idle], SHAPE)
    assert [p.step for p in pts] == [0, 1]
    assert pts[0].intensity > 50 * pts[1].intensity
    assert pts[1].flops_per_s == pytest.approx(step_cost(decode, SHAPE).flops / 0.5)
    roofs = DeviceRoofs("x", "float32", peak_flops=100.0, bandwidth=10.0)
    assert roofs.balance == 10.0
    assert roofs.attainable(1.0) == 10.0 and roofs.attainable(1000.0) == 100.0


def test_probe_is_measured_once_then_cached(tmp_path, monkeypatch):
    import torch

    from workbench.platforms import get_platform
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    cpu = get_platform("cpu")
    first = probe_roofs(cpu, torch.float32)
    assert first.peak_flops > 1e8 and first.bandwidth > 1e8      # any CPU of this decade
    files = list((tmp_path / "roofline").glob("*.json"))
    assert len(files) == 1
    assert probe_roofs(cpu, torch.float32) == first             # read back, not measured
    files[0].write_text("{ not json")                            # damaged: measured again
    again = probe_roofs(cpu, torch.float32)
    assert again != first and json.loads(files[0].read_text())["peak_flops"] == again.peak_flops


def small_trace() -> Trace:
    from workbench.core.block_manager import KVBlockSnapshot
    from workbench.engine import RequestState, TokenEvent
    from workbench.trace import TraceFrame
    states = [RequestState("a", "running", 3, 1, 3, 0, 0, [0], "Hi")]
    tok = TokenEvent("a", 42, "Hi", 1, 0.5)
    kv = KVBlockSnapshot(4, 16, [1, 0, 0, 0], [False] * 4, {"a": [0]}, step=0)
    return Trace(SHAPE, [TraceFrame(event(step=0), [tok], states, kv),
                                   TraceFrame(event(step=1, start=0.5), [], [], None)],
                 prompts={"a": "hello"},
                 roofs=DeviceRoofs("x", "float32", 1e9, 1e8))


@pytest.mark.parametrize("name", ["t.json.gz", "t.json"])
def test_trace_round_trip(tmp_path, name):
    t = small_trace()
    back = Trace.load(t.save(tmp_path / name))
    assert back.to_dict() == t.to_dict()
    assert back.frames[0].tokens[0].text == "Hi" and back.frames[0].kv.block_tables == {"a": [0]}
    assert back.info == SHAPE and back.duration == pytest.approx(1.0)


def test_trace_bad_foreign_and_wrong_version(tmp_path):
    bad = tmp_path / "bad.gz"
    bad.write_bytes(b"\x1f\x8b" + b"garbage")
    with pytest.raises(TraceError, match="not a workbench trace"):
        Trace.load(bad)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"steps": [], "requests": []}))   # telemetry JSON, say
    with pytest.raises(TraceError, match="format tag is None"):
        Trace.load(foreign)
    d = small_trace().to_dict()
    newer = tmp_path / "newer.json.gz"
    newer.write_bytes(gzip.compress(json.dumps({**d, "version": VERSION + 1}).encode()))
    with pytest.raises(TraceError, match="newer than.*upgrade"):
        Trace.load(newer)
    d["frames"][0]["step"].pop("phase")
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(d))
    with pytest.raises(TraceError, match="damaged"):
        Trace.load(damaged)
    with pytest.raises(TraceError, match="cannot read"):
        Trace.load(tmp_path / "absent.json")
    assert d["format"] == FORMAT


def test_a_trace_names_no_local_path_and_old_ones_still_load(tmp_path):
    """Traces recorded before model_sha256 kept the recording machine's absolute path in
    info.model_path (and a checkpoint directory's in info.model): they load, without it, and
    saving names the directory by its last component only."""
    from dataclasses import replace
    d = small_trace().to_dict()
    assert "model_sha256" in d and d["info"]["model_path"] is None
    old = json.loads(json.dumps(d))
    for key in ("model_sha256", "calibration"):           # what older files do not have
        del old[key]
    old["info"]["model_path"] = "/home/alice/.cache/workbench/smollm2-135m-instruct-0123"
    old["info"]["model"] = old["info"]["config"]["model"] = "/home/alice/models/Qwen3-0.6B"
    f = tmp_path / "old.trace.json.gz"
    f.write_bytes(gzip.compress(json.dumps(old).encode()))
    t = Trace.load(f)
    assert t.info.model_path is None and t.model_sha256 is None and t.calibration is None
    assert t.info.model == t.info.config.model == "Qwen3-0.6B"
    assert t.frames[0].tokens[0].text == "Hi"
    assert "alice" not in gzip.decompress(t.save(tmp_path / "again.trace.json.gz")
                                          .read_bytes()).decode()
    # Made by hand with a path, a trace drops it too; the embedded and random names stay.
    assert Trace(replace(SHAPE, model_path="/x/y"), []).info.model_path is None
    assert Trace(replace(SHAPE, model="random:tiny"), []).info.model == "random:tiny"


def test_batch1_tpot_is_the_longest_lone_decode_stretch():
    from workbench.engine import TokenEvent
    from workbench.trace import TraceFrame

    def frame(i, t, rids, phase="decode"):
        kinds = {r: phase for r in rids}
        return TraceFrame(event(step=i, start=t, duration=0.01, phase=phase,
                                num_prefill_tokens=0, num_decode_tokens=len(rids),
                                tokens_per_request={r: 1 for r in rids}, kinds=kinds),
                          [TokenEvent(r, 1, "x", 1, t) for r in rids])
    frames = [frame(0, 0.0, ["a", "b"]), frame(1, 0.1, ["a"]), frame(2, 0.3, ["a"]),
              frame(3, 0.4, ["a", "b"]),                       # b back: the stretch ends
              frame(4, 1.0, ["b"]), frame(5, 1.05, ["b"]), frame(6, 1.1, ["b"]),
              frame(7, 1.15, ["b"])]
    t = Trace(SHAPE, frames)
    tpot, n = t.batch1_tpot()
    assert n == 4 and tpot == pytest.approx(0.05)
    assert Trace(SHAPE, frames[:1]).batch1_tpot() is None


def test_check_steps_names_each_step_off_its_kinds_calibration(tmp_path):
    from dataclasses import replace

    from workbench.trace import check_steps, step_kind
    t = small_trace()                        # two steps of one kind, 0.5 s each
    samples = {step_kind(t.frames[0].step): [0.4, 0.5, 0.9]}
    cal, off = check_steps(t, samples, 2.0, 3, [0.5, 0.25, 0.125])
    assert off == []
    assert (cal.min_ratio, cal.max_ratio, cal.factor, cal.repeats) == (1.0, 1.0, 2.0, 3)
    st = cal.step_times[0]
    assert (st.phase, st.num_prefill_tokens, st.num_decode_tokens) == ("mixed", 3, 1)
    assert (st.median_s, st.min_s, st.samples) == (0.5, 0.4, 3)
    t.frames[1].step = replace(t.frames[1].step, duration=1.2)        # 2.4x the median
    t.frames[0].step = replace(t.frames[0].step, duration=0.2)        # 0.4x: too fast is off too
    cal, off = check_steps(t, samples, 2.0, 3, [0.5, 0.25, 0.125])
    assert len(off) == 2 and "step 1 (mixed, 3 prefill + 1 decode tokens)" in off[1]
    assert "1200.0 ms, 2.40x the calibration's 500.0 ms" in off[1] and "0.40x" in off[0]
    assert cal.max_ratio == pytest.approx(2.4) and cal.min_ratio == pytest.approx(0.4)
    _, off = check_steps(t, {("decode", 0, 8): [0.1]}, 2.0, 1, [0.0] * 3)
    assert len(off) == 2 and all("no step of this kind" in line for line in off)
    with pytest.raises(ValueError, match="factor"):
        check_steps(t, samples, 1.0, 3, [0.0] * 3)
    # What it was checked against travels with the trace.
    t.calibration = cal
    back = Trace.load(t.save(tmp_path / "t.json.gz"))
    assert back.calibration == cal and back.to_dict() == t.to_dict()
