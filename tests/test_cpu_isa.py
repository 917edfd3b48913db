"""The CPU engine on the CPUs people have (issue 44): a kernel that cannot be built, other
systems' CPU identity and flags, 'auto' deciding by a measurement, packed weights on the
plain-torch path, and the kernels' portable paths against the float64 reference, built for
other ISAs than this machine's, compiled for Arm, and run there under qemu-aarch64."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import background

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "workbench" / "platforms" / "csrc"


def run(code: str, env: dict, timeout: float = 300) -> str:
    """A fresh Python process running `code` (its own session; killed whole on timeout)."""
    env = {k: v for k, v in {**os.environ, "PYTHONPATH": str(ROOT), **env}.items()
           if v is not None}                                   # None: not set there
    proc = background.spawn([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out = proc.communicate()[0]
        pytest.fail(f"did not finish in {timeout} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


# --- a kernel that cannot be built -------------------------------------------------------

FAILED_START = """
import json, logging, time
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
from workbench import Engine, SamplingParams
from workbench.platforms import cpu_kernels as cpu
import torch.utils.cpp_extension as ext
calls = []
real = ext.load
ext.load = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
auto = Engine(model="random:tiny", device="cpu", num_kv_blocks=32)
deadline = time.monotonic() + 240
while cpu.kernels() is None and not cpu.build_failed() and time.monotonic() < deadline:
    time.sleep(0.2)                   # a first start: the detached build fails meanwhile
again = Engine(model="random:tiny", device="cpu", num_kv_blocks=32)
int8 = Engine(model="random:tiny", device="cpu", num_kv_blocks=32, quantization="int8")
ref = Engine(model="random:tiny", device="cpu", num_kv_blocks=32, quantization="int8",
             attention_backend="reference")
p = SamplingParams(max_tokens=8, temperature=0)
print("RESULT", json.dumps(dict(
    builds_here=len(calls), failed=cpu.build_failed(), state=cpu.kernel_state(),
    record=cpu.failure(), info=[e.info().kernels for e in (auto, again)],
    quant=[auto.info().quantization, again.info().quantization, int8.info().quantization],
    notices=again.telemetry.notices, int8_notices=int8.telemetry.notices,
    same=[o.token_ids for o in int8.generate([[1, 2, 3], [4, 5]], p)] ==
         [o.token_ids for o in ref.generate([[1, 2, 3], [4, 5]], p)])), flush=True)
"""


@background.job
def failed_cache():
    """A cache where the kernel build fails (CXX names no compiler): a first process (whose
    detached build fails), then a second one (a background job: tests/background.py)."""
    cache = background.tmpdir("nocompiler")
    env = {"WORKBENCH_CACHE": str(cache), "CXX": "/nonexistent"}
    first = run(FAILED_START, env, 600)
    second = run(FAILED_START, env, 600)
    return cache, env, [json.loads(o.split("RESULT ")[-1]) for o in (first, second)], second


def test_a_failed_build_is_recorded_with_its_log(failed_cache):
    cache, _, (first, second), _ = failed_cache
    rec = first["record"]
    assert rec is not None and "/nonexistent" in rec["error"] and "not found" in rec["error"]
    assert "FAILED" in rec["log_tail"] and rec["compiler"].startswith("/nonexistent")
    folders = list((cache / "kernels").iterdir())
    assert len(folders) == 1 and (folders[0] / "failed").is_file()
    assert not (folders[0] / "built").exists()
    for r in (first, second):
        assert r["failed"] and r["state"].startswith("failed: ")
        assert all(i.startswith("failed: ") for i in r["info"][1:])


def test_a_failed_build_is_not_retried_and_said_once(failed_cache):
    _, _, (first, second), second_out = failed_cache
    assert second["builds_here"] == 0            # the record stops it: no compiler call
    assert second_out.count("LOG CPU kernel unavailable") == 1
    assert "building the CPU" not in second_out
    assert all(i.startswith("failed: ") for i in second["info"])
    assert any("CPU kernel unavailable" in n for n in second["notices"])


def test_a_failed_build_serves_the_fastest_torch_path(failed_cache):
    """'auto' is the plain weights there; a packed format asked for runs dequantized once
    (the reference's numbers: greedy tokens equal) and says what it costs."""
    for r in failed_cache[2]:
        assert r["quant"][:2] == [None, None] and r["quant"][2] == "int8"
        assert r["same"]
        assert any("dequantized once" in n for n in r["int8_notices"])


def test_a_new_compiler_retries_the_build(failed_cache, tmp_path):
    """The record is keyed like the kernel: another compiler is another key."""
    cache, env, _, _ = failed_cache
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'g++ (Other) 99.1'\nexit 1\n")
    fake.chmod(0o755)
    out = run("from workbench.platforms import cpu_kernels as c; "
              "print('STATE', c.kernel_state(), c.build_failed())",
              {**env, "CXX": str(fake)}, 60)
    assert "STATE not built False" in out


def test_doctor_says_why_the_build_failed(failed_cache):
    _, env, _, _ = failed_cache
    out = subprocess.run([sys.executable, "-m", "workbench.cli", "doctor", "--device", "cpu"],
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "kernel         failed: " in out.stdout and "log tail:" in out.stdout
    assert "/nonexistent: not found" in out.stdout and "fix" in out.stdout


# --- other systems -------------------------------------------------------------------------

GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg \
dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""


def test_an_arm_cpu_is_identified_by_its_features_and_part():
    from workbench.platforms import cpu_kernels as cpu
    ident = cpu.cpu_identity(GRAVITON)
    assert ident["CPU part"] == "0xd40" and ident["CPU implementer"] == "0x41"
    assert {"asimd", "sve", "bf16"} <= cpu.isa_flags(GRAVITON)
    other = cpu.cpu_identity(GRAVITON.replace("0xd40", "0xd4f"))
    assert other != ident          # a Neoverse V2 is not a V1: another kernel key


def test_the_kernel_key_carries_the_cpu(monkeypatch):
    from workbench.platforms import cpu_kernels as cpu
    key = cpu.kernel_key()
    graviton = cpu.cpu_identity(GRAVITON)
    monkeypatch.setattr(cpu, "cpu_identity", lambda cpuinfo=None: graviton)
    assert cpu.kernel_key() != key


def test_macos_has_no_sched_getaffinity(monkeypatch):
    from workbench.platforms.cpu import CpuPlatform
    monkeypatch.delattr(os, "sched_getaffinity")
    assert CpuPlatform().device_name().endswith(f"{os.cpu_count()} cores")


def test_apple_clang_takes_openmp_through_the_preprocessor():
    from workbench.platforms import cpu_kernels as cpu
    flags = cpu.cflags("Darwin", "arm64")
    assert "-fopenmp" in flags and flags[flags.index("-fopenmp") - 1] == "-Xpreprocessor"
    assert not any(f.startswith("-march") for f in flags)
    assert "-lomp" in cpu.ldflags("Darwin") and cpu.ldflags("Linux") == []
    assert "-march=native" in cpu.cflags("Linux", "aarch64")


def test_onednn_bf16_needs_native_bf16_in_the_flags(monkeypatch):
    from workbench.platforms import cpu_kernels, cpu_onednn
    monkeypatch.setattr(cpu_onednn, "_onednn_bf16", None)
    monkeypatch.setattr(cpu_kernels, "isa_flags", lambda: {"avx2", "avx512f", "avx512bw"})
    assert cpu_onednn.onednn_bf16() is False
    monkeypatch.setattr(cpu_onednn, "_onednn_bf16", None)


def test_onednn_bf16_follows_onednns_isa_cap(monkeypatch):
    """ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 (how an Ice Lake is reproduced on a newer
    CPU) leaves oneDNN without native bf16, whatever the CPU's flags say."""
    from workbench.platforms import cpu_onednn
    assert cpu_onednn.onednn_isa_has_bf16(None) and cpu_onednn.onednn_isa_has_bf16("all")
    assert cpu_onednn.onednn_isa_has_bf16("AVX512_CORE_BF16")
    assert cpu_onednn.onednn_isa_has_bf16("avx512_core_amx")
    assert not cpu_onednn.onednn_isa_has_bf16("AVX512_CORE_VNNI")
    assert not cpu_onednn.onednn_isa_has_bf16("avx2")
    monkeypatch.setattr(cpu_onednn, "_onednn_bf16", None)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    assert cpu_onednn.onednn_bf16() is False
    monkeypatch.setattr(cpu_onednn, "_onednn_bf16", None)


def test_the_onednn_packing_is_the_ops_objects_state(monkeypatch):
    """A bf16 weight is packed into oneDNN's layout once, at its first batched use, and the
    packing is held by the model's ops object, not hung on the weight tensor. (This CPU may
    have no native bf16: oneDNN's two ops are stood in for by their meaning, a copy and a
    linear layer; what is checked is who holds what.)"""
    from workbench.platforms import cpu_kernels, cpu_ops
    packs = []

    def reorder(w, rows):
        packs.append(w)
        return w.clone()
    monkeypatch.setattr(cpu_ops, "onednn_bf16", lambda: True)
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", reorder)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, w, b, *a: torch.nn.functional.linear(x, w, b))
    w = torch.randn(16, 8).bfloat16()
    x = torch.randn(4, 8).bfloat16()
    ops = cpu_ops.CpuOps()
    for _ in range(3):
        assert torch.equal(ops.linear(x, w), torch.nn.functional.linear(x, w))
    assert len(packs) == 1 and ops._onednn[id(w), torch.bfloat16][0] is w
    assert not hasattr(w, "_onednn_packed")
    other = cpu_ops.CpuOps()                        # another model's ops packs its own
    other.linear(x, w)
    assert len(packs) == 2 and id(w) not in cpu_ops.CpuOps()._onednn


# --- auto by measurement -------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_auto_picks_the_measured_fastest_and_keeps_it(tmp_path):
    from workbench.platforms import cpu_choice
    clock, calls = FakeClock(), []
    cost = {"fp32": 5e-4, "q4_1": 3e-4, "bf16": 2e-4, "bf16c": 4e-4}

    def runner(fmt):
        def call():
            calls.append(fmt)
            clock.now += cost[fmt]
        return [call, call]
    figures = cpu_choice.measured(tmp_path, timer=clock,
                                  runners={f: runner(f) for f in cost})
    assert figures == {"fp32": 1000.0, "q4_1": 600.0, "bf16": 400.0, "bf16c": 800.0}
    assert cpu_choice.pick(figures, torch.float32, "gguf")[0] == "gguf"
    assert cpu_choice.pick(figures, torch.float32, None)[0] is None
    q, why = cpu_choice.pick(figures, torch.bfloat16, None)
    assert q is None and "bf16 400 µs" in why and "bf16c 800 µs" in why
    n = len(calls)
    again = cpu_choice.measured(tmp_path, timer=clock, runners={f: runner(f) for f in cost})
    assert again == figures and len(calls) == n          # kept with the build, not re-run
    cost["q4_1"] = 9e-4                                    # a slower q4_1: fp32 wins
    (tmp_path / "other").mkdir()
    slower = cpu_choice.measured(tmp_path / "other", timer=clock,
                                 runners={f: runner(f) for f in cost})
    assert cpu_choice.pick(slower, torch.float32, "gguf")[0] is None
    note = cpu_choice.cost(slower, "gguf", torch.float32)
    assert "1800 µs against fp32's 1000 µs" in note
    assert cpu_choice.cost(figures, "gguf", torch.float32) is None
    assert "dtype='bfloat16'" not in (cpu_choice.cost(figures, None, torch.bfloat16) or "")


def test_auto_ranks_the_formats_on_the_engines_threads_where_they_run_in_parallel(
        tmp_path, monkeypatch):
    """On one thread an AVX2 build's fp32 GEMV beat q4_1's, while on the engine's two a q4_1
    step took 0.66x fp32's (fp32's threads share the memory bandwidth, q4_1's divide the
    arithmetic): the threaded figures decide where the threads run in parallel; where they
    do not (a machine whose cores are busy: the threaded figures are wake-ups), the
    one-thread figures."""
    from workbench.platforms import cpu_choice
    clock = FakeClock()

    def runners(one: dict[str, float], many: dict[str, float]):
        def call(fmt):
            def run():
                clock.now += (one if torch.get_num_threads() == 1 else many)[fmt]
            return [run]
        return {f: call(f) for f in one}
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[0])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.__setitem__(0, n))
    threads = [2]
    one, two = {"fp32": 271e-6, "q4_1": 322e-6}, {"fp32": 200e-6, "q4_1": 161e-6}
    figures = cpu_choice.measured(tmp_path, runners=runners(one, two), timer=clock)
    assert figures == {"fp32": 200.0, "q4_1": 161.0} and cpu_choice.threads_of(tmp_path) == 2
    q, why = cpu_choice.pick(figures, torch.float32, "gguf", cpu_choice.threads_of(tmp_path))
    assert q == "gguf" and "2 threads" in why
    busy = {"fp32": 57695e-6, "q4_1": 72110e-6}
    (tmp_path / "busy").mkdir()
    figures = cpu_choice.measured(tmp_path / "busy", runners=runners(one, busy), timer=clock)
    assert figures == {"fp32": 271.0, "q4_1": 322.0} and cpu_choice.threads_of(tmp_path / "busy") == 1
    assert cpu_choice.pick(figures, torch.float32, "gguf")[0] is None
    assert threads == [2]


def test_engine_info_shows_the_choice_and_its_figure():
    from workbench import Engine
    from workbench.platforms import cpu_kernels
    if cpu_kernels.load_cpu_kernels() is None:
        pytest.skip("no CPU kernel here")
    info = Engine(model="random:tiny", device="cpu", num_kv_blocks=16,
                  dtype="bfloat16").info()
    assert info.kernels == "built"
    assert "measured once for this kernel build" in info.quantization_choice
    assert "µs" in info.quantization_choice


# --- packed weights on the plain-torch path -----------------------------------------------

def test_packed_weights_are_dequantized_once_without_the_kernel(monkeypatch):
    """No kernel (building, or none): a packed weight runs as its dequantized copy, made once,
    with the reference's numbers; the copies go once the kernel arrives."""
    from workbench.platforms import cpu_kernels, cpu_ops
    from workbench.platforms.ops import TorchOps
    from workbench.platforms.quant import PackedWeight, quantize_int8
    w = quantize_int8(torch.randn(64, 96))
    tiled = w.tiled()
    ops = cpu_ops.CpuOps()
    calls = []
    real = PackedWeight.dequantize
    monkeypatch.setattr(PackedWeight, "dequantize",
                        lambda self, dtype=torch.float32: (calls.append(self), real(self, dtype))[1])
    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    x = torch.randn(3, 96)
    for _ in range(3):
        y, yt = ops.linear(x[:1], w), ops.linear(x, tiled)
    assert len(calls) == 2
    monkeypatch.setattr(PackedWeight, "dequantize", real)
    assert torch.equal(y, TorchOps().linear(x[:1], w))
    assert torch.equal(yt, TorchOps().linear(x, tiled))
    k = cpu_kernels.load_cpu_kernels()
    if k is not None:
        monkeypatch.setattr(cpu_kernels, "kernels", lambda: k)
        ops.linear(x[:1], w)
        assert not ops._dense


def test_batched_bf16_without_native_bf16_takes_fp32_products(monkeypatch):
    """Where oneDNN has no native bf16 (an AVX2 CPU, an Ice Lake), batched bf16 linears run
    in fp32 on the weights widened a slice at a time and are rounded once (torch's bf16 GEMM
    there ran at 0.4x fp32's throughput): plain bf16 and bf16c give the same bits, the
    float64 reference's numbers within bf16's rounding, and torch's bf16 GEMM is not called."""
    from workbench.platforms import cpu_kernels, cpu_onednn, cpu_ops
    from workbench.platforms.quant import bf16c_pack
    if cpu_kernels.load_cpu_kernels() is None:
        pytest.skip("no CPU kernel here")
    monkeypatch.setattr(cpu_ops, "onednn_bf16", lambda: False)
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: pytest.fail(
        "torch's bf16 GEMM") if x.dtype == torch.bfloat16 else real_linear(x, w, b))
    torch.manual_seed(0)
    w = (torch.randn(1000, 192) * 0.05).bfloat16()          # 1000 rows: several slices
    c = bf16c_pack(w)
    # fp32 products either way: the widened slices (C++), or where fp32's batched linear is
    # oneDNN (onednn_fp32), the weights widened once and packed for it
    for fp32_onednn in (False, True) if cpu_onednn.onednn_packed([w.float()]) else (False,):
        monkeypatch.setattr(cpu_ops, "onednn_fp32", lambda on=fp32_onednn: on)
        ops = cpu_ops.CpuOps()
        for m in (17, 64, cpu_ops.widened_rows(cpu_kernels.kernels()) + 1):
            x, b = torch.randn(m, 192).bfloat16(), torch.randn(1000).bfloat16()
            y, yc = ops.batched_linear(x, w, b), ops.linear(x, c, b)
            assert y.dtype == yc.dtype == torch.bfloat16 and torch.equal(y, yc)
            ref = x.double() @ w.double().T + b.double()
            assert ((y.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max() < 1e-2
        assert not ops._dense                       # bf16c stayed packed: no dequantized copy
        assert bool(ops._onednn) == fp32_onednn     # packed in fp32 only for oneDNN's path


def test_a8_formats_without_vnni_take_the_row_kernels(monkeypatch):
    """A kernel without a8_linear (a build for AVX2 or Arm): an 8-bit-activation weight runs
    as x rounded through its 8-bit blocks (a8_round_trip) times the weight's row format on
    the row kernels, the reference's numbers (quant.a8_linear) up to the order of fp32 sums;
    never the torch reference on a dequantized copy (2.8x fp32's step on an AVX2 build)."""
    from workbench.platforms import cpu_kernels, cpu_ops
    from workbench.platforms.cpu_choice import _gguf
    from workbench.platforms.quant import a8_linear, quantize_int8
    k = cpu_kernels.load_cpu_kernels()
    if k is None:
        pytest.skip("no CPU kernel here")

    class NoVnni:                                  # the kernel as such a build has it
        def __getattr__(self, name):
            if name in ("a8_linear", "a8_amx"):
                raise AttributeError(name)
            return getattr(k, name)

    monkeypatch.setattr(cpu_kernels, "kernels", lambda: NoVnni())
    ops = cpu_ops.CpuOps()
    monkeypatch.setattr(ops, "dense", lambda *a: pytest.fail("dequantized for the torch path"))
    torch.manual_seed(0)
    w = torch.randn(48, 96) * 0.05
    for packed in (quantize_int8(w).tiled(), _gguf(w, "q4_1").tiled(), _gguf(w, "q8_0").tiled()):
        assert packed.activation_bits == 8
        for m in (1, 5):
            x, b = torch.randn(m, 96), torch.randn(48)
            for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
                y = ops.linear(x.to(dt), packed, b.to(dt))
                ref = a8_linear(x.to(dt).float(), packed, b).to(dt)
                assert y.dtype == dt
                assert (y.float() - ref.float()).abs().max() <= tol * ref.abs().max(), \
                    (packed.format, m, dt)
    assert len(ops._rows) == 3


# --- the kernels' ISA paths against the float64 reference ---------------------------------

KERNEL_CHECK = """
import json, torch
from workbench.platforms import cpu_kernels as cpu
from workbench.platforms.cpu_choice import _gguf
from workbench.platforms.quant import quantize_int8, bf16c_pack
k = cpu.load_cpu_kernels()
torch.manual_seed(0)
out = {"isa": k.isa(), "dir": str(cpu.kernel_dir()), "bf16c_fast": hasattr(k, "bf16c_fast")}
def rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()
for n, kk in ((37, 128), (64, 576)):
    w = torch.randn(n, kk) * 0.05
    for m in (1, 3):
        x = torch.randn(m, kk)
        if m == 1:
            out[f"fp32 {n}"] = rel(k.gemv(x, w, None), x.double() @ w.double().T)
            wb, xb = w.bfloat16(), x.bfloat16()
            refb = xb.double() @ wb.double().T
            yb = k.gemv(xb, wb, None)
            out[f"bf16 {n}"] = rel(yb, refb)
            c = bf16c_pack(wb)
            yc = k.bf16c_gemv(xb, c.data, None)
            out[f"bf16c {n}"] = rel(yc, refb)
            out[f"bf16c=bf16 {n}"] = bool(torch.equal(yc, yb))
            esc = wb.clone(); esc[0, ::3] = torch.arange(len(esc[0, ::3])).bfloat16() * 1e3
            ce = bf16c_pack(esc, max_escape_bytes=1.0)
            out[f"bf16c escapes {n}"] = rel(k.bf16c_gemv(xb, ce.data, None),
                                            xb.double() @ esc.double().T)
        else:                                   # a few rows: each weight row read once
            out[f"small_m fp32 {n}x{m}"] = rel(k.small_m_linear(x, w, None), x.double() @ w.double().T)
            wb, xb = w.bfloat16(), x.bfloat16()
            out[f"small_m bf16 {n}x{m}"] = rel(k.small_m_linear(xb, wb, None),
                                               xb.double() @ wb.double().T)
        for fmt, pw in (("q4_1", _gguf(w, "q4_1")), ("q8_0", _gguf(w, "q8_0")),
                        ("int8", quantize_int8(w))):
            ref = x.double() @ pw.dequantize().double().T
            out[f"{fmt} {n}x{m}"] = rel(k.qlinear(x, pw.data, pw.code), ref)
            out[f"{fmt} bf16 {n}x{m}"] = rel(k.qlinear(x.bfloat16(), pw.data, pw.code),
                                              x.bfloat16().double() @ pw.dequantize().double().T)
for n, kk in ((37, 128), (64, 576)):            # batched bf16 weights in fp32 (no native bf16)
    wb = (torch.randn(n, kk) * 0.05).bfloat16()
    c = bf16c_pack(wb)
    for m in (3, 40):
        x = torch.randn(m, kk)
        y = k.widened_linear(x, wb)
        out[f"widened {n}x{m}"] = rel(y, x.double() @ wb.double().T)
        out[f"bf16c rows=widened {n}x{m}"] = bool(torch.equal(k.qlinear(x, c.data, c.code), y))
from workbench.platforms.quant import dequantize_activations, quantize_activations
for m in (1, 3):                                # K not a multiple of the 32-block
    x = torch.randn(m, 100)
    for dt in (torch.float32, torch.bfloat16):
        ref = dequantize_activations(*quantize_activations(x.to(dt)), 100).to(dt)
        out[f"a8 round trip={dt} {m}"] = bool(torch.equal(k.a8_round_trip(x.to(dt)), ref))
print("RESULT", json.dumps(out), flush=True)
"""

ISAS = {"native": None, "icelake-server": "icelake-server", "x86-64-v3": "x86-64-v3",
        "x86-64": "x86-64"}
ICELAKE = {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi", "avx512_vbmi2", "bmi2"}
"""What an icelake-server build needs of the CPU it runs on: AVX-512 without BF16 (the
Xeons before Cooper Lake), whose bf16 and bf16c GEMVs widen the weights in registers."""


@pytest.mark.parametrize("isa", list(ISAS))
def test_every_format_against_float64_on_each_isa_path(isa):
    """Each build the machine can run (its own, AVX-512 without BF16, AVX2+FMA, plain
    x86-64), each built once
    into the shared content-keyed cache (minutes the first time), every format's batch-1 and
    small-batch kernels against the float64 reference; bf16c gives bf16's bits."""
    import platform
    if ISAS[isa] and platform.machine() != "x86_64":
        pytest.skip("an x86 ISA level")
    if ISAS[isa] == "x86-64-v3" and "avx2" not in _flags():
        pytest.skip("this CPU has no AVX2")
    if isa == "icelake-server" and not ICELAKE <= _flags():
        pytest.skip(f"this CPU lacks some of {sorted(ICELAKE)}")
    if isa == "icelake-server" and not _flags() & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("this CPU's native build takes the AVX-512-without-BF16 paths: checked "
                    "as 'native'")
    if (ISAS[isa] == "x86-64-v3" and "avx512f" not in _flags()
            and {"avx2", "fma", "f16c"} <= _flags()):
        # The kernels' paths are chosen by these macros alone (bindings.cpp isa()): the
        # native build of this CPU compiles the same ones, and is checked as 'native'.
        pytest.skip("this CPU's native build takes x86-64-v3's paths (AVX2+FMA+F16C, no "
                    "AVX-512): checked as 'native'")
    r = json.loads(run(KERNEL_CHECK, {"WORKBENCH_CPU_MARCH": ISAS[isa]}, 1200).split("RESULT ")[-1])
    if isa == "x86-64":
        assert r["isa"] == "portable", r["isa"]
    if isa == "x86-64-v3":
        assert "avx2" in r["isa"] and "avx512f" not in r["isa"]
    if isa == "icelake-server":
        assert "avx512f" in r["isa"] and "avx512bf16" not in r["isa"], r["isa"]
        assert r["bf16c_fast"], "bf16c rebuilt in registers without AVX-512 BF16"
    if isa == "native":                  # the CPU's own paths, whatever it has
        assert all(f in r["isa"].split() for f in ("avx2", "fma", "f16c", "avx512f")
                   if f in _flags()), (r["isa"], sorted(_flags()))
    check_formats(r)


def check_formats(r: dict) -> None:
    """KERNEL_CHECK's results: the bit-for-bit ones equal, the others within fp32's (bf16's)
    rounding of the float64 reference."""
    for key, v in r.items():
        if isinstance(v, bool) and key != "bf16c_fast":         # bit for bit
            assert v, key
        elif key not in ("isa", "dir", "bf16c_fast"):
            assert v < (2e-2 if "bf16" in key else 2e-5), (key, v, r["isa"])


def _flags():
    from workbench.platforms.cpu_kernels import isa_flags
    return isa_flags()


# --- Arm ----------------------------------------------------------------------------------

AARCH64 = shutil.which("aarch64-linux-gnu-g++")


@background.job
def arm_compile():
    """Every source compiled for aarch64 (a background job: tests/background.py): the
    compilers' exit codes and errors, and cpu_quant.o's disassembly where objdump exists."""
    if AARCH64 is None:
        pytest.skip("no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
    from torch.utils.cpp_extension import include_paths
    inc = [a for p in include_paths() for a in ("-isystem", p)]
    flags = ["-std=c++20", "-O3", "-march=armv8.2-a", "-fopenmp", "-ffast-math"]
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    obj = background.tmpdir("arm") / "cpu_quant.o"   # every format's batch-1 GEMV: here or cpu_dtype.h
    # All five at once (each parses torch's headers alone: seconds of one core apiece).
    argv = {src: [AARCH64, *flags, *inc, "-fsyntax-only", str(CSRC / src)]
            for src in ("bindings.cpp", "cpu_attention.cpp", "cpu_a8.cpp", "cpu_ops.cpp")}
    argv["cpu_quant.cpp"] = [AARCH64, *flags, *inc, "-c", str(CSRC / "cpu_quant.cpp"), "-o",
                             str(obj)]
    jobs = {src: background.spawn(a, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for src, a in argv.items()}
    errors = {src: job.communicate(timeout=900)[1] for src, job in jobs.items()}
    failed = {src: errors[src][-3000:] for src, job in jobs.items() if job.returncode != 0}
    asm = None
    if objdump and not failed:
        asm = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True).stdout
    return failed, asm


ARM_SYSROOT = Path(os.environ.get("WORKBENCH_ARM_SYSROOT",
                                  Path.home() / ".cache" / "workbench" / "arm-sysroot"))
"""An aarch64 Python with torch (tests/arm_sysroot.sh builds it; .ci/run does)."""
QEMU = shutil.which("qemu-aarch64")


@background.job
def arm_run():
    """The kernels cross-compiled for armv8.2-a (NEON) against the sysroot's aarch64 torch,
    loaded by its Python under qemu-aarch64, KERNEL_CHECK run there (a background job):
    its results."""
    ready = ARM_SYSROOT / "ready"
    if AARCH64 is None or QEMU is None or not ready.is_file():
        pytest.skip(f"no aarch64 Python under qemu-aarch64 at {ARM_SYSROOT} "
                    "(tests/arm_sysroot.sh builds one)")
    torch_dir = ARM_SYSROOT / "site" / "torch"
    abi = (ARM_SYSROOT / "abi").read_text().strip()
    so = background.tmpdir("arm-run") / "workbench_cpu_attention.so"
    build = background.spawn(
        [AARCH64, "-std=c++20", "-O3", "-march=armv8.2-a", "-fopenmp", "-ffast-math", "-shared",
         "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-isystem", str(torch_dir / "include"),
         "-isystem", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
         *[str(CSRC / f) for f in ("bindings.cpp", "cpu_attention.cpp", "cpu_ops.cpp",
                                   "cpu_quant.cpp", "cpu_a8.cpp")],
         f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch", "-o", str(so)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = build.communicate(timeout=900)[1]
    assert build.returncode == 0, err[-3000:]
    code = KERNEL_CHECK.replace("k = cpu.load_cpu_kernels()",
                                f"from pathlib import Path\nk = cpu._import_built(Path({str(so)!r}))")
    code = code.replace('"dir": str(cpu.kernel_dir()), ', "")
    py = ARM_SYSROOT / "root" / "usr" / "bin" / ready.read_text().strip()
    proc = background.spawn([QEMU, "-L", str(ARM_SYSROOT / "root"), "-E",
                             f"PYTHONPATH={ARM_SYSROOT / 'site'}:{ROOT}", "-E", "OMP_NUM_THREADS=2",
                             str(py), "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0 and "RESULT " in out, out[-3000:]
    return json.loads(out.split("RESULT ")[-1])


def test_the_kernels_run_on_arm_under_qemu(arm_run):
    """Every format's batch-1 and few-row kernels, their NEON paths as an Arm64 CPU runs
    them (qemu-aarch64, an armv8.2-a build), against the float64 reference with the x86
    builds' bounds; bf16c gives bf16's bits there too."""
    assert arm_run["isa"] == "neon", arm_run["isa"]
    check_formats(arm_run)


def test_the_kernels_compile_for_arm_with_neon_gemvs(arm_compile):
    """Every source compiles for aarch64 against torch's headers, and the batch-1 GEMVs of
    every format are NEON code there: bf16c's palette lookup (tbl), the fp32 sums' vector
    FMAs/multiplies on v registers."""
    failed, asm = arm_compile
    assert not failed, failed
    if asm is not None:
        assert "fmla\tv" in asm or "fmul\tv" in asm
        assert "tbl\tv" in asm                           # bf16c's palette lookup
