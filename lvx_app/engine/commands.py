"""The engine's commands, declared once.

The frontend sends them to rank 0 over the link (`launch.RemoteEngine` -> `link.serve_link`), rank
0's `GroupDriver` broadcasts them to the group and every other rank runs them in
`driver.worker_loop`. All three dispatch through this table, so a new command is one entry here plus
the `Session` method
every rank runs: both engines (`GroupDriver`, `RemoteEngine`) answer a plain-value command by its
name (`engine.reset()`). Only commands that stream (load_video's progress, ask's pieces) or
post-process (stats) have methods of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Reply = Literal["value", "progress", "pieces"]


@dataclass(frozen=True)
class Command:
    """One engine command and how its answer travels."""

    name: str  # on the link and the control channel; also the `Engine` method's name
    method: str | None  # the `Session` method every rank runs; None ends the group (shutdown)
    args: tuple[str, ...] = ()  # the arguments it carries, by name
    # progress: (stage, done, total) messages, then the value; pieces: interruptible text
    reply: Reply = "value"
    gathered: bool = False  # every rank's result is gathered on rank 0

    def message(self, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        """(name, arguments) to send, once the arguments are checked against the declared ones."""
        if set(kwargs) != set(self.args):
            raise TypeError(
                f"engine command {self.name!r} takes {list(self.args)}, got {list(kwargs)}"
            )
        return self.name, kwargs


LOAD_VIDEO = Command(
    "load_video", "load_video", ("path", "fps", "max_frames", "subtitles"), reply="progress"
)
ASK = Command("ask", "ask", ("question", "params"), reply="pieces")
RESET = Command("reset", "reset")
STATS = Command("stats", "local_stats", gathered=True)
SHUTDOWN = Command("shutdown", None)

COMMANDS: dict[str, Command] = {c.name: c for c in (LOAD_VIDEO, ASK, RESET, STATS, SHUTDOWN)}


def value_command(name: str) -> Command:
    """The table's command `name` if an engine may run it as a plain call (it neither streams nor
    ends the group); AttributeError otherwise, so it serves an engine's `__getattr__`."""
    command = COMMANDS.get(name)
    if command is None or command.reply != "value" or command.method is None:
        raise AttributeError(name)
    return command


# Not a command: a link message rank 0 looks for between the tokens of an answer (it never reaches
# the group).
INTERRUPT = "interrupt"
