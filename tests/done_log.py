"""pytest plugin: ``--done-log PATH`` makes a run that a time limit cuts short resumable.

Each test that passes, or that a mark skips before it starts, has its node id appended to PATH as it
finishes, and the tests PATH listed when the run started are deselected. A GPU run on a lent machine
stops at the machine's time limit; run again with the same file (``scripts/gpu_check.sh tests-shared
--resume FILE``), it runs only the tests not done yet. A failed test is not listed, nor one that
skipped itself while running or an expected failure: they depend on the run, so they run again."""

from __future__ import annotations

import os

import pytest

_NAME = "done-log-writer"
_SNAPSHOT = "done_log_snapshot"  # the ids listed at the start, handed from the controller to workers


def pytest_addoption(parser):
    parser.addoption("--done-log", metavar="PATH", default=None,
                     help="append each passed or skipped test's node id to PATH; skip those listed there at the start")


class DoneLogWriter:
    def __init__(self, path: str):
        self.path = path
        self.calls_passed: set[str] = set()

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed:
            self.calls_passed.add(report.nodeid)
        # a test whose call passed can still fail in its teardown: it is done once that passed too
        marked_skip = report.when == "setup" and report.skipped
        done = marked_skip or (report.when == "teardown" and report.passed and report.nodeid in self.calls_passed)
        if done:
            self.calls_passed.discard(report.nodeid)
            with open(self.path, "a") as f:
                f.write(report.nodeid + "\n")


def pytest_configure(config):
    path = config.getoption("done_log")
    if not path:
        return
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller's snapshot
        config._done_log_snapshot = set(config.workerinput.get(_SNAPSHOT, ()))
        return
    # the controller (or the one process): read once, before any test runs, so every worker
    # deselects the same tests however late it collects; only it writes (workers forward reports)
    with open(path, "a+") as f:
        f.seek(0)
        config._done_log_snapshot = {line.strip() for line in f if line.strip()}
    config.pluginmanager.register(DoneLogWriter(path), _NAME)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    snapshot = getattr(node.config, "_done_log_snapshot", None)
    if snapshot is not None:
        node.workerinput[_SNAPSHOT] = sorted(snapshot)


def pytest_collection_modifyitems(config, items):
    done = getattr(config, "_done_log_snapshot", None)
    if not done:
        return
    already_done = [item for item in items if item.nodeid in done]
    if already_done:
        config.hook.pytest_deselected(items=already_done)
        items[:] = [item for item in items if item.nodeid not in done]


def pytest_unconfigure(config):
    writer = config.pluginmanager.get_plugin(_NAME)
    if writer is not None:
        config.pluginmanager.unregister(writer)
