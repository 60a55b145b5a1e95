"""Hold Ctrl-C while heavy modules import, and act on it once they are in.

A KeyboardInterrupt raised while torch initialises inside C code is mishandled. Torch imports numpy
from C and clears the error, so the Ctrl-C is silently lost and `lvx chat` goes on to load the
video. The `torch.distributed` bindings turn it into `terminate called after throwing an instance of
'pybind11::error_already_set'` (SIGABRT). Holding the signal for the import and raising
KeyboardInterrupt afterwards, in plain Python, makes Ctrl-C at start-up exit quietly with 130 every
time.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Run the block with SIGINT recorded instead of raised; raise KeyboardInterrupt after it if one
    came.

    Only the main thread can handle signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
