"""Make `docs/ui.png`: `lvx serve` on the demo's tiny checkpoint, the demo's video uploaded and
loaded, one question answered, the page captured by headless Chromium (Playwright, as
`tests/test_serve_browser.py` drives it).

    python3 scripts/ui_screenshot.py [--out docs/ui.png]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

if not __package__:  # `python3 scripts/NAME.py`: this checkout's packages, installed or not
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import scripts  # noqa: F401

CHROMIUM = "/usr/bin/chromium"
WAIT_MS = 600_000  # a loaded machine takes minutes; a hang still ends


def wait_until_healthy(url: str, server: subprocess.Popen) -> None:
    """Until `GET /health` is 200 (503 "starting" while the model loads)."""
    while True:
        if server.poll() is not None:
            raise SystemExit(f"error: lvx serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "health", timeout=30) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)


def capture(url: str, video: Path, out: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    from lvx_app.cli.demo import QUESTIONS

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 900})
            page.goto(url, timeout=WAIT_MS)
            page.locator("#lvx-video input[type=file]").set_input_files(str(video))
            expect(page.locator("#lvx-video video")).to_be_attached(timeout=WAIT_MS)
            page.locator("#lvx-load").click()
            expect(page.locator("#lvx-status")).to_contain_text("frames at", timeout=WAIT_MS)
            question = page.locator("#lvx-question textarea")
            question.fill(QUESTIONS[0])
            question.press("Enter")
            expect(page.locator("#lvx-chat")).to_contain_text("tok/s", timeout=WAIT_MS)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/ui.png"), help="the PNG to write")
    args = parser.parse_args()
    from lvx_app.cli.demo import ANSWER_TOKENS, prepare  # after --help: it imports torch
    from lvx_app.defaults import default_cache_dir
    from lvx_models.api import DEFAULT_FAMILY, FAMILIES
    from scripts.gloo_ranks import free_port

    checkpoint, video = prepare(default_cache_dir() / "demo", FAMILIES[DEFAULT_FAMILY], "g2")
    port = free_port()
    command = [sys.executable, "-m", "lvx_app.cli", "serve", "--port", str(port), "--gpus", "0"]
    command += ["--model", str(checkpoint), "--max-new-tokens", str(ANSWER_TOKENS), "--no-cache"]
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False")
    server = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_until_healthy(url, server)
        capture(url, video, args.out)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
