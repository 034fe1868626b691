"""The step plan: a pure function of the scheduled batch, checked on random batches against a
row-by-row restatement of its rules, and the narrowing's host rule against its device twin."""

import numpy as np
import pytest
import torch

from tscompile.custom_ops.narrow import kept_row_mask
from tscompile.forward_context import ForwardMode
from tscompile.kv_cache import CacheGroupSpec, kept_rows
from tscompile.runtime.scheduler import Request, Scheduler
from tscompile.runtime.step_builder import ScheduledBatch, build_step_plan
from tscompile.sampling import SamplingParams
from tscompile.step_plan import ON_DEVICE
from helpers import random_scheduled_batch

BLOCK = 4
MAX_BLOCKS = 16


def _specs(window):
    full = CacheGroupSpec("full", (0, 1), 2, 8)
    if window is None:
        return [full]
    return [full, CacheGroupSpec("tail", (2, 3), 2, 8, window=window)]


def random_batch(rng, specs):
    return random_scheduled_batch(rng, specs, max_blocks=MAX_BLOCKS, sampling=lambda rng: SamplingParams(
        max_new_tokens=8, temperature=float(rng.choice([0.0, 0.7])), top_k=int(rng.integers(0, 5))))


@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("seed", range(25))
def test_plan_matches_its_rules_row_by_row(window, seed):
    rng = np.random.default_rng(seed * 10 + (window or 0))
    specs = _specs(window)
    batch, tables = random_batch(rng, specs)
    plan = build_step_plan(batch, specs, tables, BLOCK)
    reqs = batch.requests
    assert plan.request_ids == tuple(r.rid for r in reqs) and plan.num_extends == len(batch.extends)
    assert plan.mode is batch.mode
    ids, pos, q, completes = [], [], [], []
    for r, n in batch.extends:
        ids += r.prompt[r.num_computed:r.num_computed + n]
        pos += list(range(r.num_computed, r.num_computed + n))
        q.append(n)
        completes.append(r.num_computed + n == len(r.prompt))
    for r in batch.decodes:
        ids.append(r.output[-1] if len(r.output) == r.num_generated else ON_DEVICE)
        pos.append(r.num_computed)
        q.append(1)
        completes.append(False)
    assert plan.input_ids.tolist() == ids and plan.positions.tolist() == pos
    assert plan.query_lens.tolist() == q and plan.completes.tolist() == completes
    assert plan.emits.tolist() == completes[: len(batch.extends)] + [True] * len(batch.decodes)
    assert plan.prefix_lens.tolist() == [r.num_computed for r in reqs]
    for g, (spec, group) in enumerate(zip(specs, plan.groups)):
        kept = [kept_rows(n, c, spec.window) for n, c in zip(q, completes)]
        assert group.query_lens.tolist() == kept
        assert group.seq_lens.tolist() == [r.group_lens[g] + k for r, k in zip(reqs, kept)]
        assert group.block_tables.tolist() == tables[g][[r.slot for r in reqs]].tolist()
        slots = []
        for b, (r, k) in enumerate(zip(reqs, kept)):
            for p in range(group.seq_lens[b] - k, group.seq_lens[b]):
                slots.append(int(tables[g][r.slot, p // BLOCK]) * BLOCK + p % BLOCK)
        assert group.write_slots.tolist() == slots
    last = plan.groups[-1]
    assert plan.logits_rows.tolist() == (np.cumsum(last.query_lens) - 1).tolist()
    s = plan.sampling
    assert s.seeds.tolist() == [r.seed for r in reqs]
    assert s.steps.tolist() == [len(r.prompt) + r.num_generated for r in reqs]
    assert s.top_k.tolist() == [r.params.top_k for r in reqs]
    assert s.all_greedy == all(r.params.greedy for r in reqs)


@pytest.mark.parametrize("seed", range(40))
def test_device_narrowing_mask_equals_the_host_rule_on_random_batches(seed):
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 9, (1,), generator=g))
    q_lens = torch.randint(1, 12, (b,), generator=g)
    q_lens[torch.rand(b, generator=g) < 0.3] = 1  # decode-like rows
    completes = torch.rand(b, generator=g) < 0.5
    window = int(torch.randint(1, 6, (1,), generator=g))
    pad = int(torch.randint(0, 5, (1,), generator=g))  # rows past the live ones pad a token bucket
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    mask = kept_row_mask(indptr, completes, window, int(q_lens.sum()) + pad)
    host = kept_rows(q_lens.numpy(), completes.numpy(), window)
    expect = torch.zeros_like(mask)
    for i in range(b):  # the last `host[i]` rows of each request
        expect[int(indptr[i + 1]) - int(host[i]): int(indptr[i + 1])] = True
    assert torch.equal(mask, expect)


def test_a_token_read_after_planning_replaces_its_on_device_id():
    sched = Scheduler(_specs(None), [64], block_size=BLOCK, max_num_seqs=4, max_model_len=32,
                      max_num_batched_tokens=16, vocab_size=500)
    r = Request(0, [5, 6, 7], SamplingParams(max_new_tokens=4), seed=1)
    sched.add(r)
    first = sched.schedule()
    sched.update(first)  # the prefill ran; its token is not read back yet
    plan = sched.schedule()
    assert plan.mode is ForwardMode.DECODE and plan.input_ids.tolist() == [ON_DEVICE]
    assert sched.resolve_host_tokens(plan) is plan  # nothing read yet: nothing to fill
    r.output.append(42)
    resolved = sched.resolve_host_tokens(plan)
    assert resolved.input_ids.tolist() == [42] and plan.input_ids.tolist() == [ON_DEVICE]


def test_update_advances_requests_by_the_plan_and_releases_the_finished():
    specs = _specs(2)
    sched = Scheduler(specs, [64, 64], block_size=BLOCK, max_num_seqs=4, max_model_len=32,
                      max_num_batched_tokens=5, vocab_size=500)
    a = Request(0, list(range(1, 8)), SamplingParams(max_new_tokens=1), seed=1)
    b = Request(1, [9, 9], SamplingParams(max_new_tokens=3), seed=2)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()  # a: a 5-token open chunk (budget 5); b waits for the next step
    assert plan.query_lens.tolist() == [5] and plan.groups[1].query_lens.tolist() == [1]
    assert sched.update(plan) == []
    assert a.num_computed == 5 and a.num_generated == 0 and a.group_lens == [5, 1]
    plan = sched.schedule()  # a completes (2 rows, both kept); b's whole prompt (2 rows, window 2)
    assert plan.completes.tolist() == [True, True] and plan.groups[1].query_lens.tolist() == [2, 2]
    assert sched.update(plan) == [a]  # a's one token sampled: finished, its blocks freed
    assert a.slot == -1 and b.group_lens == [2, 2] and b.num_generated == 1
    assert all(alloc.num_free == alloc.num_blocks - 1 - 2 for alloc in sched.allocators)  # b reserves 2 blocks


def test_upload_keeps_values_shapes_and_aligns_every_view():
    from tscompile.utils import UPLOAD_ALIGN_BYTES, upload

    rng = np.random.default_rng(0)
    arrays = [rng.integers(-5, 5, (3, 7)).astype(np.int32), np.arange(5, dtype=np.int32), np.zeros(0, dtype=np.int64),
              rng.integers(0, 9, 11).astype(np.int64), rng.random(3).astype(np.float32), np.array([True, False])]
    out = upload(arrays, torch.device("cpu"))
    for a, t in zip(arrays, out):
        assert tuple(t.shape) == a.shape and t.numpy().tolist() == a.tolist()
        # each view's offset in its upload is aligned (a CUDA allocation's base is 512-byte aligned)
        assert t.storage_offset() * t.element_size() % UPLOAD_ALIGN_BYTES == 0


def test_bucket_is_the_smallest_ladder_entry_that_holds_n():
    from tscompile.utils import bucket

    ladder = (1, 2, 4, 8, 24)
    assert [bucket(ladder, n) for n in (1, 2, 3, 8, 9, 24, 25)] == [1, 2, 4, 8, 24, 24, None]
