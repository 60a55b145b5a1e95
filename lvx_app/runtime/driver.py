"""Run one engine command on every rank in the same order (SPMD).

Rank 0's `GroupDriver` is the `Engine` of an in-process run (and what rank 0 of a torchrun group
serves to the frontend): it broadcasts each command, then runs its own share. Other ranks sit in
`worker_loop`. An `EngineError` (bad path, question too long, ...) is raised identically on every
rank before any collective, so the group survives it; anything else ends the process and the
launcher reports which rank failed and why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from lvx_app.config import Config
from lvx_app.devices import release_free_memory
from lvx_app.engine.records import EngineError, ProgressFn
from lvx_app.engine.session import RankSession
from lvx_app.runtime.commands import COMMANDS, SHUTDOWN, Command
from lvx_app.runtime.control import ControlChannel
from lvx_app.runtime.engine_handle import Engine
from lvx_app.wire import Request


def request(command: Command, **args: Any) -> Request:
    """The `Request` that carries `command` (its arguments checked against the declared ones)."""
    return Request(*command.message(**args))


def run_share(
    session: RankSession, channel: ControlChannel, command: Command, args: dict[str, Any], **local
) -> Any:
    """This rank's share of `command`: the session method, then the gather every rank joins.
    `local` holds what stays on this rank (rank 0's progress callback and stop flag)."""
    result = command.run(session, **args, **local)
    if not command.gathered:
        return result
    every = channel.gather(result)
    if every is None or command.finish is None:  # only rank 0 gets every rank's result
        return every
    return command.finish(session, every)


class GroupDriver(Engine):
    """The engine as seen from rank 0 (or from the only process)."""

    def __init__(self, session: RankSession, channel: ControlChannel, config: Config) -> None:
        self.session, self.channel, self.config = session, channel, config
        self.last_answer = None
        self._stop = threading.Event()

    def run(self, command: Command, local: dict[str, Any] | None = None, **args: Any) -> Any:
        """Broadcast `command` to the other ranks, then run rank 0's share."""
        release_free_memory()  # what the command before this one freed
        self.channel.broadcast(request(command, **args))
        return run_share(self.session, self.channel, command, args, **(local or {}))

    def call(self, command: Command, progress: ProgressFn | None, **args: Any) -> Any:
        local = {"progress": progress} if command.reply == "progress" else None
        return self.run(command, local, **args)

    def stream(self, command: Command, **args: Any) -> Iterator[str]:
        self._stop.clear()
        answer = self.run(command, {"should_stop": self._stop.is_set}, **args)
        t0 = time.perf_counter()
        try:
            yield from answer
        except GeneratorExit:
            # the frontend stopped listening (Gradio's Stop): finish the turn on every rank
            self._stop.set()
            for _ in answer:
                pass
            raise
        finally:
            self.last_answer = self.session.last_answer
            if self.last_answer is not None and self.last_answer.total_s == 0.0:
                self.last_answer.total_s = time.perf_counter() - t0

    def describe(self) -> dict[str, Any]:
        return self.session.describe()

    def interrupt(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.channel.broadcast(request(SHUTDOWN))


def worker_loop(session: RankSession, channel: ControlChannel) -> None:
    """Ranks other than 0: run rank 0's commands until told to shut down."""
    while True:
        asked = channel.broadcast()
        release_free_memory()  # what the command before this one freed
        command = COMMANDS.get(asked.command)
        if command is None:
            raise RuntimeError(f"unknown engine command {asked.command!r}")
        if command is SHUTDOWN:
            return
        try:
            result = run_share(session, channel, command, asked.args)
            if command.reply == "pieces":
                for _ in result:  # only rank 0 streams; the others run the same steps
                    pass
        except EngineError:
            continue  # rank 0 raised the same error and reports it
