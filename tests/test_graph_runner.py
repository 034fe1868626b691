"""The graph runner's keys, buckets, capture/replay bookkeeping and its one replay switch, on the CPU.

CUDA graphs need a GPU; ``HostGraphs`` stands in for them (a replay runs the captured function again
into the captured outputs), so the same keys, padding and counters run here. tests/test_gpu_graphs.py
runs the real graphs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from fuzz_lib import SPECULATIVE_CONFIGS, Fuzzer, GraphCheck, build_engine, graph_runners, pressured_spec
from helpers import ids, poison_decode_metadata_at_each_replay, small_llm
from tscompile import SamplingParams
from tscompile.counters import counters
from tscompile.runtime.graph_runner import DECODE, PREFILL, CudaGraphs, GraphKey, GraphRunner, HostGraphs


def test_keys_follow_the_ladders_and_carry_the_verify_width():
    graphs = GraphRunner(HostGraphs(), decode_ladder=(8, 1, 2, 4), token_ladder=(16, 32), request_ladder=(2, 4))
    rng = np.random.default_rng(3)
    for n in rng.integers(1, 12, 30).tolist():
        bs = next((b for b in (1, 2, 4, 8) if b >= n), n)
        assert graphs.decode_size(n) == bs
        key = graphs.decode_key(bs, True)
        assert (key is None) == (bs > 8)
        if key is not None:
            assert key == GraphKey(DECODE, bs, bs, 1, True) and key.tokens == key.batch_size * key.width
    # a verify step of width 3: bs * 3 query rows, a graph of its own next to the plain decode one
    wide = graphs.decode_key(4, True, width=3)
    assert (wide.batch_size, wide.tokens, wide.width) == (4, 12, 3) and wide != graphs.decode_key(4, True)
    assert graphs.decode_key(5, True, width=3) is None  # not on the ladder
    assert graphs.prefill_size(20, 3) == (32, 4) and graphs.prefill_size(33, 1) is None
    assert graphs.prefill_size(16, 4) == (16, 4) and graphs.prefill_size(3, 1) == (16, 2)
    key = graphs.prefill_key(32, 4, False, "mode")
    assert (key.phase, key.tokens, key.batch_size, key.greedy, key.mode) == (PREFILL, 32, 4, False, "mode")


def test_capture_once_replay_after_and_the_switch_turns_replay_off():
    graphs = GraphRunner(HostGraphs(), decode_ladder=(2, 4))
    inputs = torch.randn(4)
    out = torch.full((4,), float("nan"))
    prepared = []

    def step():
        out.copy_(inputs * 2)
        return out

    key = graphs.decode_key(4, True)
    counters.clear()
    for _ in range(3):
        inputs.copy_(torch.randn(4))  # fresh inputs in the persistent buffer before every step
        got = graphs.run(key, step, prepare=lambda: prepared.append(1))
        assert got is out and torch.equal(got, inputs * 2)
    assert prepared == [1] and graphs.captured(key)
    assert (counters["decode_captures"], counters["decode_replays"], counters["graphs"]) == (1, 3, 0)
    graphs.replay = False
    assert graphs.decode_key(4, True) is None  # off: no key, the step runs padded without a graph
    inputs.copy_(torch.randn(4))
    assert torch.equal(graphs.run(key, step), inputs * 2)
    assert (counters["decode_captures"], counters["decode_replays"]) == (1, 3)


def test_cuda_graphs_refuse_a_device_without_cuda():
    with pytest.raises(ValueError, match="^tscompile: CUDA graphs need a CUDA device, got 'cpu'"):
        CudaGraphs(torch.device("cpu"))


def test_an_eager_engine_over_host_graphs_pads_like_graphs_and_gives_its_tokens():
    """Decode and whole-step prefill padded to their buckets (HostGraphs), the same tokens as the
    unpadded engine, greedy and seeded; captured once per key, replayed every step after, nothing
    compiled; with the switch off, the same tokens and no replay at all."""
    kw = dict(dtype=torch.float32, enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=32,
              attention_backend="torch")
    plain = small_llm(**kw)
    llm = small_llm(**kw)
    llm.runner.use_graphs(HostGraphs(), decode=True, prefill="whole")
    prompts = [[(5 * i + j) % 400 + 1 for j in range(n)] for i, n in enumerate([3, 9, 5])]
    runs = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=0.8, top_k=20, seed=5)]
    expected = [ids(plain.generate(prompts, p)) for p in runs]
    counters.clear()
    assert [ids(llm.generate(prompts, p)) for p in runs] == expected
    captured = counters["decode_captures"] + counters["prefill_captures"]
    assert counters["decode_captures"] == 2  # bs 4, greedy and sampled
    assert counters["decode_replays"] == 6 and counters["prefill_replays"] == 2 and counters["graphs"] == 0
    assert captured == len(llm.runner.graphs.graphs) and counters["decode_eager"] == 0
    llm.runner.graphs.replay = False
    counters.clear()
    assert [ids(llm.generate(prompts, p)) for p in runs] == expected
    assert counters["decode_replays"] == counters["prefill_replays"] == 0
    assert counters["decode_eager"] == 6 and counters["prefill_graphed"] == 2  # padded, ungraphed


def test_the_fuzz_graph_check_compares_every_composition_and_refuses_to_pass_vacuously():
    def make(spec):
        llm = build_engine(spec, device="cpu", dtype=torch.float32, attention_backend="torch", enforce_eager=True)
        llm.runner.use_graphs(HostGraphs(), decode=True, prefill="whole")
        llm.fuzz_name = spec.name
        return llm

    check = GraphCheck()
    fuzzer = Fuzzer(pressured_spec("llama-tiny", 16), make, extra=check)
    # both runs of a composition start from an empty prefix cache: a rerun that hit the batched run's
    # blocks would compute other shapes (in bfloat16, other roundings) and differ for that reason alone
    resets = []
    reset = fuzzer.llm.scheduler.reset_prefix_cache
    fuzzer.llm.scheduler.reset_prefix_cache = lambda: (resets.append(1), reset())[1]
    failures = [f for f in (fuzzer.check(seed) for seed in range(3)) if f is not None]
    assert not failures, failures[0]
    assert len(resets) == 6 and fuzzer.llm.scheduler.prefix_cache is not None  # two per composition, cache on
    assert check.compositions == 3 and check.graphs_on["decode_replays"] + check.graphs_on["prefill_replays"] > 0
    assert check.graphs_off["decode_replays"] == check.graphs_off["prefill_replays"] == 0
    # an engine whose switch does not hold is caught, and so is a run that replayed nothing
    comp = fuzzer.draw(0)
    stuck = GraphCheck()
    fuzzer.llm.runner.graphs.run = lambda key, step, **kw: counters.update(["prefill_replays"]) or step()
    assert "the switch did not hold" in stuck(fuzzer.llm, comp, [], {"decode_replays": 1, "prefill_replays": 0})
    del fuzzer.llm.runner.graphs.run
    assert "replayed no graph" in stuck(fuzzer.llm, comp, [], {"decode_replays": 0, "prefill_replays": 0})


def test_the_graph_check_switches_a_draft_models_graphs_off_too_and_wants_verify_replays():
    """With a draft model the engine has two graph runners (the target's and the draft's, graphed as
    the target): the rerun turns both off, so the check compares instead of failing on the draft's
    replays; a speculative run whose verify steps replayed no (bs, N) graph is refused."""
    def make(spec):
        llm = build_engine(spec, device="cpu", dtype=torch.float32, attention_backend="torch", enforce_eager=True)
        llm.runner.use_graphs(HostGraphs(), decode=True, prefill="whole")
        if spec.speculative_config is not None:  # the one-at-a-time reference has no draft model
            llm._verify.drafter.runner.parts.runner.use_graphs(HostGraphs(), decode=True, prefill="whole")
        llm.fuzz_name = spec.name
        return llm

    spec = pressured_spec("llama-tiny", 16)
    spec = replace(spec, name=f"{spec.name}/draft_model", speculative_config=SPECULATIVE_CONFIGS["draft_model"])
    check = GraphCheck()
    fuzzer = Fuzzer(spec, make, extra=check)
    assert len(graph_runners(fuzzer.llm)) == 2
    failures = [f for f in (fuzzer.check(seed) for seed in range(3)) if f is not None]
    assert not failures, failures[0]
    assert fuzzer.coverage.counts["verify_steps"] > 0
    assert fuzzer.coverage.counts["verify_replays"] == fuzzer.coverage.counts["verify_steps"]
    assert check.compositions == 3 and check.graphs_off["decode_replays"] == check.graphs_off["prefill_replays"] == 0
    fuzzer.log.verify_steps, fuzzer.log.verify_replays = 2, 0
    message = check(fuzzer.llm, fuzzer.draw(0), [], {"decode_replays": 1, "prefill_replays": 0}, fuzzer.log)
    assert "verify steps replayed no (bs, N) graph" in message


def test_compiles_and_captures_say_what_they_do_and_how_long_it_took(caplog):
    from tscompile.runtime.compile_clock import CompileClock

    def compiling_step(x):  # what a first call of a compiled step does to the backend's counter
        counters["graphs"] += 1
        return x + 1

    clock = CompileClock()
    graphs = GraphRunner(HostGraphs(), decode_ladder=(1, 2, 4), compile_seconds=lambda: clock.seconds)
    out = torch.zeros(1)
    with caplog.at_level("INFO", logger="tscompile"):
        assert clock.run("decode", compiling_step, 1) == 2
        assert clock.run("decode", lambda x: x, 5) == 5  # compiles nothing: says nothing
        graphs.capture_all(DECODE, [4, 2, 1], lambda bs: graphs.capture(graphs.decode_key(bs, True),
                                                                        lambda: out.add_(bs)), torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "tscompile: compiling the decode step ..."
    assert lines[1].startswith("tscompile: compiled the decode step in ") and lines[1].endswith(" s")
    assert sum("compiled the decode step" in m for m in lines) == 1 and clock.seconds > 0
    assert "tscompile: capturing decode graphs (3 sizes) ..." in lines
    assert any(m.startswith("tscompile: captured 3 decode graphs in ") for m in lines)
    assert len(graphs.graphs) == 3 and out.item() == 7  # each capture ran its step once


@pytest.mark.parametrize("model, speculative", [("llama-tiny", None), ("llama-tiny", "ngram"), ("narrow-tiny", None)])
def test_graphs_that_hold_the_refresh_rewrite_every_decode_buffer_they_read(model, speculative):
    """``graphed_refresh``: the decode (and verify) graphs refresh the staged rows, padded to the
    graph's batch size, themselves. With the metadata poisoned at each replay, such an engine still
    gives the unpadded engine's tokens (greedy and seeded; a batch of 3 in graphs of 4, so padding
    rows are refreshed too; the narrowing model's two cache groups); the same engine refreshing
    before its replays does not, which shows the poison reaches what the forward reads."""
    spec = None if speculative is None else SPECULATIVE_CONFIGS[speculative]
    kw = dict(dtype=torch.float32, enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=32,
              attention_backend="torch", speculative_config=spec)
    prompts = [[(5 * i + j) % 7 + 1 for j in range(n)] for i, n in enumerate([13, 9, 11])]  # repeating: drafts
    runs = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=5)]
    expected = [ids(small_llm(model, **kw).generate(prompts, p)) for p in runs]
    outcomes = {}
    for graphed in (True, False):
        llm = small_llm(model, **kw)
        llm.runner.use_graphs(HostGraphs(), decode=True, prefill=None, graphed_refresh=graphed)
        assert llm.runner.decode.graphed_refresh is graphed
        replayed = poison_decode_metadata_at_each_replay(llm)
        outcomes[graphed] = [ids(llm.generate(prompts, p)) for p in runs]
        assert any(key.phase == DECODE for key in replayed)
        if speculative is not None and graphed:  # verify graphs replayed, drafts accepted
            assert any(key.width > 1 for key in replayed) and llm.stats().spec_accepted_tokens > 0
    assert outcomes[True] == expected
    assert outcomes[False] != expected


def test_a_refresh_that_reads_the_host_is_never_held_by_a_graph():
    """A model with recurrent-state layers refreshes its state slots from the host: asking for graphed
    refresh leaves its graphs refreshing before each replay."""
    llm = small_llm("qwen3-next-tiny", dtype=torch.float32, enforce_eager=True)
    assert llm.runner.attention.refresh_reads_host
    llm.runner.use_graphs(HostGraphs(), decode=True, prefill=None, graphed_refresh=True)
    assert llm.runner.decode.graphed_refresh is False
