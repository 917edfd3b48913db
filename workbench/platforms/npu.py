"""Ascend NPU through torch_npu, imported only when this platform is asked for.

torch_npu hooks itself into `import torch` and fails without the CANN runtime, so it is never
a hard dependency: the engine only looks for it (`find_spec`) when choosing a device, and
imports it when the NPU platform is actually selected. Attention runs on torch_npu's fused
ops (`npu_attention.py`), written from their documented signatures and vLLM-Ascend's use of
them; nothing here has run on NPU hardware yet.

At construction the platform probes what it runs on (`probe`, printed by `workbench doctor
--device npu`): the torch_npu and CANN versions, the chip, the head sizes the fused ops
take there, and whether decode graphs can be captured. It refuses the chips this backend
cannot serve (310P, 950) with a message, rather than failing at the first step.

The default graph mode is 'full' (`default_graph_mode`), which on the NPU is vLLM-Ascend's
default PIECEWISE: every step, decode included, replays captured pieces with attention run
eager between them, on the ops vLLM-Ascend ran on the CANN release found (attention_path:
the ATB ops before CANN 8.3.RC1, npu_fused_infer_attention_score in TND layout after, decode-
only steps on _npu_paged_attention until 8.3.RC2), so no host-side length is baked into any
graph. Whole-step decode graphs with `_npu_paged_attention` are opt-in, as in
vLLM-Ascend (FULL_DECODE_ONLY, only for the batch sizes in its `pa_shape_list`, empty by
default): graph_mode 'decode', or EngineConfig.pa_shape_list (`decode_graph_sizes`).

Those decode graphs follow vLLM-Ascend's FULL_DECODE_ONLY: the graph is
captured plainly (no auto_dispatch_capture: several torch_npu releases record no
`_npu_paged_attention` that way, and NPUGraph.update then updates nothing and says nothing),
each layer's paged attention is captured as a task group behind an ExternalEvent with an
explicit workspace (npu_attention.DecodeGraphTasks), and every replay is: synchronize,
replay, then re-issue each task with the step's host lengths on a separate update stream
and record its event (replay_graph). Piecewise graphs (graph_mode 'full') hold no
attention and replay plainly.
"""
from __future__ import annotations

import gc
import importlib.util
import logging
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass
from unittest import mock

import torch

from .base import AcceleratorPlatform
from .npu_releases import (cann_release, FIA_FROM, FIA_DECODE_FROM, AttentionPath, ATB_PATH, FIA_PA_PATH, FIA_PATH, attention_path, supported_head_sizes, head_size_refusal, FIA_TND_BF16)  # noqa: F401

log = logging.getLogger("workbench")
INSTALL_HINT = ("device 'npu' needs Ascend's torch_npu matched to your torch version and a "
                "sourced CANN toolkit: `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
                "then `pip install -e \".[npu]\"` (see README, Ascend NPU)")

GRAPH_TASK_API = ("NPUGraph", "ExternalEvent", "graph_task_group_begin", "graph_task_group_end",
                  "graph_task_update_begin", "graph_task_update_end")
"""torch.npu's names the decode-graph update uses (all there since torch_npu 2.5.1)."""


def import_torch_npu():
    """Import torch_npu, turning any failure into one clear message."""
    if importlib.util.find_spec("torch_npu") is None:
        raise ValueError(f"{INSTALL_HINT}; torch_npu is not installed")
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as e:   # missing CANN libraries raise OSError/RuntimeError, not ImportError
        raise ValueError(f"{INSTALL_HINT}; importing torch_npu failed: {e}") from e
    return torch_npu


def chip_family(soc_version: int) -> str:
    """torch_npu.npu.get_soc_version()'s number as a family, with vLLM-Ascend's ranges."""
    if 220 <= soc_version <= 225:
        return "A2"           # Atlas A2: 910B
    if 250 <= soc_version <= 255:
        return "A3"           # Atlas A3: 910C
    if 200 <= soc_version <= 205:
        return "310P"
    if soc_version == 260:
        return "950"          # A5
    return "unknown"


REFUSED_CHIPS = {
    "310P": ("vLLM-Ascend serves it with a separate backend (_npu_flash_attention with NZ-format "
             "masks, no npu_fused_infer_attention_score), which this project does not have"),
    "950": ("npu_fused_infer_attention_score is documented there, but _npu_paged_attention, "
            "which this backend's decode needs, is not used on it by vLLM-Ascend"),
    "unknown": "this backend was written for Atlas A2 (910B) and A3 (910C) only",
}


MAX_GRAPHS = 1800
"""The graphs one process captures at most: vLLM-Ascend's MAX_CAPTURE_SIZE (utils.py
update_aclgraph_sizes at v0.11.0, 2f1aed98cc, lines 381-387: bounded by the 2048 streams,
248 kept spare), which it meets by sampling its capture sizes uniformly, first and last kept
(lines 462-470). NpuPlatform.piecewise_graph_sizes does the same."""


def vllm_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM's default capture sizes, which vLLM-Ascend captures (piecewise, by token count)
    as vLLM picks them (its set_cudagraph_sizes docstring quotes vLLM's rule): 1, 2, 4, every
    8 up to 248, then every 16, up to min(2 * max_num_seqs, 512); here also no more than the
    step's token budget. A step with more tokens runs eager, as in vLLM."""
    top = min(2 * max_num_seqs, 512, max_num_batched_tokens)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    return [s for s in sizes if s <= top]


def sample_sizes(sizes: list[int], keep: int) -> list[int]:
    """`keep` of `sizes`, spread uniformly, first and last kept (vLLM-Ascend's sampling)."""
    if keep >= len(sizes):
        return sizes
    if keep <= 1:
        return sizes[-1:] if keep == 1 else []
    step = (len(sizes) - 1) / (keep - 1)
    return sorted({sizes[round(i * step)] for i in range(keep)})


STREAM_RESOURCE_ERROR = re.compile(r"\b207008\b|stream resources are insufficient|"
                                   r"insufficient_stream_resources", re.IGNORECASE)
"""ACL_ERROR_RT_NO_STREAM_RESOURCE (207008), as a failed NPUGraph capture reports it."""
OLD_HDK_CAPTURE_ERROR = "alloc sq cq fail"
FEWER_GRAPHS = ("capture fewer graphs: a shorter cudagraph_capture_sizes (the decode batch "
                "sizes), graph_mode='decode' rather than 'full' (piecewise capture takes "
                "num_layers + 1 graphs per token bucket, and a smaller max_num_batched_tokens "
                "means fewer buckets), or graph_mode='eager'")


def capture_failure(error: Exception, captured: int) -> str | None:
    """What a failed graph capture means when the driver ran out of what graphs take, with
    the fix; None for any other failure. Facts as vLLM-Ascend has them (acl_graph.py, PR
    #10555 at 182b75ea84ff): error 207008 / 'Stream resources are insufficient' is the HDK
    (driver) running out of stream resources, which every captured graph uses some of (newer
    HDK/CANN stacks allow many more graphs); 'Alloc sq cq fail' is the signature of an HDK
    older than 25.5.1 failing to allocate a stream's submission/completion queues."""
    text = str(error)
    if OLD_HDK_CAPTURE_ERROR in text.lower():
        return (f"NPU graph capture failed after {captured} graphs with 'Alloc sq cq fail': the "
                "driver could not allocate a stream's submission/completion queues (sq/cq), "
                "the failure of Ascend HDK releases before 25.5.1; update the HDK (driver) to "
                f"25.5.1 or later with its matching CANN, or {FEWER_GRAPHS}")
    if STREAM_RESOURCE_ERROR.search(text):
        return (f"NPU graph capture failed after {captured} graphs with error 207008 (no stream "
                "resource): the HDK driver has run out of the stream resources that captured "
                f"graphs take; {FEWER_GRAPHS}; a newer HDK/CANN lets more graphs be captured")
    return None


@dataclass
class NpuReport:
    """What the NPU platform found and decided (`workbench doctor --device npu` prints it)."""
    torch_npu: str
    cann: str | None
    soc_version: int
    device_name: str
    chip: str
    head_sizes: tuple[int, ...]
    attention: str
    """The attention path on this CANN (AttentionPath.name) and its ops."""
    graphs: bool
    """Whether decode graphs can be captured (else every graph_mode runs eager)."""
    graph_update: str
    """How a replayed decode graph gets each step's host-side context lengths, and why."""
    refusal: str | None = None
    """Why this device cannot be used at all, or None."""

    def lines(self) -> list[str]:
        out = [f"torch_npu      {self.torch_npu} (torch {torch.__version__})",
               f"CANN           {self.cann or 'unknown'}",
               f"chip           {self.device_name}, soc_version {self.soc_version} "
               f"({self.chip})",
               f"head sizes     {', '.join(map(str, self.head_sizes))}",
               f"attention      {self.attention}",
               f"decode graphs  {'yes' if self.graphs else 'no'}: {self.graph_update}"]
        out.append(f"verdict        {'REFUSED: ' + self.refusal if self.refusal else 'usable'}")
        return out


def probe(torch_npu) -> NpuReport:
    """Read versions, chip and graph support from an imported torch_npu; decide nothing
    the hardware has not told us."""
    npu = torch_npu.npu
    try:
        cann = npu.utils.get_cann_version()
    except Exception:
        cann = getattr(torch.version, "cann", None)
    soc = int(npu.get_soc_version())
    chip = chip_family(soc)
    refusal = None
    if chip in REFUSED_CHIPS:
        refusal = (f"device 'npu': soc_version {soc} is an Ascend {chip} chip; "
                   f"{REFUSED_CHIPS[chip]}. Supported: Atlas A2/A3")
    missing = [n for n in GRAPH_TASK_API if not hasattr(npu, n)]
    if not hasattr(torch_npu, "_npu_paged_attention_get_workspace"):
        missing.append("torch_npu._npu_paged_attention_get_workspace")
    if missing:
        update = (f"none: this torch_npu lacks {', '.join(missing)} (the workspace API arrived "
                  "with the 7.2.0 release line: 2.6.0.post3, 2.7.1, 2.8.0); graph modes run eager")
    else:
        update = ("default graph mode 'full': piecewise, attention (decode included) eager "
                  "between the pieces, on the attention path above; opt-in "
                  "whole-step decode graphs (graph_mode 'decode' or pa_shape_list) capture "
                  "_npu_paged_attention as task groups (graph_task_group_begin/end behind an "
                  "ExternalEvent per layer) with lengths and workspace at 6144 tokens or as "
                  "many as their tables hold (npu_attention.capture_lens); each "
                  "step synchronizes, replays, then re-issues each task with its lengths and "
                  "a workspace queried for them on an update stream "
                  "(graph_task_update_begin/end) and records its event. Not "
                  "auto_dispatch_capture: 2.5.1.post1, 2.7.1, 2.8.0 and 2.8.0.post1 record no "
                  "_npu_paged_attention that way, and NPUGraph.update then silently keeps the "
                  "capture-time lengths")
    path = attention_path(cann)
    ops = (f"{path.name}: prompts {path.prompt}, chunks and mixed steps {path.chunked}, "
           f"eager decode {path.decode}; {'/'.join(str(d)[6:] for d in path.dtypes)}")
    return NpuReport(torch_npu=str(torch_npu.__version__), cann=cann, soc_version=soc,
                     device_name=str(npu.get_device_name(0)), chip=chip,
                     head_sizes=path.head_sizes, attention=ops, graphs=not missing,
                     graph_update=update, refusal=refusal)


def _no_op(*args, **kwargs):
    return None


class NpuPlatform(AcceleratorPlatform):
    name = "npu"
    graph_class = "NPUGraph"
    default_graph_mode = "full"
    """vLLM-Ascend's default (PIECEWISE): captured pieces with attention eager between them,
    decode steps included, so its fused infer-attention op takes each step's lengths as
    plain host lists and nothing needs a task update. vLLM-Ascend keeps _npu_paged_attention
    for FULL_DECODE_ONLY graphs at the batch sizes of pa_shape_list, a tuning knob empty by
    default (docs/source/faqs.md, attention/utils.py using_paged_attention at 182b75ea84ff);
    here that is graph_mode 'decode' or EngineConfig.pa_shape_list."""

    def __init__(self):
        self.torch_npu = import_torch_npu()
        self.report = probe(self.torch_npu)
        log.info("NPU platform:\n  %s", "\n  ".join(self.report.lines()))
        if self.report.refusal:
            raise ValueError(self.report.refusal)
        self._attention = None
        self._update_stream = None
        self._captured = 0
        """Graphs this platform has captured (the driver's stream budget is per process)."""

    @classmethod
    def is_available(cls) -> bool:
        """Cheap and safe for device='auto': False unless torch_npu imports and sees a device."""
        if importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            import_torch_npu()
            return bool(torch.npu.is_available())
        except ValueError:
            return False

    @property
    def supports_graphs(self) -> bool:
        return self.report.graphs

    @staticmethod
    def piecewise_graph_sizes(config, num_layers: int, decode_graphs: int) -> list[int]:
        """Token buckets as vLLM picks capture sizes (vllm_capture_sizes: 1, 2, 4, 8, 16, 24,
        ...), so a batch-1 decode replays a 1-token graph, not one padded to 16; then thinned
        uniformly until every graph (num_layers + 1 per bucket, and the decode graphs) fits
        MAX_GRAPHS."""
        sizes = vllm_capture_sizes(config.max_num_seqs, config.max_num_batched_tokens)
        keep = max(0, (MAX_GRAPHS - decode_graphs) // (num_layers + 1))
        thinned = sample_sizes(sizes, keep)
        if len(thinned) < len(sizes):
            log.info("NPU: %d piecewise buckets of %d graphs each would pass %d graphs; "
                     "capturing %d of them: %s", len(sizes), num_layers + 1, MAX_GRAPHS,
                     len(thinned), thinned)
        return thinned

    @staticmethod
    def decode_graph_sizes(config, mode: str) -> list[int] | None:
        """The batch sizes captured whole with _npu_paged_attention: pa_shape_list where it is
        set; else none under 'full' (every decode step then replays piecewise) and the
        runner's cudagraph_capture_sizes when 'decode' is asked for by name."""
        if config.pa_shape_list is not None:
            return sorted(set(config.pa_shape_list))
        return [] if mode == "full" else None

    def check_config(self, config) -> None:
        """Refuse graph capture under ASCEND_LAUNCH_BLOCKING=1, at build rather than in the
        middle of a capture: launch blocking (a debugging aid) runs every operator
        synchronously, which graph capture does not work with; vLLM-Ascend refuses the same
        pair (platform.py, PR #3574). graph_mode None counts where the device's choice
        (default_graph_mode) would capture. Also refuses pa_shape_list with graph_mode
        'eager', which would capture none of the graphs it names."""
        if config.pa_shape_list is not None and config.graph_mode == "eager":
            raise ValueError("pa_shape_list: names batch sizes for whole-step decode graphs, "
                             "and graph_mode='eager' captures none; leave graph_mode unset "
                             f"(the NPU's {self.default_graph_mode!r}) or ask for 'decode'")
        if os.environ.get("ASCEND_LAUNCH_BLOCKING", "0") != "1":
            return
        mode = config.graph_mode
        if mode == "eager" or (mode is None and not self.supports_graphs):
            return
        asked = (f"{mode!r}" if mode is not None
                 else f"None (the device's choice, which is {self.default_graph_mode!r} here)")
        raise ValueError(
            f"graph_mode: {asked} captures NPU graphs, and ASCEND_LAUNCH_BLOCKING=1 in the "
            "environment runs every launch synchronously, which graph capture does not work "
            "with; use graph_mode='eager' to debug with launch blocking, or unset "
            "ASCEND_LAUNCH_BLOCKING (or set it to 0) to capture graphs")

    def check_model(self, model) -> None:
        r = self.report
        if model.head_dim not in r.head_sizes:
            raise ValueError(head_size_refusal(model.head_dim, r.cann, r.device_name, r.chip))

    def capture_graph(self, fn, pool):
        """Capture `fn`; the decode attention it runs is recorded as updatable task groups
        (npu_attention.DecodeGraphTasks). Returns the tasks, which wrap the graph, when there
        are any, else the plain NPUGraph (a piecewise piece). A capture the driver cannot
        give stream resources to fails with what to change (capture_failure)."""
        from .npu_attention import DecodeGraphTasks
        self.warm_up(fn)
        graph = self.api.NPUGraph()
        tasks = DecodeGraphTasks(graph)
        if self._attention is not None:
            self._attention.graph_tasks = tasks
        try:
            with ExitStack() as stack:
                if self._captured:
                    # torch_npu's graph context synchronizes, runs gc.collect() and empties
                    # the caching allocator at every capture (torch_npu/npu/graphs.py
                    # __enter__, Ascend/pytorch 9e73e70 lines 898-906); vLLM-Ascend lets
                    # only its first capture do gc and empty_cache (compilation/
                    # acl_graph.py at v0.11.0, lines 139-149). Here the synchronize goes
                    # too: warm_up has queued its runs on a stream the capture stream
                    # follows, and the runner synchronizes once after its last capture.
                    stack.enter_context(mock.patch.object(gc, "collect", _no_op))
                    for name in ("empty_cache", "synchronize"):
                        stack.enter_context(mock.patch.object(self.api, name, _no_op))
                    if hasattr(self.torch_npu.npu, "host_empty_cache"):
                        stack.enter_context(mock.patch.object(
                            self.torch_npu.npu, "host_empty_cache", _no_op))
                stack.enter_context(self.api.graph(graph, pool=pool))
                out = fn()
        except RuntimeError as e:
            hint = capture_failure(e, self._captured)
            if hint is None:
                raise
            raise RuntimeError(hint) from e
        finally:
            if self._attention is not None:
                self._attention.graph_tasks = None
        if not self._captured:
            self.api.synchronize()
        self._captured += 1
        return (tasks if tasks.tasks else graph), out

    def replay_graph(self, graph, context_lens: torch.Tensor | None = None) -> None:
        from .npu_attention import DecodeGraphTasks
        if context_lens is None:
            if isinstance(graph, DecodeGraphTasks):
                raise RuntimeError("a decode graph replays only with its step's context lengths")
            graph.replay()
            return
        if not isinstance(graph, DecodeGraphTasks):
            raise RuntimeError("this graph recorded no paged attention to update: replaying it "
                               "would attend over the capture-time context lengths")
        if self._update_stream is None:
            self._update_stream = self.api.Stream()
        # vLLM-Ascend's order: the previous replay must be over before tasks it may still be
        # running are updated; then replay (each captured attention waits on its event);
        # then update each task on the update stream and record its event.
        self.api.current_stream().synchronize()
        graph.graph.replay()
        try:
            graph.update(self.torch_npu, self._update_stream, context_lens)
        except Exception as e:
            # The replay now waits on the ExternalEvents of the tasks not yet updated: record
            # them (the tasks run with their last arguments, over blocks their tables name)
            # so it finishes, then fail this step only: the engine fails its requests and
            # serves on (EngineCore's loop), the graph replays again at the next step.
            errors = graph.release(self.torch_npu, self._update_stream)
            try:
                self.api.synchronize()
            except Exception as sync_error:
                errors.append(f"synchronize: {sync_error}")
            raise RuntimeError(
                f"NPU decode graph: the task update after replay failed ({type(e).__name__}: "
                f"{e}); the replay was released and this step's output discarded"
                + (f"; releasing also failed: {'; '.join(errors)}" if errors else "")) from e

    def model_ops(self, dtype):
        from .npu_ops import NpuOps
        return NpuOps(self.torch_npu)

    def attention_backend(self, dtype, choice: str = "auto"):
        if choice != "auto":
            raise ValueError("attention_backend: the NPU runs its fused ops; 'reference' is "
                             "the CPU/CUDA plain-torch path")
        from .npu_attention import NpuAttention
        self._attention = NpuAttention(dtype, self.torch_npu, attention_path(self.report.cann))
        return self._attention

    @classmethod
    def attention_backend_classes(cls) -> tuple[type, ...]:
        from .npu_attention import NpuAttention
        return (NpuAttention,)
