"""Slow checks that run on their own while the rest of the suite runs.

Some checks are minutes of work in processes of their own, waiting for nothing the other tests
do: Triton's interpreter running the CUDA kernels on the CPU, a real build of the C++ kernel
into a fresh cache, a conversion killed half-way. Run in turn they are a quarter of the suite;
yet a third of the time the suite keeps only one of this machine's two cores busy (a server
starting, a browser rendering, a single-threaded tokenizer).

A check declared with `@background.job` becomes a session fixture of the same name. When the
session starts (after the CPU kernel of the default cache is built), the jobs that the selected
tests ask for start in worker threads, at most `PARALLEL` at a time, in the order they were
declared; the processes they spawn (through `spawn`) run at the lowest priority, so they take
the cores the tests leave idle and hardly any from the tests themselves. A test that asks for
a job before it has started runs it in its own thread at once, at normal priority; one that
asks while it runs waits for it. What the job raised (a failure, a skip) is raised in every
test that asks for it. When the session ends, every process a job spawned is killed, process
group and all, finished or not.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

PARALLEL = 2
"""Jobs running at once. Each keeps about one core busy (the interpreter and the compiler are
single-threaded), and this machine has two."""

NICE = 19
"""What their processes are niced to: the lowest priority, so a test at normal priority takes
whatever CPU it wants."""

_local = threading.local()


class Job:
    def __init__(self, name: str, fn: Callable[[], Any]):
        self.name, self.fn = name, fn
        self.procs: list[subprocess.Popen] = []
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.dirs: list[str] = []

    def run(self, niced: bool) -> None:
        _local.job, _local.niced = self, niced
        try:
            self.result = self.fn()
        except BaseException as e:            # pytest's skip and fail outcomes included
            self.error = e
        finally:
            _local.job = None
            self.done.set()

    def claim(self) -> bool:
        """True for the one caller that gets to run it."""
        with self.lock:
            if self.thread is not None:
                return False
            self.thread = threading.current_thread()
            return True

    def get(self) -> Any:
        if self.claim():
            self.run(niced=False)
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


JOBS: dict[str, Job] = {}


def job(fn: Callable[[], Any]):
    """Declare `fn` (no arguments; it blocks until its check is done and returns what the
    tests assert on) a background job, and return a session fixture of the same name that
    hands its result to the tests that name it."""
    name = fn.__name__
    JOBS[name] = Job(name, fn)

    @pytest.fixture(name=name, scope="session")
    def fixture():
        return JOBS[name].get()
    return fixture


def spawn(argv: list[str], **kw) -> subprocess.Popen:
    """Popen in a session of its own (so a kill reaches its children), at the lowest priority
    when a background worker runs it, and killed with the session's jobs."""
    p = subprocess.Popen(argv, start_new_session=True, **kw)
    if getattr(_local, "niced", False):
        lower(p.pid)
    j = getattr(_local, "job", None)
    if j is not None:
        j.procs.append(p)
    return p


def run(argv: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) through `spawn`; on a timeout its whole
    group is killed."""
    p = spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def lower(pid: int) -> None:
    """Run `pid` (which leads a session of its own) at the lowest priority: its nice value,
    which the processes it starts inherit, and, where the kernel groups a session's processes
    to share the CPU as one (autogroup scheduling, on by default in desktop and cloud
    kernels), its session's group too; without that the nice value counts only inside the
    session, and the job would take half the machine from the tests. A process that starts a
    session of its own (the engine's detached kernel builder) leaves its session's group: a
    job lowers it once it knows its pid."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, NICE)
        Path(f"/proc/{pid}/autogroup").write_text(str(NICE))
    except OSError:                         # gone already, or a kernel without autogroups
        pass


def tmpdir(prefix: str) -> Path:
    """A fresh temporary folder for the running job, removed when the session ends."""
    import tempfile
    d = tempfile.mkdtemp(prefix=f"workbench-{prefix}-")
    _local.job.dirs.append(d)
    return Path(d)


def start(names: set[str]) -> None:
    """Start the named jobs in declaration order, `PARALLEL` at a time."""
    queue = [j for n, j in JOBS.items() if n in names]
    slots = threading.Semaphore(PARALLEL)

    def worker(j: Job) -> None:
        try:
            if j.claim():
                j.run(niced=True)
        finally:
            slots.release()

    def dispatch() -> None:
        for j in queue:
            slots.acquire()
            if j.thread is not None:          # a test took it first
                slots.release()
                continue
            threading.Thread(target=worker, args=(j,), name=f"job {j.name}",
                             daemon=True).start()
    threading.Thread(target=dispatch, name="background jobs", daemon=True).start()


def stop() -> None:
    """Kill what every job spawned and wait for their workers."""
    for j in JOBS.values():
        j.kill()
    for j in JOBS.values():
        if j.thread is not None and j.thread is not threading.current_thread():
            j.done.wait(30)
        for d in j.dirs:
            shutil.rmtree(d, ignore_errors=True)
