"""The local socket between the `lvx` frontend process and rank 0 of the group.

The frontend listens; rank 0 connects once its model is loaded and says "ready". Requests go one at
a time; during an answer rank 0 streams text pieces and polls for an interrupt between tokens.
"""

from __future__ import annotations

import warnings
from multiprocessing.connection import Connection
from typing import Any

from lvx_app.engine.api import AnswerStats, EngineError, error_over_link
from lvx_app.runtime.commands import COMMANDS, INTERRUPT, SHUTDOWN, Command
from lvx_app.runtime.driver import GroupDriver


def relay_warnings(conn: Connection) -> None:
    """Rank 0: send every warning to the frontend too (this process's output only reaches the group
    log)."""
    keep_in_log = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        keep_in_log(message, category, filename, lineno, file, line)
        try:
            conn.send(("warning", str(message)))
        except OSError:
            pass  # the frontend is gone; the request loop notices

    warnings.showwarning = show


def serve_link(driver: GroupDriver, conn: Connection) -> None:
    """Rank 0: answer the frontend's requests until it says shutdown or goes away."""
    relay_warnings(conn)
    while True:
        try:
            name, kwargs = conn.recv()
        except (EOFError, OSError):
            driver.close()  # the frontend is gone: release the other ranks
            return
        if name == SHUTDOWN.name:
            driver.close()
            conn.send(("done", None))
            return
        if name == INTERRUPT:
            continue  # arrived after the answer had already finished
        try:
            command = COMMANDS.get(name)
            if command is None:
                raise EngineError(f"unknown request {name!r}")
            conn.send(("done", _run(driver, conn, command, kwargs)))
        except EngineError as exc:
            conn.send(("error", error_over_link(exc)))


def _run(driver: GroupDriver, conn: Connection, command: Command, args: dict) -> Any:
    """Run `command` on the driver, streaming what it streams; returns its result as plain data."""
    if command.reply == "pieces":
        for piece in driver.stream(command, **args):
            conn.send(("piece", piece))
            while conn.poll():
                extra, _ = conn.recv()
                if extra == INTERRUPT:
                    driver.interrupt()
        result = driver.last_answer
    else:

        def progress(stage: str, done: int, total: int) -> None:
            conn.send(("progress", (stage, done, total)))

        result = driver.call(command, progress if command.reply == "progress" else None, **args)
    return result.to_dict() if hasattr(result, "to_dict") else result


def answer_stats(value: dict | None) -> AnswerStats | None:
    if value is None:
        return None
    value = dict(value)
    value.pop("tokens_per_s", None)
    return AnswerStats(**value)
