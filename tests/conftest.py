"""Shared fixtures: tiny official-layout checkpoints and a small synthetic video, made once per test
run. What lives beside the product (benchmarks, baselines, the memory plan) imports as the package
`scripts` (pytest's `pythonpath`), which also makes the checkout importable where lvx is not
installed (a bare GPU image)."""

from __future__ import annotations

import pytest

import scripts  # noqa: F401 - first: links the checkout's packages when lvx is not installed
from lvx_app.video.synthetic import make_video
from lvx_models.mplug_owl3.tiny import write_tiny_checkpoint

pytest_plugins = ["lost_workers"]  # a crashed test process stops the run and shows what never ran


def pytest_configure(config) -> None:
    """Each of the suite's processes (`-n 2`: one a core) computes on one thread: two processes of
    two threads each on two cores wait on each other's spinning threads."""
    import os

    import torch

    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


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


@pytest.fixture(autouse=True)
def _sys_path_unchanged():
    """Ranks and decode processes unpickle test functions by module name through the parent's
    `sys.path`: a test that changes it breaks every later test that starts one, so it fails
    itself."""
    import sys

    before = list(sys.path)
    yield
    assert sys.path == before, f"this test changed sys.path: {before[:3]} -> {sys.path[:3]}"


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_test_folder(tmp_path_factory):
    """Temporary files of this process and of every process a test starts go under the run's own
    folder, which pytest prunes: libraries that leave theirs behind (gradio_client's download
    folders, torchrun's logs, forked children that never run `atexit`) fill no shared `/tmp`."""
    import os
    import tempfile

    folder = tmp_path_factory.mktemp("tmp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = str(folder), None
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
