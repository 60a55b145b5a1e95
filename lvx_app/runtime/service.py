"""One engine shared by its clients: the browser tabs of `lvx serve`, the requests of its
OpenAI-compatible API, a Video-MME run. They sit on it as vLLM's routes sit on one engine client.

The engine holds one video and one conversation at a time, so clients take turns. A client takes the
engine with `EngineService.lease` (in one queue, in order; more than `queue_size` waiting are turned
away with `Busy`, and a wait may be bounded) and the same lease gives it back, from whatever thread
it is in; nothing else touches the engine meanwhile. The service keeps each client's video request
and turns: when another client used the engine in between, `Lease.ready` first gets the client's
own video back (reloaded, from the feature cache) and rebuilds its conversation from its turns.

A dead worker group is restarted in one place, `EngineService._heal`, with the same options: in the
lease of the client that finds it dead (the page: a note says so), or behind while that client is
refused (the API answers 503 until it is back, `restarting`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lvx_app.devices import release_free_memory
from lvx_app.engine.records import EngineError, GroupFailed, ProgressFn, VideoRequest, VideoSummary
from lvx_app.runtime.engine_handle import Engine

MAX_CLIENTS = 256  # clients remembered; the one unused longest is forgotten first
# what `stats` says about the video and answers the engine holds: not shown to another client
ANOTHER_CLIENTS = ("video", "prompt tokens", "last answer")
OnDead = Literal["restart", "refuse"]


class Busy(EngineError):
    """More clients wait for the engine than the queue takes, or a wait ran out: try again
    shortly."""


class Restarting(GroupFailed):
    """The worker group is being restarted; a refusing client is told to come back shortly."""


class NoVideo(EngineError):
    """A client asked about its video before loading one (it never sees another client's)."""


@dataclass
class Client:
    """What the service keeps for one client: its video, its conversation, its Stop."""

    request: VideoRequest | None = None  # None: nothing loaded by this client (or forgotten)
    summary: VideoSummary | None = None  # what its load said
    turns: list[tuple[str, list[int]]] = field(default_factory=list)  # (question, answer ids)
    stop: threading.Event = field(default_factory=threading.Event)  # stops its answer only


class EngineService:
    """The engine, its queue, its restarts, and each client's video and conversation."""

    def __init__(
        self,
        engine: Engine,
        reopen: Callable[[], Engine] | None = None,
        *,
        queue_size: int | None = None,
        report: Callable[[str], None] | None = None,
        clients_kept: int = MAX_CLIENTS,
        stuck_after: float | None = None,
    ) -> None:
        self.engine = engine
        # seconds a lease may hold the engine with no sign of life (a piece, a progress step)
        # before a health probe calls it wedged: the longest a request may wait for it
        self.stuck_after = stuck_after
        self._quiet_since: float | None = None  # the holder's last sign of life
        self.reopen = reopen  # a fresh engine with the same options, after the group died
        self.queue_size = queue_size  # leases that may wait (None: any number)
        self.report = report or (lambda line: None)  # one line per restart, for the server's log
        self.clients_kept = clients_kept
        self.failed: str | None = None  # why the group died; the next lease restarts it
        self.talking: str | None = None  # the client whose conversation the engine holds
        self.loaded: VideoSummary | None = None  # what the load the engine holds said
        self._clients: OrderedDict[str, Client] = OrderedDict()
        self._clients_lock = threading.Lock()  # Stop arrives outside the queue
        self._turn = threading.Condition()
        self._holder: Lease | None = None
        self._waiting: deque[Lease] = deque()
        self._restarting = threading.Event()

    # ---- clients ---------------------------------------------------------------------------------
    def client(self, client_id: str) -> Client:
        """Client `client_id`, now the most recently used (new the first time, or once
        forgotten)."""
        with self._clients_lock:
            client = self._clients.pop(client_id, None) or Client()
            self._clients[client_id] = client
            while len(self._clients) > self.clients_kept:
                self._clients.popitem(last=False)
            return client

    def stop(self, client_id: str | None) -> None:
        """Stop the answer of client `client_id` only (it does not wait for the engine)."""
        with self._clients_lock:
            client = self._clients.get(client_id) if client_id else None
        if client is not None:
            client.stop.set()

    @property
    def restarting(self) -> bool:
        """Whether the worker group is being restarted (or is about to be)."""
        return self._restarting.is_set()

    def down(self) -> str | None:
        """Why the worker group cannot answer now, asked without waiting for the engine (a
        health probe): it died (found by a request, or exited since: a rank killed between
        requests), or it is being restarted; None while it runs."""
        if self.restarting:
            return "restarting"
        if self.failed is not None:
            return "down"
        engine = self.engine  # read once: a restart may replace it meanwhile
        if engine.dead():
            return "down"
        quiet = self._quiet_since
        stuck = self.stuck_after is not None and quiet is not None
        return "wedged" if stuck and time.monotonic() - quiet > self.stuck_after else None

    def touch(self) -> None:
        """A sign of life of the engine's holder (a piece, a progress step)."""
        if self._holder is not None:
            self._quiet_since = time.monotonic()

    def can_restart(self) -> bool:
        return self.reopen is not None

    # ---- the queue -------------------------------------------------------------------------------
    def lease(
        self, client_id: str, *, on_dead: OnDead = "restart", timeout: float | None = None
    ) -> Lease:
        """The engine for client `client_id` once the leases before it are given back: `Busy` when
        `queue_size` leases wait already, or after `timeout` seconds (None: as long as it takes).
        `on_dead`: a dead group is restarted in this lease ("restart") or behind it while this one
        is refused with GroupFailed, and while it restarts with `Restarting` ("refuse")."""
        if on_dead == "refuse" and self.restarting:
            raise Restarting("the worker group is restarting; try again shortly")
        lease = Lease(self, client_id, self.client(client_id), on_dead)
        self._take(lease, timeout, limited=True)
        return lease

    def _take(self, lease: Lease, timeout: float | None, *, limited: bool) -> None:
        with self._turn:
            if self._holder is None and not self._waiting:
                self._holder, self._quiet_since = lease, time.monotonic()
                return
            waiting = len(self._waiting)
            if limited and self.queue_size is not None and waiting >= self.queue_size:
                raise Busy(f"the server is busy ({waiting} requests wait); try again shortly")
            self._waiting.append(lease)
            turn = False
            try:
                turn = self._turn.wait_for(
                    lambda: self._holder is None and self._waiting[0] is lease, timeout
                )
            finally:
                if not turn:  # timed out or interrupted: out of the queue
                    self._waiting.remove(lease)
                    self._turn.notify_all()
            if not turn:
                raise Busy(f"the engine was busy for {timeout:g} s; try again shortly")
            self._waiting.popleft()
            self._holder, self._quiet_since = lease, time.monotonic()

    def _give_back(self, lease: Lease) -> None:
        with self._turn:
            if self._holder is lease:
                self._holder, self._quiet_since = None, None
                self._turn.notify_all()
        release_free_memory()  # what serving this lease freed, given back to the system

    # ---- a dead group ----------------------------------------------------------------------------
    def _fail(self, why: str) -> None:
        """The group died: the next lease restarts it; no client's video or turns are held."""
        self.failed, self.talking = why, None

    def _heal(self) -> str:
        """(With the engine leased.) Restart the dead group with the same options; the note."""
        why = self.failed
        self._restarting.set()
        try:
            with contextlib.suppress(Exception):
                self.engine.close()
            self.engine = self.reopen()  # an error here leaves `failed` set: the next lease retries
        finally:
            self._restarting.clear()
        self.failed, self.talking = None, None
        note = f"the workers restarted after: {why}"
        self.report(note)
        return note

    def _restart_behind(self) -> None:
        """Restart the dead group in a lease of its own, behind the current one."""
        with self._turn:
            if self._restarting.is_set():
                return
            self._restarting.set()
        threading.Thread(target=self._restart, name="lvx-restart", daemon=True).start()

    def _restart(self) -> None:
        lease = Lease(self, "", Client(), "restart")
        try:
            self._take(lease, None, limited=False)
            with lease:
                if self.failed is not None:
                    self._heal()
        except Exception as exc:  # noqa: BLE001 - reported; the next request tries again
            self.report(f"the workers could not restart ({exc}); the next request retries")
        finally:
            self._restarting.clear()

    def close(self) -> None:
        """Shut the engine down (the server is stopping)."""
        self.engine.close()


class Lease:
    """The engine for one client until `close` (or the end of its `with` block) gives it back."""

    def __init__(self, service: EngineService, client_id: str, client: Client, on_dead: OnDead):
        self.service, self.client_id, self.client = service, client_id, client
        self.on_dead = on_dead
        self.notes: list[str] = []  # what bringing the engine to the client took
        self.closed, self._checked = False, False

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Give the engine back; a group that died meanwhile restarts behind a refusing lease."""
        if self.closed:
            return
        self.closed = True
        service = self.service
        service._give_back(self)
        if self.on_dead == "refuse" and service.failed is not None and service.can_restart():
            service._restart_behind()

    @property
    def engine(self) -> Engine:
        """The engine, alive: a dead group is restarted first (or refused, as `on_dead` says)."""
        if self.closed:
            raise RuntimeError("this lease was given back")
        if not self._checked:
            self._checked = True
            self._alive()
        return self.service.engine

    def _alive(self) -> None:
        service = self.service
        dead = service.engine.dead()  # a group that exited between requests
        if dead and service.failed is None:
            service._fail(dead)
        if service.failed is None:
            return
        if self.on_dead == "refuse" or not service.can_restart():
            why = service.failed
            self.close()
            raise GroupFailed(why)
        self.notes.append(service._heal())

    @contextlib.contextmanager
    def _watch(self) -> Iterator[None]:
        """A group that dies during a call is remembered: the next lease restarts it."""
        try:
            yield
        except GroupFailed as exc:
            self.service._fail(str(exc))
            raise

    # ---- the client's video and conversation -----------------------------------------------------
    def load(self, request: VideoRequest, progress: ProgressFn | None = None) -> VideoSummary:
        """Load the client's video; its conversation starts afresh."""
        engine, service = self.engine, self.service
        service.talking = None  # a load clears the conversation the engine holds
        with self._watch():
            summary = service.loaded = engine.load_video(request, progress=self._lively(progress))
        self.client.request, self.client.summary, self.client.turns = request, summary, []
        service.talking = self.client_id
        return summary

    def ready(self, progress: ProgressFn | None = None) -> list[str]:
        """Bring the engine to the client: its own video, then its own conversation. Returns the
        notes of what that took (a restart too); NoVideo when the client has loaded none."""
        service, client = self.service, self.client
        if client.request is None:
            raise NoVideo("load a video first: each client asks about its own video")
        engine = self.engine
        if not self._holds(client.request):
            self._reload(client.request, progress)
        if service.talking != self.client_id:
            with self._watch():
                engine.reset()
                service.talking = None
                if client.turns:
                    engine.replay(client.turns)
                    n = len(client.turns)
                    self.notes.append(
                        f"your conversation was rebuilt from its {n} earlier turn{'s' * (n > 1)}: "
                        "another tab used the model in between"
                    )
            service.talking = self.client_id
        return list(self.notes)

    def _lively(self, progress: ProgressFn | None) -> ProgressFn:
        """`progress`, each step of it also a sign of life for a health probe."""

        def step(*args: Any) -> None:
            self.service.touch()
            if progress is not None:
                progress(*args)

        return step

    def _holds(self, request: VideoRequest) -> bool:
        held = self.engine.held
        return held is not None and held.key == request.key

    def _reload(self, request: VideoRequest, progress: ProgressFn | None) -> None:
        name = Path(request.path).name
        self.service.talking = None
        try:
            with self._watch():
                summary = self.service.loaded = self.engine.load_video(
                    request, progress=self._lively(progress)
                )
        except GroupFailed:
            raise
        except EngineError as exc:
            raise EngineError(
                f"your video {name} could not be loaded again ({exc}); load it again"
            ) from None
        cached = " from the feature cache" if summary.from_cache else ""
        self.notes.append(f"reloaded your video {name}{cached}")

    def start_over(self) -> None:
        """Forget the client's conversation (keep its video): its next question starts from the
        video prompt."""
        self.client.turns = []
        if self.service.talking == self.client_id:
            self.service.talking = None

    def ask(self, question: str, **generation: Any) -> Iterator[str]:
        """Stream the answer to the client's next question (after `ready`); the turn is kept when
        the answer finishes. The client's Stop stops it."""
        self.client.stop.clear()
        with self._watch():
            pieces = self.engine.ask(question, **generation)
        return self._stream(pieces, question)

    def chat(
        self, request: VideoRequest | None, turns: Sequence[dict], **generation: Any
    ) -> Iterator[str]:
        """Stream the answer to a whole conversation (`Engine.chat`), with the video `request`
        names loaded unless the engine holds it already. Another client's conversation is never
        reused (what it reused would tell this one what the other said): the engine forgets it
        first and keeps only the video prompt, itself a whole load this client asked for, and
        that only when it holds no other client's words (its opening's owner)."""
        engine, service = self.engine, self.service
        if request is not None and not self._holds(request):
            service.talking = None
            with self._watch():
                service.loaded = engine.load_video(request, progress=self._lively(None))
        elif service.talking != self.client_id:
            held = engine.held  # a load whose opening holds another client's words: not reused
            theirs = held is not None and held.opening.owner not in ("", self.client_id)
            with self._watch():
                engine.reset(keep_prompt=not theirs)
        service.talking = self.client_id
        with self._watch():
            pieces = engine.chat(turns, **generation)
        return self._stream(pieces, None)

    def _stream(self, pieces: Iterator[str], question: str | None) -> Iterator[str]:
        """`pieces` as they come; closing this stops the answer (the ranks finish their step). An
        answer that did not finish leaves the engine's conversation nobody's."""
        service, finished = self.service, False
        try:
            with self._watch():
                for piece in pieces:
                    service.touch()
                    yield piece
                    if self.client.stop.is_set():
                        service.engine.interrupt()
            if question is not None:
                self.client.turns.append((question, list(service.engine.last_answer.tokens)))
            finished = True
        finally:
            if not finished and service.talking == self.client_id:
                service.talking = None
            with contextlib.suppress(Exception):  # a dead group has nothing left to drain
                pieces.close()

    def stats(self) -> dict[str, Any]:
        """The engine's `/stats`, without the video and answers of another client."""
        engine, request = self.engine, self.client.request
        with self._watch():
            stats = engine.stats()
        if request is None or not self._holds(request):
            stats = {k: v for k, v in stats.items() if k not in ANOTHER_CLIENTS}
        return stats
