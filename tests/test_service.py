"""The engine service every frontend shares (`lvx_app.runtime.service`), on an engine stand-in: one
queue in order with its limit and its bounded wait, a lease given back by its owner from any
thread, each client's video and conversation brought back, Stop per client, and one restart of a
dead group however many clients find it dead."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from timing import scaled

from lvx_app.config import Config, VideoConfig
from lvx_app.engine.records import AnswerStats, GroupFailed, VideoRequest, VideoSummary
from lvx_app.runtime.engine_handle import Engine
from lvx_app.runtime.service import Busy, EngineService, NoVideo, Restarting


class StandIn(Engine):
    """An engine in memory: it records what it is asked; `dies` makes its next answer fail as a
    dead group does, `died` says it has exited."""

    def __init__(self, name: str = "first") -> None:
        self.config, self.name = Config(), name
        self.loads: list[str] = []
        self.replays: list[list] = []
        self.resets = self.interrupts = 0
        self.died: str | None = None
        self.dies = self.closed = False
        self.going = threading.Event()

    def load_video(self, request, *, progress=None):
        self.loads.append(request.path)
        self.held = request
        return VideoSummary(request.path, 10, 1.0, 10.0, 40, False, 0.01)

    def ask(self, question: str, **generation) -> Iterator[str]:
        for i in range(generation.get("max_new_tokens", 3)):
            if self.dies:
                raise GroupFailed("rank 1 failed: killed")
            self.going.set()
            yield f"{question}{i} "
            if self.interrupts:
                break
        self.last_answer = AnswerStats(new_tokens=3, tokens=[1, 2, 3])

    def reset(self) -> None:
        self.resets += 1

    def replay(self, turns) -> None:
        self.replays.append(list(turns))

    def stats(self) -> dict:
        return {"world size": 1, "video": self.held.path if self.held else None}

    def describe(self) -> dict:
        return {}

    def interrupt(self) -> None:
        self.interrupts += 1

    def dead(self) -> str | None:
        return self.died

    def close(self) -> None:
        self.closed = True


def _request(path: str) -> VideoRequest:
    return VideoRequest(path, VideoConfig())


def _in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_leases_come_in_order_and_a_full_queue_is_busy():
    service = EngineService(StandIn(), queue_size=2)
    first = service.lease("a")
    order: list[str] = []

    def wait(name: str) -> None:
        with service.lease(name):
            order.append(name)

    waiting = []
    for n, name in enumerate(("b", "c"), start=1):
        waiting.append(_in_thread(lambda name=name: wait(name)))
        while len(service._waiting) < n:
            waiting[-1].join(0.01)
    with pytest.raises(Busy, match=r"busy \(2 requests wait\)"):
        service.lease("d")
    _in_thread(first.close).join()  # given back by its owner, from another thread
    for thread in waiting:
        thread.join(scaled(10))
    assert order == ["b", "c"] and service._holder is None
    first.close()  # twice: nothing more happens
    with pytest.raises(RuntimeError, match="given back"):
        first.engine  # noqa: B018


def test_a_bounded_wait_gives_up_and_leaves_the_queue():
    service = EngineService(StandIn())
    with service.lease("a"):
        with pytest.raises(Busy, match="busy for 0.05 s"):
            service.lease("b", timeout=0.05)
        assert not service._waiting
    with service.lease("b", timeout=0.05) as lease:
        assert lease.engine is service.engine


def test_each_client_gets_its_own_video_and_conversation_back():
    engine = StandIn()
    service = EngineService(engine)
    with service.lease("A") as lease:
        with pytest.raises(NoVideo):
            lease.ready()
        lease.load(_request("a.mp4"))
        assert lease.ready() == []
        assert "".join(lease.ask("q")) == "q0 q1 q2 "
    with service.lease("B") as lease:
        lease.load(_request("b.mp4"))
        assert "b.mp4" in lease.stats()["video"]
    with service.lease("A") as lease:
        assert "video" not in lease.stats(), "another client's video is not shown"
        notes = lease.ready()
        assert engine.loads == ["a.mp4", "b.mp4", "a.mp4"] and engine.replays == [
            [("q", [1, 2, 3])]
        ]
        assert notes[0] == "reloaded your video a.mp4" and "rebuilt from its 1 earlier" in notes[1]
        lease.start_over()
        assert lease.ready() == notes, "a fresh conversation: the video prompt alone"
    assert engine.replays == [[("q", [1, 2, 3])]] and engine.resets == 2


def test_stop_stops_only_its_own_clients_answer():
    engine = StandIn()
    service = EngineService(engine)
    with service.lease("A") as lease:
        lease.load(_request("a.mp4"))
        pieces = lease.ask("q", max_new_tokens=50)
        next(pieces)
        service.stop("B")
        next(pieces)
        assert engine.interrupts == 0
        service.stop("A")
        rest = list(pieces)
    assert engine.interrupts == 1 and rest == [], "it stops at its next token"
    assert service.client("A").turns == [("q", [1, 2, 3])]


def test_an_answer_left_unfinished_leaves_the_conversation_nobodys():
    engine = StandIn()
    service = EngineService(engine)
    with service.lease("A") as lease:
        lease.load(_request("a.mp4"))
        pieces = lease.ask("q", max_new_tokens=50)
        next(pieces)
        pieces.close()  # the client went away
    assert service.talking is None and service.client("A").turns == []
    with service.lease("A") as lease:
        lease.ready()
    assert engine.resets == 1 and engine.replays == []


def test_a_dead_group_is_restarted_once_in_the_lease_that_finds_it():
    engines = [StandIn("first"), StandIn("second")]
    service = EngineService(engines[0], reopen=lambda: engines.pop(1))
    with service.lease("A") as lease:
        lease.load(_request("a.mp4"))
    engines[0].died = "rank 1 failed: killed"
    with service.lease("A") as lease:
        notes = lease.ready()
        assert lease.engine.name == "second"
    assert notes == [
        "the workers restarted after: rank 1 failed: killed",
        "reloaded your video a.mp4",
    ]
    with service.lease("B") as lease:
        assert lease.engine.name == "second" and lease.notes == [], "restarted once"


def test_a_group_dying_mid_answer_restarts_on_the_next_lease():
    first, second = StandIn("first"), StandIn("second")
    reports: list[str] = []
    service = EngineService(first, reopen=lambda: second, report=reports.append)
    with service.lease("A") as lease:
        lease.load(_request("a.mp4"))
        first.dies = True
        with pytest.raises(GroupFailed):
            list(lease.ask("q"))
    assert service.failed == "rank 1 failed: killed" and first.closed is False
    with service.lease("A") as lease:
        lease.ready()
        assert lease.engine is second and first.closed
    assert reports == ["the workers restarted after: rank 1 failed: killed"]


def test_a_refusing_client_is_told_503_while_the_group_restarts_behind_it():
    """The API's way: its lease is refused at once, the restart happens in a lease of its own."""
    first, second = StandIn("first"), StandIn("second")
    opened = threading.Event()
    release = threading.Event()

    def reopen() -> Engine:
        opened.set()
        release.wait(scaled(10))
        return second

    service = EngineService(first, reopen=reopen)
    first.died = "rank 1 failed: killed"
    with (
        service.lease("api", on_dead="refuse") as lease,
        pytest.raises(GroupFailed, match="rank 1"),
    ):
        lease.chat(None, [{"role": "user", "content": "hi"}])
    assert service.restarting
    opened.wait(scaled(10))
    with pytest.raises(Restarting, match="restarting; try again shortly"):
        service.lease("api", on_dead="refuse")  # while it restarts: no second restart
    release.set()
    with service.lease("page") as lease:  # waits behind the restart
        assert lease.engine is second and lease.notes == []
    assert not service.restarting and service.failed is None


def test_a_failed_restart_is_tried_again_by_the_next_lease():
    second = StandIn("second")
    tries: list[int] = []

    def reopen() -> Engine:
        tries.append(1)
        if len(tries) == 1:
            raise GroupFailed("no GPU left")
        return second

    first = StandIn("first")
    first.died = "rank 0 failed"
    service = EngineService(first, reopen=reopen)
    with service.lease("A") as lease, pytest.raises(GroupFailed, match="no GPU left"):
        lease.engine  # noqa: B018
    assert service.failed == "rank 0 failed"
    with service.lease("A") as lease:
        assert lease.engine is second
    assert len(tries) == 2


def test_without_a_way_to_restart_a_dead_group_is_one_line():
    engine = StandIn()
    engine.died = "rank 1 failed: killed"
    with EngineService(engine).lease("eval") as lease, pytest.raises(GroupFailed, match="rank 1"):
        lease.engine  # noqa: B018


def test_the_product_restarts_a_group_and_takes_the_engine_in_one_place():
    """No frontend restarts the group or queues for the engine itself: the service does."""
    root = Path(__file__).resolve().parents[1]
    found: dict[str, list[str]] = {"reopen": [], "lock": []}
    for path in [*(root / "lvx_app").rglob("*.py"), *(root / "ui").rglob("*.py")]:
        text = path.read_text()
        name = str(path.relative_to(root))
        if re.search(r"\breopen\(\)", text):
            found["reopen"].append(name)
        if re.search(r"\block\.(acquire|release)\(", text):
            found["lock"].append(name)
    # the one lock outside the service is the engine's own guard, which refuses a second thread's
    # command in one line and never queues it
    expected = {
        "reopen": ["lvx_app/runtime/service.py"],
        "lock": ["lvx_app/runtime/engine_handle.py"],
    }
    assert found == expected, found


def test_health_says_wedged_when_the_holder_shows_no_life_past_its_bound():
    """A lease that holds the engine with no piece and no progress step for longer than the
    service's bound: `/health` is 503 wedged, without waiting for the engine; 200 once it moves
    on and gives the engine back."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from lvx_ui.openai_request import VideoFiles
    from lvx_ui.openai_routes import OpenAIApi

    engine = StandIn()
    service = EngineService(engine, stuck_after=0.2)
    app = FastAPI()
    OpenAIApi(service, Config(), VideoFiles([], 1.0, None), report=lambda line: None).mount(app)
    http = TestClient(app)
    assert http.get("/health").status_code == 200
    free = threading.Event()
    lease = service.lease("a")
    stuck = _in_thread(lambda: free.wait(scaled(60)))  # the holder, silent

    def health() -> tuple[int, str]:
        answer = http.get("/health")
        return answer.status_code, answer.json()["status"]

    seen = [health()]
    while seen[-1] != (503, "wedged") and len(seen) < 1000:
        free.wait(0.05)
        seen.append(health())
    assert seen[-1] == (503, "wedged"), seen
    service.touch()  # a sign of life: a piece or a progress step
    assert health() == (200, "ok")
    free.set()
    stuck.join()
    lease.close()
    assert health() == (200, "ok")
