"""The memory an API request costs the server is bounded by the budgets it states: a frame bomb
(one huge first frame, many tiny ones, each resized to the first) and large bodies sent at once,
measured as the server process's own high-water mark (`VmHWM`) above its resident size before."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

HERE = Path(__file__).parent
MB = 2**20


def _png(size: tuple[int, int], colour: int = 90) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (colour, 30, 200)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


class Server:
    def __init__(self, folder: Path, request_mb: int, all_mb: int) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
            ),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "request_memory_server.py"), str(folder)]
            + [str(request_mb), str(all_mb)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.url = f"http://127.0.0.1:{self.proc.stdout.readline().strip()}/v1/chat/completions"
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        self.post([_png((8, 8)), _png((8, 8), 7)])  # warm: the image and video libraries loaded
        self.rss = _memory(self.proc.pid)["VmRSS"]

    def post(self, parts: list[str] | None = None, video: str | None = None) -> httpx.Response:
        content = [{"type": "image_url", "image_url": {"url": u}} for u in parts or []]
        if video is not None:
            content = [{"type": "video_url", "video_url": {"url": video}}]
        content.append({"type": "text", "text": "what happens?"})
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        for _ in range(100):  # the server starts listening a moment after it prints its port
            try:
                return httpx.post(self.url, json=body, timeout=300)
            except httpx.ConnectError:
                threading.Event().wait(0.1)
        raise AssertionError("the server never listened")

    def peak_mb(self) -> float:
        """The most the server held above its resident size once warm, in MB."""
        return (_memory(self.proc.pid)["VmHWM"] - self.rss) / MB

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def server(tmp_path):
    made: list[Server] = []

    def start(request_mb: int, all_mb: int) -> Server:
        made.append(Server(tmp_path, request_mb, all_mb))
        return made[-1]

    yield start
    for s in made:
        s.stop()


def test_a_frame_bomb_is_refused_by_its_headers_and_frames_are_made_one_at_a_time(server):
    """One 4000x4000 frame and twenty 2x2 ones (every frame resized to the first: 1 GB decoded)
    is refused before any is decoded, naming the budget; a 2000x2000 first frame and thirty tiny
    ones fit it and are made within it."""
    s = server(200, 400)
    bomb = s.post([_png((4000, 4000))] + [_png((2, 2), i) for i in range(20)])
    error = bomb.json()["error"]
    assert bomb.status_code == 413 and "--request-memory-mb" in error["message"], bomb.text
    assert "decoding 21 frames of 4000x4000" in error["message"], error
    assert s.peak_mb() < 50, s.peak_mb()  # nothing was decoded
    fits = s.post([_png((2000, 2000))] + [_png((2, 2), i) for i in range(30)])
    assert fits.status_code == 200, fits.text
    assert s.peak_mb() < 200, s.peak_mb()  # all 31 frames at 2000x2000 decoded: 372 MB


def test_large_bodies_sent_at_once_stay_within_the_stated_budgets(server):
    """Each 45 MB video (60 MB of base64) fits a request's 200 MB, and takes no more than that
    alone; three at once would take more than the 400 MB all requests may: those past it are
    turned away (429), and the server's peak stays within what it says."""
    s = server(200, 400)
    video = "data:video/mp4;base64," + base64.b64encode(os.urandom(45 * MB)).decode()
    assert s.post(video=video).status_code == 200
    assert s.peak_mb() < 200, s.peak_mb()  # one alone: within a request's budget
    replies: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda: replies.append(s.post(video=video))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in replies)
    assert codes[0] == 200 and set(codes) <= {200, 429}, [r.text[:200] for r in replies]
    for r in replies:
        if r.status_code == 429:
            assert "--requests-memory-mb" in r.json()["error"]["message"], r.text
    assert s.peak_mb() < 400, s.peak_mb()
    big = base64.b64encode(os.urandom(55 * MB)).decode()
    too_big = s.post(video="data:video/mp4;base64," + big)
    assert too_big.status_code == 413 and "over the 50 MB limit" in too_big.text, too_big.text
