"""No file a user names may block a process: a FIFO (or a device, a folder) is refused in one line,
never opened for a read that waits for a writer; also when it is swapped in for a video while its
request waits. Real FIFOs (os.mkfifo); a test that would hang writes EOF into the FIFO itself after
a long wait, then fails."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
from timing import scaled

from lvx_app.regular_files import NotARegularFile, check_regular, read_regular
from lvx_app.subtitles import read_embedded


def unblocked(fifo: str, fn: Callable[[], Any], wait: float = 30) -> tuple[Any, bool]:
    """(what `fn()` returned or raised, whether it had to be freed): after `wait` scaled seconds
    still running, `fn` is freed by a writer opening and closing `fifo` (an EOF to its reader)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(scaled(wait))
    freed = thread.is_alive()
    while thread.is_alive():  # blocked in open() or read() of the FIFO: give it an EOF
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(0.5)
    return out[0], freed


def test_the_rule_refuses_fifos_devices_and_folders_in_one_line(tmp_path):
    fifo = tmp_path / "pipe.mp4"
    os.mkfifo(fifo)
    for path, kind in (
        (fifo, "a FIFO"),
        ("/dev/zero", "a character device"),
        (tmp_path, "a folder"),
    ):
        with pytest.raises(NotARegularFile, match=f"is {kind}.*not a file"):
            check_regular(path)
    regular = tmp_path / "a.srt"
    regular.write_bytes(b"x" * 100)
    assert read_regular(regular, 100) == b"x" * 100
    with pytest.raises(ValueError, match="larger than"):
        read_regular(regular, 99)


def test_subtitles_auto_never_opens_a_fifo(tmp_path):
    fifo = str(tmp_path / "movie.mp4")
    os.mkfifo(fifo)
    track, freed = unblocked(fifo, lambda: read_embedded(fifo))
    assert not freed, "read_embedded waited on the FIFO"
    assert not isinstance(track, BaseException) and not track.cues


@pytest.mark.slow
def test_load_video_of_a_fifo_is_an_error_not_a_wait(tiny_checkpoints, tmp_path):
    """`engine.load_video(fifo)` from Python, subtitles auto: an EngineError line naming the FIFO,
    and the engine loads the next video."""
    from engine_configs import engine_config

    from lvx_app.engine.records import EngineError
    from lvx_app.runtime.open import open_engine
    from lvx_app.video.synthetic import make_video

    fifo = str(tmp_path / "movie.mp4")
    os.mkfifo(fifo)
    config = engine_config(tiny_checkpoints["g2"], tmp_path / "cache", subtitles="auto")
    with open_engine(config) as engine:
        refused, freed = unblocked(fifo, lambda: engine.load_video(fifo))
        assert not freed, "load_video waited on the FIFO"
        assert isinstance(refused, EngineError), repr(refused)
        assert "is a FIFO (named pipe), not a file" in str(refused) and "\n" not in str(refused)
        video = make_video(tmp_path / "ok.mp4", num_frames=20, fps=10, width=64, height=48)
        assert engine.load_video(str(video)).frames == 2
