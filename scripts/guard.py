"""`python3 scripts/guard.py COMMAND...`: run COMMAND and end it, with every process of this process
group, when the process that started the guard ends, however it ended (killed with SIGKILL too).

The acceptance run (scripts/gpu_acceptance.py) starts each item through a guard in a session of its
own: the guard is the group's leader, the item and what it starts (pytest's workers, decode
processes, torchrun's agent) are in the group, and the runner ends an item by signalling the
group. The guard watches its parent (the runner names itself in $LVX_GUARD_PARENT, so a runner
killed before the guard started is seen too): when that is gone, or when the guard is sent
SIGTERM, SIGINT or SIGHUP, it sends the group SIGTERM, waits `GRACE_S` for the item, then SIGKILL
(itself included).
Ranks that torchrun starts in sessions of their own die with torchrun (`die_with_parent`). The exit
code is the item's (128 + N when signal N ended it). Plain Python, no torch: it starts at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

POLL_S = 0.1  # how often the guard looks at its parent
GRACE_S = 10.0  # from SIGTERM to SIGKILL
PARENT_ENV = "LVX_GUARD_PARENT"  # the runner's pid, set by it: a runner gone before we start


def end_group(item: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM to this process group, SIGKILL once the item has exited or `grace_s` has passed;
    the guard dies with the group."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the guard stays to finish the job
    os.killpg(0, signal.SIGTERM)
    try:
        item.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: guard.py COMMAND [ARGS...]")
    parent = int(os.environ.pop(PARENT_ENV, 0)) or os.getppid()
    if os.getppid() != parent:  # the runner died as it started this guard: start nothing
        print(f"guard: the process that started this item ({parent}) is gone", file=sys.stderr)
        return 1
    item = subprocess.Popen(argv)  # in the guard's process group

    def stop(signum, frame) -> None:
        end_group(item)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    while True:
        try:
            code = item.wait(POLL_S)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            if os.getppid() != parent:  # the runner is gone: so is its item
                end_group(item)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
