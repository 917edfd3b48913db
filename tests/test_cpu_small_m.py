"""A few rows through a linear layer on the CPU (csrc/cpu_ops.cpp: small_m_linear, a verify
step's k + 1 tokens or a small batch): each weight row read once for all rows. Its sums run
in another order than torch's, so it must equal F.linear to a few units in the last place
(fp32) or one bf16 unit, for every row count it takes, N and K with vector tails, with and
without a bias; CpuOps.linear takes it for the rows measured faster here (cpu_choice)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from workbench.platforms import cpu_kernels as cpu


@pytest.fixture(scope="module")
def kern():
    k = cpu.load_cpu_kernels()
    if k is None or not hasattr(k, "small_m_linear"):
        pytest.skip("no C++ compiler: the CPU kernels could not be built")
    return k


def units(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> float:
    """The largest difference in units of the last place of fp32 (2^-23) of the row's
    magnitude (the sum of |x| |w|, the scale of the rounding errors of any order of sums)."""
    return float(((got.double() - ref.double()).abs() / mag).max()) / 2 ** -23


@pytest.mark.parametrize("n,k", [(96, 64), (37, 100), (9, 33), (5, 7), (4, 576), (1, 3)])
def test_small_m_linear_equals_f_linear(kern, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for m in range(2, 17):
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            mag = x.abs().double() @ w.abs().double().T + (0 if bias is None else b.abs().double())
            # fp32: a few ulps of F.linear's (and as close to float64's as F.linear is)
            y, ref = kern.small_m_linear(x, w, bias), F.linear(x, w, bias)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert units(y, ref, mag) <= 4, (m, bias is None)
            want = x.double() @ w.double().T + (0 if bias is None else b.double())
            assert units(y, want, mag) <= 2 * units(ref, want, mag) + 2
            # bf16: fp32 sums of the exact products, one rounding after the bias: one bf16
            # unit of torch's bf16 linear at most, and mostly its bits
            xb, wb = x.bfloat16(), w.bfloat16()
            bb = None if bias is None else bias.bfloat16()
            yb, refb = kern.small_m_linear(xb, wb, bb), F.linear(xb, wb, bb)
            assert yb.dtype == torch.bfloat16 and yb.shape == (m, n)
            assert bool(((yb.float() - refb.float()).abs() <= 2 ** -7 * refb.float().abs()).all())
            assert float((yb != refb).float().mean()) <= 0.05


def test_small_m_linear_refuses_what_it_does_not_take(kern):
    w = torch.randn(8, 16)
    for x, what in ((torch.randn(17, 16), "rows"), (torch.randn(0, 16), "rows"),
                    (torch.randn(3, 15), "shapes")):
        with pytest.raises(RuntimeError, match=what):
            kern.small_m_linear(x, w, None)
    with pytest.raises(RuntimeError, match="mixed dtypes"):
        kern.small_m_linear(torch.randn(3, 16).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        kern.small_m_linear(torch.randn(3, 16), w, torch.randn(7))


def test_cpu_ops_takes_it_for_the_rows_measured_faster(kern):
    from workbench.platforms.cpu_ops import CpuOps, small_m_rows
    ops = CpuOps()
    w, b = torch.randn(40, 24), torch.randn(40)
    for dt in (torch.float32, torch.bfloat16):
        most = small_m_rows(dt)
        assert most in (0, 2, 4, 8, 16)
        for m in (2, 5, 16, 17):
            x = torch.randn(m, 24).to(dt)
            want = kern.small_m_linear(x, w.to(dt), b.to(dt)) if m <= most else \
                ops.batched_linear(x, w.to(dt), b.to(dt))
            assert torch.equal(ops.linear(x, w.to(dt), b.to(dt)), want), (dt, m, most)


def test_fp32_batched_linear_is_the_measured_path_and_f_linears_numbers(kern):
    """fp32 past small_m's rows: oneDNN on the weight packed once where the build measured it
    faster than F.linear (cpu_choice 'onednn'), F.linear where not; oneDNN sums in another
    order, so to a few units in the last place of F.linear's, for batches and prefill
    chunks, with and without a bias; the packing is made once and kept."""
    from workbench.platforms import cpu_ops
    ops = cpu_ops.CpuOps()
    cpu_ops.small_m_rows(torch.float32)                      # the build's choice, measured
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(200, 72, generator=g), torch.randn(200, generator=g)
    for m in (17, 32, 100, 300):
        x = torch.randn(m, 72, generator=g)
        for bias in (None, b):
            y, ref = ops.batched_linear(x, w, bias), F.linear(x, w, bias)
            mag = x.abs().double() @ w.abs().double().T + (0 if bias is None else b.abs().double())
            assert units(y, ref, mag) <= 4, (m, bias is None)
            if not cpu_ops.onednn_fp32():
                assert torch.equal(y, ref)
    key = (id(w), torch.float32)
    assert (key in ops._onednn) == cpu_ops.onednn_fp32()
    if cpu_ops.onednn_fp32():
        packed = ops._onednn[key][1]
        ops.batched_linear(torch.randn(40, 72), w)
        assert ops._onednn[key][1] is packed                 # packed once, not per call


def test_the_choice_is_measured_once_per_build_and_kept(kern, tmp_path):
    from workbench.platforms import cpu_choice
    rows = cpu_choice.small_m_rows(tmp_path, kern, reps=1)
    kept = json.loads((tmp_path / cpu_choice.SMALL_M_FILE).read_text())
    assert kept["rows"] == rows and set(rows) == {"float32", "bfloat16", "packed", "onednn"}
    us = kept["us"]
    # fp32's batched linear: oneDNN on prepacked weights where faster than F.linear at every
    # count of ONEDNN_M (a torch with oneDNN times both at every count)
    if "float32 32 onednn" in us:
        assert rows["onednn"] == all(us[f"float32 {m} onednn"] < us[f"float32 {m} torch"]
                                     for m in cpu_choice.ONEDNN_M)
    else:
        assert rows["onednn"] == 0
    for dt in ("float32", "bfloat16"):                 # the rule: faster at every count to it
        most = rows[dt]
        batched = "onednn" if dt == "float32" and rows["onednn"] else "torch"
        for m in cpu_choice.SMALL_M:
            faster = us[f"{dt} {m} small_m"] < us[f"{dt} {m} {batched}"]
            if m <= most:
                assert faster
            elif m == min(c for c in cpu_choice.SMALL_M if c > most):
                assert not faster
    if "q4_1 32 packed" in kept["us"]:                 # packed rows: the same rule from 16
        for m in cpu_choice.PACKED_M:
            faster = kept["us"][f"q4_1 {m} packed"] < kept["us"][f"q4_1 {m} slices"]
            if m <= rows["packed"]:
                assert faster
            elif m == min(c for c in cpu_choice.PACKED_M if c > rows["packed"]):
                assert not faster
    else:
        assert rows["packed"] == 16
    from workbench.platforms.cpu import few_rows_line  # what `workbench doctor` says of it
    line = few_rows_line(tmp_path)
    assert f"float32 up to {rows['float32']}" in line
    assert f"packed weights stay packed up to {rows['packed']} rows" in line
    kept["rows"] = {"float32": 4, "bfloat16": 0, "onednn": 0}   # read back, not measured again
    (tmp_path / cpu_choice.SMALL_M_FILE).write_text(json.dumps(kept))
    assert cpu_choice.small_m_rows(tmp_path, kern) == kept["rows"]


def test_a_onednn_that_packs_but_cannot_multiply_fp32_leaves_f_linear(kern, tmp_path,
                                                                        monkeypatch):
    """The build's choice tries oneDNN's fp32 product once before timing it: a torch whose
    oneDNN packs fp32 weights but fails to multiply them keeps fp32 on F.linear."""
    from workbench.platforms import cpu_choice
    real = torch.ops.mkldnn

    class Ops:                                   # torch.ops.mkldnn, failing fp32 products
        _reorder_linear_weight = staticmethod(real._reorder_linear_weight)
        _is_mkldnn_bf16_supported = staticmethod(real._is_mkldnn_bf16_supported)

        @staticmethod
        def _linear_pointwise(x, *a):
            if x.dtype == torch.float32:
                raise RuntimeError("no fp32 matmul here")
            return real._linear_pointwise(x, *a)
    monkeypatch.setattr(torch.ops, "mkldnn", Ops)
    rows = cpu_choice.small_m_rows(tmp_path, kern, reps=1)
    assert rows["onednn"] == 0
    assert not any("onednn" in key for key in
                   json.loads((tmp_path / cpu_choice.SMALL_M_FILE).read_text())["us"])


def test_sliced_rows_through_onednn_or_torchs_gemm_give_the_formats_numbers(kern):
    """Past the packed rows, a packed weight is dequantized a slice at a time and each slice
    multiplied by fp32's batched choice (set_onednn_slices: oneDNN, or torch's GEMM): either
    way the dequantized weight's product to a few units in the last place."""
    from workbench.platforms.quant import quantize_int8
    if not hasattr(kern, "set_onednn_slices"):
        pytest.skip("a kernel without the choice")
    g = torch.Generator().manual_seed(3)
    w = quantize_int8(torch.randn(700, 96, generator=g))      # several slices' rows
    x = torch.randn(300, 96, generator=g)
    ref = F.linear(x, w.dequantize(torch.float32))
    mag = x.abs().double() @ w.dequantize(torch.float32).abs().double().T
    rows, slices = kern.set_packed_rows(1), kern.set_onednn_slices(False)
    try:
        for on in (False, True):
            kern.set_onednn_slices(on)
            assert units(kern.qlinear(x, w.data, w.code), ref, mag) <= 4, on
    finally:
        kern.set_packed_rows(rows)
        kern.set_onednn_slices(slices)


def test_onednn_sees_a_bounded_set_of_row_counts(monkeypatch):
    """torch's oneDNN linear builds and caches a primitive for every row count it is called
    with, so onednn_linear calls it in blocks of ONEDNN_BLOCK rows, each of a bounded set of
    counts (the rest zeros, cut off): every count from 1 to 2048 rows gives the unblocked
    product to a few units in the last place, through 31 counts in all."""
    from workbench.platforms import cpu_onednn
    packed = cpu_onednn.onednn_packed([torch.randn(40, 24)])
    if packed is None:
        pytest.skip("torch without oneDNN")
    w = torch.randn(40, 24)
    (p,) = cpu_onednn.onednn_packed([w])
    seen = set()
    real = torch.ops.mkldnn._linear_pointwise

    class Ops:                                   # torch.ops.mkldnn, counting the rows
        @staticmethod
        def _linear_pointwise(x, *a):
            seen.add(x.shape[0])
            return real(x, *a)
    monkeypatch.setattr(torch.ops, "mkldnn", Ops)
    g = torch.Generator().manual_seed(5)
    b = torch.randn(40, generator=g)
    for m in (*range(0, 300), 511, 512, 700, 2048):        # 0: a step with no rows here
        x = torch.randn(m, 24, generator=g)
        y, ref = cpu_onednn.onednn_linear(x, p, b), F.linear(x, w, b)
        mag = x.abs().double() @ w.abs().double().T + b.abs().double()
        assert y.shape == (m, 40) and (m == 0 or units(y, ref, mag) <= 4), m
    assert max(seen) == cpu_onednn.ONEDNN_BLOCK and len(seen - {0}) == 31, sorted(seen)


def test_available_memory_is_what_the_machine_says():
    from workbench.platforms.cpu_onednn import available_memory
    free = available_memory()
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert free is not None and 0 < free <= total


def test_available_memory_off_linux_is_psutils(monkeypatch):
    """Without /proc/meminfo and cgroup files (macOS), psutil's figure."""
    import builtins

    psutil = pytest.importorskip("psutil")
    from workbench.platforms.cpu_onednn import available_memory
    real_open = builtins.open

    def no_proc(path, *a, **kw):
        if str(path).startswith(("/proc/", "/sys/")):
            raise FileNotFoundError(path)
        return real_open(path, *a, **kw)
    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 5 << 30}))
    assert available_memory() == 5 << 30


def test_packed_copies_are_kept_only_where_they_fit(kern, monkeypatch):
    """CpuOps.prepare keeps oneDNN's packed copies of a model's linear weights only where
    they take at most PACK_SHARE of the memory free, less what other live models here will
    still pack; else it says so, and its batched linears take F.linear's path, packing
    nothing. Where it keeps them and the kernel is loaded, it packs them then."""
    from torch import nn

    from workbench.platforms import cpu_onednn, cpu_ops

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(48, 40), nn.Linear(40, 48, bias=False)
            self.embed_tokens, self.tie_word_embeddings = nn.Embedding(100, 48), True

    if cpu_onednn.onednn_packed([torch.randn(4, 4)]) is None:
        pytest.skip("torch without oneDNN")
    model = Model()
    need = (48 * 40 + 40 * 48 + 100 * 48) * 4                 # fp32's bytes, the LM head too
    cpu_ops.small_m_rows(torch.float32)
    monkeypatch.setattr(cpu_ops, "onednn_fp32", lambda: True)  # (a CPU where oneDNN won)
    assert sum(map(cpu_onednn.packed_bytes, cpu_onednn.linear_weights(model))) == need
    monkeypatch.setattr(cpu_ops, "_LIVE", __import__("weakref").WeakSet())
    made = [cpu_ops.CpuOps() for _ in range(3)]
    monkeypatch.setattr(cpu_ops, "available_memory", lambda: 3 * need - sum(
        cpu_onednn.packed_bytes(w) for o in made for w, _ in o._onednn.values()))
    for ops in made:
        ops.prepare(model, None)
    # 3 x need free: the first fits in half; the second in half of what the first took or
    # will take (2 x need); the third has need / 2 and does not.
    first, _, third = made
    assert [o.packing for o in made] == [True, True, False]
    assert first.notices() == [] and len(third.notices()) == 1
    assert "unpacked" in third.notices()[0] and "GiB" in third.notices()[0]
    assert (len(first._onednn), first._pending) == (3, 0)
    x = torch.randn(64, 48)
    assert torch.equal(third.batched_linear(x, model.a.weight, model.a.bias),
                       F.linear(x, model.a.weight, model.a.bias))
    assert third._onednn == {}
    # Where the build chose F.linear for fp32 nothing is packed, whatever the memory.
    monkeypatch.setattr(cpu_ops, "onednn_fp32", lambda: False)
    monkeypatch.setattr(cpu_ops, "available_memory", lambda: 0)
    ops = cpu_ops.CpuOps()
    ops.prepare(model, None)
    assert ops.packing and ops.notices() == [] and ops._onednn == {}


def test_an_engine_too_large_to_pack_says_so_and_serves_the_same_tokens(kern, monkeypatch):
    """An engine packs its weights as it loads where they fit; one told that they do not
    fit says so and gives the same greedy tokens unpacked."""
    from workbench import Engine, SamplingParams
    from workbench.platforms import cpu_ops
    prompts = [[(7 * j) % 250 + 1 for j in range(40)], [3, 1, 4, 1, 5]]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(model="random:tiny", device="cpu", num_kv_blocks=32, quantization=None)
    ref = Engine(**kw, attention_backend="reference")
    want = [o.token_ids for o in ref.generate(prompts, p)]
    roomy = Engine(**kw)                    # packed as it loads, where oneDNN runs fp32 here
    assert bool(roomy.core.model.ops._onednn) == cpu_ops.onednn_fp32()
    assert [o.token_ids for o in roomy.generate(prompts, p)] == want
    monkeypatch.setattr(cpu_ops, "available_memory", lambda: 1 << 10)
    monkeypatch.setattr(cpu_ops, "onednn_fp32", lambda: True)     # (a CPU where oneDNN won)
    e = Engine(**kw)
    assert any("batched linears unpacked" in n for n in e.telemetry.notices), e.telemetry.notices
    assert [o.token_ids for o in e.generate(prompts, p)] == want
    assert e.core.model.ops._onednn == {}


def test_doctor_says_what_the_memory_free_allows(monkeypatch):
    from workbench.platforms import cpu, cpu_onednn
    monkeypatch.setattr(cpu_onednn, "available_memory", lambda: 8 << 30)
    line = cpu.memory_line()
    assert "8.0 GiB free now" in line and f"fits in {8 * cpu_onednn.PACK_SHARE:.1f} GiB" in line
    monkeypatch.setattr(cpu_onednn, "available_memory", lambda: None)
    assert "not known" in cpu.memory_line()
