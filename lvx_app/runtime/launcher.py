"""Start a local torchrun worker group and drive it from this process.

torch's torchrun (through `lvx_app.parallel.torchrun`, which dies with this process and names the
rank that failed first) starts and watches the ranks; we only add the socket to rank 0, a log file
for everything the ranks print, and that reason when the group dies. What crosses the socket is
`lvx_app.wire`'s messages (see `socket_link` for rank 0's side).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
import time
import warnings
from dataclasses import replace
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, Iterator, Sequence

from lvx_app.config import Config, ServeConfig
from lvx_app.engine.records import EngineError, EngineWarning, GroupFailed, ProgressFn
from lvx_app.parallel.failures import (
    FAILURE_PREFIX,
    RUN_DIR_ENV,
    RankFailure,
    describe_failures,
    error_file,
    pid_file,
)
from lvx_app.parallel.lifeline import LAUNCHER_PID_ENV, kill_tree, mark_launcher
from lvx_app.parallel.run_dirs import RunDir
from lvx_app.parallel.torchrun import local_group
from lvx_app.parallel.world import World
from lvx_app.runtime.commands import SHUTDOWN, Command
from lvx_app.runtime.driver import request
from lvx_app.runtime.engine_handle import Engine
from lvx_app.wire import Failure, Interrupt, Message, Piece, Progress, Ready, Reply, Warned
from lvx_app.wire import receive as receive_message
from lvx_app.wire import send as send_message

__all__ = [
    "LINK_ENV",
    "LINK_KEY_ENV",
    "RUN_DIR_ENV",
    "RemoteEngine",
    "describe_failure",
    "error_file",
    "pid_file",
]

LINK_ENV = "LVX_LINK"
LINK_KEY_ENV = "LVX_LINK_KEY"
# What every rank runs (after `python`): the product's rank entry point; a benchmark passes its own
# script, which calls `rank_main.run_rank_session` with its own `parallelize`
RANK_ENTRY = ("-m", "lvx_app.runtime.rank_main")


def describe_failure(run_dir: Path, returncode: int | None) -> str:
    """Name the rank that failed first and why: the line our launcher (`lvx_app.parallel.torchrun`)
    wrote to the log."""
    log = run_dir / "group.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    said = [line.removeprefix(FAILURE_PREFIX) for line in lines if line.startswith(FAILURE_PREFIX)]
    if said:
        return said[-1]
    for path in sorted(run_dir.glob("error-rank*.txt")):
        return describe_failures(
            [RankFailure(int(path.stem.removeprefix("error-rank")), 1)], run_dir
        )
    return f"the worker group exited (code {returncode}); see {log}"


class RemoteEngine(Engine):
    """An `Engine` whose ranks run under torchrun; this process keeps the terminal."""

    def __init__(
        self,
        config: Config,
        world: World,
        *,
        entry: Sequence[str] = RANK_ENTRY,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.config, self.world, self.last_answer = config, world, None
        self._run = RunDir()
        self.run_dir = self._run.path
        # the run folder is kept when a failure named in it was reported; a stop asked for is none
        self._keep_run_dir = self._stopped = False
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        cmd, env = local_group(
            world,
            [
                *entry,
                # the page's login and the API key stay off the ranks' command line
                *("--config", json.dumps(replace(config, serve=ServeConfig()).to_dict())),
                *("--world", json.dumps(world.to_dict())),
            ],
        )
        env.update(
            {LINK_ENV: f"{host}:{port}", LINK_KEY_ENV: key.hex(), RUN_DIR_ENV: str(self.run_dir)}
        )
        if threading.current_thread() is threading.main_thread():
            mark_launcher(env)  # the group's launcher dies with this process, and the ranks with it
        else:  # the kernel's parent-death signal follows the thread that started a child
            env.pop(LAUNCHER_PID_ENV, None)
        self._log = open(self.run_dir / "group.log", "wb")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self.conn = self._accept(start_timeout_s)
            ready = self._receive()
        except BaseException:  # Ctrl-C or a failed start: no rank outlives this call
            self._kill()
            self._listener.close()
            self._log.close()
            self._run.close(keep=self._keep_run_dir)
            raise
        if not isinstance(ready, Ready):
            raise EngineError(f"unexpected first message from rank 0: {ready!r}")
        self.info: dict[str, Any] = ready.info

    def _accept(self, timeout_s: float) -> Connection:
        box: list[Connection] = []
        thread = threading.Thread(target=lambda: box.append(self._listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.2)
            if self.proc.poll() is not None:
                raise GroupFailed(self._failure())
            if time.monotonic() > deadline:
                self._kill()
                self._keep_run_dir = True
                raise EngineError(
                    f"the worker group did not start within {timeout_s:.0f}s; see "
                    f"{self.run_dir}/group.log"
                )
        return box[0]

    def _receive(self) -> Message:
        """The next message from rank 0; warnings it relays are re-raised here on the way (as
        EngineWarning)."""
        try:
            while True:
                message = receive_message(self.conn)
                if not isinstance(message, Warned):
                    return message
                # shown as one line by lvx_app.warning_lines
                warnings.warn(message.message, EngineWarning)
        except (EOFError, OSError):
            raise self._group_failed() from None

    def _send(self, command: Command, **args: Any) -> None:
        asked = request(command, **args)
        try:
            send_message(self.conn, asked)
        except OSError:
            raise self._group_failed() from None

    def _group_failed(self) -> GroupFailed:
        """The link to rank 0 broke: let torchrun finish stopping the group (or kill it), then say
        which rank failed."""
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
        return GroupFailed(self._failure())

    def _failure(self) -> str:
        """Which rank failed and why; the run folder that says more is kept."""
        self._keep_run_dir = True
        return describe_failure(self.run_dir, self.proc.returncode)

    def call(self, command: Command, progress: ProgressFn | None, **args: Any) -> Any:
        self._send(command, **args)
        while True:
            message = self._receive()
            if isinstance(message, Progress):
                if progress is not None:
                    progress(message.stage, message.done, message.total)
            elif isinstance(message, (Reply, Failure)):
                return _result(message)
            else:
                raise EngineError(f"unexpected message from rank 0: {message!r}")

    def stream(self, command: Command, **args: Any) -> Iterator[str]:
        self._send(command, **args)
        finished = False
        try:
            while True:
                message = self._receive()
                if isinstance(message, Piece):
                    yield message.text
                elif isinstance(message, (Reply, Failure)):
                    finished = True
                    self.last_answer = _result(message)
                    return
        finally:
            if not finished:  # the caller stopped reading: stop the group, drain the turn
                self.interrupt()
                self._drain()

    def _drain(self) -> None:
        while True:
            message = self._receive()
            if isinstance(message, Reply):
                self.last_answer = message.value
                return
            if isinstance(message, Failure):
                return

    def interrupt(self) -> None:
        try:
            send_message(self.conn, Interrupt())
        except OSError:
            pass  # the group is gone; the next receive reports why

    def describe(self) -> dict[str, Any]:
        return self.info

    def dead(self) -> str | None:
        """Which rank failed, if torchrun has already ended the group (a rank died between
        requests); else None."""
        if self.proc.poll() is None:
            return None
        return self._failure()

    def close(self) -> None:
        self.closed = True
        if self.proc.poll() is None:
            try:
                self.call(SHUTDOWN, None)
                self.proc.wait(timeout=30)
            except (EngineError, OSError, subprocess.TimeoutExpired):
                self._kill()
        self.conn.close()
        self._listener.close()
        self._log.close()
        failed = self.proc.returncode != 0 and not self._stopped
        self._run.close(keep=self._keep_run_dir or failed)  # kept when something went wrong

    def abort(self) -> None:
        """Stop the group now, with no goodbye to a rank 0 that may be busy for minutes (Ctrl-C
        while loading)."""
        self._stopped = True
        self._kill()
        self.close()

    def _kill(self) -> None:
        kill_tree(self.proc.pid)  # torchrun, and the ranks in sessions of their own
        self.proc.wait()


def _result(message: Reply | Failure) -> Any:
    """A request's result, or its engine error raised again as the type rank 0 raised."""
    if isinstance(message, Failure):
        raise message.error(EngineError) or EngineError(message.message)
    return message.value
