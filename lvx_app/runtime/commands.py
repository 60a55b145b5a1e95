"""The engine's commands, declared once: each entry is the `RankSession` method every rank runs.

The frontend sends a command's name and arguments to rank 0 (`launcher.RemoteEngine` ->
`socket_link.serve_link`), rank 0's `GroupDriver` broadcasts them to the group, and every other rank
runs the same entry in `driver.worker_loop`. A new command is one entry here plus the session
method, and the `Engine` method that sends it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from lvx_app.engine.session import RankSession

Reply = Literal["value", "progress", "pieces"]


@dataclass(frozen=True)
class Command:
    """One engine command and how its answer travels."""

    name: str  # on the link and the control channel
    run: Callable[..., Any] | None  # run(session, **args) on every rank; None ends the group
    args: tuple[str, ...] = ()  # the arguments it carries, by name
    # progress: (stage, done, total) messages, then the value; pieces: interruptible text
    reply: Reply = "value"
    gathered: bool = False  # every rank's result is gathered on rank 0
    finish: Callable[..., Any] | None = None  # finish(session, gathered) on rank 0

    def message(self, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        """(name, arguments) to send, once the arguments are checked against the declared ones."""
        if set(kwargs) != set(self.args):
            raise TypeError(
                f"engine command {self.name!r} takes {list(self.args)}, got {list(kwargs)}"
            )
        return self.name, kwargs


LOAD_VIDEO = Command("load_video", RankSession.load_video, ("request",), reply="progress")
ASK = Command("ask", RankSession.ask, ("question", "generation"), reply="pieces")
CHAT = Command("chat", RankSession.chat, ("turns", "generation"), reply="pieces")
RESET = Command("reset", RankSession.reset, ("keep_prompt",))
REPLAY = Command("replay", RankSession.replay, ("turns",))
STATS = Command("stats", RankSession.local_stats, gathered=True, finish=RankSession.summarize_stats)
SHUTDOWN = Command("shutdown", None)

COMMANDS: dict[str, Command] = {
    c.name: c for c in (LOAD_VIDEO, ASK, CHAT, RESET, REPLAY, STATS, SHUTDOWN)
}
