from __future__ import annotations

import time

import torch

class Platform:
    """What the engine needs to know about a device. Subclasses fill in the specifics."""
    name = "base"
    default_dtype = torch.float32
    supports_graphs = False
    """Whether this platform can capture and replay step graphs (graph_mode 'decode'/'full')."""
    default_graph_mode = "decode"
    """What graph_mode None means on this platform where it can capture graphs at all
    (supports_graphs; else 'eager'): whole decode steps as graphs, prefill eager, falling
    back to 'eager' where the attention cannot be captured whole (graphs.plan_graphs).
    The NPU's is 'full' (NpuPlatform.default_graph_mode)."""
    runs_async = False
    """Whether device work runs behind the host (queued launches), so that async
    scheduling can overlap the two; the CPU computes each op as it is called."""
    has_device_memory = False
    """Whether the device has memory of its own that a step's inputs are copied into. The
    CPU has not: the runner's host buffers are the step's inputs (executor/staging.py)."""

    @classmethod
    def is_available(cls) -> bool:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    def synchronize(self) -> None:
        """Wait for queued device work (no-op where ops run synchronously)."""

    def device_name(self) -> str:
        """The device in words, e.g. 'NVIDIA H200' (keys per-device caches such as the
        roofline probe's)."""
        return self.name

    def peak_memory_bytes(self) -> int:
        raise NotImplementedError

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window, where the device tracks one."""

    def empty_cache(self) -> None:
        """Hand memory that freed tensors left in the allocator's cache back to the device
        (so memory_info counts it as free)."""

    def host_buffer(self, n: int, dtype) -> torch.Tensor:
        """A host tensor that device-to-host copies can fill without blocking the host."""
        return self.pinned(torch.empty(n, dtype=dtype))

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        """t in page-locked host memory, where the platform has it (else t). A non-blocking
        copy between host and device runs when the copy engine gets to it: from pageable
        memory torch_npu queues the raw host pointer, so a source freed or refilled before
        then is read as garbage. Only a pinned source is safe to copy without waiting, and
        only while nobody writes it before the copy is done (executor/staging.py)."""
        return t

    def record_event(self):
        """A marker after the work queued so far; `.synchronize()` waits for it."""
        return _Done()

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) device memory in bytes, or None where the device does not say (the
        CPU: its KV pool is sized by kv_cache_memory_gb or 1 GiB)."""
        return None

    def graph_pool(self):
        """A memory-pool handle that every captured graph of an engine shares."""
        raise NotImplementedError

    def capture_graph(self, fn, pool) -> tuple[object, object]:
        """Warm `fn` up, capture it into a graph using `pool`, and return (graph, output):
        replaying the graph reruns the captured work, refreshing `output` in place."""
        raise NotImplementedError

    def replay_graph(self, graph, context_lens: torch.Tensor | None = None) -> None:
        """Replay a captured graph. context_lens: this step's host-side lengths, for attention
        ops that read them from host memory (which a graph would otherwise keep as captured)."""
        graph.replay()

    @staticmethod
    def piecewise_graph_sizes(config, num_layers: int, decode_graphs: int
                              ) -> list[int] | None:
        """The token buckets to capture piecewise under graph_mode 'full' (each takes
        num_layers + 1 graphs), given decode_graphs whole-step graphs besides; None: the
        runner's default (graphs.default_piecewise_sizes)."""
        return None

    @staticmethod
    def decode_graph_sizes(config, mode: str) -> list[int] | None:
        """The decode batch sizes to capture as whole-step graphs under graph_mode `mode`;
        None: the runner's default (cudagraph_capture_sizes, or 1, 2, 4, 8, then every 16)."""
        return None

    def best_time(self, fn, reps: int = 5) -> float:
        """Seconds one call of `fn` takes here: one call to warm up, then the best of `reps`,
        each waited for (`synchronize`) before the clock stops.

        The two timers of device work, and what each is for (nothing else times device work):
        - this one, the roofline's measurement: a call as the host sees it, launch and
          wait included. It measures the roofs (roofline.measure_roofs) and the device
          benchmarks' ceilings and graph replays (bench/device_run.py). Best, not median:
          noise (another process, a clock still ramping up) only ever adds time, and a roof
          is what the device can do.
        - `kernel_timer` (accelerators: `time_in_graph`): device time per call replayed from
          a captured graph, in µs, with no launch cost of the host's: what an op costs
          inside a decode step, for ops that pick a kernel by measuring them (the GEMV's
          tuning, triton_ops.TritonOps.prepare)."""
        fn()
        self.synchronize()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    def kernel_timer(self):
        """A function timing device work as a decode step runs it (fn -> µs per call), for
        ops that pick kernels by measuring them; None where this device has none. Not
        `best_time`: see there for the difference."""
        return None

    def check_model(self, model) -> None:
        """Refuse a model whose shapes this device's kernels cannot run (ValueError), at
        engine build rather than at the first step."""

    def attention_backend(self, dtype: torch.dtype, choice: str = "auto"):
        """This device's AttentionBackend (platforms/attention.py) for `dtype`: its fused
        kernels where it has them for that dtype and `choice` is 'auto', else the plain-torch
        reference."""
        from .attention import TorchAttention
        return TorchAttention(dtype)

    @classmethod
    def attention_backend_classes(cls) -> tuple[type, ...]:
        """Every backend class this platform may hand out (the knob domains are their
        union), readable without constructing the platform."""
        from .attention import TorchAttention
        return (TorchAttention,)

    packed_weights = False
    """Whether this device's ops take low-bit weights (EngineConfig.quantization)."""

    def streams_bf16c(self) -> bool:
        """Whether this device's batch-1 kernel streams `bf16c` weights (what 'auto' stores
        a bf16 model's weights as where it does)."""
        return False

    def choose_quantization(self, asked: str | None, own: str | None,
                            dtype: torch.dtype) -> tuple[str | None, str | None]:
        """(what the weights are stored as, a sentence saying why or what it costs, or None)
        for EngineConfig.quantization `asked` ('auto' or a format) on this device; `own` is
        the checkpoint's own low-bit format (the embedded GGUF's: 'gguf'), if any. Here:
        'auto' keeps the weights in `dtype` (a device with packed kernels decides by
        measuring them: CpuPlatform)."""
        return (None if asked == "auto" else asked), None

    def notices(self) -> list[str]:
        """What an engine built now should say about this device, once (a kernel that could
        not be built, and why)."""
        return []

    def kernel_state(self) -> str | None:
        """This device's compiled kernels in a word or a line ('built', 'building',
        'failed: <error>'), None where it has none to build."""
        return None

    def check_config(self, config) -> None:
        """Refuse knob values this device cannot run (ValueError naming the knob); the
        attention backend checks its own (AttentionBackend.check_config)."""

    def model_ops(self, dtype):
        """The decoder's fusable ops (RMSNorm, SiLU-and-mul, q/k norm + RoPE) for this
        device and dtype: fused kernels where the platform has them, else the torch
        reference (platforms/ops.py)."""
        from .ops import TorchOps
        return TorchOps()


class _Done:
    """The event of a platform whose ops finish before they return."""

    def synchronize(self) -> None:
        pass


class AcceleratorPlatform(Platform):
    """What CUDA GPUs and Ascend NPUs share: torch.cuda and torch.npu (torch_npu) mirror each
    other, so memory queries, synchronisation and graph capture are written once against
    `torch.<name>`."""
    default_dtype = torch.bfloat16
    graph_class = "CUDAGraph"
    """The graph type in torch.<name>."""

    @property
    def api(self):
        return getattr(torch, self.name)

    def synchronize(self) -> None:
        self.api.synchronize()

    def device_name(self) -> str:
        return str(self.api.get_device_name(self.device))

    has_device_memory = True

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def record_event(self):
        event = self.api.Event()
        event.record()
        return event

    def peak_memory_bytes(self) -> int:
        return self.api.max_memory_allocated()

    def reset_peak_memory(self) -> None:
        self.api.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self.api.empty_cache()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes on the device."""
        return self.api.mem_get_info()

    def graph_pool(self):
        return self.api.graph_pool_handle()

    def warm_up(self, fn) -> None:
        """Run `fn` twice on a side stream before capturing it: lazy inits, kernel compiles
        and autotuning happen here, not inside the capture."""
        api = self.api
        stream = api.Stream()
        stream.wait_stream(api.current_stream())
        with api.stream(stream):
            for _ in range(2):
                fn()
        api.current_stream().wait_stream(stream)

    def kernel_timer(self):
        return self.time_in_graph

    def time_in_graph(self, fn, reps: int = 20) -> float:
        """Device time of one call of `fn`, in µs, replayed from a captured graph: what it
        costs inside a decode step, with no launch overhead of the host's (the kernel
        timer; `best_time` says how it differs from the roofline's measurement)."""
        api = self.api
        self.warm_up(fn)
        graph = getattr(api, self.graph_class)()
        with api.graph(graph):
            fn()
        graph.replay()
        start, end = api.Event(enable_timing=True), api.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps

    def capture_graph(self, fn, pool):
        self.warm_up(fn)
        graph = getattr(self.api, self.graph_class)()
        with self.api.graph(graph, pool=pool):
            out = fn()
        self.api.synchronize()
        return graph, out
