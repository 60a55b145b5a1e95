"""Why a worker group died, in one line naming the rank that failed first: shared by every launcher
of ours.

When one rank dies, its peers fail too (gloo "Connection reset by peer", NCCL timeouts) and torchrun
sends the rest SIGTERM; those are consequences. The cause is a rank whose own error is not a lost
peer, or one killed by a signal other than torchrun's SIGTERM (the out-of-memory killer, a segfault,
`kill -9`). When no rank's failure is a cause, a rank that gave up waiting for a peer (a collective
past the group's `--timeout`: a peer hung) says more than the ranks torchrun then stopped. Ranks
started through `lvx_app.parallel.group.run_rank` with `RUN_DIR_ENV` set write their error to
`error_file(run_dir, rank)`.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

RUN_DIR_ENV = "LVX_RUN_DIR"
FAILURE_PREFIX = "error: "  # the launcher's line: FAILURE_PREFIX + describe_failures(...)

PEER_LOST = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|remote process exited|peer "
    r"(rank|process).*(died|exited)"
    r"|NCCL.*(remote|peer)|Socket Timeout|Timed out waiting",
    re.IGNORECASE,
)
# gloo's and NCCL's words for a collective past its timeout (with the milliseconds waited)
TIMED_OUT = re.compile(
    r"Timed out waiting (\d+)ms|ran for (\d+) milliseconds before timing out|Socket Timeout"
    r"|Timed out waiting",
    re.IGNORECASE,
)


def error_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"error-rank{rank}.txt"


def pid_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"pid-rank{rank}.txt"


def done_file(run_dir: str | Path, rank: int) -> Path:
    """Written by a rank whose work returned and met every other rank's in a last barrier
    (`run_rank`)."""
    return Path(run_dir) / f"done-rank{rank}.txt"


@dataclass(frozen=True)
class RankFailure:
    """One failed rank as the launcher saw it, in the order the launcher observed them."""

    rank: int
    exitcode: int | None  # negative: killed by that signal


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def timed_out(text: str) -> str | None:
    """The line for a rank whose collective gave up waiting for a peer (gloo's or NCCL's timeout
    message), or None when `text` is something else."""
    found = TIMED_OUT.search(text)
    if found is None:
        return None
    ms = next((int(g) for g in found.groups() if g), None)
    after = f" {ms / 1000:g} s" if ms is not None else ""
    return (
        f"gave up after waiting{after} for another rank (--timeout): a rank hung or is far slower "
        "than the others"
    )


# how well a rank's failure explains the group's death, best first
CAUSE, WAITED, ENDED_ITSELF, CONSEQUENCE = 3, 2, 1, 0


def _reason(f: RankFailure, run_dir: Path | None) -> tuple[str, int]:
    """(what happened to the rank, how well that explains the group's death: a cause, a rank that
    waited for a hung peer in vain, a rank that ended itself without saying why (named before the
    ranks torchrun stopped in the same second), a consequence of another rank's failure)."""
    own = error_file(run_dir, f.rank) if run_dir is not None else None
    if own is not None and own.exists():
        text = _last_line(own)
        waited = timed_out(text)
        if waited is not None:
            return waited, WAITED
        return text, CONSEQUENCE if PEER_LOST.search(text) else CAUSE
    if f.exitcode is not None and f.exitcode < 0:
        why = f"killed by {_signal_name(f.exitcode)} (out of memory, a crash, or by hand)"
        stopped = f.exitcode == -signal.SIGTERM  # torchrun stops the rest with SIGTERM
        return why, CONSEQUENCE if stopped else CAUSE
    return f"exit code {f.exitcode}", ENDED_ITSELF


def first_failure(
    failures: list[RankFailure], run_dir: Path | None
) -> tuple[RankFailure, str] | None:
    """The rank that failed first and why: the first whose failure is a cause, not a peer that lost
    it; else the first that waited for a hung peer in vain; else the first."""
    if not failures:
        return None
    reasons = [(f, *_reason(f, run_dir)) for f in failures]
    best = max(weight for _, _, weight in reasons)
    failure, why, _ = next(r for r in reasons if r[2] == best)
    return failure, why


def crashed_after_done(failures: list[RankFailure], run_dir: Path | None) -> bool:
    """True when every failed rank was killed by a signal after it wrote `done_file`, or by
    torchrun's SIGTERM once another rank had: all work had met in the last barrier, so the failure
    was in tearing down, and nothing is lost."""
    if (
        run_dir is None
        or not failures
        or any(f.exitcode is None or f.exitcode >= 0 for f in failures)
    ):
        return False
    done = {f.rank for f in failures if done_file(run_dir, f.rank).exists()}
    return bool(done) and all(f.rank in done or f.exitcode == -signal.SIGTERM for f in failures)


def describe_failures(failures: list[RankFailure], run_dir: Path | None) -> str | None:
    """'rank R failed: why' for `first_failure`; None when there is no failure."""
    chosen = first_failure(failures, run_dir)
    return None if chosen is None else f"rank {chosen[0].rank} failed: {chosen[1]}"
