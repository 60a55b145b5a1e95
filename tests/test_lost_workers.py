"""A test process killed under the suite (memory ran short) stops the run with the test it died on
named, the failure summary printed and every test that never ran listed; the run does not pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DIES = """
import os, signal

def test_before():
    pass

def test_dies():
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer does

def test_after():
    pass
"""
FAILS = """
def test_fails():
    assert 1 == 2, "a failure the summary must still show"
"""


@pytest.mark.slow
def test_a_killed_test_process_stops_the_run_and_lists_what_never_ran(tmp_path):
    (tmp_path / "test_dies.py").write_text(DIES)
    (tmp_path / "test_fails.py").write_text(FAILS)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["lost_workers"]\n')
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "xdist"]
    run = subprocess.run(
        [*command, "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    said = run.stdout + run.stderr
    assert run.returncode == 1 and "INTERNALERROR" not in said, said
    assert "crashed while running 'test_dies.py::test_dies'" in said, said
    assert "a failure the summary must still show" in said, "the failure summary is printed"
    assert "1 tests never ran" in said and "test_dies.py: 1 not run" in said, said
