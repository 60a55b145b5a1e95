"""`GET /health` of `lvx serve` answers from the first moment its port is open: 503 "starting"
while the model loads (held here until the probe has seen it) and while the page is built, then
200 "ok"; never a 404, and never a refused connection once the port has opened (the page is
mounted into the server that opened it)."""

from __future__ import annotations

import signal
import threading

import pytest

httpx = pytest.importorskip("httpx")

from test_serve import free_port  # noqa: E402

from lvx_app.config import Config  # noqa: E402
from lvx_app.runtime.open import open_engine  # noqa: E402
from lvx_ui import server  # noqa: E402
from lvx_ui.app import build_app  # noqa: E402


def _probe(url: str, seen: list, loading: threading.Event, stop: threading.Event) -> None:
    """Every answer of /health, in order, polled every 20 ms: until one answers, then until it is
    200 (a connection refused after the first answer is one too). The model loads only once the
    probe has seen the port open."""
    while True:
        try:
            answer = httpx.get(url, timeout=60)
        except httpx.TransportError as exc:  # the port is not open yet (or closed again)
            if seen:
                seen.append(("no answer", type(exc).__name__))
            if stop.wait(0.02):
                return
            continue
        seen.append((answer.status_code, answer.json().get("status")))
        loading.set()
        if answer.status_code == 200 or stop.wait(0.02):
            return


@pytest.mark.slow
@pytest.mark.parametrize("no_ui", [True, False], ids=["api-alone", "page"])
def test_health_says_starting_while_the_model_loads(tiny_checkpoints, monkeypatch, no_ui):
    port = free_port()
    config = Config.from_dict(
        {
            "model": {"path": tiny_checkpoints["g1"]},
            "parallel": {"gpus": 0},
            "serve": {"port": port, "no_ui": no_ui},
        }
    )
    seen: list = []
    loading, healthy, stop = threading.Event(), threading.Event(), threading.Event()

    def slow_open(config, console=None):
        assert loading.wait(120), "the port never answered /health while the model loaded"
        return open_engine(config, console)

    def serve_until_healthy(serving=lambda: True):
        probe.join(120)
        healthy.set()
        return None

    url = f"http://127.0.0.1:{port}/health"
    probe = threading.Thread(target=_probe, args=(url, seen, loading, stop), daemon=True)
    built: list = []  # /health once the page is built: the port is still open, gradio's not yet

    def build_and_probe(*args, **kwargs):
        demo = build_app(*args, **kwargs)
        try:
            built.append(httpx.get(url, timeout=60).status_code)
        except httpx.TransportError as exc:
            built.append(repr(exc))
        return demo

    monkeypatch.setattr("lvx_ui.app.build_app", build_and_probe)
    monkeypatch.setattr(server, "open_engine", slow_open)
    monkeypatch.setattr(server, "_wait_for_a_stop_signal", serve_until_healthy)
    sigterm = signal.getsignal(signal.SIGTERM)
    probe.start()
    try:
        assert server.run_serve(config) == 0
    finally:
        stop.set()
        signal.signal(signal.SIGTERM, sigterm)
    assert healthy.is_set()
    assert seen[0] == (503, "starting"), seen
    assert seen[-1] == (200, "ok"), seen
    refused = [s for s in seen if s[0] == "no answer"]
    assert refused == [], f"{len(refused)} polls 20 ms apart found the port closed: {refused[:3]}"
    assert {status for status, _ in seen} <= {200, 503}, seen  # never "wrong URL"
    assert built == ([] if no_ui else [503]), built
