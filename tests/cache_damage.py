"""Damage a saved cache file the ways a disk or a second writer does, and put someone's folder where
it belongs, for the tests of every kind of entry."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

from lvx_app.cache import CacheWarning

DAMAGES = ["header", "data", "truncated", "other key", "an empty folder"]


def damage(path: Path, how: str, other_entry: Callable[[], Path]) -> None:
    """Rewrite `path`: a flipped header byte, a flipped data byte, cut in half, (`other key`) the
    bytes of another entry's file (`other_entry` saves one and returns its path) put in its place,
    or a folder (holding only an empty folder) in its place."""
    if how == "an empty folder":
        path.unlink()
        (path / "inside").mkdir(parents=True)
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
    with pytest.warns(CacheWarning, match=warning) as caught:
        assert store.load(key) is None
    assert len(caught) == 1 and not path.exists()
    store.save(key, saved, video=video)
    assert store.load(key) is not None


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def check_a_folder_holding_files_is_left_alone(
    path: Path, save: Callable[[], Any], load: Callable[[], Any]
) -> None:
    """Someone's folder, with a file in it, where the cache file `path` belongs: loading says so in
    one line and misses, saving writes nothing (no temporary file either) and says nothing more,
    the folder and its file stay; once it is moved away the entry is saved and read again."""
    assert save() == path
    path.unlink()
    path.mkdir()
    (path / "notes.txt").write_text("someone's")
    before = _files(path.parent)
    with pytest.warns(CacheWarning, match="is a folder holding files lvx did not write") as caught:
        assert load() is None
        assert save() is None
        assert load() is None
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert (path / "notes.txt").read_text() == "someone's" and _files(path.parent) == before
    (path / "notes.txt").unlink()
    path.rmdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert save() == path and load() is not None
