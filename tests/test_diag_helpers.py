"""The helpers the scripts/ diagnostics share (bench/workloads.py): the bench-shaped engine and the
per-call timer that splits a step's host time into phases."""

from __future__ import annotations

import torch

from tscompile.bench import workloads


class _Thing:
    def work(self, x, *, scale=1):
        return x * scale

    def fail(self):
        raise KeyError("boom")


def test_time_method_records_every_call_and_keeps_results_and_errors():
    thing, seen = _Thing(), []
    workloads.time_method(thing, "work", seen.append)
    workloads.time_method(thing, "fail", seen.append)
    assert thing.work(3, scale=2) == 6
    try:
        thing.fail()
    except KeyError as e:
        assert e.args == ("boom",)
    else:
        raise AssertionError("the wrapper swallowed the error")
    assert len(seen) == 2 and all(isinstance(s, float) and s >= 0 for s in seen)


def test_bench_engine_builds_the_bench_shaped_engine_and_runs_a_prefill():
    runner = workloads.bench_engine("llama-tiny", "cpu", backend="torch", max_num_seqs=4, num_pages=64)
    llm = runner.llm
    assert llm.scheduler.max_num_seqs == 4 and llm.scheduler.max_model_len == 2064
    assert next(llm.model.parameters()).dtype == torch.float32  # float32 off CUDA
    seconds = runner.run_prefill([5, 7, 11, 13])
    assert seconds > 0 and runner.host_launch_s > 0
