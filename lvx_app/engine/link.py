"""The local socket between the `lvx` frontend process and rank 0 of the group.

The frontend listens; rank 0 connects once its model is loaded and says
"ready". Requests go one at a time; during an answer rank 0 streams text
pieces and polls for an interrupt between tokens.
"""

from __future__ import annotations

import warnings
from multiprocessing.connection import Connection
from typing import Any

from lvx_app.engine.api import AnswerStats, EngineError

REQUESTS = ("load_video", "ask", "interrupt", "reset", "stats", "shutdown")


def relay_warnings(conn: Connection) -> None:
    """Rank 0: send every warning to the frontend too (this process's output only reaches the group log)."""
    keep_in_log = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        keep_in_log(message, category, filename, lineno, file, line)
        try:
            conn.send(("warning", str(message)))
        except OSError:
            pass  # the frontend is gone; the request loop notices

    warnings.showwarning = show


def serve_link(driver: Any, conn: Connection) -> None:
    """Rank 0: answer the frontend's requests until it says shutdown or goes away."""
    relay_warnings(conn)
    while True:
        try:
            op, kwargs = conn.recv()
        except (EOFError, OSError):
            driver.close()  # the frontend is gone: release the other ranks
            return
        if op == "shutdown":
            driver.close()
            conn.send(("done", None))
            return
        if op == "interrupt":
            continue  # arrived after the answer had already finished
        try:
            conn.send(("done", _run(driver, conn, op, kwargs)))
        except EngineError as exc:
            conn.send(("error", str(exc)))


def _run(driver: Any, conn: Connection, op: str, kwargs: dict) -> Any:
    if op == "load_video":
        summary = driver.load_video(**kwargs, progress=lambda stage, done, total: conn.send(("progress", (stage, done, total))))
        return summary.to_dict()
    if op == "ask":
        for piece in driver.ask(**kwargs):
            conn.send(("piece", piece))
            while conn.poll():
                extra, _ = conn.recv()
                if extra == "interrupt":
                    driver.interrupt()
        return driver.last_answer.to_dict() if driver.last_answer else None
    if op == "reset":
        driver.reset()
        return None
    if op == "stats":
        return driver.stats()
    raise EngineError(f"unknown request {op!r}")


def answer_stats(value: dict | None) -> AnswerStats | None:
    if value is None:
        return None
    value = dict(value)
    value.pop("tokens_per_s", None)
    return AnswerStats(**value)
