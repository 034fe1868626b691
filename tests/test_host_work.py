"""The host-side helpers of one step (step plan arrays, extend metadata written in place, the
whole-step staging, the decode staging's padding), each checked against a plain restatement of its
rule on random data, over poisoned buffers so a row left unwritten shows."""

import numpy as np
import pytest
import torch

import tscompile
from tscompile.attention import create_attention_router
from tscompile.kv_cache import CacheGroupSpec, KVCachePool
from tscompile.kv_cache.slots import expand_block_table_rows
from tscompile.runtime.prefill_buffers import WholeStepBuffers
from tscompile.runtime.scheduler import Request, Scheduler
from tscompile.runtime.step_builder import ScheduledBatch, build_step_plan
from tscompile.runtime.staging import DecodeStaging
from tscompile.sampling import SamplingParams
from tscompile.step_plan import ON_DEVICE, GroupPlan, arange_view, put_padded, row_offsets

BLOCK = 4
MAX_BLOCKS = 8
FULL = CacheGroupSpec("full", (0, 1), 2, 16)
TAIL = CacheGroupSpec("tail", (2,), 2, 16, window=3)


def test_put_padded_writes_the_source_then_the_pad_value_over_every_later_row():
    rng = np.random.default_rng(0)
    dst = np.full(9, -77, dtype=np.int64)
    src = rng.integers(1, 1000, 6)
    put_padded(dst, src, 5)
    assert dst.tolist() == src.tolist() + [5, 5, 5]
    full = rng.integers(1, 1000, 9)
    put_padded(dst, full, 0)  # no padding rows
    assert dst.tolist() == full.tolist()
    table = np.full((4, 3), -1, dtype=np.int32)  # 2-D: whole rows
    put_padded(table, np.arange(6, dtype=np.int32).reshape(2, 3) + 1, 0)
    assert table.tolist() == [[1, 2, 3], [4, 5, 6], [0, 0, 0], [0, 0, 0]]


def test_arange_view_is_a_read_only_arange_that_grows_on_demand():
    assert arange_view(7).tolist() == list(range(7))
    big = arange_view(10_000)
    assert big.dtype == np.int64 and np.array_equal(big, np.arange(10_000))
    assert arange_view(3).tolist() == [0, 1, 2]  # still right after growing
    with pytest.raises(ValueError):
        big[0] = 5


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_row_offsets_are_the_exclusive_prefix_sums(dtype):
    lens = np.random.default_rng(1).integers(0, 50, 11).astype(dtype)
    out = row_offsets(lens)
    assert out.dtype == np.int32 and out.tolist() == [0] + np.cumsum(lens).tolist()
    assert row_offsets(np.zeros(0, dtype=dtype)).tolist() == [0]


def test_prefill_token_ids_equal_prefill_tokens_in_the_prompt_and_past_it():
    rng = np.random.default_rng(2)
    prompt = [int(x) for x in rng.integers(1, 500, 13)]
    r = Request(0, prompt, SamplingParams(max_new_tokens=8), seed=1)
    r.output = [int(x) for x in rng.integers(1, 500, 5)]
    r.resumed = 5  # preempted: its generated tokens are prefilled again after the prompt
    for start, stop in [(0, 13), (3, 9), (10, 16), (13, 18), (0, 18), (17, 18)]:
        ids = r.prefill_token_ids(start, stop)
        assert ids.dtype == np.int64 and ids.tolist() == r.prefill_tokens(start, stop), (start, stop)
    inside = r.prefill_token_ids(2, 6)
    with pytest.raises(ValueError):  # a slice of the request's own prompt array: no plan may write it
        inside[0] = 0


@pytest.mark.parametrize("seed", range(6))
def test_a_one_request_group_plan_places_its_rows_as_the_row_by_row_rule(seed):
    rng = np.random.default_rng(seed)
    table = (rng.permutation(4 * MAX_BLOCKS) + 1).astype(np.int32).reshape(4, MAX_BLOCKS)[:1]
    q = int(rng.integers(1, 12))
    seq = q + int(rng.integers(0, MAX_BLOCKS * BLOCK - q))
    group = GroupPlan(np.array([q], dtype=np.int32), np.array([seq], dtype=np.int32), table, BLOCK)
    positions = list(range(seq - q, seq))
    assert group.positions.tolist() == positions
    assert group.write_slots.tolist() == [int(table[0, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]
    # the same request among others gets the same rows through the many-request path
    two = GroupPlan(np.array([q, 2], dtype=np.int32), np.array([seq, 5], dtype=np.int32),
                    np.concatenate([table, table + 40]), BLOCK)
    assert two.positions[:q].tolist() == positions and two.write_slots[:q].tolist() == group.write_slots.tolist()


def _request(rid, prompt_len, slot, rng, **state):
    r = Request(rid, [int(x) for x in rng.integers(1, 500, prompt_len)], SamplingParams(max_new_tokens=8),
                seed=rid, slot=slot)
    for k, v in state.items():
        setattr(r, k, v)
    return r


def _mixed_plan(specs, rng):
    """One extend chunk of 5 rows, then a decode whose token is known and one whose token is not."""
    tables = [(rng.permutation(4 * MAX_BLOCKS) + 1).astype(np.int32).reshape(4, MAX_BLOCKS) for _ in specs]
    ext = _request(0, 9, 0, rng, num_computed=2, group_lens=[2, 1][: len(specs)])
    known = _request(1, 3, 1, rng, num_computed=4, num_generated=2, output=[11, 12], group_lens=[4, 3][: len(specs)])
    unread = _request(2, 4, 2, rng, num_computed=5, num_generated=2, output=[13], group_lens=[5, 3][: len(specs)])
    return build_step_plan(ScheduledBatch([(ext, 5)], [known, unread]), specs, tables, BLOCK), tables


def test_tokens_on_device_are_the_unread_decode_rows_only():
    plan, _ = _mixed_plan([FULL], np.random.default_rng(3))
    assert plan.input_ids.tolist()[5:] == [12, ON_DEVICE]
    assert plan.tokens_on_device.tolist() == [6] == np.flatnonzero(plan.input_ids == ON_DEVICE).tolist()
    r = _request(3, 6, 0, np.random.default_rng(4), group_lens=[0])
    lone = build_step_plan(ScheduledBatch([(r, 6)], []), [FULL], [np.ones((4, MAX_BLOCKS), np.int32)], BLOCK)
    assert lone.tokens_on_device.size == 0


def _router(pages_per_block, specs):
    page_size = BLOCK // pages_per_block
    router = create_attention_router("torch", specs, max_model_len=MAX_BLOCKS * BLOCK, page_size=page_size,
                                     pages_per_block=pages_per_block, device="cpu")
    router.set_cache_pool(KVCachePool.allocate(specs, [64 * pages_per_block] * len(specs), page_size=page_size,
                                               pages_per_block=pages_per_block, dtype=torch.float32, device="cpu"))
    return router


@pytest.mark.parametrize("pages_per_block", [1, 2])
@pytest.mark.parametrize("specs", [[FULL], [FULL, TAIL]], ids=["one-group", "narrowed-tail"])
def test_extend_metadata_written_in_place_covers_every_element_with_the_padding_rule(pages_per_block, specs):
    plan, tables = _mixed_plan(specs, np.random.default_rng(5))
    router = _router(pages_per_block, specs)
    tokens, requests = 16, 5
    layout = router.extend_array_layout(tokens, requests)
    out = [np.full(shape, -7, dtype=dtype) for shape, dtype in layout]
    router.fill_extend_host_arrays(plan, out)
    b = plan.num_requests
    for gid, group in enumerate(plan.groups):
        pages, seq_lens, qo_indptr, slots = out[4 * gid: 4 * gid + 4]
        width = router.leaves[gid].max_pages
        want_pages = expand_block_table_rows(tables[gid][[0, 1, 2]], pages_per_block, width)
        assert pages[:b].tolist() == want_pages.tolist() and not pages[b:].any()
        assert seq_lens.tolist() == group.seq_lens.tolist() + [0] * (requests - b)
        rows = int(group.query_lens.sum())
        assert qo_indptr.tolist() == [0] + np.cumsum(group.query_lens).tolist() + [rows] * (requests - b)
        assert slots.tolist() == group.write_slots.tolist() + [0] * (tokens - rows)
    # the fresh arrays of the piecewise path are the same arrays, unpadded
    fresh = router.extend_host_arrays(plan, {})
    for gid, group in enumerate(plan.groups):
        rows = int(group.query_lens.sum())
        assert [a.shape[0] for a in fresh[4 * gid: 4 * gid + 4]] == [b, b, b + 1, rows]
        for a, padded in zip(fresh[4 * gid: 4 * gid + 4], out[4 * gid: 4 * gid + 4]):
            assert a.tolist() == padded[: a.shape[0]].tolist()


def test_whole_step_staging_sends_what_the_fill_wrote_into_buffers_that_never_move():
    i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
    whole = WholeStepBuffers(torch.device("cpu"),
                             layout=lambda t, r: [((t,), i64), ((r + 1,), i32), ((r, 3), i32), ((r,), np.dtype(bool))])
    rng = np.random.default_rng(6)
    sent = []
    for _ in range(2):
        values = [rng.integers(-100, 100, 8), rng.integers(-100, 100, 3), rng.integers(-100, 100, (2, 3)),
                  rng.integers(0, 2, 2).astype(bool)]

        def fill(host):
            for h, v in zip(host, values):
                h[...] = v

        dev = whole.stage((8, 2), fill)
        assert [t.tolist() for t in dev] == [v.tolist() for v in values]
        assert [t.dtype for t in dev] == [torch.int64, torch.int32, torch.int32, torch.bool]
        sent.append([t.data_ptr() for t in dev])
    assert sent[0] == sent[1]


@pytest.mark.parametrize("bs", [3, 4])  # rows past the 3 live ones are padding, or there are none
def test_decode_staging_writes_the_live_rows_and_pads_only_past_them(bs):
    rng = np.random.default_rng(7)
    specs = [FULL]
    tables = [(rng.permutation(4 * MAX_BLOCKS) + 1).astype(np.int32).reshape(4, MAX_BLOCKS)]
    params = [SamplingParams(max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9, min_tokens=4),
              SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.5)]
    reqs = []
    for i, p in enumerate(params):
        r = _request(i, 5, i, rng, num_computed=5 + i, num_generated=1 + i, group_lens=[5 + i])
        r.output = [int(x) for x in rng.integers(1, 500, r.num_generated - (i == 1))]  # request 1's token unread
        r.params = p
        reqs.append(r)
    plan = build_step_plan(ScheduledBatch([], reqs), specs, tables, BLOCK, eos_token_ids=(2,), banned_width=3)
    staging = DecodeStaging(4, 1, MAX_BLOCKS, 3, torch.device("cpu"))
    for host in staging._sets:  # poison both host sets and the device copy
        host.n64.fill(-99), host.n32.fill(-99), host.nf.fill(-99.0)
    staging.d64.fill_(-99), staging.d32.fill_(-99), staging.df.fill_(-99.0)
    staging.fill(plan, bs, prev_rows=[-1, 0, -1])
    staging.upload()
    pad = bs - 3
    assert staging.input_ids[:bs].tolist() == [reqs[0].output[-1], 0, reqs[2].output[-1]] + [0] * pad
    assert staging.positions[:bs].tolist() == [5, 6, 7] + [0] * pad
    assert staging.prev_rows[:bs].tolist() == [-1, 0, -1] + [-1] * pad
    s = staging.sampling_inputs
    assert s.seeds[:bs].tolist() == [0, 1, 2] + [0] * pad
    assert s.steps[:bs].tolist() == [6, 7, 8] + [0] * pad
    assert s.top_k[:bs].tolist() == [5, 0, 0] + [1] * pad
    assert s.temperature[:bs].tolist() == pytest.approx([0.7, 0.0, 1.0] + [0.0] * pad)
    assert s.top_p[:bs].tolist() == pytest.approx([0.9, 1.0, 0.5] + [1.0] * pad)
    assert s.banned[:bs].tolist() == [[2, -1, -1], [-1, -1, -1], [-1, -1, -1]] + [[-1, -1, -1]] * pad
    inputs = staging.decode_inputs(3)
    assert inputs.block_tables[0].tolist() == tables[0][:3].tolist()
    assert inputs.seq_lens[0].tolist() == [6, 7, 8]


def test_the_engine_validates_each_request_once_and_a_direct_add_still_refuses():
    llm = tscompile.LLM("llama-tiny", device="cpu", dtype=torch.float32, max_model_len=64, max_num_seqs=2,
                        enforce_eager=True)
    calls = []
    validate = llm.scheduler.validate
    llm.scheduler.validate = lambda prompt, params: (calls.append(len(prompt)), validate(prompt, params))[1]
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=2))
    assert calls == [3, 2] and [len(o.outputs[0].token_ids) for o in out] == [2, 2]
    sched = Scheduler([FULL], [16], block_size=BLOCK, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=8,
                      vocab_size=500)
    with pytest.raises(ValueError, match="tscompile: token id 900 outside the vocabulary"):
        sched.add(Request(0, [1, 900], SamplingParams(max_new_tokens=2), seed=0))
    assert not sched.waiting
