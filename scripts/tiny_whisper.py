"""A tiny random-weight Whisper checkpoint in faster-whisper's published layout
(`lvx_app/speech/tiny.py`), for the tests and by hand.

    python3 scripts/tiny_whisper.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the checkout's packages, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts import checkout

    checkout.link()

from lvx_app.speech.tiny import make_tiny_whisper

__all__ = ["make_tiny_whisper"]

if __name__ == "__main__":
    print(make_tiny_whisper(sys.argv[1] if len(sys.argv) > 1 else "tiny-whisper"))
