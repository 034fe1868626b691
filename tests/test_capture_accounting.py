"""Capture time leaves out the compile that a first step runs inside its capture's warm-up."""

import time

import torch

from tscompile.runtime import prefill_graphs


def test_whole_step_capture_seconds_exclude_the_compile_inside_the_capture(monkeypatch):
    compiled = {"s": 0.0}
    monkeypatch.setattr(prefill_graphs, "capture_graph", lambda step, *a: (step(), None))
    whole = prefill_graphs.WholeStepPrefill(torch.device("cpu"), (16,), (1,), host_replay=True,
                                            compile_seconds=lambda: compiled["s"])
    whole.stream = whole.pool = None  # capture_graph is stubbed: no CUDA stream or pool needed

    def step():  # a first step: 0.2 s of it is compiling (as the runner's _timed counts it), 0.05 s not
        time.sleep(0.25)
        compiled["s"] += 0.2

    whole._capture((16, 1, True, None), step)
    assert 0.04 <= whole.capture_seconds < 0.2, whole.capture_seconds
    whole._capture((16, 1, False, None), lambda: time.sleep(0.05))  # nothing compiled: all of it counts
    assert 0.09 <= whole.capture_seconds < 0.25, whole.capture_seconds
