"""Die with the launcher: a rank (or torchrun's agent) must not outlive the process that started it.

Without this, `kill -9` of `lvx finetune` leaves torchrun and its ranks training to the end as
orphans, writing to the output folder under a second run's feet. On Linux the kernel's parent-death
signal (prctl PR_SET_PDEATHSIG) kills us the moment our parent exits, whatever killed it; elsewhere
this is a no-op. A launcher of ours puts its pid in `LAUNCHER_PID_ENV`, so a child that starts after
its parent already died notices and exits too. The signal follows the *thread* that started the
child: a launcher marks itself only from a thread that lives as long as it. A launcher that stops
its group kills every process below it at once (`kill_tree`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

LAUNCHER_PID_ENV = "LVX_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent exits; True when that is armed
    (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if expected and os.getppid() != int(expected):  # the launcher died before we armed the signal
        os.kill(os.getpid(), sig)
    return True


def mark_launcher(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) naming this process as the launcher its children must die
    with."""
    env = os.environ if env is None else env
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    return env


def _children() -> dict[int, list[int]]:
    """Every process's children, by parent pid, as /proc shows them now (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat"), "rb") as stat:
                parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry.name))
    return children


def _stop_below(pid: int) -> list[int]:
    """Stop every process below `pid` (torchrun starts each rank in a session of its own, so its
    process group holds none of them); their pids. Stopped processes start no more children, so a
    second look finds any that were being born during the first."""
    stopped: set[int] = set()
    while True:
        children, todo, found = _children(), [pid], []
        while todo:
            for child in children.get(todo.pop(), []):
                found.append(child)
                todo.append(child)
        new = [child for child in found if child not in stopped]
        if not new:
            return sorted(stopped)
        for child in new:
            _signal(child, signal.SIGSTOP)
        stopped.update(new)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _running(pid: int) -> bool:
    """Whether `pid` still runs (an exited process waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def kill_tree(pid: int, wait_s: float = 10.0) -> None:
    """Kill the launcher `pid` (the leader of its own process group) and every process below it at
    once, ranks that have not yet armed their parent-death signal (still importing torch) included:
    left alone they would run on, and take the cores from everyone, until their imports end. Returns
    once they have all exited (at most `wait_s` seconds)."""
    try:
        os.killpg(pid, signal.SIGSTOP)  # it starts no more ranks
    except ProcessLookupError:
        return
    below = _stop_below(pid) if sys.platform.startswith("linux") else []
    os.killpg(pid, signal.SIGKILL)
    for child in below:
        _signal(child, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(_running(child) for child in below) and time.monotonic() < deadline:
        time.sleep(0.01)


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Ctrl-C for a launcher started in a session of its own: it gets SIGINT and `grace_s` seconds
    to stop its ranks (they end what they are writing), then it and every process below it are
    killed (`kill_tree`); a second Ctrl-C ends the wait at once."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    if proc.poll() is None:
        kill_tree(proc.pid)
    proc.wait()
