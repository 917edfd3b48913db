"""Which attention path the NPU runs on which torch_npu / CANN release, and what each path
takes (head sizes, dtypes), from op-plugin's docs and vLLM-Ascend's release branches at the
commits cited beside each rule. npu.py chooses with these; the doctor and the fake follow them.
Nothing here imports torch_npu."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch


def cann_release(text: str | None) -> tuple[int, ...]:
    """A CANN version in release order: '8.3.RC1' -> (8, 3, 0, 1), '8.3.RC2' -> (8, 3, 0, 2),
    '8.5.0' -> (8, 5, 1, 0) (a line's release candidates come before its releases); a build
    of neither form ('9.0.T102') counts as its line's first candidate; unparsable -> ()."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(RC)?(\d+))?", text or "", re.IGNORECASE)
    if not m:
        return ()
    major, minor, rc, n = m.groups()
    return (int(major), int(minor), 0 if rc or n is None else 1, int(n or 0))


FIA_FROM = (8, 3, 0, 1)
"""CANN 8.3.RC1: the first release whose npu_fused_infer_attention_score takes our call (TND,
head size 128, paged KV, fewer KV heads than query heads). Before it, op-plugin's doc of the
op allows TND only with Q_D = K_D = 192, equal query/key/value head counts and no page
attention, bf16 only (docs/context/torch_npu-npu_fused_infer_attention_score.md at 480bc43,
the 7.1.0 line of torch_npu 2.5.1.post1 / 2.6.0, lines 231-236; op-plugin 8abaa31, the 7.0.0
line of 2.5.1, has no doc and the same kernels' generation); at 691bf15 (7.2.0: torch_npu
2.7.1 / 2.8.0, CANN 8.3.RC1) the same section takes Q_D = K_D = V_D = 128 and no longer asks
for equal head counts (lines 221-224), still bf16 only, and still lists page attention as
unsupported (line 227), which vLLM-Ascend's paged call on 8.3 contradicts.
vLLM-Ascend gated its first paged TND call on `torch.version.cann.startswith("8.3")`
(f1f2c8f5e5, PR #2962) and dropped its older path with the CANN 8.3.RC1 upgrade (#3945)."""

FIA_DECODE_FROM = (8, 3, 0, 2)
"""CANN 8.3.RC2. vLLM-Ascend decodes through npu_fused_infer_attention_score (TND) since
b4bf01ead169 (PR #4531, v0.12.0rc1: torch_npu 2.8.0, its Dockerfile on cann:8.3.rc2), and
its A2 CI ran Llama-3.2-1B (head size 64) through that path on the 8.3.rc2 image from
e11ff8e535b7. Up to v0.11.0 (torch_npu 2.7.1) a decode-only step ran eager
`_npu_paged_attention` (vllm_ascend/attention/attention_v1.py _forward_decode_only at
v0.11.0, 2f1aed98cc, lines 397-499). No earlier CANN was paired with a head size 64 TND call."""


@dataclass(frozen=True)
class AttentionPath:
    """Which torch_npu ops run a step's attention on a CANN release: the path vLLM-Ascend
    ran there (module docstring of npu_attention.py; README, Ascend NPU)."""
    name: str
    """'atb' (CANN before 8.3.RC1), 'fia+pa' (8.3.RC1), 'fia' (8.3.RC2 and later)."""
    prompt: str
    """The op of a step whose requests are all prompts with nothing cached."""
    chunked: str
    """The op of any other step holding a prefill chunk (mixed steps included)."""
    decode: str
    """The op of an eager decode-only step."""
    head_sizes: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    why_dtypes: str
    """Why dtypes is what it is (the refusal's reason)."""
    source: str
    """What it was read from."""


ATB_PATH = AttentionPath(
    "atb", "_npu_flash_attention", "_npu_paged_attention_splitfuse", "_npu_paged_attention",
    (64, 128), (torch.bfloat16, torch.float16), "",
    "vLLM-Ascend v0.9.1-v0.11.0rc0 (torch_npu 2.5.1.post1 / 2.7.1.dev, CANN 8.2.RC1): "
    "attention_v1.py at v0.10.1rc1 (7e16b4a7cd) _forward_prefill_no_cache (flash attention, "
    "lines 282-313), _forward_decode_only (paged attention, 365-412) and _forward_v1_style "
    "(splitfuse, 414-464); head size 64 ran there in its CI (Qwen2.5-0.5B-Instruct, "
    "tests/e2e/singlecard/test_chunked.py:30); _npu_paged_attention needs block_size x head "
    "size <= 128 x 128")
FIA_TND_BF16 = ("npu_fused_infer_attention_score takes TND layout in bfloat16 only (op-plugin "
                "docs/context/torch_npu-npu_fused_infer_attention_score.md at 691bf15, line "
                "224: 数据类型仅支持bfloat16); use dtype='bfloat16'")
FIA_PA_PATH = AttentionPath(
    "fia+pa", "npu_fused_infer_attention_score", "npu_fused_infer_attention_score",
    "_npu_paged_attention", (128,), (torch.bfloat16,), FIA_TND_BF16,
    "vLLM-Ascend v0.11.0 (2f1aed98cc, torch_npu 2.7.1): attention_v1.py _forward_v1_style "
    "(FIA TND, lines 501-563) and _forward_decode_only (lines 397-499); TND head size 128 "
    "only (op-plugin 691bf15 doc, lines 221-224)")
FIA_PATH = AttentionPath(
    "fia", "npu_fused_infer_attention_score", "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score", (64, 128), (torch.bfloat16,), FIA_TND_BF16,
    "vLLM-Ascend v0.12.0rc1 on (b4bf01ead169, PR #4531; torch_npu 2.8.0, CANN 8.3.RC2): "
    "forward_fused_infer_attention for every step")


def attention_path(cann: str | None) -> AttentionPath:
    """The attention path for a CANN version (unknown: the oldest, whose ops every release
    has)."""
    release = cann_release(cann)
    if release >= FIA_DECODE_FROM:
        return FIA_PATH
    if release >= FIA_FROM:
        return FIA_PA_PATH
    return ATB_PATH


def supported_head_sizes(cann: str | None) -> tuple[int, ...]:
    """Head sizes the attention path of this CANN takes with block_size 128."""
    return attention_path(cann).head_sizes


def head_size_refusal(head_dim: int, cann: str | None, device: str = "NPU",
                      chip: str = "") -> str:
    path = attention_path(cann)
    sizes = " or ".join(map(str, path.head_sizes))
    more = ("; head size 64 needs CANN 8.3.RC2 or later (torch_npu 2.8.0 with CANN 8.3.RC2, "
            "or 2.8.0.post2 with 8.5.0)" if head_dim == 64 and path.name == "fia+pa" else "")
    return (f"model: head size {head_dim} is not supported by the NPU's attention on "
            f"{device}{f' ({chip})' if chip else ''} with CANN {cann or 'unknown'}: its path "
            f"({path.name!r}: {path.chunked}, {path.decode}) takes {sizes}{more} "
            "(npu_fused_infer_attention_score in TND layout per op-plugin's doc of that release; "
            "_npu_paged_attention needs block_size x head size <= 128 x 128)")
