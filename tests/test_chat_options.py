"""`lvx chat` options a user gets wrong: one line before any model loads, or a warning before a slow
start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from test_engine import _lvx


@pytest.mark.parametrize(
    "option, message",
    [
        (["--temperature", "nan"], "--temperature must be 0 (greedy) or a finite number above 0"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or a finite number above 0"),
        (["--top-p", "2"], "--top-p must be above 0 and at most 1 (got 2.0)"),
        (["--top-p", "-0.5"], "--top-p must be above 0 and at most 1 (got -0.5)"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be 1 or more (got 0)"),
    ],
)
def test_bad_sampling_values_are_one_line_before_any_model_loads(
    short_video, tmp_path, option, message
):
    """The model path does not exist: the line is about the option, so nothing was loaded yet."""
    result = _lvx("chat", short_video, "--model", str(tmp_path / "no-model"), *option)
    said = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2 and len(said) == 1, said
    assert said[0].startswith(f"error: {message}") and "Traceback" not in result.stderr, said


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset to pin to one core")
def test_more_cpu_ranks_than_cores_are_said_before_the_slow_start(short_video, tmp_path):
    env = dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1")
    chat = [sys.executable, "-m", "lvx_app.cli", "chat", short_video, "--gpus", "0", "--ranks"]
    model = ["--model", str(tmp_path / "no-model")]  # the ranks then stop at once
    result = subprocess.run(
        ["taskset", "-c", "0", *chat, "2", *model], capture_output=True, text=True, env=env
    )
    said = result.stderr.splitlines() + result.stdout.splitlines()
    assert said[0] == (
        "warning: 2 CPU ranks on 1 core(s): every rank loads the model and they take turns on the "
        "cores, so starting takes long and answers are slow; use --ranks 1 or fewer"
    ), said
    assert result.returncode == 2 and "no-model" in said[-1], said
