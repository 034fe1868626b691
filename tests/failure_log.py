"""pytest plugin: ``--failure-log PATH`` appends each failure's report to PATH as it happens.

pytest (and pytest-xdist's controller) print the tracebacks only when the whole run ends, so a run
cut by a time limit, as GPU runs on a lent machine are, would keep none of them."""

from __future__ import annotations

_NAME = "failure-log-writer"


def pytest_addoption(parser):
    parser.addoption("--failure-log", metavar="PATH", default=None,
                     help="append each failed test's report to PATH when it fails")


class FailureLogWriter:
    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.failed:
            with open(self.path, "a") as f:
                f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def pytest_configure(config):
    # only where every report arrives once: the controller under xdist (workers forward theirs to it),
    # or the one process without xdist
    path = config.getoption("failure_log")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FailureLogWriter(path), _NAME)


def pytest_unconfigure(config):
    writer = config.pluginmanager.get_plugin(_NAME)
    if writer is not None:
        config.pluginmanager.unregister(writer)
