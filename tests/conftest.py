"""Shared fixtures: tiny official-layout checkpoints and a small synthetic video, made once per test
run. The benchmark scripts' modules (the memory plan, the emulated link, the baseline attentions)
import as top-level modules, as the scripts themselves import them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from lvx_app.video.synthetic import make_video
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        g: str(write_tiny_checkpoint(root / f"tiny-{g}", g)) for g in ("g1-gateproj", "g1", "g2")
    }


@pytest.fixture(scope="session")
def short_video(tmp_path_factory):
    """10 s at 10 fps, 96x64: 10 frames at 1 fps, 20 at 2 fps."""
    return str(
        make_video(
            tmp_path_factory.mktemp("videos") / "short.mp4",
            num_frames=100,
            fps=10,
            width=96,
            height=64,
        )
    )
