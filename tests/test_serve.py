"""`lvx serve` end to end: a real server process on 1 and 2 CPU ranks, driven with gradio_client.

The answers streamed into the chat must be exactly the model's own greedy answers (computed in this
process by test_engine's reference), and failures must come back as readable messages while the
server keeps serving.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from timing import scaled

# a bare GPU image has neither: this file (and the serve tests importing it) skip there
gradio_client = pytest.importorskip("gradio_client")
pytest.importorskip("gradio")

from test_engine import PARAMS, QUESTIONS, _reference  # noqa: E402

from lvx_app.engine.describe import printable  # noqa: E402
from lvx_app.video.synthetic import make_video  # noqa: E402
from lvx_ui.app import link_timestamps, message_text  # noqa: E402
from scripts.gloo_ranks import free_port  # noqa: E402

LVX = [sys.executable, "-m", "lvx_app.cli"]
MAX_UPLOAD_MB = 1


def start_server(
    args: list[str], log: Path, timeout_s: float = 240
) -> tuple[subprocess.Popen, str]:
    """Start `lvx serve ARGS` and wait for its "ready on URL" line; fail with the log if it dies
    first."""
    port = free_port()
    # the worker group's run dir (pid files) lands next to the log
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GRADIO_ANALYTICS_ENABLED="False",
        COLUMNS="200",
        TMPDIR=str(log.parent),
    )
    out = open(log, "wb")
    proc = subprocess.Popen(
        [*LVX, "serve", "--port", str(port), *args], stdout=out, stderr=subprocess.STDOUT, env=env
    )
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "ready on http://" in text:
            return proc, f"http://127.0.0.1:{port}/"
        if proc.poll() is not None:
            pytest.fail(f"lvx serve exited with {proc.returncode}:\n{text}")
        time.sleep(0.3)
    proc.kill()
    pytest.fail(
        f"lvx serve did not get ready in {timeout_s:.0f}s:\n{log.read_text(errors='replace')}"
    )


def stop_server(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM must close the engine (and its torchrun group) and exit cleanly."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=scaled(60))
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"lvx serve ignored SIGTERM:\n{log.read_text(errors='replace')}")
    text = log.read_text(errors="replace")
    assert code == 0, text
    assert "lvx serve: stopped by SIGTERM" in text and "Keyboard interruption" not in text, text


@pytest.fixture(scope="module")
def expected(tiny_checkpoints, short_video) -> list[str]:
    """The greedy answers to QUESTIONS as the chat shows them (control characters dropped, times
    linked)."""
    return [
        link_timestamps(printable(a), 10.0) for a in _reference(tiny_checkpoints["g2"], short_video)
    ]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(["--gpus", "0"], id="1rank"),
        pytest.param(["--gpus", "0", "--ranks", "2", "--auth", "alice:pass:word"], id="2ranks"),
    ],
)
def server(request, tiny_checkpoints, short_video, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    videos = root / "videos"
    videos.mkdir()
    shutil.copy(short_video, videos / "short.mp4")
    log = root / "serve.log"
    args = [
        *request.param,
        "--model",
        tiny_checkpoints["g2"],
        "--cache-dir",
        str(root / "cache"),
        "--allow-paths",
        str(videos),
        "--max-upload-mb",
        str(MAX_UPLOAD_MB),
        "--max-new-tokens",
        str(PARAMS.max_new_tokens),
    ]
    proc, url = start_server(args, log)
    ranks = 2 if "--ranks" in request.param else 1
    auth = ("alice", "pass:word") if "--auth" in request.param else None
    yield SimpleNamespace(url=url, videos=videos, ranks=ranks, log=log, root=root, auth=auth)
    stop_server(proc, log)
    assert "Traceback" not in log.read_text(errors="replace")


def client(server, **kwargs):
    return gradio_client.Client(server.url, verbose=False, auth=server.auth, **kwargs)


def last_answer(history: list[dict]) -> tuple[str, str]:
    """(answer, footer) of the last assistant message."""
    assert history[-1]["role"] == "assistant"
    text = message_text(history[-1]["content"])
    answer, _, footer = text.rpartition("\n\n")
    return answer, footer


def ask(
    c, question: str, history: list, max_new_tokens: int = PARAMS.max_new_tokens
) -> tuple[list, list[str]]:
    """Submit a question, return (final history, the answer text seen at each streamed update)."""
    job = c.submit(question, history, max_new_tokens, api_name="/chat")
    partials = [
        message_text(out[0][-1]["content"])
        for out in job
        if out[0] and out[0][-1]["role"] == "assistant"
    ]
    return job.result()[0], partials


@pytest.mark.slow
def test_load_ask_twice_reset(server, short_video, expected):
    c = client(server)
    job = c.submit(gradio_client.handle_file(short_video), "", 1.0, 0, api_name="/load")
    progress = set()
    while not job.done():  # the engine's progress reaches the page as Gradio progress updates
        progress.update(p.desc for p in job.status().progress_data or [])
        time.sleep(0.01)
    status, chat, _ = job.result()
    assert any(desc and desc.startswith("frames") for desc in progress), progress
    assert "10 frames at 1 fps" in status and "40 visual tokens" in status, status
    assert f"world size {server.ranks}" in status
    for rank in range(server.ranks):  # one memory row per rank
        assert f"\n| {rank} | cpu |" in status, status
    assert chat == []

    history: list = []
    for i, question in enumerate(QUESTIONS):
        history, partials = ask(c, question, history)
        answer, footer = last_answer(history)
        assert answer == expected[i], (i, answer, expected[i])
        assert "TTFT" in footer and "tok/s" in footer, footer
        growing = [p for p in dict.fromkeys(partials) if p and "TTFT" not in p]
        assert len(growing) >= 3, f"answer was not streamed token by token: {partials}"
        assert growing[-1] == expected[i]
    assert [message_text(m["content"]) for m in history if m["role"] == "user"] == list(QUESTIONS)

    chat, status = c.predict(api_name="/reset")
    assert chat == [] and "cleared" in status and "10 frames" in status
    history, _ = ask(c, QUESTIONS[0], [])
    assert last_answer(history)[0] == expected[0], (
        "reset must forget the conversation but keep the video"
    )

    stats = c.predict(api_name="/stats")
    assert f"world size: {server.ranks}" in stats and "kv mode" in stats

    # The same file again hits the visual-feature cache (by path: a re-upload is a new file to the
    # cache).
    in_place = str(server.videos / "short.mp4")
    first, _, _ = c.predict(None, in_place, 1.0, 0, api_name="/load")
    again, _, _ = c.predict(None, in_place, 1.0, 0, api_name="/load")
    assert "from cache" not in first and "from cache" in again, (first, again)

    # Warnings raised on the ranks (here: fps above the video's own) reach the page, not only the
    # server's stderr.
    clamped, _, _ = c.predict(None, in_place, 50.0, 0, api_name="/load")
    assert (
        "⚠️ --fps 50 is above the video's own 10 fps; using 10" in clamped
        and "100 frames" in clamped
    ), clamped
    back, _, _ = c.predict(None, in_place, 1.0, 0, api_name="/load")
    assert "⚠️" not in back and "10 frames" in back, back


@pytest.mark.slow
def test_failures_are_readable_and_the_server_keeps_serving(server, expected):
    if server.auth:  # --auth user:password (the password may hold colons) keeps strangers out
        with pytest.raises(Exception, match="(?i)login|auth|credentials"):
            gradio_client.Client(server.url, verbose=False, auth=("alice", "wrong"))
    c = client(server)
    junk = server.root / "junk.mp4"
    junk.write_bytes(b"not a video at all " * 100)
    status, _, _ = c.predict(gradio_client.handle_file(str(junk)), "", 1.0, 0, api_name="/load")
    assert status.startswith("⚠️ error:") and "video" in status and "Traceback" not in status, status

    big = server.root / "big.mp4"
    big.write_bytes(b"\0" * (MAX_UPLOAD_MB * 2**20 + 1))
    with pytest.raises(ValueError, match="maximum file size"):
        c.predict(gradio_client.handle_file(str(big)), "", 1.0, 0, api_name="/load")

    for path, message in (
        ("/etc/hostname", "outside the allowed folders"),
        (str(server.videos / "missing.mp4"), "not found"),
        ("", "upload a video first"),
        (str(server.videos / "a\x00b.mp4"), "is not a path"),
    ):
        status, _, _ = c.predict(None, path, 1.0, 0, api_name="/load")
        assert status.startswith("⚠️ error:") and message in status, status
    for fps, max_frames, message in (
        (0, 0, "fps must be above 0"),
        (1.0, -3, "max frames must be 1 or more (got -3)"),
    ):
        status, _, _ = c.predict(
            None, str(server.videos / "short.mp4"), fps, max_frames, api_name="/load"
        )
        assert status.startswith("⚠️ error:") and message in status, status

    # A new server-side video loads by path (no upload), and the chat still answers exactly.
    raw = client(server, download_files=False)
    status, _, player = raw.predict(
        None, str(server.videos / "short.mp4"), 1.0, 0, api_name="/load"
    )
    assert "10 frames at 1 fps" in status, status
    in_place = (server.videos / "short.mp4").resolve()
    assert Path(player["path"]).resolve() == in_place, (
        "allowed videos are played in place, not copied"
    )
    history, _ = ask(raw, "   ", [])
    assert history == []
    history, _ = ask(raw, QUESTIONS[0], [])
    assert last_answer(history)[0] == expected[0]
    # another tab (c) has no video of its own: it is asked to load one, not answered about raw's
    history, _ = ask(c, QUESTIONS[0], [])
    assert message_text(history[-1]["content"]).startswith(
        "⚠️ error: load a video in this browser tab first"
    ), history
    for bad in (0, -3):  # the box rounds a fraction itself
        history, _ = ask(raw, QUESTIONS[0], [], bad)
        line = message_text(history[-1]["content"])
        assert line == f"⚠️ error: max new tokens must be a whole number of 1 or more (got {bad})"


@pytest.mark.slow
def test_stop_and_cancel_leave_the_group_in_step(server, short_video, expected):
    c = client(server)
    status, _, _ = c.predict(None, str(server.videos / "short.mp4"), 1.0, 0, api_name="/load")
    assert "10 frames" in status, status

    job = c.submit(QUESTIONS[0], [], 400, api_name="/chat")
    for seen, _ in enumerate(job):
        if seen == 3:
            c.predict(api_name="/stop")
    answer, footer = last_answer(job.result()[0])
    assert "interrupted" in footer and answer, footer

    job = c.submit(QUESTIONS[0], [], 400, api_name="/chat")
    for seen, _ in enumerate(job):
        if seen == 3:
            job.cancel()  # what closing the tab does: GeneratorExit in the handler
            break
    deadline = time.monotonic() + scaled(30)
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.1)

    # Another browser tab (a new client) loads its video and starts its own conversation; answers
    # stay exact.
    other = client(server)
    other.predict(None, str(server.videos / "short.mp4"), 1.0, 0, api_name="/load")
    history, _ = ask(other, QUESTIONS[0], [])
    assert last_answer(history)[0] == expected[0]
    history, _ = ask(other, QUESTIONS[1], history)
    assert last_answer(history)[0] == expected[1]


@pytest.mark.slow
def test_two_sessions_at_once_are_served_one_after_the_other(server, expected):
    """One engine: the second request waits in Gradio's queue; each tab starts its own
    conversation."""
    clients = [client(server), client(server)]
    for c in clients:
        c.predict(None, str(server.videos / "short.mp4"), 1.0, 0, api_name="/load")
    jobs = [c.submit(QUESTIONS[0], [], PARAMS.max_new_tokens, api_name="/chat") for c in clients]
    for job in jobs:
        assert last_answer(job.result()[0])[0] == expected[0]


@pytest.mark.slow
def test_dead_rank_is_a_readable_error_and_the_page_keeps_answering(server):
    """Runs last in the module: it kills rank 1 of the group."""
    if server.ranks < 2:
        pytest.skip("needs a worker rank to kill")
    c = client(server)
    status, _, _ = c.predict(None, str(server.videos / "short.mp4"), 1.0, 0, api_name="/load")
    assert "10 frames" in status, status
    (pid,) = server.root.glob("lvx-run-*/pid-rank1.txt")
    os.kill(int(pid.read_text()), signal.SIGKILL)
    t0 = time.monotonic()
    for _ in range(5):  # the first request may still be answered before torchrun notices
        history, _ = ask(c, QUESTIONS[0], [], 50)
        text = message_text(history[-1]["content"])
        if (
            "rank 1 failed" in text
        ):  # an error line, or the footer of an answer from the restarted workers
            break
        time.sleep(1)
    assert "rank 1 failed" in text and "Traceback" not in text, text
    assert time.monotonic() - t0 < scaled(90)
    # the server keeps answering: the group was restarted (tests/test_serve_faults.py)
    stats = c.predict(api_name="/stats")
    assert not stats.startswith("⚠️ error:") and "world size: 2" in stats, stats


@pytest.mark.slow
def test_subtitles_from_the_video_or_an_upload(server, short_video):
    """The checkbox uses the text stream inside the video, an upload replaces it, a bad upload is
    one line; the status says how many lines were placed; switching subtitles reloads from the
    feature cache."""
    from videos import add_subtitle_stream

    talk = add_subtitle_stream(
        short_video, server.videos / "talk.mp4", [(0.5, 2.5, "hello there"), (3, 5, "bye")]
    )
    c = client(server)
    status, _, _ = c.predict(None, str(talk), 1.0, 0, None, True, api_name="/load")
    stream = "from stream 1 (mov_text, eng) of talk.mp4"
    assert f"subtitles: 2 line(s) at the sampled frames, {stream}" in status, status
    assert "2 subtitle line(s) placed" in status
    history, _ = ask(c, QUESTIONS[0], [])
    assert last_answer(history)[0]
    status, _, _ = c.predict(None, str(talk), 1.0, 0, None, False, api_name="/load")
    assert "subtitle" not in status and "loaded from cache" in status, status
    srt = server.root / "mine.srt"
    srt.write_text("1\n00:00:00,000 --> 00:00:09,500\nfrom the upload\n")
    status, _, _ = c.predict(
        None, str(talk), 1.0, 0, gradio_client.handle_file(str(srt)), True, api_name="/load"
    )
    placed = "subtitles: 1 line(s) at the sampled frames, from mine.srt"
    assert placed in status and "loaded from cache" in status, status
    junk = server.root / "junk.srt"
    junk.write_bytes(bytes(range(256)) * 8)
    status, _, _ = c.predict(
        None, str(talk), 1.0, 0, gradio_client.handle_file(str(junk)), True, api_name="/load"
    )
    assert status.startswith("⚠️ error: junk.srt is binary"), status
    assert "--" not in status and "or remove it" in status, "the page's words, not a flag's"


def test_timestamps_become_seek_links_only_inside_the_video():
    text = "at 0:05, then 1:02:03; not 12:75 or 3:4 or 99:00 (past the end), and 0:05 again."
    assert link_timestamps(text, 10.0) == (
        "at [0:05](#lvx-seek-5), then 1:02:03; not 12:75 or 3:4 or 99:00 (past the end), and "
        "[0:05](#lvx-seek-5) again."
    )
    assert "[1:02:03](#lvx-seek-3723)" in link_timestamps(text, 4000.0)
    assert "[99:00](#lvx-seek-5940)" not in link_timestamps(text, 4000.0)
    assert link_timestamps(text, None) == text  # no video loaded: nothing to seek


def test_bad_options_fail_fast_with_one_line(tmp_path):
    """Checked before any model is loaded; exit code 2 and a line saying what to do."""
    from typer.testing import CliRunner

    from lvx_app.cli.main import app

    for args, message in (
        (["--auth", "alice"], "--auth takes user:password"),
        (["--allow-paths", str(tmp_path / "nope")], "is not a directory"),
        (["--max-upload-mb", "0"], "--max-upload-mb must be a number above 0"),
        (["--port", "70000"], "--port must be 1..65535"),
    ):
        result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), *args])
        said = (result.stdout + result.stderr).strip().splitlines()
        assert result.exit_code == 2 and len(said) == 1 and message in said[0], said


@pytest.mark.slow
def test_a_server_side_video_plays_in_place_without_a_copy(server):
    """A video opened by path under --allow-paths is shown by the player from where it is: an hour
    of video is not copied into the server's temporary folder."""
    # a video of its own: no earlier test has uploaded these bytes into the temporary folder
    source = make_video(server.videos / "in-place.mp4", num_frames=30, fps=10, width=80, height=48)
    status, _, _ = client(server).predict(None, str(source), 1.0, 0, api_name="/load")
    assert "in-place.mp4" in status
    size = source.stat().st_size
    copies = [
        p
        for p in server.root.rglob("*")
        if p.is_file() and p.stat().st_size == size and server.videos not in p.parents
    ]
    assert copies == [], copies


@pytest.mark.slow
def test_no_schema_route_and_no_fifo_behind_the_file_route(server):
    """`/openapi.json` was a 500 with a pydantic traceback in the log on every call; the page's
    file route on a FIFO under --allow-paths blocked until someone wrote into it. Both are one
    answer now (the fixture checks the log holds no traceback)."""
    import httpx

    fifo = server.videos / "pipe.mp4"
    os.mkfifo(fifo)
    try:
        with httpx.Client(timeout=scaled(30), auth=server.auth) as http:
            assert http.get(server.url + "openapi.json").status_code == 404
            for route in ("gradio_api/file=", "file="):
                answer = http.get(server.url + route + str(fifo))
                assert answer.status_code == 404, answer.text
                assert answer.json() == {"detail": "not a regular file: the page serves files only"}
            assert http.get(server.url + "gradio_api/file=" + str(server.videos)).status_code == 404
    finally:
        fifo.unlink()


@pytest.mark.slow
def test_a_malformed_chat_history_is_one_line(server):
    """A history the page never sends (a made-up role, a number for content) was a pydantic
    validation error with its traceback in the log (the fixture checks the log holds none)."""
    c = client(server)
    for history in ([{"role": "robot", "content": 5}], [["a", "b", "c"]], "not a list"):
        with pytest.raises(Exception) as e:
            c.predict("what happens?", history, 4, api_name="/chat")
        assert "the chat history is not one the page sent" in str(e.value), e.value
