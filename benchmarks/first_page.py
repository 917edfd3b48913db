"""Time the dashboard's first page: `workbench dashboard` started, opened in Debian's
Chromium, Send pressed as soon as it is enabled; seconds from the start to Voila answering,
to Send enabled (engine loaded) and to the first streamed text.

    python benchmarks/first_page.py            # warm: the caches as they are
    python benchmarks/first_page.py --cold     # a fresh, empty WORKBENCH_CACHE (conversion
                                               # and the kernel build happen in this run)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true", help="start from an empty cache")
    ap.add_argument("--port", type=int, default=8877)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    import httpx
    from playwright.sync_api import sync_playwright
    env = dict(os.environ)
    cache = tempfile.mkdtemp(prefix="wb-cold-") if a.cold else None
    if cache:
        env["WORKBENCH_CACHE"] = cache
    url = f"http://127.0.0.1:{a.port}/"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "dashboard", "--device",
                             "cpu", "--port", str(a.port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {"cold": a.cold, "load_average": os.getloadavg()[0]}
    try:
        deadline = t0 + a.timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "api/status", timeout=2).status_code < 500:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        out["voila_s"] = round(time.monotonic() - t0, 1)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium") or
                                        "/usr/bin/chromium", headless=True,
                                        args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(url, timeout=a.timeout * 1000)
            send = page.get_by_role("button", name="Send")
            send.wait_for(timeout=a.timeout * 1000)
            out["page_s"] = round(time.monotonic() - t0, 1)
            while send.is_disabled() and time.monotonic() < deadline:
                time.sleep(0.05)
            out["send_enabled_s"] = round(time.monotonic() - t0, 1)
            send.click()
            text = "() => [...document.querySelectorAll('.wb .card .txt')]" \
                   ".reduce((n, e) => n + e.innerText.length, 0)"
            while not page.evaluate(text) and time.monotonic() < deadline:
                time.sleep(0.05)
            out["first_text_s"] = round(time.monotonic() - t0, 1)
            browser.close()
    finally:
        from workbench.launch import stop_tree
        stop_tree(proc.pid)
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
