"""The command table is the only place a command is declared: a new entry (the session method every
rank runs) reaches every rank through the driver, the worker loop and the frontend link, with no
other code."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest

from lvx_app.config import Config
from lvx_app.engine.records import QuestionTooLong
from lvx_app.runtime import commands
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.driver import GroupDriver, worker_loop
from lvx_app.runtime.launcher import RemoteEngine
from lvx_app.runtime.socket_link import serve_link
from lvx_app.wire import Reply, Request, receive, send
from scripts.gloo_ranks import run_ranks


class EchoSession:
    """A session with just the new command's method; it remembers what every rank ran."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.calls: list[str] = []

    def shout(self, text: str) -> str:
        self.calls.append(text)
        return f"{text.upper()} from rank {self.rank}"


ECHO = commands.Command("echo", EchoSession.shout, ("text",))


@pytest.fixture
def echo_command(monkeypatch):
    monkeypatch.setitem(commands.COMMANDS, ECHO.name, ECHO)


def test_a_new_entry_runs_on_the_in_process_engine(echo_command):
    session = EchoSession()
    driver = GroupDriver(session, ControlChannel(), Config())
    assert driver.call(ECHO, None, text="hi") == "HI from rank 0"
    assert session.calls == ["hi"]
    with pytest.raises(TypeError, match="takes \\['text'\\]"):
        driver.call(ECHO, None, words="hi")


def _echo_on_ranks(rank: int, world: int) -> list[str]:
    commands.COMMANDS[ECHO.name] = ECHO  # every rank has the same table, as with a real entry
    session, channel = EchoSession(rank), ControlChannel()
    if rank == 0:
        driver = GroupDriver(session, channel, Config())
        assert driver.call(ECHO, None, text="a") == "A from rank 0"
        driver.call(ECHO, None, text="b")
        driver.close()
    else:
        worker_loop(session, channel)
    return session.calls


def test_every_rank_runs_a_new_entry_in_order():
    assert run_ranks(_echo_on_ranks, 2) == [["a", "b"], ["a", "b"]]


def _remote_over(frontend) -> RemoteEngine:
    """The frontend half of a RemoteEngine, on a pipe: no torchrun group behind this link."""
    remote = RemoteEngine.__new__(RemoteEngine)
    remote.conn = frontend
    return remote


def test_a_new_entry_travels_over_the_frontend_link(echo_command):
    frontend, rank0 = Pipe()
    driver = GroupDriver(EchoSession(), ControlChannel(), Config())
    link = threading.Thread(target=serve_link, args=(driver, rank0), daemon=True)
    link.start()
    assert _remote_over(frontend).call(ECHO, None, text="over the link") == (
        "OVER THE LINK from rank 0"
    )
    send(frontend, Request(commands.SHUTDOWN.name))
    assert receive(frontend) == Reply(None)
    link.join(5)
    assert not link.is_alive()


class RefusingSession(EchoSession):
    def shout(self, text: str) -> str:
        raise QuestionTooLong(f"the question is {len(text):,} tokens, over the cap")


REFUSE = commands.Command("echo", RefusingSession.shout, ("text",))


def test_an_engine_error_keeps_its_type_over_the_link(monkeypatch):
    monkeypatch.setitem(commands.COMMANDS, REFUSE.name, REFUSE)
    frontend, rank0 = Pipe()
    driver = GroupDriver(RefusingSession(), ControlChannel(), Config())
    link = threading.Thread(target=serve_link, args=(driver, rank0), daemon=True)
    link.start()
    with pytest.raises(QuestionTooLong, match="over the cap"):
        _remote_over(frontend).call(REFUSE, None, text="x" * 10)
    send(frontend, Request(commands.SHUTDOWN.name))
    assert receive(frontend) == Reply(None)
    link.join(5)
