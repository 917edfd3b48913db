"""`workbench doctor --device npu`: the probe's report, then one tiny op of each kind.

The probe (npu.probe) says what torch_npu and CANN claim; it cannot say whether the ops run.
A host can import torch_npu and still lack what an op needs at its first launch: the ATB ops
(`_npu_*`) load NNAL's libatb.so, which only a sourced `nnal/atb/set_env.sh` puts on the
library path; the fused infer-attention op needs the CANN kernels package for the chip; a
graph capture needs stream resources the HDK driver hands out (error 207008, or 'Alloc sq cq
fail' before HDK 25.5.1). So the doctor launches, at toy sizes (one 128-token block, head size
128, bf16), exactly the calls an engine step makes, and reports each as ran or failed with the
error and the fix (a check this torch_npu cannot make is skipped, not failed):

1. cache write: `_npu_reshape_and_cache` of one token into a one-block pool, read back;
2. paged decode: `_npu_paged_attention` of one request over that block, against torch;
3. FIA prefill: `npu_fused_infer_attention_score` in TND layout, causal (sparse_mode 3),
   paged, against torch;
4. graph: one paged attention captured as a task group (npu_attention.DecodeGraphTasks,
   what decode graphs use), replayed through NpuPlatform.replay_graph with a task update
   carrying a length the capture never saw, against torch.

A result that differs from torch counts as a failure too: an op that runs and answers wrong
is what a first hardware run most needs to hear about.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import torch

TOOLKIT_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"
ATB_ENV = "source /usr/local/Ascend/nnal/atb/set_env.sh"
BLOCK, HEADS, KV_HEADS, D, LEN = 128, 2, 1, 128, 6
"""Toy sizes every A2/A3 CANN takes: block 128, head size 128 (npu.supported_head_sizes)."""


@dataclass
class OpCheck:
    name: str
    ran: bool
    error: str | None = None
    fix: str | None = None
    skipped: str | None = None
    """Why the check was not tried (a torch_npu without the graph task API: the engine runs
    eager there and says so), which is not a failure."""

    @property
    def ok(self) -> bool:
        return self.ran or self.skipped is not None

    def lines(self) -> list[str]:
        if self.ran:
            return [f"  {self.name:<14} ran"]
        if self.skipped is not None:
            return [f"  {self.name:<14} skipped: {self.skipped}"]
        return [f"  {self.name:<14} FAILED: {self.error}", f"  {'':<14} fix: {self.fix}"]


def fix_for(name: str, error: Exception | str) -> str:
    """What to do about a failed check, read off its error first (the driver's and loader's
    messages are specific), else the check's usual cause."""
    from .npu import capture_failure
    text = str(error)
    low = text.lower()
    hint = capture_failure(error, 0) if isinstance(error, Exception) else None
    if hint is not None:
        return hint
    if re.search(r"libatb|\batb\b|nnal", low):
        return (f"`{ATB_ENV}` before starting (the _npu_* ops load NNAL's libatb.so); install "
                "the NNAL package of your CANN release if that script is missing")
    if "differs from torch" in low:
        return ("the op ran and answered wrong: send this report (README, Ascend NPU) and run "
                "with graph_mode='eager' meanwhile if only the graph check failed")
    if isinstance(error, AttributeError):
        return ("this torch_npu lacks the op: install the torch_npu release paired with your "
                "torch and CANN (README, Ascend NPU), with the CANN toolkit sourced")
    if name in ("cache write", "paged decode"):
        return f"`{TOOLKIT_ENV}` and `{ATB_ENV}` (the ATB ops need both), then retry"
    if name == "FIA prefill":
        return (f"`{TOOLKIT_ENV}`; npu_fused_infer_attention_score needs the CANN kernels "
                "package for this chip, matched to the toolkit")
    return ("graph capture needs an Ascend HDK (driver) of 25.5.1 or later with its matching "
            "CANN; meanwhile graph_mode='eager' runs without graphs")


def _attend(q, keys, values, causal):
    """torch's answer on the same device, in fp32."""
    q, k, v = (t.float().transpose(0, 1) for t in (q, keys, values))
    k = k.repeat_interleave(HEADS // KV_HEADS, 0)
    v = v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(D)
    if causal:
        n, m = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device)
                                    .triu(m - n + 1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _close(got, want, what):
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    if not err <= 2e-2:
        raise RuntimeError(f"{what} differs from torch (max relative error {err:.3g})")


def run_checks(platform) -> list[OpCheck]:
    """The four checks on `platform` (an NpuPlatform); each runs whatever the others did
    (check 2 refills the block check 1 was to write)."""
    from .npu_attention import DecodeGraphTasks
    npu, dev, api = platform.torch_npu, platform.device, platform.api
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dev, torch.bfloat16)  # noqa: E731
    k_cache = torch.zeros(2, BLOCK, KV_HEADS, D, dtype=torch.bfloat16, device=dev)
    v_cache = torch.zeros_like(k_cache)
    keys, values = rand(LEN, KV_HEADS, D), rand(LEN, KV_HEADS, D)
    table = torch.tensor([[1]], dtype=torch.int32).to(dev)
    lens = torch.tensor([LEN], dtype=torch.int32)          # host memory, as the op reads it
    q1 = rand(1, HEADS, D)
    checks = []

    def cache_write():
        slots = torch.arange(BLOCK, BLOCK + LEN, dtype=torch.int32).to(dev)
        npu._npu_reshape_and_cache(key=keys, value=values, key_cache=k_cache,
                                   value_cache=v_cache, slot_indices=slots)
        platform.synchronize()
        if not (torch.equal(k_cache[1, :LEN].cpu(), keys.cpu())
                and torch.equal(v_cache[1, :LEN].cpu(), values.cpu())):
            raise RuntimeError("the cache write differs from torch (not at the slots given)")

    def paged():
        k_cache[1, :LEN], v_cache[1, :LEN] = keys, values     # whatever check 1 did
        out = torch.empty_like(q1)
        npu._npu_paged_attention(query=q1, key_cache=k_cache, value_cache=v_cache,
                                 num_kv_heads=KV_HEADS, num_heads=HEADS, scale_value=D ** -0.5,
                                 block_table=table, context_lens=lens, out=out)
        platform.synchronize()
        _close(out, _attend(q1, keys, values, False), "paged attention")

    def fia():
        from .npu_attention import MASK_SIZE
        q = rand(LEN, HEADS, D)
        mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=dev).triu(1)
        out, _ = npu.npu_fused_infer_attention_score(
            q, k_cache.view(2, BLOCK, KV_HEADS * D), v_cache.view(2, BLOCK, KV_HEADS * D),
            atten_mask=mask, actual_seq_lengths=[LEN], actual_seq_lengths_kv=[LEN],
            block_table=table, num_heads=HEADS, scale=D ** -0.5, input_layout="TND",
            num_key_value_heads=KV_HEADS, sparse_mode=3, block_size=BLOCK)
        platform.synchronize()
        _close(out, _attend(q, keys, values, True), "fused infer attention")

    def graph():
        out = torch.empty_like(q1)
        args = dict(query=q1, key_cache=k_cache, value_cache=v_cache, num_kv_heads=KV_HEADS,
                    num_heads=HEADS, scale_value=D ** -0.5, block_table=table, out=out)
        tasks = DecodeGraphTasks(api.NPUGraph())
        with api.graph(tasks.graph, pool=platform.graph_pool()):
            tasks.capture(npu, args, torch.ones(1, dtype=torch.int32))
        platform.synchronize()
        platform.replay_graph(tasks, lens.clone())
        platform.synchronize()
        _close(out, _attend(q1, keys, values, False), "the replayed, updated graph")

    for name, fn in (("cache write", cache_write), ("paged decode", paged),
                     ("FIA prefill", fia), ("graph", graph)):
        if name == "graph" and not platform.supports_graphs:
            checks.append(OpCheck(name, False, skipped=(
                "this torch_npu has no graph task API or paged-attention workspace, so every "
                "graph mode runs eager; a torch_npu of the 7.2.0 line or later has them")))
            continue
        try:
            fn()
            checks.append(OpCheck(name, True))
        except Exception as e:     # each check reports its own failure; the others still run
            checks.append(OpCheck(name, False, f"{type(e).__name__}: {e}"[:600],
                                  fix_for(name, e)))
    return checks


def doctor() -> tuple[object, list[OpCheck]]:
    """The probe's report and, unless it refuses the chip, the op checks (run on a real
    NpuPlatform, the one the engine would build)."""
    from .npu import NpuPlatform, import_torch_npu, probe
    report = probe(import_torch_npu())
    if report.refusal:
        return report, []
    return report, run_checks(NpuPlatform())


def as_json(report, checks: list[OpCheck]) -> dict:
    """One JSON-able dict: the report's fields and each check's outcome."""
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(report).items()}
    out["torch"] = torch.__version__
    out["ops"] = [asdict(c) for c in checks]
    out["ok"] = not report.refusal and all(c.ok for c in checks)
    return out
