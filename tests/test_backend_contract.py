"""The decode contract on the torch backend tree (router + paged leaves): one refresh path,
padding to the null page, pointer-stable views, the inherited idle refresh, graded graph support,
validate-then-publish rebind."""

import inspect
import logging

import numpy as np
import pytest
import torch

from tscompile.attention import (
    AttentionBackend, AttentionRouter, CudaGraphSupport, DecodeInputs, PagedAttentionBackend,
    create_attention_router, resolve_cuda_graph_support,
)
from tscompile.attention.torch_backend import TorchAttentionBackend
from tscompile.forward_context import ForwardMode
from tscompile.kv_cache import CacheGroupSpec, KVCachePool, slot_from_block_table
from tscompile.runtime.scheduler import Request
from tscompile.runtime.step_builder import ScheduledBatch, build_step_plan
from tscompile.sampling import SamplingParams

SPECS = [CacheGroupSpec("full", (0, 1), 2, 16), CacheGroupSpec("tail", (2,), 2, 16, window=3)]


def make_tree(max_decode_bs=8, page_size=4, pages_per_block=2, num_pages=256, max_model_len=64, specs=SPECS):
    backend = create_attention_router("torch", specs, max_model_len=max_model_len, page_size=page_size,
                                      pages_per_block=pages_per_block, device="cpu")
    pool = KVCachePool.allocate(specs, [num_pages] * len(specs), page_size=page_size,
                                pages_per_block=pages_per_block, dtype=torch.float32, device="cpu")
    backend.set_cache_pool(pool)
    backend.allocate_decode_buffers(max_decode_bs)
    return backend, pool


def live_inputs(n, seed=0, max_blocks=8, block_size=8):
    g = torch.Generator().manual_seed(seed)
    tables = {gid: (torch.randperm(120, generator=g)[: n * max_blocks] + 1).view(n, max_blocks).to(torch.int32)
              for gid in range(2)}
    seq_lens = torch.randint(1, max_blocks * block_size + 1, (n,), generator=g).to(torch.int32)
    tail = torch.clamp(seq_lens - 2, min=1).to(torch.int32)
    return tables, seq_lens, tail


def refresh(backend, bs, actual_bs, tables, seq_lens, tail):
    inputs = DecodeInputs(tuple(tables[g][:actual_bs] for g in sorted(tables)), (seq_lens[:actual_bs], tail[:actual_bs]))
    backend.refresh_decode_metadata(bs, inputs)


def snapshot(backend, bs):
    return [(leaf.page_table_buf[:bs].clone(), leaf.seq_lens_buf[:bs].clone(),
             backend.write_locations(SPECS[gid].layer_ids[0], ForwardMode.DECODE).clone())
            for gid, leaf in enumerate(backend.leaves)]


def test_padded_requests_map_to_page_zero():
    backend, _ = make_tree()
    tables, seq_lens, tail = live_inputs(3)
    for leaf in backend.leaves:
        leaf.page_table_buf.fill_(-5)
    refresh(backend, 7, 3, tables, seq_lens, tail)
    for leaf, (pt, sl, wl) in zip(backend.leaves, snapshot(backend, 7)):
        assert torch.equal(pt[3:], torch.zeros_like(pt[3:]))
        assert sl[3:].tolist() == [0] * 4 and wl[3:].tolist() == [0] * 4
        assert (pt[:3] > 0).any()


def test_eager_and_padded_refresh_leave_identical_live_rows():
    backend, _ = make_tree()
    tables, seq_lens, tail = live_inputs(3, seed=2)
    refresh(backend, 3, 3, tables, seq_lens, tail)
    eager = snapshot(backend, 3)
    for leaf in backend.leaves:  # poison the shared buffers between the two refreshes
        leaf.page_table_buf.fill_(-9)
        leaf.seq_lens_buf.fill_(-9)
    refresh(backend, 8, 3, tables, seq_lens, tail)
    padded = snapshot(backend, 8)
    for (pe, se, we), (pp, sp, wp) in zip(eager, padded):
        assert torch.equal(pe, pp[:3]) and torch.equal(se, sp[:3]) and torch.equal(we, wp[:3])
    # and the live write slots are the scheduler's raw-table slots
    assert eager[0][2].tolist() == slot_from_block_table(tables[0], seq_lens - 1, 8).tolist()
    assert eager[1][2].tolist() == slot_from_block_table(tables[1], tail - 1, 8).tolist()


def test_views_are_pointer_stable_per_bs_including_above_ladder():
    backend, _ = make_tree(max_decode_bs=8)
    tables, seq_lens, tail = live_inputs(6, seed=3)
    refresh(backend, 6, 6, tables, seq_lens, tail)  # a bs no ladder captured: views built lazily
    first = [leaf.forward_decode_metadata for leaf in backend.leaves]
    ptrs = [(m.page_table.data_ptr(), m.seq_lens.data_ptr(), m.qo_indptr.data_ptr()) for m in first]
    wl_ptr = backend.write_locations(0, ForwardMode.DECODE).data_ptr()
    tables2, seq_lens2, tail2 = live_inputs(6, seed=4)
    refresh(backend, 6, 6, tables2, seq_lens2, tail2)
    second = [leaf.forward_decode_metadata for leaf in backend.leaves]
    assert all(a is b for a, b in zip(first, second))
    assert ptrs == [(m.page_table.data_ptr(), m.seq_lens.data_ptr(), m.qo_indptr.data_ptr()) for m in second]
    assert backend.write_locations(0, ForwardMode.DECODE).data_ptr() == wl_ptr
    assert second[0].seq_lens.tolist() == seq_lens2.tolist()


def test_capture_is_inherited_idle_refresh():
    backend, _ = make_tree()
    tables, seq_lens, tail = live_inputs(4, seed=5)
    refresh(backend, 4, 4, tables, seq_lens, tail)
    backend.refresh_idle_decode_metadata(4)
    for pt, sl, wl in snapshot(backend, 4):
        assert not pt.any() and not sl.any() and not wl.any()
    # no metadata method of its own: the idle refresh is the router's one refresh
    assert "refresh_idle_decode_metadata" not in vars(PagedAttentionBackend)


def _plan(extends, decodes, *, block_size=8, max_blocks=8, seed=0):
    """A step plan over fake requests that own distinct blocks: ``extends`` as (prompt_len, computed,
    chunk), ``decodes`` as (prompt_len, generated)."""
    rng = np.random.default_rng(seed)
    n = len(extends) + len(decodes)
    tables = [np.zeros((n, max_blocks), dtype=np.int32) for _ in SPECS]
    for t in tables:
        t[:] = (rng.permutation(n * max_blocks) + 1).reshape(n, max_blocks)
    reqs, ext = [], []
    for i, (plen, computed, chunk) in enumerate(extends):
        r = Request(i, list(range(1, plen + 1)), SamplingParams(max_new_tokens=4), seed=i, slot=i,
                    num_computed=computed, group_lens=[computed, min(computed, 2)])
        ext.append((r, chunk))
    for j, (plen, gen) in enumerate(decodes):
        i = len(extends) + j
        r = Request(i, list(range(1, plen + 1)), SamplingParams(max_new_tokens=8), seed=i, slot=i,
                    output=[7] * gen, num_generated=gen, num_computed=plen + gen - 1,
                    group_lens=[plen + gen - 1, 3 + gen - 1])
        reqs.append(r)
    return build_step_plan(ScheduledBatch(ext, reqs), SPECS, tables, block_size)


def test_decode_call_to_init_forward_metadata_raises():
    backend, _ = make_tree()
    with pytest.raises(ValueError, match="tscompile: init_forward_metadata does not serve DECODE"):
        backend.init_forward_metadata(_plan([], [(5, 2)]), {})
    backend.init_forward_metadata(_plan([(3, 0, 3)], [(5, 2)]), {})  # a mixed step is fine


def test_extend_metadata_is_the_plans_host_facts_on_the_device():
    backend, _ = make_tree()
    plan = _plan([(9, 0, 9), (12, 4, 5), (6, 2, 3)], [(5, 2), (7, 1)], seed=3)
    backend.init_forward_metadata(plan, {0: 32})
    for gid, (leaf, group) in enumerate(zip(backend.leaves, plan.groups)):
        meta = leaf.metadata(ForwardMode.EXTEND)
        assert meta.qo_indptr.tolist() == group.qo_indptr.tolist()
        assert meta.seq_lens.tolist() == group.seq_lens.tolist()
        locs = backend.write_locations(SPECS[gid].layer_ids[0], ForwardMode.EXTEND)
        live = group.num_rows
        assert locs[:live].tolist() == group.write_slots.tolist()
        if gid == 0:  # padded to the bucket: the padded rows write slot 0, in the null page
            assert locs.shape[0] == 32 and not locs[live:].any()
        # the slots are the raw-table slots of each kept row's position
        req = np.repeat(np.arange(plan.num_requests), group.query_lens)
        raw = [int(group.block_tables[b, p // 8]) * 8 + int(p) % 8 for b, p in zip(req, group.positions)]
        assert group.write_slots.tolist() == raw


def _all_backend_classes():
    seen, todo = [], [AttentionBackend]
    import tscompile.attention.torch_backend  # noqa: F401
    try:
        import tscompile.attention.triton_backend  # noqa: F401
    except ImportError:
        pass
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def test_no_metadata_parameter_has_a_default():
    """No default may hide a missing input: every metadata method takes its bundle explicitly."""
    classes = _all_backend_classes()
    assert {AttentionRouter, PagedAttentionBackend, TorchAttentionBackend} <= set(classes)
    checked = 0
    for cls in classes:
        for name in ("init_forward_metadata", "refresh_decode_metadata"):
            if name not in vars(cls):
                continue
            for p in inspect.signature(getattr(cls, name)).parameters.values():
                assert p.default is inspect.Parameter.empty, f"{cls.__name__}.{name}({p.name}) has a default"
            checked += 1
    assert checked >= 4


class _NoPrefillGraphLeaf(TorchAttentionBackend):
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=False)


class _NoGraphLeaf(TorchAttentionBackend):
    cuda_graph_support = CudaGraphSupport(decode_graph=False, prefill_graph=False)


def test_support_resolution_logs_culprits_and_downgrades(caplog):
    leaves = [_NoPrefillGraphLeaf(0, max_pages=4, device="cpu"), _NoGraphLeaf(1, max_pages=4, device="cpu")]
    router = AttentionRouter(SPECS, leaves, max_blocks=4, device="cpu")
    with caplog.at_level(logging.WARNING, logger="tscompile"):
        resolved = resolve_cuda_graph_support(router)
    assert resolved.support == CudaGraphSupport(decode_graph=False, prefill_graph=False)
    assert resolved.decode_culprits == ("_NoGraphLeaf",)
    assert resolved.prefill_culprits == ("_NoPrefillGraphLeaf", "_NoGraphLeaf")
    text = caplog.text
    assert "decode CUDA graph disabled by _NoGraphLeaf" in text
    assert "prefill CUDA graph disabled by _NoPrefillGraphLeaf" in text
    clean, _ = make_tree()
    assert resolve_cuda_graph_support(clean).support == CudaGraphSupport(True, True, whole_prefill_graph=False)


def test_whole_step_prefill_falls_back_to_piecewise_for_a_backend_with_a_host_driven_extend(caplog):
    """The torch backend's extend reads its lengths on the host (measured on the H200: capturing it
    failed with a CPU->CUDA copy); Triton's reads device tensors only."""
    from tscompile.attention.triton_backend import TritonAttentionBackend
    from tscompile.runtime.model_runner import whole_step_prefill_possible
    specs = [CacheGroupSpec("full", (0, 1, 2), 2, 16)]  # no narrowing (that falls back for its own reason)
    for leaf_cls, possible in ((TorchAttentionBackend, False), (TritonAttentionBackend, True)):
        router = AttentionRouter(specs, [leaf_cls(0, max_pages=4, device="cpu")], max_blocks=4, device="cpu")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tscompile"):
            resolved = resolve_cuda_graph_support(router)
            assert whole_step_prefill_possible(router, resolved) is possible
        assert resolved.support.prefill_graph  # the piecewise graphs stay on either way
        assert resolved.whole_prefill_culprits == (() if possible else ("TorchAttentionBackend",))
        assert ("TorchAttentionBackend cannot launch its extend attention inside a captured graph" in caplog.text) \
            is not possible
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tscompile"):  # the default "auto" says it without a warning
            assert whole_step_prefill_possible(router, resolved, asked=False) is possible
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert ("prefill_graph_mode='auto' runs piecewise prefill graphs" in caplog.text) is not possible


def test_rejected_rebind_changes_nothing():
    backend, pool = make_tree()
    tables, seq_lens, tail = live_inputs(3, seed=6)
    refresh(backend, 3, 3, tables, seq_lens, tail)
    before = snapshot(backend, 3)
    decode_meta = [leaf.forward_decode_metadata for leaf in backend.leaves]
    bad = KVCachePool.allocate(SPECS, [64, 64], page_size=8, pages_per_block=1, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="tscompile: rebind changes group 0 layout"):
        backend.set_cache_pool(bad)
    wrong_heads = [CacheGroupSpec("full", (0, 1), 4, 16), SPECS[1]]
    bad2 = KVCachePool.allocate(wrong_heads, [64, 64], page_size=4, pages_per_block=2, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="tscompile: pool group 0 geometry"):
        backend.set_cache_pool(bad2)
    assert backend.pool is pool
    assert [leaf.forward_decode_metadata for leaf in backend.leaves] == decode_meta
    assert all(leaf.page_size == 4 for leaf in backend.leaves)
    for (a, b, c), (x, y, z) in zip(before, snapshot(backend, 3)):
        assert torch.equal(a, x) and torch.equal(b, y) and torch.equal(c, z)
    bigger = KVCachePool.allocate(SPECS, [128, 128], page_size=4, pages_per_block=2, dtype=torch.float32, device="cpu")
    backend.set_cache_pool(bigger)  # page count may change
    assert backend.pool is bigger


def test_live_delivery_must_cover_every_group():
    backend, _ = make_tree()
    tables, seq_lens, tail = live_inputs(2)
    with pytest.raises(ValueError, match=r"decode inputs for 1 cache groups, the model has 2"):
        backend.refresh_decode_metadata(2, DecodeInputs((tables[0],), (seq_lens,)))


def test_pointer_guard_names_a_rebound_metadata_tensor():
    from tscompile.attention import AttentionMetadata
    from tscompile.runtime import pointer_guard

    backend, _ = make_tree()
    tables, seq_lens, tail = live_inputs(3, seed=8)
    refresh(backend, 4, 3, tables, seq_lens, tail)

    def roots():
        return {f"leaves[{g}].forward_decode_metadata": leaf.forward_decode_metadata
                for g, leaf in enumerate(backend.leaves)} | {"router.decode_write_locations": backend.decode_write_locations}

    snap = pointer_guard.snapshot(roots())
    assert "leaves[1].forward_decode_metadata.page_table" in snap and "router.decode_write_locations[0]" in snap
    tables2, seq_lens2, tail2 = live_inputs(3, seed=9)
    refresh(backend, 4, 3, tables2, seq_lens2, tail2)  # an in-place refresh keeps every address
    pointer_guard.verify(snap, roots())
    leaf = backend.leaves[1]
    views = leaf._decode_views_by_bs[4]
    leaf._decode_views_by_bs[4] = AttentionMetadata(views.page_table, views.seq_lens.clone(), views.qo_indptr, True)
    refresh(backend, 4, 3, tables2, seq_lens2, tail2)
    with pytest.raises(RuntimeError, match=r"rebound since capture.*leaves\[1\]\.forward_decode_metadata\.seq_lens"):
        pointer_guard.verify(snap, roots())
