"""schemathesis against `workbench serve` (issue 27): the server's own /openapi.json drives a
bounded, seeded property-based run over every operation, checking that no response is a 5xx.

    python benchmarks/schemathesis_run.py [--max-examples 25] [--seed 0]

Starts the server on the CPU on a free loopback port (smollm2, a short max_model_len so
generated bodies that ask for long outputs stay cheap), runs `schemathesis run` with the
not_a_server_error check, prints its summary and a JSON line of the figures, and stops the
server with its process group. Exit status: schemathesis's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-examples", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=48)
    ap.add_argument("--timeout", type=float, default=1200, help="for the whole run, seconds")
    a = ap.parse_args()
    exe = shutil.which("schemathesis") or shutil.which("st")
    if exe is None:
        print("schemathesis is not installed (pip install schemathesis)", file=sys.stderr)
        return 2
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)
    server = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", "--device", "cpu",
                               "--model", "smollm2", "--max-model-len", str(a.max_model_len),
                               "--num-kv-blocks", "512", "--log-level", "warning",
                               "--port", str(port)], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            print(Path(log.name).read_text(errors="replace")[-3000:], file=sys.stderr)
            return 2
        t0 = time.monotonic()
        r = subprocess.run([exe, "--no-color", "run", url + "/openapi.json", "--checks",
                            "not_a_server_error",
                            "--max-examples", str(a.max_examples), "--seed", str(a.seed),
                            "--request-timeout", "300"],
                           capture_output=True, text=True, timeout=a.timeout,
                           env={**os.environ, "NO_COLOR": "1"})
        seconds = time.monotonic() - t0
        out = r.stdout + r.stderr
        print(out[-6000:])
        server_log = Path(log.name).read_text(errors="replace")
        figures = {"rc": r.returncode, "seconds": round(seconds, 1),
                   "max_examples": a.max_examples, "seed": a.seed,
                   "tracebacks_in_server_log": server_log.count("Traceback"),
                   "health_after": httpx.get(url + "/health", timeout=10).status_code}
        m = re.search(r"Test cases:\s*(\d+) generated", out)
        if m:
            figures["test_cases"] = int(m.group(1))
        print(json.dumps(figures))
        return r.returncode
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)
        os.unlink(log.name)


if __name__ == "__main__":
    sys.exit(main())
