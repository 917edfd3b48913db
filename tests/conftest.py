"""Shared fixtures: the embedded model, HF reference generations, tiny random checkpoints."""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from workbench.platforms.cpu import CpuPlatform

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

# Every process the tests start runs tests/site/sitecustomize.py (why: its docstring); this one
# does the same.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(Path(__file__).parent / "site"), os.environ.get("PYTHONPATH")) if p)
sys.modules.setdefault("rfc3987_syntax", None)

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "In 1969, the first humans landed on the Moon. Describe what they saw and how they felt "
    "when they stepped out of the lunar module onto the grey dust of the surface.",
    "Hi",
    "Explain, step by step, how a paged KV cache lets an inference engine serve many requests "
    "at once without reserving memory for the longest possible sequence. Mention blocks, "
    "block tables and what happens when the pool runs out of free blocks during decoding.",
    "Translate to French: good morning, my friend.",
]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' own greedy generation for one prompt (batch of 1: no padding)."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session", autouse=True)
def cpu_kernel_built():
    """The CPU kernel of the default cache is built before any test runs. Otherwise the first
    engine of the session (in this process, or in a server a test starts) spawns the detached
    build (platforms.cpu_kernels.build_in_background), which by design outlives whoever started it:
    a server stopped mid-build leaves the builder and its compiler in the server's process
    tree, and which test met that first depended on the order the tests ran in (a file run
    alone on a fresh machine failed its teardown). Tests of the build itself use caches of
    their own (WORKBENCH_CACHE)."""
    from workbench.platforms import cpu_kernels as cpu
    cpu.ensure_kernel_built()


def pytest_collection_modifyitems(session, config, items):
    """The tests that read a background job's result run last (in their order), so that the
    jobs have the whole session to run beside the other tests."""
    import background
    items.sort(key=lambda item: any(n in background.JOBS for n in item.fixturenames))


@pytest.fixture(scope="session", autouse=True)
def background_jobs(request, cpu_kernel_built):
    """The background jobs (tests/background.py) the selected tests ask for start now, once
    the kernel is built (their processes load it), and whatever they spawned is killed when
    the session ends."""
    import background
    background.start({n for item in request.session.items for n in item.fixturenames
                      if n in background.JOBS})
    yield
    background.stop()


@pytest.fixture(scope="session")
def smollm2_dir():
    from workbench.executor.models.loader import smollm2_checkpoint_dir
    return smollm2_checkpoint_dir()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # compare whole lengths; tests cut at EOS
    return model


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def make_tiny_checkpoint(path, kind: str, seed: int = 0, head_dim: int = 48, **shape):
    """A small random HF checkpoint of the given family, saved as safetensors, with the HF
    model returned for reference. Weights are drawn wider than HF's default init so that
    logits are peaked and greedy choices are not near-ties. head_dim: Qwen3's (the NPU's
    fused attention takes only a few sizes); `shape` overrides config fields (vocab_size...)."""
    import transformers
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.25)
    common.update(shape)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=False)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "llama3":
        cfg = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(kind)
    cfg.eos_token_id = None
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():   # biases are zero-initialised by HF; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    out = {}
    for kind in ("qwen2", "qwen3", "llama3"):
        path = tmp_path_factory.mktemp(kind)
        out[kind] = (path, make_tiny_checkpoint(path, kind))
    return out


@pytest.fixture(scope="session")
def qwen3_d128(tmp_path_factory):
    """A tiny Qwen3 with head size 128, the one every A2/A3 CANN's fused attention takes
    (the NPU tests' model)."""
    path = tmp_path_factory.mktemp("qwen3_d128")
    make_tiny_checkpoint(path, "qwen3", head_dim=128)
    return path


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(r.randint(lo, hi))] for _ in range(n)]


def stop_tree(proc, timeout: float = 30.0, sig=None) -> list[int]:
    """Stop a `workbench` command the way a service manager does (SIGTERM, or `sig`; it stops
    its own children), then kill whatever of its process tree survived, and, where it leads a
    process group of its own (start_server), whatever of that group is left too (children
    that outlived their parent). Returns the survivors' pids, so a test can assert there were
    none; nothing is left running either way."""
    import os
    import signal
    import time

    import psutil
    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    own_group = _pgid(proc.pid) == proc.pid
    if proc.poll() is None:
        proc.send_signal(sig or signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    kill_all(alive)
    proc.wait(10)
    survivors = [p.pid for p in alive]
    if own_group:
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid):       # members may take a moment to exit after the leader
            if time.monotonic() > deadline:
                survivors.append(-proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
    return survivors


def _pgid(pid: int) -> int | None:
    import os
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _group_alive(pgid: int) -> bool:
    import os
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def kill_all(procs: list) -> None:
    """The test's own clean-up, whatever the code under test did."""
    import psutil
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd, log_path, ready: str = "/health", ok=lambda code: code == 200,
                 timeout: float = 180.0, env: dict | None = None, what: str | None = None):
    """The one way tests start a server: `cmd --port P` (or `cmd(P)` where cmd is a function of
    the port, for a server configured otherwise) on a free loopback port, in its own
    process group (so stop_tree can sweep it), output appended to log_path; polls GET
    `ready` until `ok(status)` within `timeout` s. A port taken between picking and binding
    it is retried on another. Returns (proc, base url); fails the test with the log's tail
    (having stopped what it started) if the server exits or never answers."""
    import os
    import subprocess
    import time
    from pathlib import Path

    import httpx
    log_path = Path(log_path)
    for _ in range(3):
        port = free_port()
        with open(log_path, "ab") as log:
            argv = cmd(port) if callable(cmd) else [*cmd, "--port", str(port)]
            proc = subprocess.Popen(argv, cwd=Path(__file__).parents[1],
                                    env={**os.environ, **(env or {})}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if ok(httpx.get(url + ready, timeout=2.0).status_code) and proc.poll() is None:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        stop_tree(proc)
        if "address already in use" not in log_path.read_text(errors="replace").lower():
            break
    pytest.fail(f"{what or argv[0]} did not come up; log:\n"
                f"{log_path.read_text(errors='replace')[-4000:]}")


class ReplayGraph:
    """Stands in for a device graph on the CPU: replay reruns the captured function, which
    reads the same static buffers a real graph would, and refreshes the captured output."""

    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        out = self.fn()
        if self.out is not None:
            self.out.copy_(out)
        self.replays += 1


class ReplayingCpuPlatform(CpuPlatform):
    """The CPU platform with 'graphs' (ReplayGraph): decode graphs and async scheduling run
    on the CPU as they would on a device."""

    supports_graphs = True

    def graph_pool(self):
        return None

    def capture_graph(self, fn, pool):
        out = fn()
        return ReplayGraph(fn, out), out


@pytest.fixture
def replaying_platform(monkeypatch):
    import workbench.engine.build
    monkeypatch.setattr(workbench.engine.build, "get_platform", lambda name: ReplayingCpuPlatform())
