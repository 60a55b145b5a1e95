"""What a careless or hostile client sends never becomes a traceback, a forged log line, a raw
escape sequence on the operator's terminal or the server's upload path in an answer; the words of
each refusal name what the thing is (a folder, a FIFO, a name too long). The API runs here on an
engine stand-in (no model)."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import socket
import time
from pathlib import Path

import pytest
from test_api_harness import serving
from test_service import StandIn
from test_video_cache import key_for, save_shard
from typer.testing import CliRunner

from lvx_app.cache import FeatureCache
from lvx_app.cli.cache import cache_app
from lvx_app.engine.records import EngineError

ESC = "\x1b[2J\x1b[31m"  # clears the terminal and turns it red
FORGED = "\nlvx serve: stopped by Ctrl-C"


class Answers(StandIn):
    """The stand-in answering a whole conversation as it answers a question."""

    def chat(self, turns, **generation):
        return self.ask("ok", **generation)

    def describe(self) -> dict:
        return {}

    def reset(self, keep_prompt: bool = True) -> None:
        self.resets += 1


def _api(tmp_path: Path, engine=None):
    """(the app, the lines it reported, its upload folder) of the API on a stand-in engine, with
    `tmp_path / "allowed"` as its allowed folder."""
    from fastapi import FastAPI

    from lvx_app.config import Config
    from lvx_app.runtime.service import EngineService
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    (tmp_path / "allowed").mkdir(exist_ok=True)
    service = EngineService(engine or Answers())
    files = VideoFiles([str(tmp_path / "allowed")], 10.0, tmp_path / "uploads")
    app, reported = FastAPI(), []
    OpenAIApi(service, Config.from_options(model=str(tmp_path)), files, reported.append).mount(app)
    return app, reported, files.folder


def _ask(client, url: str, **fields):
    video = {"type": "video_url", "video_url": {"url": url}}
    body = {"model": "m", "messages": [{"role": "user", "content": [video]}], **fields}
    return client.post("/v1/chat/completions", json=body)


def _png(colour: int) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (colour, 0, 0)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_what_a_client_sends_reaches_the_log_escaped(tmp_path):
    """An escape sequence in a video_url and a newline that would start a forged line in the
    subtitles field are shown as escapes, on the one line of their refusal."""
    from starlette.testclient import TestClient

    app, reported, _ = _api(tmp_path)
    client = TestClient(app)
    _ask(client, f"file://{tmp_path}/allowed/{ESC}.mp4")
    (tmp_path / "allowed" / "clip.mp4").write_bytes(b"x")
    _ask(client, f"file://{tmp_path}/allowed/clip.mp4", subtitles=f"{tmp_path}{FORGED}")
    assert len(reported) == 2, reported
    for line in reported:
        assert not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in line), repr(line)
    assert "\\x1b[2J" in reported[0] and "\\nlvx serve: stopped by Ctrl-C" in reported[1]


def _cached(video: Path, *rates: float) -> FeatureCache:
    """A cache beside `video` (a file of random bytes made here) holding its features at `rates`."""
    video.write_bytes(os.urandom(1 << 12))
    store = FeatureCache(video.parent / "cache")
    for fps in rates:
        save_shard(store, key_for(video, world_size=1, fps=fps), video)
    return store


def test_cache_ls_shows_a_file_names_control_characters_escaped(tmp_path):
    store = _cached(tmp_path / f"a{ESC}\nb.mp4", 1.0)
    out = CliRunner().invoke(cache_app, ["ls", "--cache-dir", str(store.root)])
    assert out.exit_code == 0 and "\x1b" not in out.output, repr(out.output)
    assert "a\\x1b[2J\\x1b[31m\\nb.mp4" in out.output, out.output


@pytest.mark.parametrize(
    "url, says",
    [
        ("file://[x/y", "is not a URL"),
        ("file:///{allowed}/" + "a" * 300 + ".mp4", "file name too long"),
        ("file:///{allowed}" + "/a" * 4000, "file name too long"),
    ],
)
def test_urls_and_paths_that_cannot_be_opened_are_one_400_line(tmp_path, url, says):
    from starlette.testclient import TestClient

    app, reported, _ = _api(tmp_path)
    reply = _ask(TestClient(app), url.format(allowed=tmp_path / "allowed"))
    assert reply.status_code == 400 and says in reply.json()["error"]["message"], reply.text
    assert len(reported) == 1 and "\n" not in reported[0], reported


def test_the_file_route_refuses_a_name_too_long_in_one_line(tmp_path):
    """Gradio's file route would fail on it with a traceback (its own `is_file`)."""
    from lvx_ui.page_files import special_file

    assert special_file(f"{tmp_path}/" + "a" * 300)
    assert special_file(str(tmp_path) + "/a" * 4000)
    assert not special_file(f"{tmp_path}/missing.mp4")  # Gradio's own 404


def test_a_client_that_leaves_mid_body_is_one_line(tmp_path, caplog):
    """Its half-sent body is no 85-line ClientDisconnect traceback: one line in the log."""
    app, reported, _ = _api(tmp_path)
    caplog.set_level(logging.INFO)
    with serving(app) as url:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b'Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"mod'
                )
        deadline = time.monotonic() + 10
        while len(reported) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(reported) == 3, reported
    assert all("499 client_closed: the client went away while it sent" in r for r in reported)
    assert "Traceback" not in caplog.text and "ClientDisconnect" not in caplog.text, caplog.text


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_folder_or_fifo_as_subtitles_over_the_api_is_named_for_what_it_is(tmp_path, kind):
    from starlette.testclient import TestClient

    app, _, _ = _api(tmp_path)
    (tmp_path / "allowed" / "clip.mp4").write_bytes(b"x")
    odd = tmp_path / "allowed" / "talk.srt"
    odd.mkdir() if kind == "folder" else os.mkfifo(odd)
    reply = _ask(TestClient(app), f"file://{tmp_path}/allowed/clip.mp4", subtitles=str(odd))
    message = reply.json()["error"]["message"]
    what = "a folder" if kind == "folder" else "a FIFO (named pipe)"
    assert reply.status_code == 400 and f"is {what}, not a file" in message, message
    assert "not found" not in message


def test_a_fifo_as_the_video_on_the_page_is_named_a_fifo(tmp_path):
    from lvx_app.config import Config
    from lvx_ui.app import ChatApp

    fifo = tmp_path / "movie.mp4"
    os.mkfifo(fifo)
    page = ChatApp(None, Config.from_options(model=str(tmp_path)), allow_paths=[str(tmp_path)])
    with pytest.raises(EngineError, match=r"movie.mp4 is a FIFO \(named pipe\), not a video file"):
        page._resolve(None, str(fifo))
    with pytest.raises(EngineError, match="file name too long"):
        page._resolve(None, f"{tmp_path}/" + "a" * 300)


@pytest.mark.parametrize("where", ["top", "media_io_kwargs"])
def test_num_frames_means_the_same_at_top_level_and_in_media_io_kwargs(where):
    """-1: every frame, in both places; 0: refused, in both places (it samples nothing)."""
    from lvx_ui.openai_request import EVERY_FRAME, ApiError, read_video_options

    def options(n: int) -> dict:
        if where == "top":
            return read_video_options({"num_frames": n})
        return read_video_options({"media_io_kwargs": {"video": {"num_frames": n}}})

    assert options(-1) == {"num_frames": EVERY_FRAME} and options(8) == {"num_frames": 8}
    with pytest.raises(ApiError, match="num_frames takes a whole number of 1 or more, or -1"):
        options(0)


def test_an_api_error_never_shows_the_servers_upload_path(tmp_path):
    """The engine's words about an uploaded video name it "the video sent", not the file the
    server keeps it in."""
    from starlette.testclient import TestClient

    class Unreadable(Answers):
        def load_video(self, request, *, progress=None):
            raise EngineError(f"{request.path} is not a video decord can read")

    app, reported, uploads = _api(tmp_path, Unreadable())
    video = "data:video/mp4;base64," + base64.b64encode(b"not a video" * 10).decode()
    reply = _ask(TestClient(app), video)
    message = reply.json()["error"]["message"]
    assert reply.status_code == 400, reply.text
    assert message == "the video sent is not a video decord can read", message
    assert str(uploads) not in reported[0]


def test_the_answers_log_line_names_the_video_and_its_frames(tmp_path):
    from starlette.testclient import TestClient

    app, reported, _ = _api(tmp_path)
    client = TestClient(app)
    (tmp_path / "allowed" / "clip.mp4").write_bytes(b"x")
    assert _ask(client, f"file://{tmp_path}/allowed/clip.mp4", max_tokens=2).status_code == 200
    frames = [{"type": "image_url", "image_url": {"url": _png(c)}} for c in (10, 200)]
    body = {"model": "m", "messages": [{"role": "user", "content": frames}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert reported[0].startswith("api: 3 tokens") and reported[0].endswith(
        "prompt tokens, video clip.mp4 (10 frames)"
    ), reported
    assert reported[1].endswith("prompt tokens, video frames (10 frames)"), reported


def test_the_same_frames_sent_again_keep_their_file_identity(tmp_path):
    """The frames' video is named by its content; its mtime is part of the features' key, so
    it is the same however often (and after however many removals) the file is made."""
    from lvx_app.cache.features import file_identity
    from lvx_ui.openai_request import VideoFiles

    files = VideoFiles([], 10.0, tmp_path / "uploads")
    frames = (_png(10), _png(200))
    first = files.video(frames, 1.0)
    identity = file_identity(first)
    time.sleep(0.02)
    assert files.video(frames, 1.0) == first and file_identity(first) == identity
    os.remove(first)  # forgotten among the old uploads
    time.sleep(0.02)
    assert file_identity(files.video(frames, 1.0)) == identity


def test_cache_clear_with_no_answer_says_to_pass_yes(tmp_path):
    store = _cached(tmp_path / "movie.mp4", 1.0)
    out = CliRunner().invoke(cache_app, ["clear", "--cache-dir", str(store.root)], input="")
    assert out.exit_code == 2 and "pass --yes" in out.output, out.output
    assert "aborted" not in out.output.lower() and len(store.entries()) == 1


def test_an_id_too_short_to_be_one_removes_nothing_and_lists_the_candidates(tmp_path):
    store = _cached(tmp_path / "movie.mp4", 1.0, 2.0)
    first, second = (e.entry_id for e in store.entries())
    targets = [second[:8], first[:2], "--cache-dir", str(store.root)]
    out = CliRunner().invoke(cache_app, ["rm", *targets])
    assert out.exit_code == 2 and "nothing removed" in out.output, out.output
    assert first[:8] in out.output and len(store.entries()) == 2


class Endless(Answers):
    """A stand-in whose answer is 64 KB pieces for as long as it is read."""

    def chat(self, turns, **generation):
        def pieces():
            for _ in range(generation.get("max_new_tokens", 3)):
                self.going.set()
                yield "x" * 65536

        return pieces()


def test_a_client_that_stops_reading_its_stream_frees_the_engine(tmp_path, caplog):
    """A socket that never reads a `stream: true` answer: past --send-timeout the answer stops,
    the engine answers another client, and the log says why the answer stopped."""
    from dataclasses import replace

    from fastapi import FastAPI

    from lvx_app.config import Config
    from lvx_app.runtime.service import EngineService
    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    config = Config.from_options(model=str(tmp_path))
    config = replace(config, serve=replace(config.serve, send_timeout=1.0))
    service = EngineService(Endless())
    app, reported = FastAPI(), []
    files = VideoFiles([], 10.0, tmp_path / "uploads")
    OpenAIApi(service, config, files, reported.append).mount(app)
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 100000,
        }
    ).encode()
    with serving(app) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            s.connect((host, int(port)))
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            deadline = time.monotonic() + 30
            while not reported and time.monotonic() < deadline:
                time.sleep(0.1)
            assert reported, "the answer still holds the engine"
            lease = service.lease("another client", timeout=5)  # the engine is free
            lease.close()
    assert "stopped: the client read nothing for 1 s (--send-timeout) after " in reported[0], (
        reported
    )
    assert "Traceback" not in caplog.text, caplog.text
