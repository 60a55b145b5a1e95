"""Run one engine command on every rank in the same order (SPMD).

Rank 0's `GroupDriver` is the `Engine` a frontend uses: it broadcasts the
command, then runs its own share. Other ranks sit in `worker_loop`. A
`UserFacingError` (bad path, prompt too long, ...) is raised identically on
every rank before any collective, so the group survives it; anything else
ends the process and the launcher reports which rank failed and why.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

from lvx_app.engine.api import AnswerStats, EngineError, GenerationParams, ProgressFn, VideoSummary
from lvx_app.engine.control import ControlChannel


class GroupDriver:
    """The engine as seen from rank 0 (or from the only process)."""

    def __init__(self, session: Any, channel: ControlChannel) -> None:
        self.session = session
        self.channel = channel
        self.last_answer: AnswerStats | None = None
        self._stop = threading.Event()

    def _command(self, op: str, **kwargs: Any) -> None:
        self.channel.broadcast((op, kwargs))

    def load_video(
        self, path: str, fps: float, max_frames: int | None = None, progress: ProgressFn | None = None
    ) -> VideoSummary:
        self._command("load_video", path=path, fps=fps, max_frames=max_frames)
        return self.session.load_video(path=path, fps=fps, max_frames=max_frames, progress=progress)

    def ask(self, question: str, params: GenerationParams = GenerationParams()) -> Iterator[str]:
        self._stop.clear()
        self._command("ask", question=question, params=params)
        answer = self.session.ask(question=question, params=params, should_stop=self._stop.is_set)
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

    def reset(self) -> None:
        self._command("reset")
        self.session.reset()

    def stats(self) -> dict[str, Any]:
        self._command("stats")
        per_rank = self.channel.gather(self.session.local_stats())
        return self.session.summarize_stats(per_rank)

    def close(self) -> None:
        self._command("shutdown")


def worker_loop(session: Any, channel: ControlChannel) -> None:
    """Ranks other than 0: execute rank 0's commands until told to shut down."""
    while True:
        op, kwargs = channel.broadcast()
        if op == "shutdown":
            return
        try:
            if op == "load_video":
                session.load_video(**kwargs, progress=None)
            elif op == "ask":
                for _ in session.ask(**kwargs, should_stop=lambda: False):
                    pass
            elif op == "reset":
                session.reset()
            elif op == "stats":
                channel.gather(session.local_stats())
            else:
                raise RuntimeError(f"unknown engine command {op!r}")
        except EngineError:
            continue  # rank 0 raised the same error and reports it
