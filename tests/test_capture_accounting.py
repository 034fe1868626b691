"""Capture time leaves out the compile that a first step runs inside its capture's warm-up."""

import types

import pytest
import torch

from tscompile.runtime import prefill_graphs


def test_whole_step_capture_seconds_exclude_the_compile_inside_the_capture(monkeypatch):
    clock = {"now": 100.0}
    compiled = {"s": 0.0}
    # a fake clock: the steps below say how long they take, so the figures are exact
    monkeypatch.setattr(prefill_graphs, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    monkeypatch.setattr(prefill_graphs, "capture_graph", lambda step, *a: (step(), None))
    whole = prefill_graphs.WholeStepPrefill(torch.device("cpu"), (16,), (2,), host_replay=True,
                                            compile_seconds=lambda: compiled["s"])
    whole.stream = whole.pool = None  # capture_graph is stubbed: no CUDA stream or pool needed

    def first_step():  # 0.25 s, of which 0.2 s compiling (as the runner's _timed counts it)
        clock["now"] += 0.25
        compiled["s"] += 0.2

    whole._capture((16, 2, True, None), first_step)
    assert whole.capture_seconds == pytest.approx(0.05)

    def later_step():  # nothing compiled: all of it is capture
        clock["now"] += 0.07

    whole._capture((16, 2, False, None), later_step)
    assert whole.capture_seconds == pytest.approx(0.12)
