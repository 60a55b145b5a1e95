"""Defaults shared by the commands and the library, and the check of the timeouts, in a module that
imports nothing of lvx (nor torch).

`lvx eval` keeps its CLI free of torch and the engine (so `lvx eval merge/report` work without
them), yet its defaults must match `lvx chat`'s: both read them from here.
"""

import os
from pathlib import Path

DEFAULT_MODEL = "mPLUG/mPLUG-Owl3-7B-241101"

# The cache folder (features, saved prompts and visual K/V, encoder fingerprints, this machine's
# calibration) unless --cache-dir names another.
CACHE_ENV = "LVX_CACHE_DIR"


def default_cache_dir() -> Path:
    """`$LVX_CACHE_DIR` if set, else `~/.cache/lvx`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lvx"


# Seconds one chunk of frames may take to decode before its worker process is killed and the chunk
# retried frame by frame (decord can hang forever on some H.264 files and then ignores SIGTERM).
DEFAULT_DECODE_TIMEOUT_S = 120.0

# Seconds a rank waits for a dead or hung peer before the worker group stops (every collective's
# timeout).
DEFAULT_TIMEOUT_S = 300.0

# The same for the groups of the GPU checks (scripts/nccl_check.py, group_decode_compare.py,
# bench_schedule.py): below the acceptance run's limits for them (170 s and more), so that a hang
# ends with NCCL's own report of the collective it hung in, not with the item's time limit.
CHECK_TIMEOUT_S = 90.0

# Most tokens the subtitle block of a video prompt may take (lvx chat / serve); beyond it lines are
# dropped, evenly over the video, with a warning that says how many.
DEFAULT_SUBTITLE_TOKENS = 8192

# The Whisper checkpoint that transcribes a video's speech when it has no subtitles
# (lvx_app/speech): auto is large-v3-turbo on GPU ranks (large-v3's encoder with a 4-layer decoder:
# near large-v3's words in many languages at several times its speed, projected at hundreds of
# seconds of audio per second on one H100) and base on CPU ranks (about twice tiny's compute;
# tiny.en transcribes 3.6 s of audio per second on 2 busy cores, so base keeps up with the video
# there, which small, at about 6 times tiny's compute, does not). docs/benchmarks.md,
# "Transcribing".
DEFAULT_SPEECH_MODEL = "auto"
SPEECH_MODEL_ON_GPU = "large-v3-turbo"
SPEECH_MODEL_ON_CPU = "base"

# Longest answer, in tokens, unless a command or the page asks for another.
DEFAULT_MAX_NEW_TOKENS = 512

# How frames (and each frame's placeholder tokens) are dealt over the ranks
# (lvx_app.parallel.layout): zigzag balances the media-masked prefill best, by measurement
# (docs/design-measurements.md, "Balanced prefill layouts").
LAYOUTS = ("contiguous", "striped", "zigzag")
DEFAULT_LAYOUT = "zigzag"


def check_layout(layout: str) -> str:
    """The layout name, or a one-line ValueError naming the choices."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown --layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    return layout


# Saved visual K/V (lvx_app/engine/resident_visual_kv.py): the first open of a video in kv mode
# "cache" times the hyper layers' K/V projection and saves the K/V next to the features only when
# recomputing them is clearly slower than reading them back. Reading back is estimated as bytes /
# VISUAL_KV_READ_BYTES_PER_S, a conservative disk read rate (1 GB/s: a local NVMe reads 2-7 GB/s, a
# network file system often about 1); "clearly" is a factor of VISUAL_KV_SAVE_MARGIN, so a near tie
# keeps recomputing (no disk space spent for nothing).
VISUAL_KV_READ_BYTES_PER_S = 1e9
VISUAL_KV_SAVE_MARGIN = 2.0
