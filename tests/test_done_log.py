"""tests/done_log.py: a run given its done-log again runs only what did not pass, with and without
pytest-xdist."""

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture
def run(pytester, monkeypatch):
    """pytest in a fresh process (as a resumed run is) that finds the plugin beside this file. The log
    is passed as ``--done-log=PATH``: pytest takes an existing path given as a separate argument for
    a test path when it picks the root directory, which would rename every node id."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
    return lambda *args: pytester.runpytest_subprocess("-p", "done_log", "-p", "no:cacheprovider", *args)


TESTS = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_skips_itself():
    pytest.skip("depends on the run")

@pytest.mark.xfail(reason="expected")
def test_expected_failure():
    assert False

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown")

def test_passes_then_its_teardown_fails(broken_teardown):
    pass
"""


def test_a_second_run_runs_only_the_tests_not_done(pytester, run, tmp_path):
    log = tmp_path / "done.txt"
    pytester.makepyfile(test_mixed=TESTS)
    first = run(f"--done-log={log}")
    first.assert_outcomes(passed=2, failed=1, skipped=2, xfailed=1, errors=1)
    assert sorted(log.read_text().split()) == ["test_mixed.py::test_passes", "test_mixed.py::test_skipped"]
    second = run(f"--done-log={log}")
    second.assert_outcomes(passed=1, failed=1, skipped=1, xfailed=1, errors=1, deselected=2)
    assert sorted(log.read_text().split()) == ["test_mixed.py::test_passes", "test_mixed.py::test_skipped"]


def test_workers_skip_what_the_log_listed_when_the_run_started(pytester, run, tmp_path):
    pytest.importorskip("xdist")
    log = tmp_path / "done.txt"
    pytester.makepyfile(test_many="\n".join(f"def test_{i}():\n    pass\n" for i in range(12)))
    log.write_text("".join(f"test_many.py::test_{i}\n" for i in range(0, 12, 3)))
    result = run(f"--done-log={log}", "-n", "2")
    result.assert_outcomes(passed=8)
    assert sorted(log.read_text().split()) == sorted(f"test_many.py::test_{i}" for i in range(12))
    # nothing left to run (the workers deselect; xdist's summary does not count it)
    run(f"--done-log={log}", "-n", "2").assert_outcomes()
