"""Capture time leaves out the compile that a first step runs inside its capture's warm-up."""

import types

import pytest

from tscompile.runtime import graph_runner
from tscompile.runtime.graph_runner import GraphRunner, HostGraphs


def test_capture_seconds_exclude_the_compile_inside_the_capture(monkeypatch):
    clock = {"now": 100.0}
    compiled = {"s": 0.0}
    # a fake clock: the steps below say how long they take, so the figures are exact
    monkeypatch.setattr(graph_runner, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    graphs = GraphRunner(HostGraphs(), token_ladder=(16,), request_ladder=(2,), decode_ladder=(2,),
                         compile_seconds=lambda: compiled["s"])

    def first_step():  # 0.25 s, of which 0.2 s compiling (as the runner's compile clock counts it)
        clock["now"] += 0.25
        compiled["s"] += 0.2

    graphs.capture(graphs.prefill_key(16, 2, True, None), first_step)
    assert graphs.capture_seconds["prefill"] == pytest.approx(0.05)

    def later_step():  # nothing compiled: all of it is capture
        clock["now"] += 0.07

    graphs.capture(graphs.prefill_key(16, 2, False, None), later_step)
    assert graphs.capture_seconds["prefill"] == pytest.approx(0.12)
    graphs.capture(graphs.decode_key(2, True), later_step)  # each phase keeps its own
    assert graphs.capture_seconds["decode"] == pytest.approx(0.07)
    assert graphs.capture_seconds["prefill"] == pytest.approx(0.12)
