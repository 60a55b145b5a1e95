"""Damage a saved cache file the ways a disk or a second writer does, for the saved-prompt and visual-K/V tests."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

DAMAGES = ["header", "data", "truncated", "other key"]


def damage(path: Path, how: str, other_entry: Callable[[], Path]) -> None:
    """Rewrite `path`: a flipped header byte, a flipped data byte, cut in half, or (`other key`) the bytes of another
    entry's file (`other_entry` saves one and returns its path) put in its place."""
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
