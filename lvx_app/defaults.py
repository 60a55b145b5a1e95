"""Defaults shared by the commands and the library, and the check of the timeouts, in a module that imports nothing.

`lvx eval` keeps its CLI free of torch and the engine (so `lvx eval merge/report` work without them), yet its
defaults must match `lvx chat`'s: both read them from here.
"""

DEFAULT_MODEL = "mPLUG/mPLUG-Owl3-7B-241101"

# Seconds one chunk of frames may take to decode before its worker process is killed and the chunk retried frame
# by frame (decord can hang forever on some H.264 files and then ignores SIGTERM).
DEFAULT_DECODE_TIMEOUT_S = 120.0

# Seconds a rank waits for a dead or hung peer before the worker group stops (every collective's timeout).
DEFAULT_TIMEOUT_S = 300.0

# Most tokens the subtitle block of a video prompt may take (lvx chat / serve); beyond it lines are dropped, evenly
# over the video, with a warning that says how many.
DEFAULT_SUBTITLE_TOKENS = 8192

# Longest answer, in tokens, unless a command or the page asks for another.
DEFAULT_MAX_NEW_TOKENS = 512

# How frames (and each frame's placeholder tokens) are dealt over the ranks (lvx_app.parallel.layout): zigzag
# balances the media-masked prefill best, by measurement (docs/benchmarks.md, "Balanced prefill layouts").
LAYOUTS = ("contiguous", "striped", "zigzag")
DEFAULT_LAYOUT = "zigzag"


def check_seconds(options: dict[str, float]) -> None:
    """Raise ValueError naming the first option (e.g. "--timeout") that is not a positive number of seconds."""
    for name, value in options.items():
        if not value > 0:
            raise ValueError(f"{name} must be a number of seconds above 0 (got {value:g})")
