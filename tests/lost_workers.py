"""A test process that dies (killed when memory runs short) is shown, and so is what it never ran.

pytest-xdist (3.8 and before) replaces a crashed worker, but under `--dist loadfile` its scheduler
may then fail with `INTERNALERROR> KeyError: <WorkerController gwN>` (losing the failure summary) or
run the test that killed the worker again until the restarts run out. So, unless
`--max-worker-restart` is given, a crashed worker stops the run at once (xdist names the test it
died on), and the summary lists every collected test that never reported, by file; a run that left
tests unrun never exits 0.
"""

from __future__ import annotations

from collections import Counter

import pytest

SHOWN_FILES = 20  # the files with unrun tests listed by name; the rest are counted


class UnrunTests:
    """Collected test ids against reported ones, on the xdist controller."""

    def __init__(self) -> None:
        self.collected: set[str] = set()
        self.reported: set[str] = set()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self.collected.update(ids)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.reported.add(report.nodeid)

    def unrun(self) -> list[str]:
        return sorted(self.collected - self.reported)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unrun() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        unrun = self.unrun()
        if not unrun:
            return
        files = Counter(nodeid.split("::")[0] for nodeid in unrun)
        terminalreporter.write_sep("=", f"{len(unrun)} tests never ran", red=True)
        for name, count in files.most_common(SHOWN_FILES):
            terminalreporter.write_line(f"{name}: {count} not run")
        if len(files) > SHOWN_FILES:
            terminalreporter.write_line(f"... and {len(files) - SHOWN_FILES} more files")


def pytest_configure(config: pytest.Config) -> None:
    """On the xdist controller (before xdist starts its workers): no worker restarts unless asked,
    and the account of unrun tests."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if getattr(config.option, "maxworkerrestart", None) is None:
        config.option.maxworkerrestart = "0"
    config.pluginmanager.register(UnrunTests(), "lvx-unrun-tests")
