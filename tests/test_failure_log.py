"""tests/failure_log.py: a failure's report is in the --failure-log file while the run goes on."""

pytest_plugins = ["pytester"]


def test_a_failure_is_logged_when_it_happens_and_passes_are_not(pytester, tmp_path):
    log = tmp_path / "failures.txt"
    pytester.makepyfile(test_two="""
        from pathlib import Path

        def test_fails():
            assert 1 + 1 == 3, "arithmetic"

        def test_sees_the_log_already_written():
            assert "test_fails" in Path(%r).read_text()
    """ % str(log))
    result = pytester.runpytest("-p", "failure_log", "--failure-log", str(log), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    text = log.read_text()
    assert text.startswith("==== test_two.py::test_fails (call)") and "arithmetic" in text
    assert "test_sees_the_log_already_written" not in text
