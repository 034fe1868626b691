"""Prefill graphs captured at engine start-up (``prefill_capture="startup"``) or on first use ("lazy").

CPU: the option's validation, the placeholder steps' planning (which shapes, which keys), that they
write only the null page and leave the scheduler and the KV pool as they were, and, with host
replay (the graphs' bookkeeping without CUDA), that after them no real step of any bucket captures
and the tokens equal an eager engine's. GPU (``-m gpu``): the real graphs, both prefill graph modes
and the narrowing model, against a lazily-capturing engine and an eager one."""

import random

import numpy as np
import pytest
import torch

from helpers import ids, small_llm
from tscompile import SamplingParams
from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile.forward_context import ForwardMode
from tscompile.kv_cache.spec import kept_rows
from tscompile.runtime.graph_runner import HostGraphs
from tscompile.runtime.prefill_capture import (PlaceholderShape, StepLimits, candidate_shapes, placeholder_plan,
                                               reachable_token_ladder, startup_plans)

LADDER = {"token_ladder": (4, 8, 16), "prefill_graph_max_tokens": 16, "decode_ladder": (1, 2, 4),
          "prefill_capture": "startup"}


# -- the option --------------------------------------------------------------------------------------
def test_prefill_capture_is_validated_defaults_to_lazy_and_leaves_the_hash_alone():
    assert TscompileConfig().prefill_capture == "lazy"
    for bad in ("eager", "", None, True):
        with pytest.raises(ValueError, match=r"^tscompile: prefill_capture must be one of \['startup', 'lazy'\], got"):
            TscompileConfig(prefill_capture=bad)
    with pytest.raises(ValueError, match="tscompile: prefill_capture"):
        TscompileConfig.from_options({"prefill_capture": "later"})
    # the same graphs get compiled either way: only when differs
    assert TscompileConfig(prefill_capture="startup").compute_hash() == TscompileConfig().compute_hash()


# -- planning ----------------------------------------------------------------------------------------
def test_candidate_shapes_cover_each_reachable_bucket_and_request_count_extend_and_mixed():
    limits = StepLimits(max_tokens=12, max_requests=4, max_chunk=62)
    ladder = reachable_token_ladder((4, 8, 16, 32), limits.max_tokens)
    assert ladder == (4, 8, 16)  # 32: no step of at most 12 tokens pads to it
    shapes = candidate_shapes(ladder, (1, 2, 4), limits)
    seen = {(s.num_tokens, s.num_requests, s.decodes) for s in shapes}
    # the top bucket gets the budget's 12 tokens (more than the bucket below), the others their size
    assert seen == {(t, r, d) for t in (12, 8, 4) for r in (1, 2, 4) for d in (0, 1) if not (r == 1 and d)}
    assert [s.num_tokens for s in shapes] == sorted((s.num_tokens for s in shapes), reverse=True)  # largest first
    assert all(all(s.completes) and max(s.chunks) <= limits.max_chunk for s in shapes)


def test_candidate_shapes_respect_the_longest_chunk_and_skip_what_no_step_can_be():
    # chunks of at most 5 tokens: 16 tokens need 4 requests, 2 reach 10, 1 request never passes bucket 8
    shapes = candidate_shapes((8, 16), (1, 2, 4), StepLimits(max_tokens=16, max_requests=4, max_chunk=5))
    assert all(max(s.chunks) <= 5 for s in shapes)
    assert {(s.num_tokens, s.num_requests, s.decodes) for s in shapes if s.num_tokens > 8} == {
        (16, 4, 0), (16, 4, 1), (10, 2, 0)}  # a mixed step of 2: one chunk of 5 and a decode row, 6 tokens
    assert not any(s.num_requests == 1 and s.num_tokens > 5 for s in shapes)
    assert (5, 1) in {(s.num_tokens, s.num_requests) for s in shapes}  # 5 tokens: bucket 8


def test_narrowing_candidates_reach_every_kept_row_count_once():
    window = 4
    shapes = candidate_shapes((16,), (4,), StepLimits(max_tokens=16, max_requests=4, max_chunk=62), window)
    extend4 = [s for s in shapes if s.num_requests == 4 and s.decodes == 0]
    rows = [int(kept_rows(np.array(s.chunks), np.array(s.completes), window).sum()) for s in extend4]
    assert rows == [16, 13, 10, 7, 4]  # 4 chunks of 4: c complete keep 4 each, the open ones 1
    assert len(set(rows)) == len(rows)


def test_a_placeholder_plan_writes_only_the_null_page_and_reads_back_known_tokens():
    llm = small_llm("narrow-tiny", dtype=torch.float32, enforce_eager=True)
    sched = llm.scheduler
    shape = PlaceholderShape(chunks=(7, 5), completes=(True, False), decodes=1)
    plan = placeholder_plan(shape, sched.specs, block_size=sched.block_size, max_blocks=sched.max_blocks,
                            eos_token_ids=sched.eos_token_ids, banned_width=sched.banned_width)
    assert plan.mode is ForwardMode.MIXED and plan.num_tokens == 13 and plan.num_requests == 3
    assert plan.tokens_on_device.size == 0 and plan.sampling.all_greedy
    for g in plan.groups:
        assert g.block_tables.shape == (3, sched.max_blocks) and not g.block_tables.any()
        assert (g.write_slots < sched.block_size).all()  # every write in the null block
    assert list(plan.completes) == [True, False, False]


def test_lazy_or_no_prefill_graphs_plan_nothing_at_start_up():
    lazy = small_llm(dtype=torch.float32, compile_options={**LADDER, "prefill_capture": "lazy"})
    lazy.runner.use_graphs(HostGraphs(), decode=False, prefill="piecewise")
    assert lazy.runner.prefill_token_ladder and startup_plans(lazy.runner, lazy.scheduler) == []
    cpu = small_llm(dtype=torch.float32, compile_options=LADDER)  # the CPU has no prefill graphs
    assert cpu.runner.prefill_token_ladder == () and startup_plans(cpu.runner, cpu.scheduler) == []
    assert cpu.runner.prefill_capture_seconds == 0.0
    eager = small_llm(dtype=torch.float32, enforce_eager=True)
    assert startup_plans(eager.runner, eager.scheduler) == []


def test_whole_step_keys_make_one_plan_per_token_and_request_bucket_and_mode():
    llm = small_llm(dtype=torch.float32, compile_options=LADDER, max_num_batched_tokens=16, max_num_seqs=4)
    llm.runner.use_graphs(HostGraphs(), decode=False, prefill="whole")
    plans = startup_plans(llm.runner, llm.scheduler)
    keys = [k for p in plans for k in llm.runner.prefill_graph_keys(p)]
    assert len(keys) == len(set(keys)) == len(plans)  # each plan captures one graph no other does
    # no request bucket of 1 (it would specialize the graph): a one-request step pads to 2, a bucket
    # the mixed steps of 2 requests reach too
    assert llm.runner.prefill_request_ladder == (2, 4)
    expected = {(t, r, True, mode) for t in (4, 8, 16) for r in (2, 4) for mode in (ForwardMode.EXTEND,
                                                                                    ForwardMode.MIXED)}
    assert {(k.tokens, k.batch_size, k.greedy, k.mode) for k in keys} == expected and {k.width for k in keys} == {1}


# -- running them (host replay) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def warmed():
    """A piecewise engine whose placeholder steps ran, with the state before and after them."""
    llm = small_llm(dtype=torch.float32, compile_options=LADDER, max_num_batched_tokens=16, max_num_seqs=4)
    llm.runner.use_graphs(HostGraphs(), decode=False, prefill="piecewise")
    # a request mid-prompt holds pages and a slot: the placeholder steps must not touch either
    busy = llm.add_request([(5 * j) % 300 + 1 for j in range(30)], SamplingParams(max_new_tokens=4))
    llm.step()
    llm.sync()
    pool = llm.pool
    for group in pool.groups.values():  # poison so a stray write or read shows
        for t in [*group.k.values(), *group.v.values()]:
            t[1:].normal_()
    before = _state(llm)
    counters.clear()
    plans = startup_plans(llm.runner, llm.scheduler)
    llm.runner.capture_prefill_graphs(plans)
    after = _state(llm)
    captured = dict(counters)
    llm.abort(busy.rid)
    return llm, plans, before, after, captured


def _state(llm):
    s = llm.scheduler
    pages = [t[1:].clone() for g in llm.pool.groups.values() for t in [*g.k.values(), *g.v.values()]]
    return {"pages": pages, "free": [list(a._free) for a in s.allocators], "tables": [t.copy() for t in s.block_tables],
            "slots": list(s.free_slots), "running": [(r.rid, r.num_computed, list(r.group_lens)) for r in s.running],
            "waiting": [r.rid for r in s.waiting]}


def test_placeholder_steps_leave_the_scheduler_and_every_page_but_the_null_one_unchanged(warmed):
    llm, plans, before, after, captured = warmed
    assert len(plans) > 0
    for name in ("free", "slots", "running", "waiting"):
        assert after[name] == before[name], name
    assert all(np.array_equal(a, b) for a, b in zip(after["tables"], before["tables"]))
    assert all(torch.equal(a, b) for a, b in zip(after["pages"], before["pages"]))
    assert captured["prefill_captures"] > 0
    # not steps: the step counters stay as they were
    assert captured.get("prefill_graphed", 0) == 0 and captured.get("prefill_eager", 0) == 0
    assert llm.runner.prefill_capture_seconds > 0


def test_after_start_up_capture_no_step_of_any_bucket_captures_and_tokens_equal_eager(warmed):
    llm = warmed[0]
    rng = random.Random(3)
    batches = [[[rng.randint(1, 400) for _ in range(rng.randint(1, 15))] for _ in range(rng.randint(1, 4))]
               for _ in range(6)]
    batches.append([[7] * 3, [8] * 12, [9] * 1, [4] * 9])  # chunked: a mixed step follows
    params = SamplingParams(max_new_tokens=3)
    eager = small_llm(dtype=torch.float32, enforce_eager=True, max_num_batched_tokens=16, max_num_seqs=4)
    expected = [ids(eager.generate(b, params)) for b in batches]
    modes = []
    original = llm.runner.prefill.run

    def extend(plan):
        modes.append(plan.mode)
        original(plan)

    llm.runner.prefill.run = extend
    counters.clear()
    try:
        assert [ids(llm.generate(b, params)) for b in batches] == expected
    finally:
        del llm.runner.prefill.run
    assert ForwardMode.MIXED in modes and ForwardMode.EXTEND in modes
    assert counters["prefill_graphed"] > 0 and counters["prefill_replays"] > 0
    assert counters["prefill_captures"] == 0


# -- the narrowing model (host replay) ----------------------------------------------------------------------
# Each token bucket rounds to its own multiple of the upload's alignment (16 int64s), so each gives
# the last piece its own logits-row offset; two requests keep at most 8 rows (window 4): row buckets
# 4 and 8, both reachable from 32 and 64 tokens.
NARROW_LADDER = {**LADDER, "token_ladder": (4, 32, 64), "prefill_graph_max_tokens": 64}
NARROW = {"max_num_batched_tokens": 64, "max_num_seqs": 2}


@pytest.fixture(scope="module")
def narrow_warmed():
    """A narrow-tiny engine whose placeholder steps ran under host replay."""
    llm = small_llm("narrow-tiny", dtype=torch.float32, compile_options=NARROW_LADDER, **NARROW)
    llm.runner.use_graphs(HostGraphs(), decode=False, prefill="piecewise")
    llm.runner.capture_prefill_graphs(startup_plans(llm.runner, llm.scheduler))
    return llm


def _narrow_step_shapes(max_tokens: int, max_requests: int) -> list[PlaceholderShape]:
    """Every step of up to ``max_tokens`` tokens and ``max_requests`` requests the scheduler can
    form, up to how the tokens split: any number of decode rows (a mixed step), the extend chunks
    even, each complete or open."""
    shapes = []
    for requests in range(1, max_requests + 1):
        for decodes in range(requests):
            extends = requests - decodes
            for tokens in range(requests, max_tokens + 1):
                chunks = tuple(_even_split(tokens - decodes, extends))
                for complete in range(extends + 1):
                    shapes.append(PlaceholderShape(chunks, tuple(j < complete for j in range(extends)), decodes))
    return shapes


def _even_split(tokens, parts):
    return [tokens // parts + (i < tokens % parts) for i in range(parts)]


def test_narrowing_model_after_start_up_capture_no_step_of_any_token_row_and_request_bucket_captures(narrow_warmed):
    # The last piece reads its logits rows from a view into the step's upload, after the padded ids
    # and positions: the view's offset (twice the token bucket, rounded up to the upload's alignment)
    # is one of its inputs, so a row bucket reached from another token bucket than the planned one
    # captured anew (on the H200: a mixed
    # step of 7 requests, 25 tokens and 10 kept rows, after start-up).
    llm = narrow_warmed
    sched, buckets = llm.scheduler, llm.runner.prefill.buckets
    seen, steps = set(), 0
    for shape in _narrow_step_shapes(sched.max_num_batched_tokens, sched.max_num_seqs):
        plan = placeholder_plan(shape, sched.specs, block_size=sched.block_size, max_blocks=sched.max_blocks,
                                eos_token_ids=sched.eos_token_ids, banned_width=sched.banned_width)
        # one step per padded size and Dynamo class: what decides which graphs a step replays
        size = (buckets.sizes_of(plan), plan.mode, plan.num_requests == 1)
        if size in seen:
            continue
        seen.add(size)
        counters.clear()
        llm.runner.execute(plan)
        steps += 1
        assert counters["prefill_graphed"] == 1 and counters["prefill_captures"] == 0, (
            f"{shape} (tokens, rows, requests) = {size[0]}, {plan.mode}: captured {counters['prefill_captures']} "
            f"graph(s) after start-up")
    # the sweep reaches every row bucket from every token bucket, mixed and extend; among them the
    # steps the planner missed before its last-piece keys had the token bucket: 2 open chunks of 16
    # tokens keep 2 rows, a row bucket the planner had reached only with 64 tokens
    reached = {(t, r, mode) for (t, r, _), mode, _ in seen}
    assert buckets.row_ladder == (4, 8)
    assert {(t, r, m) for t in (32, 64) for r in (4, 8) for m in (ForwardMode.EXTEND, ForwardMode.MIXED)} <= reached
    assert steps == len(seen) > 10


# -- GPU ------------------------------------------------------------------------------------------------
GPU_LADDER = {"decode_ladder": (1, 2, 4, 8), "token_ladder": (16, 32, 64), "prefill_graph_max_tokens": 64}
GPU_CASES = [("llama-tiny", "whole", "triton"), ("llama-tiny", "piecewise", "torch"),
             ("narrow-tiny", "piecewise", "torch"), ("qwen3-next-tiny", "piecewise", "triton")]


def _gpu_llm(model, backend, **kw):
    import tscompile
    return tscompile.LLM(model, attention_backend=backend, device="cuda", max_model_len=256, max_num_seqs=8,
                         page_size=16, dtype=torch.float32, max_num_batched_tokens=64, **kw)


def _gpu_batches():
    rng = random.Random(11)
    batches = [[[rng.randint(1, 400) for _ in range(rng.randint(1, 60))] for _ in range(rng.randint(1, 8))]
               for _ in range(8)]
    return batches + [[[5] * 40, [6] * 50, [7] * 3]]  # 93 tokens: chunked, a mixed step follows


@pytest.mark.gpu
@pytest.mark.parametrize("model, mode, backend", GPU_CASES)
def test_gpu_start_up_capture_leaves_nothing_to_capture_and_tokens_equal_lazy_and_eager(model, mode, backend, caplog):
    params = SamplingParams(max_new_tokens=4)
    batches = _gpu_batches()
    eager = [ids(_gpu_llm(model, backend, enforce_eager=True).generate(b, params)) for b in batches]
    lazy_llm = _gpu_llm(model, backend, compile_options={**GPU_LADDER, "prefill_graph_mode": mode,
                                                         "prefill_capture": "lazy"})
    assert lazy_llm.runner.prefill_capture_seconds == 0.0
    lazy = [ids(lazy_llm.generate(b, params)) for b in batches]
    del lazy_llm
    counters.clear()
    with caplog.at_level("INFO", logger="tscompile"):
        llm = _gpu_llm(model, backend, compile_options={**GPU_LADDER, "prefill_graph_mode": mode,
                                                        "prefill_capture": "startup"})
    assert (llm.runner.prefill.whole is not None) == (mode == "whole")
    assert counters["prefill_captures"] > 0 and counters["prefill_graphed"] == 0
    assert any("Prefill graph capturing finished" in r.getMessage() for r in caplog.records)
    assert llm.runner.prefill_capture_seconds > 0 and llm.capture_seconds >= llm.prefill_capture_seconds
    counters.clear()
    assert [ids(llm.generate(b, params)) for b in batches] == eager == lazy
    assert counters["prefill_graphed"] > 0 and counters["prefill_captures"] == 0


# -- the hybrid model (host replay) ---------------------------------------------------------------------
def test_hybrid_placeholder_steps_write_only_the_null_state_slot_and_then_nothing_captures():
    """qwen3-next-tiny: every placeholder request's state slot is the null slot, so the state ops of
    the placeholder steps leave a request that is mid-prompt with its state; after them no real step
    captures, and the tokens equal an eager engine's."""
    from tscompile.kv_cache.state_pool import NULL_SLOT

    kw = dict(dtype=torch.float32, max_num_batched_tokens=16, max_num_seqs=4)
    llm = small_llm("qwen3-next-tiny", compile_options=LADDER, **kw)
    llm.runner.use_graphs(HostGraphs(), decode=False, prefill="piecewise")
    busy = llm.add_request([(5 * j) % 300 + 1 for j in range(30)], SamplingParams(max_new_tokens=4))
    llm.step()  # its first chunk, after which its slot holds a state
    llm.sync()
    pool = llm.attention.state.pool
    live = [pool.conv_all[:, NULL_SLOT + 1:].clone(), pool.ssm_all[:, NULL_SLOT + 1:].clone()]
    assert any(t.abs().sum() > 0 for t in live)
    plans = startup_plans(llm.runner, llm.scheduler)
    assert plans and all(p.state_slots.tolist() == [NULL_SLOT] * p.num_requests for p in plans)
    counters.clear()
    llm.runner.capture_prefill_graphs(plans)
    assert counters["prefill_captures"] > 0
    assert torch.equal(pool.conv_all[:, NULL_SLOT + 1:], live[0])
    assert torch.equal(pool.ssm_all[:, NULL_SLOT + 1:], live[1])
    llm.abort(busy.rid)

    rng = random.Random(5)
    batches = [[[rng.randint(1, 400) for _ in range(rng.randint(1, 15))] for _ in range(rng.randint(1, 4))]
               for _ in range(3)]
    params = SamplingParams(max_new_tokens=3)
    eager = small_llm("qwen3-next-tiny", enforce_eager=True, **kw)
    expected = [ids(eager.generate(b, params)) for b in batches]
    counters.clear()
    assert [ids(llm.generate(b, params)) for b in batches] == expected
    assert counters["prefill_replays"] > 0 and counters["prefill_captures"] == 0
