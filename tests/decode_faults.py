"""Decode workers that misbehave on purpose, as decord does on some files: they run in the decode
worker processes in place of the product's `_Worker` (`DecodePool(worker_class=...)`)."""

from __future__ import annotations

import signal
import time

from lvx_app.video.decode import _Worker

HANG_AT = 60  # a frame index whose chunks hang
FAIL_AT = 90  # a frame index whose chunks fail


def _hang() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as decord#375: only SIGKILL ends it
    while True:
        time.sleep(3600)


class HangsInBatch(_Worker):
    """`get_batch` over frame HANG_AT hangs; frame by frame works."""

    def decode(self, path, indices, mode):
        if mode == "batch" and HANG_AT in indices:
            _hang()
        return super().decode(path, indices, mode)


class AlwaysHangs(_Worker):
    """Any chunk holding frame HANG_AT hangs, batch or frame by frame."""

    def decode(self, path, indices, mode):
        if HANG_AT in indices:
            _hang()
        return super().decode(path, indices, mode)


class AlwaysFails(_Worker):
    """Any chunk holding frame FAIL_AT fails to decode."""

    def decode(self, path, indices, mode):
        if FAIL_AT in indices:
            raise RuntimeError("injected decode failure")
        return super().decode(path, indices, mode)
