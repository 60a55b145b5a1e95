"""One wire for every hop: the typed messages round-trip through the one codec, and an error keeps
its type across it (its nearest known base when the receiver does not know the type itself), over
the frontend's link to rank 0 as over a decode worker's pipe."""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from multiprocessing import Pipe

import numpy as np
import pytest

from lvx_app.config import Config, VideoConfig
from lvx_app.engine.records import EngineError, EngineWarning, GroupFailed, QuestionTooLong
from lvx_app.runtime import commands
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver
from lvx_app.runtime.launcher import RemoteEngine
from lvx_app.runtime.socket_link import serve_link
from lvx_app.video.errors import PlanTooLargeError, VideoError, VideoNotFoundError
from lvx_app.wire import (
    Failure,
    Interrupt,
    Piece,
    Progress,
    Ready,
    Reply,
    Request,
    Warned,
    WireError,
    decode,
    encode,
    receive,
    send,
)


@dataclass(frozen=True)
class Asked:
    """A request dataclass the wire has never heard of."""

    path: str
    video: VideoConfig


MESSAGES = [
    Request("load_video", {"asked": Asked("v.mp4", VideoConfig(fps=2.0))}, id=7),
    Ready({"world size": 2}),
    Progress("frames", 3, 10),
    Piece("The storm"),
    Reply(np.arange(6, dtype=np.uint8).reshape(2, 3), id=7),
    Warned("fps clamped to 25"),
    Interrupt(),
    Failure.of(QuestionTooLong("the question is too long")),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    again = decode(encode(message))
    assert type(again) is type(message)
    if isinstance(message, Reply):
        assert np.array_equal(again.value, message.value) and again.id == message.id
    else:
        assert again == message


def test_only_wire_messages_are_sent_or_read():
    import pickle

    with pytest.raises(TypeError, match="not a wire message"):
        encode(("done", None))
    with pytest.raises(TypeError, match="not a wire message: tuple"):
        decode(pickle.dumps(("done", None)))


@pytest.mark.parametrize(
    "error",
    [
        EngineError("no video is loaded"),
        GroupFailed("rank 1 failed: killed by SIGKILL"),
        QuestionTooLong("the question is 9,000 tokens"),
        VideoNotFoundError("Video not found: /x.mp4; check the path."),
        PlanTooLargeError("the plan has 9,000 frames"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_error_keeps_its_type_and_its_one_line(error):
    failure = decode(encode(Failure.of(error, id=3)))
    again = failure.error()
    assert type(again) is type(error) and str(again) == str(error) and failure.id == 3
    assert failure.name == type(error).__name__


def test_a_type_the_receiver_does_not_know_arrives_as_its_nearest_known_base():
    failure = Failure(
        ("elsewhere.SubtitleTooLong", "lvx_app.engine.records.QuestionTooLong"), "too long", 0
    )
    assert type(failure.error()) is QuestionTooLong
    assert failure.error(VideoError) is None  # not a video error: the caller decides
    foreign = Failure.of(RuntimeError("boom"), message="boom, in one line")
    assert foreign.error() is None and foreign.name == "RuntimeError"
    assert foreign.message == "boom, in one line"


def test_a_new_error_type_crosses_with_no_registration():
    class Refused(EngineError):
        pass

    class Counted(QuestionTooLong):
        def __init__(self, tokens: int, limit: int) -> None:
            super().__init__(f"the question is {tokens:,} tokens, over the {limit:,} cap")

    assert issubclass(EngineError, WireError) and issubclass(VideoError, WireError)
    again = decode(encode(Failure.of(Refused("no")))).error(EngineError)
    assert type(again) is Refused and isinstance(again, EngineError)
    counted = decode(encode(Failure.of(Counted(9000, 8192)))).error()
    assert type(counted) is QuestionTooLong  # made from more than a message: its base
    assert str(counted) == "the question is 9,000 tokens, over the 8,192 cap"


# -- the frontend's link to rank 0 -----------------------------------------------------------------


class Session:
    """A session with the test commands' methods."""

    def __init__(self) -> None:
        self.held: Asked | None = None

    def hold(self, asked: Asked, progress=None) -> str:
        self.held = asked
        for done in range(1, 3):
            progress("frames", done, 2)
        return f"{asked.path} at {asked.video.fps:g} fps"

    def refuse(self, asked: Asked) -> str:
        raise Refused(f"{asked.path} is refused")


class Refused(QuestionTooLong):
    """An engine error of this test only: it crosses as its own type."""


HOLD = commands.Command("hold", Session.hold, ("asked",), reply="progress")
REFUSE = commands.Command("refuse", Session.refuse, ("asked",))


@pytest.fixture
def link(monkeypatch):
    """A frontend's engine and rank 0 serving it over a pipe (no torchrun group behind)."""
    for command in (HOLD, REFUSE):
        monkeypatch.setitem(commands.COMMANDS, command.name, command)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # rank 0 relays them
    frontend, rank0 = Pipe()
    session = Session()
    served = threading.Thread(
        target=serve_link, args=(GroupDriver(session, ControlChannel(), Config()), rank0)
    )
    served.start()
    remote = RemoteEngine.__new__(RemoteEngine)
    remote.conn = frontend
    yield remote, session
    remote.call(commands.SHUTDOWN, None)
    served.join()


def test_a_request_dataclass_and_its_progress_cross_the_link(link):
    remote, session = link
    asked = Asked("v.mp4", VideoConfig(fps=2.0, max_frames=8))
    seen = []
    said = remote.call(HOLD, lambda *p: seen.append(p), asked=asked)
    assert said == "v.mp4 at 2 fps" and session.held == asked
    assert seen == [("frames", 1, 2), ("frames", 2, 2)]


def test_a_warning_on_rank_0_is_raised_again_in_the_frontend(monkeypatch):
    from lvx_app.runtime.socket_link import relay_warnings

    monkeypatch.setattr(warnings, "showwarning", lambda *args, **kwargs: None)
    frontend, rank0 = Pipe()
    relay_warnings(rank0)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn(EngineWarning("fps clamped to 25"))
    assert frontend.poll(0) and receive(frontend) == Warned("fps clamped to 25")
    send(rank0, Warned("fps clamped to 25"))
    send(rank0, Reply("done"))
    remote = RemoteEngine.__new__(RemoteEngine)
    remote.conn = frontend
    with pytest.warns(EngineWarning, match="fps clamped to 25"):
        assert remote._receive() == Reply("done")


def test_an_engine_error_crosses_the_link_as_its_own_type(link):
    remote, _ = link
    with pytest.raises(Refused, match="v.mp4 is refused"):
        remote.call(REFUSE, None, asked=Asked("v.mp4", VideoConfig()))
    with pytest.raises(EngineError, match="unknown request 'nope'"):
        remote.call(commands.Command("nope", None), None)
