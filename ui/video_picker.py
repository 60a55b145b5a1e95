"""The page's list of the videos in the folders `--allow-paths` opens, to pick one instead of typing
its path: every file with a video's name under them (links not followed), sorted, at most `MOST`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lvx_app.video.decode import VIDEO_EXTENSIONS

MOST = 500  # a list to pick from, not a file browser; the path box takes any other


def allowed_videos(roots: Sequence[Path], most: int = MOST) -> list[str]:
    """The paths of the videos under `roots`, sorted, the first `most`."""
    found: list[str] = []
    for root in roots:
        for folder, subfolders, files in os.walk(root, onerror=lambda exc: None):
            subfolders.sort()
            for name in sorted(files):
                if Path(name).suffix.lower() in VIDEO_EXTENSIONS:
                    found.append(os.path.join(folder, name))
                    if len(found) >= most:
                        return sorted(found)
    return sorted(found)
