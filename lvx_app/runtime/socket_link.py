"""The local socket between the `lvx` frontend process and rank 0 of the group.

The frontend listens; rank 0 connects once its model is loaded and says `Ready`. Requests go one at
a time; during an answer rank 0 streams `Piece`s and looks for an `Interrupt` between tokens. Every
message is one of `lvx_app.wire`'s, and an engine error crosses as a `Failure` that the frontend
raises again as the same type.
"""

from __future__ import annotations

import warnings
from multiprocessing.connection import Connection
from typing import Any

from lvx_app.engine.records import EngineError
from lvx_app.runtime.commands import COMMANDS, SHUTDOWN, Command
from lvx_app.runtime.driver import GroupDriver
from lvx_app.wire import Failure, Interrupt, Piece, Progress, Reply, Request, Warned, receive, send


def relay_warnings(conn: Connection) -> None:
    """Rank 0: send every warning to the frontend too (this process's output only reaches the group
    log)."""
    keep_in_log = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        keep_in_log(message, category, filename, lineno, file, line)
        try:
            send(conn, Warned(str(message)))
        except OSError:
            pass  # the frontend is gone; the request loop notices

    warnings.showwarning = show


def serve_link(driver: GroupDriver, conn: Connection) -> None:
    """Rank 0: answer the frontend's requests until it says shutdown or goes away."""
    relay_warnings(conn)
    while True:
        try:
            message = receive(conn)
        except (EOFError, OSError):
            driver.close()  # the frontend is gone: release the other ranks
            return
        if isinstance(message, Interrupt):
            continue  # arrived after the answer had already finished
        if isinstance(message, Request) and message.command == SHUTDOWN.name:
            driver.close()
            send(conn, Reply())
            return
        try:
            send(conn, Reply(_answer(driver, conn, message)))
        except EngineError as exc:
            send(conn, Failure.of(exc))


def _answer(driver: GroupDriver, conn: Connection, message: Any) -> Any:
    """The result of the frontend's request `message` (an EngineError for one rank 0 cannot run)."""
    if not isinstance(message, Request) or message.command not in COMMANDS:
        what = message.command if isinstance(message, Request) else type(message).__name__
        raise EngineError(f"unknown request {what!r}")
    return _run(driver, conn, COMMANDS[message.command], message.args)


def _run(driver: GroupDriver, conn: Connection, command: Command, args: dict) -> Any:
    """Run `command` on the driver, streaming what it streams; returns its result."""
    if command.reply == "pieces":
        for piece in driver.stream(command, **args):
            send(conn, Piece(piece))
            while conn.poll():
                if isinstance(receive(conn), Interrupt):
                    driver.interrupt()
        return driver.last_answer

    def progress(stage: str, done: int, total: int) -> None:
        send(conn, Progress(stage, done, total))

    return driver.call(command, progress if command.reply == "progress" else None, **args)
