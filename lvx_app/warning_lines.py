"""Show lvx's own warnings as one readable line ("warning: ...") instead of Python's file:line +
source echo.

Warnings raised by lvx code (lvx_app, models, ui) are messages for the user (an fps clamped to the
video's own, a prompt beyond the trained length, a cache that could not be written); their source
line means nothing to them. Warnings from other libraries keep Python's format, which is what their
authors expect for debugging.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Optional, TextIO

_ROOT = Path(__file__).resolve().parents[1]
_OURS = tuple(str(_ROOT / pkg) for pkg in ("lvx_app", "models", "ui"))


def is_lvx_source(filename: str) -> bool:
    """Whether a warning was raised from lvx's own code (lvx_app, models, ui)."""
    return str(Path(filename).resolve()).startswith(_OURS)


def _show(message, category, filename, lineno, file: Optional[TextIO] = None, line=None) -> None:
    out = file if file is not None else sys.stderr
    if out is None:  # no stderr (pythonw): nothing to tell
        return
    if is_lvx_source(filename):
        text = "warning: " + str(message)
        text = (
            f"\033[33m{text}\033[0m\n" if getattr(out, "isatty", lambda: False)() else text + "\n"
        )
    else:
        # Python's own format
        text = warnings.formatwarning(message, category, filename, lineno, line)
    try:
        out.write(text)
    except OSError:  # stderr gone (closed terminal)
        pass


def install() -> None:
    """Use the one-line format for lvx's warnings in this process (idempotent)."""
    warnings.showwarning = _show
