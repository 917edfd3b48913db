"""Jupyter servers (Voila for the dashboard, JupyterLab for the notebooks) run as a child
process tree that is stopped whole: on the server's exit, on SIGINT/SIGTERM/SIGHUP to this
process, or on any other way out."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path


def notebooks_dir() -> Path:
    """The repository's notebooks/ (the dashboard and the lab open them from a checkout)."""
    d = Path(__file__).resolve().parents[1] / "notebooks"
    if not (d / "dashboard.ipynb").is_file():
        raise FileNotFoundError(f"{d / 'dashboard.ipynb'} not found: the dashboard and the lab "
                                "run from a source checkout (git clone …; pip install -e \".[ui]\")")
    return d


def trust_notebooks(d: Path) -> None:
    """Sign the shipped notebooks in this user's Jupyter trust store (what `jupyter trust`
    does), so that opening one logs no "Notebook … is not trusted". They ship without
    outputs: there is nothing in them to distrust."""
    import nbformat
    from nbformat.sign import NotebookNotary
    notary = NotebookNotary()
    for path in sorted(d.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if not notary.check_signature(nb):
            notary.sign(nb)


def ipc_kernels() -> list[str]:
    """Kernels over Unix sockets, for both Jupyter servers: over TCP each kernel warns that its
    traffic is unencrypted, and kernels started at once can race for the same free port."""
    import os
    return ["--KernelManager.transport=ipc"] if os.name == "posix" else []


START_HERE = "00_start_here.ipynb"
"""What `workbench lab` opens on: which notebook to start with and how long each takes."""


def run_lab(host: str, port: int, browser: bool) -> int:
    """`workbench lab`: JupyterLab on notebooks/, its first line a URL that opens it on the
    start page (START_HERE)."""
    import os
    import secrets
    d = notebooks_dir()
    trust_notebooks(d)
    # The token goes in the environment (argv shows in `ps`) and in the URL printed first, so
    # that URL opens the Lab.
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_urlsafe(24)
    args = [f"--ServerApp.root_dir={d}", f"--ServerApp.ip={host}", f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",     # the port printed is the port served, or an error
            # notebook_shim (classic Notebook server extensions, none here) reads every member of
            # the server at start-up, the deprecated ServerApp.token among them, which prints
            # "ServerApp.token config is deprecated" although the token is given the current way.
            "--ServerApp.jpserver_extensions=notebook_shim=False"]
    args += ipc_kernels()
    if not browser:
        args.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")    # containers often run as root; Jupyter refuses without it
    return run_jupyter("jupyterlab", args, {"JUPYTER_TOKEN": token},
                       f"JupyterLab on {d}: "
                       f"http://{host}:{port}/lab/tree/{START_HERE}?token={token}")


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


class _Stop(Exception):
    """A stop signal arrived."""


def stop_tree(pid: int, timeout: float = 15.0) -> None:
    """Stop `pid` and every process below it: SIGTERM, then SIGKILL what is left after
    `timeout` seconds. The tree is taken before signalling, because Jupyter starts each kernel
    in a session of its own (a process-group kill misses it) and a child whose parent died is
    re-parented out of the tree."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    # Anything started while we waited (a kernel's own children) goes too.
    alive += [c for p in alive for c in _children(p) if c not in alive]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def _children(p) -> list:
    import psutil
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def run_jupyter(module: str, args: list[str], env: dict[str, str], url: str) -> int:
    """Run a Jupyter server until it exits or this process gets SIGINT, SIGTERM or SIGHUP;
    then stop it with its kernels and everything else it started."""
    import importlib.util
    import os
    import signal
    import subprocess
    if importlib.util.find_spec(module) is None:
        print(f"error: {module} is not installed; pip install -e \".[ui]\"", file=sys.stderr)
        return 2
    print(f"{url}   (Ctrl-C stops it)", flush=True)

    def on_signal(signum, frame):
        raise _Stop(signum)

    def hold(handler) -> dict:
        return {s: signal.signal(getattr(signal, s), handler)
                for s in STOP_SIGNALS if hasattr(signal, s)}

    previous = hold(on_signal)
    try:
        # Its own session: a terminal's Ctrl-C reaches us only, and we stop the whole tree
        # (Jupyter would otherwise ask "Shutdown this server (y/[n])?" on SIGINT).
        proc = subprocess.Popen([sys.executable, "-m", module, *args],
                                env={**os.environ, **env}, start_new_session=True)
        try:
            return proc.wait()
        except (KeyboardInterrupt, _Stop):
            hold(signal.SIG_IGN)             # a second Ctrl-C must not cut the clean-up short
            stop_tree(proc.pid)
            return 0
        finally:
            if proc.poll() is None:          # any other way out: leave nothing behind
                stop_tree(proc.pid)
    finally:
        for s, handler in previous.items():
            signal.signal(getattr(signal, s), handler)


class ServeProcess:
    """`workbench serve` in a child process on a free loopback port, for a notebook or a
    script that wants a real server beside it: started on construction (waits until /health
    answers), stopped with everything below it by `stop()`, by leaving a `with` block, or when
    this process exits. `url` is its root; `log` the file its output goes to.

        with ServeProcess("--model", "smollm2", "--device", "cpu") as server:
            RemoteEngine(server.url).stream(...)
    """

    def __init__(self, *args: str, timeout: float = 300.0):
        import atexit
        import os
        import socket
        import subprocess
        import tempfile
        import time
        import urllib.request
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        fd, name = tempfile.mkstemp(prefix="workbench-serve-", suffix=".log")
        self.log = Path(name)
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "workbench.cli", "serve", *args, "--host", "127.0.0.1",
                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        self.stop()
        tail = self.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"workbench serve did not come up within {timeout:g} s; its log "
                           f"({self.log}) ends:\n{tail}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Stop the server and everything it started (idempotent)."""
        if self.proc.poll() is None:
            stop_tree(self.proc.pid, timeout=15)
        self.proc.wait(timeout=15)

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_dashboard(env: dict[str, str], host: str, port: int, kernel_idle_timeout: int,
                  browser: bool) -> int:
    """Voila serving notebooks/dashboard.ipynb with the `workbench` template; `env`: what the
    page reads (WORKBENCH_* variables, checked by cli.py's `dashboard`)."""
    import os
    # notebooks/.voila holds the `workbench` Voila template: Voila's lab template without
    # its CDN links, so the page makes no request beyond this server.
    templates = str(notebooks_dir() / ".voila")
    env = {**env, "JUPYTER_PATH": os.pathsep.join(filter(None, [templates,
                                                                os.environ.get("JUPYTER_PATH")]))}
    args = [str(notebooks_dir() / "dashboard.ipynb"), "--no-browser", f"--port={port}",
            f"--Voila.ip={host}", "--template=workbench", "--strip_sources=True",
            "--show_tracebacks=True", "--Voila.port_retries=0",
            # A kernel whose page is gone (no websocket) and that has been idle this long is
            # shut down: each one holds an engine (1-2 GB with smollm2).
            f"--MappingKernelManager.cull_idle_timeout={kernel_idle_timeout}",
            f"--MappingKernelManager.cull_interval={max(1, min(10, kernel_idle_timeout // 2))}",
            "--MappingKernelManager.cull_connected=False", *ipc_kernels(),
            # How long rendering waits for a cell's outputs after the cell has run (nbclient's
            # default, 4 s, drops the outputs of a cell whose messages come later: on a loaded
            # machine a page then lacked its widgets, "Timeout waiting for IOPub output").
            "--VoilaExecutor.iopub_timeout=60"]
    if browser:
        args.remove("--no-browser")
    return run_jupyter("voila", args, env, f"dashboard: http://{host}:{port}/")
