"""What the API's requests may take of the server's memory: each request a budget for its body,
the frames it carries (decoded) and its upload, and all requests in flight together another.

A request reserves what a step will cost before it takes the step (the body by its length before
it is read, each frame by the pixels its header states before it is decoded), so a request past
either budget is refused in one line naming the limit before the memory is taken. The defaults
are shares of the machine's memory: a server never says it accepts more than it could hold.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from lvx_app.config import ServeConfig
from lvx_ui.api_errors import ApiError

MB = 2**20
BODY_COST = 3  # bytes of memory per byte of a body, read, parsed and its base64 decoded
REQUEST_SHARE, ALL_SHARE = 1 / 16, 1 / 4  # the default budgets, shares of the machine's memory
MOST_REQUEST_MB = 4096.0  # the default for one request, however large the machine


def machine_memory_bytes() -> int:
    """The memory this machine has, or its cgroup's limit when that is less."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return min(total, int(limit)) if limit != "max" else total
    except (OSError, ValueError):
        return total


@dataclass(frozen=True)
class MemoryLimits:
    """The budgets in MB: one request's, all requests' together, and the largest upload (a
    video sent in the body costs `BODY_COST` times its size while it is read)."""

    request_mb: float
    all_mb: float
    upload_mb: float

    @classmethod
    def of(cls, serve: ServeConfig, machine_bytes: int | None = None) -> MemoryLimits:
        """The options' budgets; those not given are shares of the machine's memory."""
        machine_mb = (machine_bytes or machine_memory_bytes()) / MB
        request = serve.request_memory_mb or min(MOST_REQUEST_MB, machine_mb * REQUEST_SHARE // 1)
        together = serve.requests_memory_mb or max(request, machine_mb * ALL_SHARE // 1)
        upload = serve.max_upload_mb or request / (BODY_COST * 4 / 3) // 1  # base64: 4/3
        return cls(request, together, upload)

    def describe(self) -> str:
        return (
            f"a request may take {self.request_mb:,.0f} MB of memory, all requests "
            f"{self.all_mb:,.0f} MB, an upload {self.upload_mb:,.0f} MB"
        )


class RequestMemory:
    """The bytes the requests in flight have reserved; each request reserves through its own
    `Reservation`."""

    def __init__(self, limits: MemoryLimits) -> None:
        self.limits = limits
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self) -> Reservation:
        return Reservation(self)

    def _take(self, nbytes: int, held: int, what: str) -> None:
        request, together = self.limits.request_mb * MB, self.limits.all_mb * MB
        if held + nbytes > request:
            raise ApiError(
                413,
                f"{what} would take {(held + nbytes) / MB:,.0f} MB of the server's memory, over "
                f"the {self.limits.request_mb:,.0f} MB a request may take (--request-memory-mb)",
                "request_too_large",
            )
        with self._lock:
            if self.used + nbytes > together:
                raise ApiError(
                    429,
                    f"the requests in flight hold {self.used / MB:,.0f} MB of the "
                    f"{self.limits.all_mb:,.0f} MB all requests may take (--requests-memory-mb), "
                    f"too little for {what}; try again shortly",
                    "server_memory_full",
                )
            self.used += nbytes

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


class Reservation:
    """One request's share of `RequestMemory`: grown before each step, given back at the end
    (`close`, which may be called more than once)."""

    def __init__(self, memory: RequestMemory | None) -> None:
        self.memory, self.taken = memory, 0  # no memory: nothing is counted (a Python caller)

    def grow(self, nbytes: float, what: str) -> None:
        """Reserve `nbytes` more for `what` ("the body", "decoding 3 frames ..."), or raise the
        ApiError that names the budget it would pass."""
        nbytes = max(0, int(nbytes))
        if self.memory is not None:
            self.memory._take(nbytes, self.taken, what)
        self.taken += nbytes

    def keep(self, nbytes: float) -> None:
        """Hold only `nbytes` from now on (what the request keeps while it waits and answers)."""
        nbytes = max(0, min(self.taken, int(nbytes)))
        if self.memory is not None:
            self.memory._give(self.taken - nbytes)
        self.taken = nbytes

    def close(self) -> None:
        self.keep(0)
