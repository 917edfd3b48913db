"""`workbench doctor --device npu`: what was found, then the default path's calls, checked.

The probe (npu.probe) says what torch_npu and CANN claim; it cannot say whether the ops run.
A host can import torch_npu and still lack what an op needs at its first launch: the ATB ops
(`_npu_*`) load NNAL's libatb.so, which only a sourced `nnal/atb/set_env.sh` puts on the
library path; the fused infer-attention op needs the CANN kernels package for the chip; a
graph capture needs stream resources the HDK driver hands out (error 207008, or 'Alloc sq cq
fail' before HDK 25.5.1). So the doctor first reports torch, torch_npu, `torch.version.cann`,
the CANN version file and the SoC, then runs, through the engine's own NpuAttention on the
attention path of the release found (npu.attention_path), in bf16 with head size 128, 16
query heads and 2 KV heads, block size 128, each compared with torch:

1. kv write: `_npu_reshape_and_cache` into one layer's view of the real pool layout;
2. decode: a decode-only batch with KV lengths 1, 127, 129 and 300;
3. chunk: a 50-token chunk after a 200-token cached prefix;
4. prefill: three prompts with nothing cached (5, 60 and 130 tokens);
5. graph: a paged-attention task-group graph (npu_attention.DecodeGraphTasks) at table
   widths 16 and 48, replayed three steps with changing lengths through
   NpuPlatform.replay_graph (skipped, not failed, where this torch_npu has no task API);
6. refusals: what the engine refuses here and why (fp16, head size 64), from the same rules
   the engine applies at build.

Each is reported ran / failed with the error and the fix; `--report FILE` writes it all as
JSON to attach to a bug report. A result that differs from torch counts as a failure: an op
that runs and answers wrong is what a first hardware run most needs to hear about.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import torch

TOOLKIT_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"
ATB_ENV = "source /usr/local/Ascend/nnal/atb/set_env.sh"
BLOCK, HEADS, KV_HEADS, D = 128, 16, 2, 128
"""The default path's shapes: block 128, head size 128 (every release's path takes it), GQA."""
NUM_BLOCKS = 16
CANN_VERSION_FILES = ("/usr/local/Ascend/ascend-toolkit/latest/version.cfg",
                      "/usr/local/Ascend/ascend-toolkit/latest/compiler/version.info",
                      "/usr/local/Ascend/ascend-toolkit/latest/runtime/version.info")


@dataclass
class OpCheck:
    name: str
    ran: bool
    error: str | None = None
    fix: str | None = None
    skipped: str | None = None
    """Why the check was not tried (a torch_npu without the graph task API: the engine runs
    eager there and says so), which is not a failure."""
    detail: str | None = None
    """What a check that ran found (the refusals: what is refused and why)."""

    @property
    def ok(self) -> bool:
        return self.ran or self.skipped is not None

    def lines(self) -> list[str]:
        if self.ran:
            return [f"  {self.name:<14} ran" + (f": {self.detail}" if self.detail else "")]
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
    if name in ("kv write", "decode"):
        return f"`{TOOLKIT_ENV}` and `{ATB_ENV}` (the ATB ops need both), then retry"
    if name in ("chunk", "prefill"):
        return (f"`{TOOLKIT_ENV}`; npu_fused_infer_attention_score needs the CANN kernels "
                "package for this chip, matched to the toolkit")
    return ("graph capture needs an Ascend HDK (driver) of 25.5.1 or later with its matching "
            "CANN; meanwhile graph_mode='eager' runs without graphs")


def _attend(q, keys, values):
    """torch's answer, in fp32: q [n, H, D] over keys/values [L, kvH, D], causal aligned to
    the end (a decode's one query sees everything)."""
    q, k, v = (t.float().cpu().transpose(0, 1) for t in (q, keys, values))
    k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
    v = v.repeat_interleave(q.shape[0] // v.shape[0], 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    n, m = scores.shape[-2:]
    scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(m - n + 1),
                                float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _close(got, want, what):
    got, want = got.float().cpu(), want.float().cpu()
    err = float((got - want).abs().max() / want.abs().max())
    if not err <= 2e-2:
        raise RuntimeError(f"{what} differs from torch (max relative error {err:.3g})")


def versions(torch_npu) -> dict:
    """torch, torch_npu, torch.version.cann, the CANN version file(s) and the SoC."""
    out = {"torch": torch.__version__, "torch_npu": str(getattr(torch_npu, "__version__", "?")),
           "torch.version.cann": getattr(torch.version, "cann", None), "cann_version_files": {}}
    for path in CANN_VERSION_FILES:
        try:
            with open(path) as f:
                out["cann_version_files"][path] = f.read(2000).strip()
        except OSError:
            pass
    try:
        out["soc_version"] = int(torch_npu.npu.get_soc_version())
    except Exception as e:
        out["soc_version"] = f"unreadable: {e}"
    return out


class _Pool:
    """One engine's KV pool (NpuAttention.bind: [layers, K/V, blocks, block_size, kv_heads,
    D]) of two layers; checks use layer 1's views, filled with known K/V."""

    def __init__(self, backend, dev, gen):
        self.backend, self.dev, self.gen = backend, dev, gen
        self.pool = backend.bind(2, HEADS, KV_HEADS, D, NUM_BLOCKS, BLOCK, dev)
        self.k, self.v = self.pool[1][0], self.pool[1][1]

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dev, torch.bfloat16)

    def step(self, reqs: list[tuple[int, int]], width: int | None = None, decode=False):
        """A step of requests (cached tokens, new tokens), all decodes (one new token each)
        or all prefill chunks: fills each one's cached K/V straight into its blocks, returns the
        step's CommonAttentionMetadata, its q/k/v and what torch says each request's
        attention is."""
        null = 0      # the block pool's null block (core.block_manager.NULL_BLOCK): padding
        from .attention import CommonAttentionMetadata
        self.pool.zero_()
        rows, slots, qs, ks, vs, want, nxt = [], [], [], [], [], [], 1
        for cached, new in reqs:
            n_blocks = -(-(cached + new) // BLOCK)
            blocks = list(range(nxt, nxt + n_blocks))
            nxt += n_blocks
            assert nxt <= NUM_BLOCKS
            rows.append(blocks)
            keys = self.rand(cached + new, KV_HEADS, D)
            values = self.rand(cached + new, KV_HEADS, D)
            pos = torch.arange(cached + new)
            b = torch.tensor(blocks)[pos // BLOCK].to(self.dev)
            off = (pos % BLOCK).to(self.dev)
            self.k[b[:cached], off[:cached]] = keys[:cached]
            self.v[b[:cached], off[:cached]] = values[:cached]
            slots += (torch.tensor(blocks)[pos[cached:] // BLOCK] * BLOCK
                      + pos[cached:] % BLOCK).tolist()
            q = self.rand(new, HEADS, D)
            qs.append(q), ks.append(keys[cached:]), vs.append(values[cached:])
            want.append(_attend(q, keys, values))
        width = width or max(map(len, rows))
        table = torch.full((len(reqs), width), null, dtype=torch.long)
        for i, r in enumerate(rows):
            table[i, :len(r)] = torch.tensor(r)
        counts = torch.tensor([new for _, new in reqs])
        qsl = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        lens = torch.tensor([c + n for c, n in reqs])
        nd = len(reqs) if decode else 0
        common = CommonAttentionMetadata(qsl.to(self.dev), lens.to(self.dev), table.to(self.dev),
                                         torch.tensor(slots).to(self.dev), nd,
                                         query_start_loc_cpu=qsl, seq_lens_cpu=lens)
        return common, torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(want)


def refusals(report) -> str:
    """What the engine refuses on this release, from its own rules (npu.attention_path)."""
    from .npu import attention_path, head_size_refusal
    path = attention_path(report.cann)
    fp16 = ("fp16 taken" if torch.float16 in path.dtypes
            else f"fp16 refused: {path.why_dtypes}")
    d64 = ("head size 64 taken" if 64 in path.head_sizes
           else "head size 64 refused: " + head_size_refusal(64, report.cann))
    return f"{fp16}; {d64}"


def run_checks(platform) -> list[OpCheck]:
    """The checks on `platform` (an NpuPlatform), through the engine's own attention backend
    on this release's path; each runs whatever the others did."""
    from .npu import attention_path
    from .npu_attention import DecodeGraphTasks, NpuAttention
    npu, dev = platform.torch_npu, platform.device
    backend = NpuAttention(torch.bfloat16, npu, attention_path(platform.report.cann))
    pool = _Pool(backend, dev, torch.Generator().manual_seed(0))
    scale = D ** -0.5

    def forward(reqs, what, decode=False):
        common, q, k, v, want = pool.step(reqs, decode=decode)
        out = backend.forward(q, k, v, pool.k, pool.v, backend.build(common), scale)
        platform.synchronize()
        _close(out, want, what)

    def kv_write():
        common, _, k, v, _ = pool.step([(0, 6)])
        npu._npu_reshape_and_cache(key=k, value=v, key_cache=pool.k, value_cache=pool.v,
                                   slot_indices=common.slot_mapping.to(torch.int32))
        platform.synchronize()
        if not (torch.equal(pool.k[1, :6].cpu(), k.cpu())
                and torch.equal(pool.v[1, :6].cpu(), v.cpu())
                and not pool.pool[0].any()):
            raise RuntimeError("the kv write differs from torch (not at the slots given, or "
                               "into another layer)")

    def graph():
        lens_steps = ([1, 127, 129, 300], [2, 128, 130, 301], [50, 129, 131, 302])
        for width in (16, 48):
            common, q, k, v, _ = pool.step([(n - 1, 1) for n in lens_steps[-1]], width, True)
            meta = backend.build(common)
            npu._npu_reshape_and_cache(key=k, value=v, key_cache=pool.k, value_cache=pool.v,
                                       slot_indices=meta.slot_mapping)
            out = torch.zeros_like(q)
            args = dict(query=q, key_cache=pool.k, value_cache=pool.v, num_kv_heads=KV_HEADS,
                        num_heads=HEADS, scale_value=scale, block_table=meta.decode_block_tables,
                        out=out)
            tasks = DecodeGraphTasks(platform.api.NPUGraph())
            with platform.api.graph(tasks.graph, pool=platform.graph_pool()):
                tasks.capture(npu, args, meta.decode_lens)
            platform.synchronize()
            for lens in lens_steps:
                platform.replay_graph(tasks, torch.tensor(lens, dtype=torch.int32))
                platform.synchronize()
                table = meta.decode_block_tables.long().cpu()
                want = []
                for i, n in enumerate(lens):
                    pos = torch.arange(n)
                    b, off = table[i][pos // BLOCK], pos % BLOCK
                    want.append(_attend(q[i:i + 1], pool.k[b.to(dev), off.to(dev)],
                                        pool.v[b.to(dev), off.to(dev)]))
                _close(out, torch.cat(want), f"the replayed graph (table width {width}, "
                                             f"lengths {lens})")

    checks = []
    for name, fn in (("kv write", kv_write),
                     ("decode", lambda: forward([(0, 1), (126, 1), (128, 1), (299, 1)],
                                                "decode attention", decode=True)),
                     ("chunk", lambda: forward([(200, 50)], "a chunk after a cached prefix")),
                     ("prefill", lambda: forward([(0, 5), (0, 60), (0, 130)], "prefill")),
                     ("graph", graph)):
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
    checks.append(OpCheck("refusals", True, detail=refusals(platform.report)))
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
    import sys
    if "torch_npu" in sys.modules:
        out["versions"] = versions(sys.modules["torch_npu"])
    out["torch"] = torch.__version__
    out["ops"] = [asdict(c) for c in checks]
    out["ok"] = not report.refusal and all(c.ok for c in checks)
    return out


def run_doctor(report_path: str | None = None) -> int:
    """`workbench doctor --device npu`: print what was found and each check, write it all as
    JSON to `report_path` if given; 0 when the chip is taken and every check passed."""
    import json
    report, checks = doctor()
    print("\n".join(report.lines()))
    if not report.refusal:
        print("checks         the default path's calls on this release, against torch (bf16, "
              "head size 128, 16 query / 2 KV heads, block size 128)")
        for c in checks:
            print("\n".join(c.lines()))
    if report_path:
        with open(report_path, "w") as f:
            json.dump(as_json(report, checks), f, indent=1, default=str)
        print(f"report         written to {report_path} (attach it to a bug report)")
    if report.refusal:
        return 1
    return 0 if all(c.ok for c in checks) else 1
