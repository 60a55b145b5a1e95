"""Die with the launcher: a rank (or torchrun's agent) must not outlive the process that started it.

Without this, `kill -9` of `lvx finetune` leaves torchrun and its ranks training to the end as
orphans, writing to the output folder under a second run's feet. On Linux the kernel's parent-death
signal (prctl PR_SET_PDEATHSIG) kills us the moment our parent exits, whatever killed it; elsewhere
this is a no-op. A launcher of ours puts its pid in `LAUNCHER_PID_ENV`, so a child that starts after
its parent already died notices and exits too. The signal follows the *thread* that started the
child: a launcher marks itself only from a thread that lives as long as it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

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
