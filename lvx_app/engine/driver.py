"""Run one engine command on every rank in the same order (SPMD).

Rank 0's `GroupDriver` is the `Engine` a frontend uses: it broadcasts the command, then runs its own
share. Other ranks sit in `worker_loop`. A `UserFacingError` (bad path, prompt too long, ...) is
raised identically on every rank before any collective, so the group survives it; anything else ends
the process and the launcher reports which rank failed and why.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator, Sequence

from lvx_app.engine.api import AnswerStats, EngineError, GenerationParams, ProgressFn, VideoSummary
from lvx_app.engine.commands import (
    ASK,
    COMMANDS,
    LOAD_VIDEO,
    SHUTDOWN,
    STATS,
    Command,
    value_command,
)
from lvx_app.engine.control import ControlChannel


def run_share(
    session: Any, channel: ControlChannel, command: Command, kwargs: dict[str, Any], **local: Any
) -> Any:
    """This rank's share of `command`: the session method, then the gather every rank joins.

    `local` holds what stays on this rank (rank 0's progress callback and stop flag)."""
    result = getattr(session, command.method)(**kwargs, **local)
    return channel.gather(result) if command.gathered else result


class GroupDriver:
    """The engine as seen from rank 0 (or from the only process)."""

    def __init__(self, session: Any, channel: ControlChannel) -> None:
        self.session = session
        self.channel = channel
        self.last_answer: AnswerStats | None = None
        self._stop = threading.Event()

    def _run(self, command: Command, local: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Broadcast `command` to the other ranks, then run rank 0's share."""
        self.channel.broadcast(command.message(**kwargs))
        return run_share(self.session, self.channel, command, kwargs, **(local or {}))

    def load_video(
        self,
        path: str,
        fps: float,
        max_frames: int | None = None,
        progress: ProgressFn | None = None,
        subtitles: Sequence[Any] | None = None,
    ) -> VideoSummary:
        return self._run(
            LOAD_VIDEO,
            {"progress": progress},
            path=path,
            fps=fps,
            max_frames=max_frames,
            subtitles=list(subtitles) if subtitles else None,
        )

    def ask(self, question: str, params: GenerationParams = GenerationParams()) -> Iterator[str]:
        self._stop.clear()
        answer = self._run(
            ASK, {"should_stop": self._stop.is_set}, question=question, params=params
        )
        t0 = time.perf_counter()
        try:
            yield from answer
        except GeneratorExit:
            # The frontend stopped listening (Gradio's Stop): finish the turn on every rank.
            self._stop.set()
            for _ in answer:
                pass
            raise
        finally:
            self.last_answer = self.session.last_answer
            if self.last_answer is not None and self.last_answer.total_s == 0.0:
                self.last_answer.total_s = time.perf_counter() - t0

    def interrupt(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, Any]:
        return self.session.summarize_stats(self._run(STATS))

    def close(self) -> None:
        self.channel.broadcast(SHUTDOWN.message())

    def __getattr__(self, name: str) -> Any:
        """Any other command of the table (`reset`, ...) as a method: broadcast it, run rank 0's
        share."""
        command = value_command(name)
        return lambda **kwargs: self._run(command, **kwargs)


def worker_loop(session: Any, channel: ControlChannel) -> None:
    """Ranks other than 0: execute rank 0's commands until told to shut down."""
    while True:
        name, kwargs = channel.broadcast()
        command = COMMANDS.get(name)
        if command is None:
            raise RuntimeError(f"unknown engine command {name!r}")
        if command is SHUTDOWN:
            return
        try:
            result = run_share(session, channel, command, kwargs)
            if command.reply == "pieces":
                for _ in result:  # only rank 0 streams; the others run the same steps
                    pass
        except EngineError:
            continue  # rank 0 raised the same error and reports it
