"""The cache under $WORKBENCH_CACHE: the converted model and the CPU kernel are keyed by what
they are made from, shared between environments, and survive a start killed with kill -9."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import background

ROOT = Path(__file__).resolve().parents[1]


def start(code: str, cache: Path) -> subprocess.Popen:
    """A fresh Python process running `code` against the cache `cache`, in a session of its
    own so that a kill reaches its compiler too."""
    env = {**os.environ, "WORKBENCH_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    return background.spawn([sys.executable, "-c", code], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill9_when(proc: subprocess.Popen, ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"never saw {what}: {proc.communicate()[0][-2000:]}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)      # the start and its ninja/compiler children
    proc.wait(10)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"did not finish within {timeout} s (a lock left by the killed start?):\n"
                    f"{out[-2000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


KERNEL = ("import torch; from workbench.platforms.cpu_kernels import load_cpu_kernels\n"
          "k = load_cpu_kernels(); print('KERNEL', k is not None)")

MODEL = "random:tiny-qwen3"
"""What the starts below serve: a small random model, so that the kernel build (the point of
these tests, and their slow part) is what they wait for."""

# A first start on a machine, and a short-lived one: the engine serves at once, decoding in
# plain torch while the kernel builds in a detached process, and the process exits without
# waiting for the build (a `workbench generate`, a script); greedy tokens equal the reference.
FIRST_START = """
import json, sys, time
from workbench import Engine, SamplingParams
from workbench.platforms import cpu_kernels as cpu
model = sys.argv[1]
params = SamplingParams(max_tokens=12, temperature=0)
prompts = [[5, 17, 301, 42, 7], [11, 2, 93], [64] * 9]
t = time.perf_counter()
engine = Engine(model=model, device="cpu", num_kv_blocks=64)
during = [o.token_ids for o in engine.generate(prompts, params)]
first_s = time.perf_counter() - t
building = cpu._kernels is None and cpu._builder.poll() is None
ref = Engine(model=model, device="cpu", num_kv_blocks=64, attention_backend="reference")
expected = [o.token_ids for o in ref.generate(prompts, params)]
print("RESULT", json.dumps(dict(first_s=first_s, building=building, builder=cpu._builder.pid,
                                during=during == expected, expected=expected)), flush=True)
"""

# The next process: the module is there, loaded without building, and decodes the same tokens.
AFTER = """
import json, sys
from workbench import Engine, SamplingParams
from workbench.platforms import cpu_kernels as cpu
engine = Engine(model=sys.argv[1], device="cpu", num_kv_blocks=64)
loaded = cpu._kernels is not None and cpu._builder is None
prompts = [[5, 17, 301, 42, 7], [11, 2, 93], [64] * 9]
got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))]
print("RESULT", json.dumps(dict(loaded=loaded, got=got)), flush=True)
"""


@background.job
def kernel_cache():
    """A cache whose kernel builds were killed with kill -9 half-way, twice: once a build
    running in the process that asked for it, once the detached builder an engine starts.
    Then a start that must not wait for the dead builds' lock: it serves while it builds the
    kernel again and exits before the build is done; the builder finishes by itself, and the
    next process loads the module. (One full build for all of it: it is the slow part; a
    background job, tests/background.py. The waits are long because its processes run at the
    lowest priority beside the rest of the suite.)"""
    import psutil
    cache = background.tmpdir("cache")
    t0 = time.monotonic()
    stages = {}

    def stage(name: str) -> None:
        stages[name] = round(time.monotonic() - t0 - sum(stages.values()), 1)

    first = start(KERNEL, cache)
    ninja = lambda: any((cache / "kernels").glob("*/build.ninja"))   # noqa: E731
    kill9_when(first, ninja, 600, "the kernel build start")
    for f in (cache / "kernels").glob("*/build.ninja"):
        f.unlink()
    out = finish(start(SHORT_LIVED, cache), 600)
    builder = int(out.split("BUILDER ", 1)[1].split()[0])
    deadline = time.monotonic() + 600
    while not ninja() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(builder, signal.SIGKILL)          # the builder's session: its compiler too
    wait_gone(builder, 10)
    assert not any((cache / "kernels").glob("*/built"))
    stage("two builds started and killed")
    out = finish(start_model(FIRST_START, MODEL, cache), 600)
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    (build,) = (cache / "kernels").iterdir()
    result["left_building"] = psutil.pid_exists(result["builder"]) and \
        not (build / "built").is_file()
    stage("the first start")
    wait_gone(result["builder"], 600)
    stage("the rest of the build")
    result["built"] = (build / "built").is_file()
    result["build_log"] = (build / "build.log").read_text()[-2000:] if not result["built"] else ""
    result["stray_tmp"] = (build / "built.tmp").exists()
    cli = "from workbench.cli import main; raise SystemExit(main(['build-kernels']))"
    result["build_kernels"] = finish(start(cli, cache), 600)[-2000:]
    after = json.loads(finish(start_model(AFTER, MODEL, cache), 600)
                       .split("RESULT ", 1)[1].splitlines()[0])
    result["loaded"], result["after"] = after["loaded"], after["got"] == result["expected"]
    stage("build-kernels and the next start")
    print(f"first start after two killed builds: {result}; seconds: {stages}")
    return cache, build, result


def start_model(code: str, model: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "WORKBENCH_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    return background.spawn([sys.executable, "-c", code, model], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


SHORT_LIVED = """
from workbench import Engine, SamplingParams
from workbench.platforms import cpu_kernels as cpu
e = Engine(model="random:tiny", device="cpu", num_kv_blocks=16)
print("BUILDER", cpu._builder.pid, flush=True)
print(e.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids)
"""


def wait_gone(pid: int, timeout: float) -> None:
    import psutil
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        os.killpg(pid, signal.SIGKILL)
        pytest.fail(f"the detached kernel build {pid} ran past {timeout} s")


def test_a_short_lived_process_leaves_a_built_kernel(kernel_cache):
    """A process that starts the build and exits at once does not wait for it and does not
    kill it: the build runs in a detached process of its own, which finishes and exits by
    itself; the next process loads the module without building (`workbench build-kernels`
    finds it built)."""
    _, build, result = kernel_cache
    assert result["left_building"], \
        "the first process waited for the build instead of leaving it to the builder"
    assert result["built"], result["build_log"]
    assert not result["stray_tmp"]
    out = result["build_kernels"]
    assert f"built: {build}" in out and "building the CPU kernel" not in out, out
    assert result["loaded"], "the next process built (or waited for) the kernel again"


def test_a_build_killed_with_kill9_does_not_block_the_next_start(kernel_cache):
    _, build, result = kernel_cache
    assert (build / "built").is_file() and result["built"]


def test_the_first_start_serves_while_the_kernel_builds(kernel_cache):
    _, _, result = kernel_cache
    assert result["building"], "the first requests waited for the kernel build"
    assert result["during"] and result["after"]     # greedy tokens equal the reference path


def test_a_built_kernel_is_loaded_without_the_builder(kernel_cache, monkeypatch):
    """Another venv (other paths in torch's ninja file) loads the module that is there
    instead of rebuilding it: torch's builder is not even called."""
    import torch.utils.cpp_extension

    from workbench.platforms import cpu_kernels as cpu

    def no_build(*a, **k):
        raise AssertionError("torch's extension builder was called for a cached kernel")
    monkeypatch.setenv("WORKBENCH_CACHE", str(kernel_cache[0]))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    monkeypatch.setattr(cpu, "_kernels", None)
    assert cpu.load_cpu_kernels() is not None


PRIORITY = """
import os
print(os.getpriority(os.PRIO_PROCESS, 0))
path = "/proc/self/autogroup"
print(open(path).read().split()[-1] if os.path.exists(path) else "none")
"""


@pytest.mark.parametrize("starter_nice", [0, 15])
def test_the_detached_build_runs_below_whoever_starts_it(starter_nice):
    """The detached build runs 10 nice levels below the process that starts it (19 at most),
    and so does its session where the kernel schedules sessions as groups (autogroups): a
    nice value alone would not keep it from taking half of a 2-core machine from an engine
    serving beside it. Checked from a starter at nice 0 and one niced to 15."""
    starter = (f"import os, subprocess, sys\n"
               f"from workbench.platforms.cpu_kernels import below_me\n"
               f"os.nice({starter_nice})\n"
               f"open('/proc/self/autogroup', 'w').write('{starter_nice}') "
               f"if os.path.exists('/proc/self/autogroup') else None\n"
               f"print(subprocess.run([sys.executable, '-c', {PRIORITY!r}], "
               f"start_new_session=True, preexec_fn=below_me(), capture_output=True, "
               f"text=True).stdout, end='')\n")
    r = subprocess.run([sys.executable, "-c", starter], start_new_session=True,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    nice, group = r.stdout.split()
    want = min(19, starter_nice + 10)
    assert int(nice) == want
    assert group in ("none", str(want)), group


def test_the_kernel_key_follows_the_compiler(tmp_path, monkeypatch):
    from workbench.platforms import cpu_kernels as cpu
    key = cpu.kernel_key()
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'g++ (Fake) 99.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert cpu.kernel_key() != key
    monkeypatch.delenv("CXX")
    assert cpu.kernel_key() == key


CONVERT = ("from workbench.executor.models.loader import smollm2_checkpoint_dir\n"
           "print('DIR', smollm2_checkpoint_dir())")


@background.job
def converted_cache():
    """A conversion killed with kill -9 while it writes, then one that finishes (a background
    job, tests/background.py)."""
    pytest.importorskip("gguf")
    from workbench.executor.models.loader import smollm2_gguf_path
    smollm2_gguf_path()            # skips the module's tests with the install line if absent
    cache = background.tmpdir("cache")
    first = start(CONVERT, cache)
    # Killed while it writes the checkpoint (its temporary directory exists).
    kill9_when(first, lambda: any(cache.glob(".convert-*/*")), 600, "the conversion writing")
    out = finish(start(CONVERT, cache), 600)
    return cache, Path(out.split("DIR ")[-1].strip())


def test_a_conversion_killed_with_kill9_leaves_one_clean_copy(converted_cache):
    cache, out = converted_cache
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [out.name]   # no leftovers


def test_the_converted_model_is_keyed_by_content_not_place(converted_cache, tmp_path,
                                                           monkeypatch):
    """The same GGUF installed in another venv (another path, another mtime) reuses the
    conversion; nothing is converted again."""
    from workbench.executor.models import loader
    cache, out = converted_cache
    other = tmp_path / "other-venv" / loader.SMOLLM2_GGUF
    other.parent.mkdir()
    shutil.copyfile(loader.smollm2_gguf_path(), other)
    monkeypatch.setenv("WORKBENCH_CACHE", str(cache))
    monkeypatch.setattr(loader, "smollm2_gguf_path", lambda: other)

    def convert_again(*a, **k):
        raise AssertionError("the GGUF was converted again")
    monkeypatch.setattr(loader, "_convert_gguf", convert_again)
    assert loader.smollm2_checkpoint_dir() == out


def test_the_converted_smollm2_knows_its_facts(converted_cache):
    """Our GGUF conversion (dequantized, Q/K rows put back in HF's rotary order) makes a model
    that answers, in transformers; rows left in llama.cpp's interleaved order give gibberish."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import hf_greedy
    _, out = converted_cache
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tok("The capital of France is").input_ids
    assert "Paris" in tok.decode(hf_greedy(model, ids, 4))


@pytest.mark.skipif(not os.environ.get("WORKBENCH_SLOW_TESTS"),
                    reason="about 30 s on 2 cores: set WORKBENCH_SLOW_TESTS=1")
def test_the_gguf_conversion_equals_transformers_own(converted_cache):
    """Every tensor bit-equal to transformers' own GGUF loader, and the same tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from safetensors.torch import load_file
    from workbench.executor.models import loader
    _, smollm2_dir = converted_cache
    gguf = loader.smollm2_gguf_path()
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
    theirs = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=shell)["tensors"]
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    theirs.pop("lm_head.weight", None)                         # tied to the embedding
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k].float()) for k in ours)
    text = "Héllo wörld\n\tdef f(x): return x ** 2  <|im_start|>"
    assert AutoTokenizer.from_pretrained(smollm2_dir)(text).input_ids == \
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(text).input_ids


def test_earlier_versions_path_keyed_entries_are_removed(tmp_path, monkeypatch):
    """Models and kernels cached by earlier versions under path-derived keys are deleted on
    the next start; today's content-keyed entries stay."""
    from workbench.executor.models import loader
    keep = [tmp_path / "smollm2-135m-instruct-b179c9523d0e6a0f", tmp_path / "kernels" /
            "80e7cdfa84210fc9", tmp_path / "smollm2-135m-instruct-notahexkey"]
    old = [tmp_path / "smollm2-135m-instruct-080b2246f3", tmp_path / "kernels" / "7e92c448f653"]
    for d in keep + old:
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "file_digest", lambda path: "b179c9523d0e6a0f" + "0" * 48)
    monkeypatch.setattr(loader, "smollm2_gguf_path", lambda: tmp_path / "x.gguf")
    assert loader.smollm2_checkpoint_dir() == keep[0]
    assert all(d.is_dir() for d in keep) and not any(d.exists() for d in old)
