"""What a notebook session needs around its measurements: wait for the CPU kernel before
timing anything, progress bars with an estimate for long cells, an interrupt that ends a
cell in one line, and native libraries' stderr chatter kept off the page.

    from widgets.notebook import interrupts_in_one_line, progress_bar, quiet_stderr
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings

from .progress import BuildProgress


def wait_for_cpu_kernel(engine, timeout: float = 900.0) -> str:
    """For a notebook that measures: on the CPU, while the C++ kernel that this process
    started building is not done, show a bar and wait for it, so that the figures that follow
    are the kernel's and not the plain-torch fallback's. `engine`: the engine that will be
    timed, or the device a server about to start will run on ('auto', 'cpu', …): then this
    process starts the build that server would, so that the server starts on a built kernel.
    Returns a line to print: what the figures below run on."""
    from IPython.display import display
    from workbench.platforms import auto_device
    from workbench.platforms import cpu_kernels as ck
    device = engine if isinstance(engine, str) else engine.info().device
    device = auto_device() if device == "auto" else device
    if device != "cpu":
        return f"running on {device}"
    if isinstance(engine, str) and not ck.kernel_is_built() and ck.failure() is None:
        ck.build_in_background()
    bar = BuildProgress()
    t0 = time.monotonic()
    if ck.kernel_is_building():
        display(bar)
        while ck.kernel_is_building() and time.monotonic() - t0 < timeout:
            el = time.monotonic() - t0
            bar.show("Building the C++ CPU kernel (once per machine; about a minute on 2 "
                     "cores) before measuring", el / (el + 60.0), el)
            ck.wait_for_kernel(0.5)
        bar.hide()
    if ck.kernels() is not None:
        waited = time.monotonic() - t0
        return ("the C++ CPU kernel is loaded" + (f" (built in {waited:.0f} s)" if waited > 1
                                                  else ""))
    return ("NOTE: the C++ CPU kernel is unavailable (see `workbench build-kernels`): every "
            "figure below is the plain-torch fallback's, several times slower")


def progress_bar(desc: str, unit: str = "it"):
    """A tqdm bar (a widget in Jupyter: elapsed, rate and time left) fed by a progress
    callback: `(done, total)` as `bench.offline.sweep` and `Engine.generate` call it, or
    `(trial, done, total)` as `workbench.tune` does; the bar closes at done == total."""
    from tqdm.auto import tqdm
    bar = None

    def progress(*args) -> None:        # (done, total), or the tuner's (trial, done, total)
        nonlocal bar
        done, total = args[-2:]
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit=unit, leave=True)
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return progress


def interrupts_in_one_line() -> None:
    """Interrupt (the stop button, Kernel > Interrupt) ends the running cell with one line
    instead of a traceback through the engine's loop. The engine's own clean-up still runs:
    the KeyboardInterrupt unwinds through it before IPython reports it here."""
    from IPython import get_ipython
    shell = get_ipython()
    if shell is None:
        return

    def one_line(shell, etype, value, tb, tb_offset=None):
        print("Interrupted: this cell stopped (run it again to start it over).", file=sys.stderr)
    shell.set_custom_exc((KeyboardInterrupt,), one_line)
    # trio (where installed, the first engine imports it through huggingface_hub's HTTP
    # stack) warns on import when it finds a custom exception handler, because it then skips
    # its own for exception groups; Python 3.11+ shows those itself, and the warning would be
    # a red box under the first cell that builds an engine.
    warnings.filterwarnings("ignore", message="IPython detected, but you already have a custom "
                            "exception handler", category=RuntimeWarning)


@contextlib.contextmanager
def quiet_stderr():
    """Native code's writes to file descriptor 2 (the torch profiler's kineto logs
    `profiler_start` / `profiler_stop` there) go nowhere inside the block; Jupyter would
    show them as a red stderr box under the cell. Python's own sys.stderr is untouched."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
