"""Start a local torchrun worker group and drive it from this process.

`torch.distributed.run` starts and watches the ranks; we only add the
socket to rank 0, a log file for everything the ranks print, and a
readable reason when the group dies.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, Iterator

from lvx_app.engine.api import (
    AnswerStats,
    EngineError,
    EngineWarning,
    GenerationParams,
    GroupFailed,
    ProgressFn,
    VideoSummary,
)
from lvx_app.engine.commands import ASK, INTERRUPT, LOAD_VIDEO, SHUTDOWN, STATS, Command, value_command
from lvx_app.engine.link import answer_stats

LINK_ENV = "LVX_LINK"
LINK_KEY_ENV = "LVX_LINK_KEY"
RUN_DIR_ENV = "LVX_RUN_DIR"
# The module every rank runs (the frontend layer owns it: rank 0 may run the terminal chat itself).
WORKER_MODULE = "lvx_app.frontends.worker"


def error_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"error-rank{rank}.txt"


def pid_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"pid-rank{rank}.txt"


_PEER_LOST = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|remote process exited|peer (rank|process).*(died|exited)"
    r"|NCCL.*(remote|peer)|Socket Timeout|Timed out waiting", re.IGNORECASE
)


def _failures(log: Path) -> list[tuple[str, int | None, str, bool]]:
    """(rank, exitcode, cause, is_root) of every failure in torchrun's closing summary, root cause first."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if "Root Cause" not in text:
        return []
    summary = text[text.rfind("Failures:") if "Failures:" in text else text.index("Root Cause") :]
    out = []
    for block in re.split(r"\n\[\d+\]:", summary)[1:]:
        rank = re.search(r"rank\s*:\s*(\d+)", block)
        code = re.search(r"exitcode\s*:\s*(-?\d+)", block)
        cause = re.search(r"traceback\s*:\s*(.+)", block)
        if rank:
            is_root = "Root Cause" in summary[: summary.index(block)]
            text_cause = cause.group(1).strip() if cause else f"exit code {code.group(1) if code else '?'}"
            out.append((rank.group(1), int(code.group(1)) if code else None, text_cause, is_root))
    return sorted(out, key=lambda f: not f[3])


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"


def describe_failure(run_dir: Path, returncode: int | None) -> str:
    """Name the rank that failed first and why.

    torchrun's "first observed failure" is often a rank that merely lost its peer (a gloo "Connection reset by
    peer") when the real cause was another rank killed by a signal (the OOM killer, a segfault): prefer that one.
    """
    failures = _failures(run_dir / "group.log")

    def reason(rank: str, cause: str) -> str:
        own = error_file(run_dir, int(rank))
        return _last_line(own) if own.exists() else cause

    if failures:
        chosen = failures[0]
        if _PEER_LOST.search(reason(chosen[0], chosen[2])) or not error_file(run_dir, int(chosen[0])).exists():
            # killed by a signal other than torchrun's own SIGTERM to the survivors
            chosen = next((f for f in failures[1:] if f[1] is not None and f[1] < 0 and f[1] != -15), chosen)
        rank, code, cause, _ = chosen
        hint = " (killed: out of memory, a crash, or by hand)" if code is not None and code < 0 else ""
        return f"rank {rank} failed: {reason(rank, cause)}{hint}"
    for path in sorted(run_dir.glob("error-rank*.txt")):
        return f"rank {path.stem.removeprefix('error-rank')} failed: {_last_line(path)}"
    return f"the worker group exited (code {returncode}); see {run_dir / 'group.log'}"


class RemoteEngine:
    """An `Engine` whose ranks run under torchrun; this process keeps the terminal."""

    def __init__(
        self,
        worker_config: dict[str, Any],
        nproc: int,
        *,
        cuda: bool,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.last_answer: AnswerStats | None = None
        self.run_dir = Path(tempfile.mkdtemp(prefix="lvx-run-"))
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        env = dict(os.environ)
        env.update({LINK_ENV: f"{host}:{port}", LINK_KEY_ENV: key.hex(), RUN_DIR_ENV: str(self.run_dir)})
        if not cuda:
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.5",
            "-m", WORKER_MODULE, "--config", json.dumps(worker_config),
        ]  # fmt: skip
        self._log = open(self.run_dir / "group.log", "wb")
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.conn = self._accept(start_timeout_s)
        kind, value = self._recv()
        if kind != "ready":
            raise EngineError(f"unexpected first message from rank 0: {kind}")
        self.info: dict[str, Any] = value

    def _accept(self, timeout_s: float) -> Connection:
        box: list[Connection] = []
        thread = threading.Thread(target=lambda: box.append(self._listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.2)
            if self.proc.poll() is not None:
                raise GroupFailed(describe_failure(self.run_dir, self.proc.returncode))
            if time.monotonic() > deadline:
                self._kill()
                raise EngineError(f"the worker group did not start within {timeout_s:.0f}s; see {self.run_dir}/group.log")
        return box[0]

    def _recv(self) -> tuple[str, Any]:
        """The next message from rank 0; warnings it relays are re-raised here on the way (as EngineWarning)."""
        try:
            while True:
                kind, value = self.conn.recv()
                if kind != "warning":
                    return kind, value
                warnings.warn(value, EngineWarning)  # shown as one line by lvx_app.warning_lines
        except (EOFError, OSError):
            raise self._group_failed() from None

    def _send(self, command: Command, **kwargs: Any) -> None:
        try:
            self.conn.send(command.message(**kwargs))
        except OSError:
            raise self._group_failed() from None

    def _group_failed(self) -> GroupFailed:
        """The link to rank 0 broke: let torchrun finish stopping the group (or kill it), then say which rank failed."""
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
        return GroupFailed(describe_failure(self.run_dir, self.proc.returncode))

    def _request(self, command: Command, **kwargs: Any) -> Any:
        self._send(command, **kwargs)
        while True:
            kind, value = self._recv()
            if kind == "done":
                return value
            if kind == "error":
                raise EngineError(value)
            raise EngineError(f"unexpected message {kind!r} from rank 0")

    def load_video(
        self, path: str, fps: float, max_frames: int | None = None, progress: ProgressFn | None = None
    ) -> VideoSummary:
        self._send(LOAD_VIDEO, path=path, fps=fps, max_frames=max_frames)
        while True:
            kind, value = self._recv()
            if kind == "progress":
                if progress is not None:
                    progress(*value)
            elif kind == "done":
                return VideoSummary(**value)
            elif kind == "error":
                raise EngineError(value)

    def ask(self, question: str, params: GenerationParams = GenerationParams()) -> Iterator[str]:
        self._send(ASK, question=question, params=params)
        finished = False
        try:
            while True:
                kind, value = self._recv()
                if kind == "piece":
                    yield value
                elif kind == "done":
                    self.last_answer = answer_stats(value)
                    finished = True
                    return
                elif kind == "error":
                    finished = True
                    raise EngineError(value)
        finally:
            if not finished:  # the caller stopped reading: stop the group, drain to the end of the turn
                self.interrupt()
                while True:
                    kind, value = self._recv()
                    if kind == "done":
                        self.last_answer = answer_stats(value)
                        break
                    if kind == "error":
                        break

    def interrupt(self) -> None:
        try:
            self.conn.send((INTERRUPT, {}))
        except OSError:
            pass  # the group is gone; the next receive reports why

    def stats(self) -> dict[str, Any]:
        return self._request(STATS)

    def dead(self) -> str | None:
        """Which rank failed, if torchrun has already ended the group (a rank died between requests); else None."""
        return None if self.proc.poll() is None else describe_failure(self.run_dir, self.proc.returncode)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._request(SHUTDOWN)
                self.proc.wait(timeout=30)
            except (EngineError, OSError, subprocess.TimeoutExpired):
                self._kill()
        self.conn.close()
        self._listener.close()
        self._log.close()
        if self.proc.returncode == 0:
            shutil.rmtree(self.run_dir, ignore_errors=True)  # kept only when something went wrong

    def __getattr__(self, name: str) -> Any:
        """Any other command of the table (`reset`, ...) as a method: one request to rank 0, its reply."""
        command = value_command(name)
        return lambda **kwargs: self._request(command, **kwargs)

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
