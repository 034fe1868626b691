"""The host-work shortcuts of one step, each checked against the plain rule it replaces on random
data: the plan built from one array per dtype (its seeded row offsets and unread rows, its sampling
rows, the shared no-ban rows), one request's write slots from the blocks it spans, the one-row
stores of ``put_rows``, the plan classes' hand-written constructors, the byte arenas that send a
step's inputs in one copy, and the engine's inline fault handling."""

import dataclasses
import inspect

import numpy as np
import pytest
import torch

import tscompile
from tscompile.kv_cache import CacheGroupSpec, kept_rows
from tscompile.kv_cache.slots import slot_from_block_rows, slots_of_run
from tscompile.runtime.device_faults import EngineDeadError
from tscompile.runtime.arena import arena_places, upload_packed
from tscompile.runtime.graph_runner import GraphRunner, HostGraphs
from tscompile.runtime.prefill_buffers import ExtendBuffers
from tscompile.runtime.scheduler import Request
from tscompile.runtime.step_builder import ScheduledBatch, build_step_plan
from tscompile.runtime.staging import DecodeStaging
from tscompile.sampling import SamplingParams
from tscompile.step_plan import ON_DEVICE, GroupPlan, SamplingRows, StepPlan, put_rows, row_offsets
from tscompile.utils import UPLOAD_ALIGN_BYTES
from helpers import random_scheduled_batch

BLOCK = 4
MAX_BLOCKS = 12
EOS = (2, 7)
WIDTH = len(EOS) + 8


def _sampling(rng) -> SamplingParams:
    """Random sampling parameters, some requests still below ``min_tokens`` (they ban eos and their
    stop ids)."""
    return SamplingParams(max_new_tokens=12, temperature=float(rng.choice([0.0, 0.7, 1.3])),
                          top_k=int(rng.integers(0, 5)), top_p=float(rng.choice([1.0, 0.5])),
                          min_tokens=int(rng.choice([0, 6])), stop_token_ids=[int(rng.integers(10, 20))])


def _random_batch(rng, specs):
    return random_scheduled_batch(rng, specs, max_blocks=MAX_BLOCKS, sampling=_sampling, max_generated=8,
                                  rid_base=100)


def _specs(window):
    full = CacheGroupSpec("full", (0, 1), 2, 8)
    return [full] if window is None else [full, CacheGroupSpec("tail", (2,), 2, 8, window=window)]


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("seed", range(20))
def test_the_plan_from_one_array_per_dtype_keeps_every_documented_rule_and_dtype(window, seed):
    rng = np.random.default_rng(seed)
    specs = _specs(window)
    batch, tables = _random_batch(rng, specs)
    plan = build_step_plan(batch, specs, tables, BLOCK, EOS, WIDTH)
    reqs = batch.requests
    for name, dtype in [("input_ids", np.int64), ("positions", np.int64), ("query_lens", np.int32),
                        ("prefix_lens", np.int32), ("completes", bool), ("emits", bool), ("logits_rows", np.int64)]:
        assert getattr(plan, name).dtype == dtype, name
    # the row offsets the builder seeded are the prefix sums of the plan's and each group's lens
    assert plan.qo_indptr.dtype == np.int32 and plan.qo_indptr.tolist() == row_offsets(plan.query_lens).tolist()
    completes = plan.completes.tolist()
    for spec, group in zip(specs, plan.groups):
        kept = [int(kept_rows(n, c, spec.window)) for n, c in zip(plan.query_lens.tolist(), completes)]
        assert group.query_lens.dtype == np.int32 and group.query_lens.tolist() == kept
        assert group.seq_lens.dtype == np.int32
        assert group.qo_indptr.dtype == np.int32 and group.qo_indptr.tolist() == [0, *np.cumsum(kept).tolist()]
    assert plan.logits_rows.tolist() == (np.cumsum(plan.groups[-1].query_lens) - 1).tolist()
    # the seeded unread rows equal the rule's, recomputed by a copy that carries no cache
    fresh = dataclasses.replace(plan, input_ids=plan.input_ids.copy())
    assert "tokens_on_device" not in fresh.__dict__
    assert plan.tokens_on_device.tolist() == fresh.tokens_on_device.tolist()
    first = plan.num_tokens - plan.num_decodes
    assert plan.tokens_on_device.tolist() == [first + i for i, r in enumerate(batch.decodes)
                                              if len(r.output) < r.num_generated]
    assert all(plan.input_ids[row] == ON_DEVICE for row in plan.tokens_on_device.tolist())
    s = plan.sampling
    assert s.temperature.dtype == np.float32 and s.top_p.dtype == np.float32 and s.top_k.dtype == np.int32
    assert s.seeds.dtype == np.int64 and s.steps.dtype == np.int64 and s.banned.dtype == np.int64
    assert s.temperature.tolist() == pytest.approx([r.params.temperature for r in reqs])
    assert s.top_p.tolist() == pytest.approx([r.params.top_p for r in reqs])
    assert s.banned.shape == (len(reqs), WIDTH)
    for r, row in zip(reqs, s.banned.tolist()):
        ids = list(r.params.banned_ids(EOS, r.num_generated))
        assert row == ids + [-1] * (WIDTH - len(ids))


def test_a_plan_that_bans_nothing_shares_read_only_rows_and_one_that_bans_gets_its_own():
    rng = np.random.default_rng(3)
    specs = _specs(None)
    tables = [np.arange(1, 8 * MAX_BLOCKS + 1, dtype=np.int32).reshape(8, MAX_BLOCKS)]
    free = Request(1, [5, 6, 9], SamplingParams(max_new_tokens=4), seed=3, slot=0, group_lens=[0])
    plans = [build_step_plan(ScheduledBatch([(free, 3)], []), specs, tables, BLOCK, EOS, WIDTH) for _ in range(2)]
    assert plans[0].sampling.banned is plans[1].sampling.banned
    assert plans[0].sampling.banned.tolist() == [[-1] * WIDTH]
    with pytest.raises(ValueError):
        plans[0].sampling.banned[0, 0] = 5  # shared by every such plan: nobody may write it
    held = Request(2, [int(x) for x in rng.integers(1, 50, 4)], SamplingParams(max_new_tokens=4, min_tokens=2),
                   seed=4, slot=1, group_lens=[0])
    plan = build_step_plan(ScheduledBatch([(held, 4)], []), specs, tables, BLOCK, EOS, WIDTH)
    assert plan.sampling.banned.tolist() == [list(EOS) + [-1] * (WIDTH - len(EOS))]
    assert plan.sampling.banned.flags.writeable


@pytest.mark.parametrize("seed", range(4))
def test_one_requests_write_slots_from_its_blocks_equal_the_per_row_gather(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        block = int(rng.integers(1, 9))
        width = int(rng.integers(1, 10))
        row = rng.integers(1, 2**30, width).astype(np.int32)  # large ids: the slot needs int64
        first = int(rng.integers(0, width * block))
        rows = int(rng.integers(0, width * block - first + 1))
        want = slot_from_block_rows(row[None], 0, np.arange(first, first + rows), block)
        got = slots_of_run(row, first, rows, block)
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
    with pytest.raises(IndexError):  # past the table: the gather's error, not a short answer
        slots_of_run(np.ones(2, dtype=np.int32), 6, 4, 4)
    group = GroupPlan(np.array([5], dtype=np.int32), np.array([9], dtype=np.int32),
                      np.array([[3, 8, 11]], dtype=np.int32), 4)
    assert group.write_slots.tolist() == [8 * 4 + 0, 8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3, 11 * 4 + 0]


@pytest.mark.parametrize("n,end", [(1, 1), (1, 2), (1, 4), (3, 3), (3, 4), (3, 7), (0, 2)])
def test_put_rows_writes_the_values_then_pads_exactly_up_to_end(n, end):
    rng = np.random.default_rng(n * 10 + end)
    flat = np.full(12, -99, dtype=np.int64)
    values = rng.integers(1, 1000, n)
    put_rows(flat, 2, values, n, end, 5)
    assert flat.tolist() == [-99] * 2 + values.tolist() + [5] * (end - n) + [-99] * (10 - end)
    listed = np.full(12, -99, dtype=np.int64)  # a Python list and a scalar take the general path
    put_rows(listed, 2, values.tolist(), n, end, 5)
    assert listed.tolist() == flat.tolist()
    scalar = np.full(12, -99, dtype=np.int64)
    put_rows(scalar, 2, -1, n, end, 5)
    assert scalar.tolist() == [-99] * 2 + [-1] * n + [5] * (end - n) + [-99] * (10 - end)
    table = np.full((5, 3), -99, dtype=np.int32)  # 2-D: whole rows
    rows = rng.integers(1, 100, (n, 3)).astype(np.int32)
    put_rows(table, 1, rows, n, min(end, 4), 0)
    assert table[1: 1 + n].tolist() == rows.tolist()
    assert table[1 + n: 1 + min(end, 4)].tolist() == [[0, 0, 0]] * (min(end, 4) - n)
    assert table[0].tolist() == [-99] * 3 and table[1 + min(end, 4):].tolist() == [[-99] * 3] * (4 - min(end, 4))


@pytest.mark.parametrize("cls", [GroupPlan, SamplingRows, StepPlan])
def test_the_plan_classes_take_their_fields_in_order_and_stay_frozen(cls):
    fields = [f.name for f in dataclasses.fields(cls)]
    assert list(inspect.signature(cls.__init__).parameters)[1:] == fields
    values = {name: object() for name in fields}
    obj = cls(**values)
    assert all(getattr(obj, name) is value for name, value in values.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, fields[0], 1)
    with pytest.raises(TypeError):
        cls(*list(values.values())[:-1])  # a missing field is refused as by the generated __init__


def test_a_cached_plan_property_is_computed_once_and_a_replaced_copy_recomputes():
    lens = np.array([3, 1, 4], dtype=np.int32)
    group = GroupPlan(lens, lens + 2, np.zeros((3, 4), dtype=np.int32), 4)
    first = group.qo_indptr
    assert first.tolist() == [0, 3, 4, 8] and group.qo_indptr is first
    other = dataclasses.replace(group, query_lens=np.array([1, 1, 1], dtype=np.int32))
    assert other.qo_indptr.tolist() == [0, 1, 2, 3]


def _layout():
    i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
    return [((9,), i64), ((9,), i64), ((3,), i64), ((4,), i32), ((3,), np.dtype(bool)), ((3, 5), i32), ((3,), i32),
            ((4,), i32), ((9,), i64)]


def test_whole_step_buffers_are_aligned_disjoint_views_of_one_arena_that_only_the_first_starts():
    layout = _layout()
    buf = ExtendBuffers(layout, torch.device("cpu"), pin=False)
    starts, nbytes = arena_places(layout)
    assert buf.arena.numel() == nbytes and buf.arena.dtype == torch.uint8
    spans = []
    for t, h, (shape, dtype), start in zip(buf.tensors, buf.host, layout, starts):
        assert tuple(t.shape) == shape and h.shape == shape and h.dtype == dtype
        offset = t.data_ptr() - buf.arena.data_ptr()
        assert offset == start and offset % UPLOAD_ALIGN_BYTES == 0
        spans.append((offset, offset + t.numel() * t.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert [min(t.storage_offset(), 2) for t in buf.tensors] == [0] + [2] * (len(layout) - 1)


def test_the_packed_upload_keeps_values_and_the_offsets_of_the_whole_step_buffers():
    rng = np.random.default_rng(9)
    layout = _layout()
    arrays = [rng.integers(0, 2, shape).astype(bool) if dtype == bool else rng.integers(-500, 500, shape).astype(dtype)
              for shape, dtype in layout]
    dev = upload_packed(arrays, torch.device("cpu"))
    assert [t.tolist() for t in dev] == [a.tolist() for a in arrays]
    persistent = ExtendBuffers(layout, torch.device("cpu"), pin=False)
    assert [t.storage_offset() * t.element_size() for t in dev] == \
           [t.storage_offset() * t.element_size() for t in persistent.tensors]
    assert [t.dtype for t in dev] == [t.dtype for t in persistent.tensors]


def test_the_decode_staging_sends_every_region_in_one_copy_of_one_arena():
    staging = DecodeStaging(4, 2, 5, 3, torch.device("cpu"))
    base = staging.arena.data_ptr()
    for view in (staging.d64, staging.d32, staging.df):
        assert (view.data_ptr() - base) % UPLOAD_ALIGN_BYTES == 0
        assert view.untyped_storage().data_ptr() == staging.arena.untyped_storage().data_ptr()
    rng = np.random.default_rng(11)
    host = staging._sets[staging._turn]
    values = (rng.integers(-9, 9, host.n64.shape), rng.integers(-9, 9, host.n32.shape),
              rng.standard_normal(host.nf.shape).astype(np.float32))
    host.n64[:], host.n32[:], host.nf[:] = values
    staging.d64.fill_(-99), staging.d32.fill_(-99), staging.df.fill_(-99.0)
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, *args, **kwargs):
        copies.append(self)
        return real_copy(self, *args, **kwargs)

    torch.Tensor.copy_ = counting_copy
    try:
        staging.upload()
    finally:
        torch.Tensor.copy_ = real_copy
    assert len(copies) == 1
    assert staging.d64.tolist() == values[0].tolist() and staging.d32.tolist() == values[1].tolist()
    assert staging.df.tolist() == pytest.approx(values[2].tolist())


def test_a_fault_inside_a_step_still_kills_the_engine_and_anything_else_propagates_unchanged(monkeypatch):
    llm = tscompile.LLM("llama-tiny", device="cpu", dtype=torch.float32, max_model_len=64, max_num_seqs=2,
                        enforce_eager=True)
    llm.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    original = llm.runner.launch

    def broken(plan, prev_rows=None):
        raise KeyError("not a device fault")

    monkeypatch.setattr(llm.runner, "launch", broken)
    with pytest.raises(KeyError, match="not a device fault"):
        llm.step()
    assert not llm.is_dead

    def faulted(plan, prev_rows=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(llm.runner, "launch", faulted)
    with pytest.raises(EngineDeadError) as info:
        llm.step()
    assert isinstance(info.value.__cause__, RuntimeError) and llm.is_dead
    monkeypatch.setattr(llm.runner, "launch", original)
    with pytest.raises(EngineDeadError):
        llm.sync()


def test_bucket_bisection_equals_the_ladder_scan():
    from tscompile.utils import bucket

    rng = np.random.default_rng(13)
    for _ in range(200):
        ladder = tuple(sorted(set(rng.integers(1, 300, rng.integers(1, 9)).tolist())))
        for n in rng.integers(0, 320, 20).tolist():
            assert bucket(ladder, n) == next((b for b in ladder if b >= n), None), (ladder, n)


def test_whole_step_buckets_follow_the_ladder_rule():
    whole = GraphRunner(HostGraphs(), token_ladder=(16, 32, 64), request_ladder=(2, 4))
    rng = np.random.default_rng(12)
    for tokens, requests in rng.integers(1, 80, (200, 2)).tolist():
        t = next((b for b in (16, 32, 64) if b >= tokens), None)
        r = next((b for b in (2, 4) if b >= requests), None)
        want = None if t is None or r is None else (t, min(r, t))
        assert whole.prefill_size(tokens, requests) == want


def test_decode_padded_sizes_follow_the_ladder_rule():
    decode = GraphRunner(HostGraphs(), decode_ladder=(4, 1, 2))
    for n in [3, 1, 5, 4, 2, 3, 9, 1]:
        padded = next((b for b in (1, 2, 4) if b >= n), n)
        assert decode.decode_size(n) == padded
        assert (decode.decode_key(padded, True) is None) == (padded > 4)
