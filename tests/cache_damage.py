"""Damage a saved cache file the ways a disk or a second writer does, for the saved-prompt and
visual-K/V tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import pytest

from lvx_app.video.errors import VideoWarning

DAMAGES = ["header", "data", "truncated", "other key", "a folder"]


def damage(path: Path, how: str, other_entry: Callable[[], Path]) -> None:
    """Rewrite `path`: a flipped header byte, a flipped data byte, cut in half, (`other key`) the
    bytes of another entry's file (`other_entry` saves one and returns its path) put in its place,
    or a folder in its place."""
    if how == "a folder":
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("x")
        return
    data = bytearray(path.read_bytes())
    if how == "header":
        data[12] ^= 0xFF
    elif how == "data":
        data[-3] ^= 0x01
    elif how == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray(other_entry().read_bytes())
    path.write_bytes(bytes(data))


def check_damage_is_discarded(
    store: Any, key: Any, saved: Any, video: Path, how: str, warning: str
) -> None:
    """Save `saved` under `key`, damage the file `how`, and check that loading it gives None with
    one warning that matches `warning`, deletes the file (the "other key" bytes come from the
    same entry under another checkpoint), and that it is saved and read again afterwards."""
    path = store.save(key, saved, video=video)
    damage(
        path, how, lambda: store.save(dataclasses.replace(key, checkpoint="x"), saved, video=video)
    )
    with pytest.warns(VideoWarning, match=warning) as caught:
        assert store.load(key) is None
    assert len(caught) == 1 and not path.exists()
    store.save(key, saved, video=video)
    assert store.load(key) is not None
