"""onnxruntime (faster-whisper's voice-activity detector runs on it) writes a `.ses` file, its
telemetry session, into the temporary folder when it is imported, and never removes it: imported
here with the temporary folder one of ours, removed at once, so a speech run leaves nothing."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading

_lock = threading.Lock()


def import_onnxruntime_privately() -> None:
    """Import onnxruntime (when installed and not imported yet) leaving no file behind."""
    with _lock:
        if "onnxruntime" in sys.modules or importlib.util.find_spec("onnxruntime") is None:
            return
        given = os.environ.get("TMPDIR")
        with tempfile.TemporaryDirectory(prefix="lvx-onnxruntime-") as private:
            os.environ["TMPDIR"] = private
            try:
                import onnxruntime  # noqa: F401 - imported for its side effect, here
            finally:
                if given is None:
                    os.environ.pop("TMPDIR", None)
                else:
                    os.environ["TMPDIR"] = given
