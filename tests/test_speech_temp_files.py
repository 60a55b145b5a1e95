"""A speech run leaves nothing in the temporary folder: onnxruntime, which faster-whisper's
voice-activity detector runs on, writes a `.ses` file there when it is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("faster_whisper")
pytest.importorskip("onnxruntime")

FIND_SPEECH = """
import numpy as np
from lvx_app.speech.transcribe import speech_spans
noise = np.random.default_rng(0).standard_normal(16000 * 2).astype(np.float32) * 0.1
speech_spans(noise)
"""


def test_finding_speech_leaves_no_file_in_the_temporary_folder(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", FIND_SPEECH], env=env, capture_output=True)
    assert run.returncode == 0, run.stderr.decode()
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
