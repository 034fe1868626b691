"""The seed-000 decode contract on the torch backend tree (router + paged leaves)."""

import inspect
import logging

import pytest
import torch

from tscompile.attention import (
    AttentionBackend, CacheGroupRouter, CudaGraphSupport, ForwardMode, PagedAttentionBackend, create_attention_backend,
    resolve_cuda_graph_support,
)
from tscompile.attention.torch_backend import TorchAttentionBackend
from tscompile.kv_cache import CacheGroupSpec, KVCachePool, slot_from_block_table

SPECS = [CacheGroupSpec("full", (0, 1), 2, 16), CacheGroupSpec("tail", (2,), 2, 16, window=3)]
BUNDLE = ("extend_seq_lens", "extend_seq_lens_cpu", "extend_prefix_lens", "extend_prefix_lens_cpu", "extend_with_prefix")


def make_tree(max_decode_bs=8, page_size=4, pages_per_block=2, num_pages=256, max_model_len=64, specs=SPECS):
    backend = create_attention_backend("torch", specs, max_model_len=max_model_len, page_size=page_size, device="cpu")
    pool = KVCachePool.allocate(specs, [num_pages] * len(specs), page_size=page_size,
                                pages_per_block=pages_per_block, dtype=torch.float32, device="cpu")
    backend.set_cache_pool(pool)
    backend.init_cuda_graph_state(max_decode_bs)
    return backend, pool


def live_inputs(n, seed=0, max_blocks=8, block_size=8):
    g = torch.Generator().manual_seed(seed)
    tables = {gid: (torch.randperm(120, generator=g)[: n * max_blocks] + 1).view(n, max_blocks).to(torch.int32)
              for gid in range(2)}
    seq_lens = torch.randint(1, max_blocks * block_size + 1, (n,), generator=g).to(torch.int32)
    tail = torch.clamp(seq_lens - 2, min=1).to(torch.int32)
    return tables, seq_lens, tail


def refresh(backend, bs, actual_bs, tables, seq_lens, tail):
    backend.refresh_decode_metadata(bs, actual_bs, torch.arange(actual_bs), seq_lens, forward_mode=ForwardMode.DECODE,
                                    block_tables=tables, num_extends=0, for_graph_replay=bs != actual_bs,
                                    group_seq_lens={1: tail})


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
    placeholder = {gid: torch.zeros(4, 8, dtype=torch.int32) for gid in range(2)}
    backend.init_forward_metadata_capture_cuda_graph(4, torch.zeros(4, dtype=torch.int64),
                                                     torch.ones(4, dtype=torch.int32), block_tables=placeholder,
                                                     group_seq_lens={1: torch.ones(4, dtype=torch.int32)})
    for pt, sl, wl in snapshot(backend, 4):
        assert not pt.any() and not sl.any() and not wl.any()


def _extend_kwargs(mode):
    e = torch.zeros(0, dtype=torch.int32)
    return dict(forward_mode=mode, req_pool_indices=torch.zeros(1, dtype=torch.int64),
                seq_lens=torch.ones(1, dtype=torch.int32), seq_lens_cpu=torch.ones(1, dtype=torch.int32),
                block_tables={0: torch.ones(1, 8, dtype=torch.int32), 1: torch.ones(1, 8, dtype=torch.int32)},
                num_extends=0, extend_seq_lens=e, extend_seq_lens_cpu=e, extend_prefix_lens=e,
                extend_prefix_lens_cpu=e, extend_with_prefix=False, extend_prompt_lens_cpu=e,
                group_seq_lens_cpu={1: torch.ones(1, dtype=torch.int32)})


def test_decode_call_to_init_forward_metadata_raises():
    backend, _ = make_tree()
    with pytest.raises(ValueError, match="tscompile: init_forward_metadata does not serve DECODE"):
        backend.init_forward_metadata(**_extend_kwargs(ForwardMode.DECODE))
    leaf_kwargs = {k: v for k, v in _extend_kwargs(ForwardMode.DECODE).items()
                   if k not in ("extend_prompt_lens_cpu", "group_seq_lens_cpu")}
    with pytest.raises(ValueError, match="does not serve DECODE"):
        backend.leaves[0].init_forward_metadata(**leaf_kwargs, page_table=torch.zeros(1, 16, dtype=torch.int32),
                                                qo_indptr=torch.tensor([0, 1], dtype=torch.int32))
    backend.init_forward_metadata(**_extend_kwargs(ForwardMode.MIXED))  # a one-row mixed step is fine


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


def test_no_extend_bundle_parameter_has_a_default():
    classes = _all_backend_classes()
    assert {CacheGroupRouter, PagedAttentionBackend, TorchAttentionBackend} <= set(classes)
    for cls in classes:
        sig = inspect.signature(cls.init_forward_metadata)
        for name in BUNDLE:
            p = sig.parameters[name]
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, (cls, name)
            assert p.default is inspect.Parameter.empty, f"{cls.__name__}.{name} has a default"
        refresh_sig = inspect.signature(cls.refresh_decode_metadata)
        for name in ("forward_mode", "block_tables", "num_extends", "for_graph_replay"):
            assert refresh_sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
            assert refresh_sig.parameters[name].default is inspect.Parameter.empty


class _NoPrefillGraphLeaf(TorchAttentionBackend):
    cuda_graph_support = CudaGraphSupport(decode_graph=True, prefill_graph=False)


class _NoGraphLeaf(TorchAttentionBackend):
    cuda_graph_support = CudaGraphSupport(decode_graph=False, prefill_graph=False)


def test_support_resolution_logs_culprits_and_downgrades(caplog):
    leaves = [_NoPrefillGraphLeaf(0, max_pages=4, device="cpu"), _NoGraphLeaf(1, max_pages=4, device="cpu")]
    router = CacheGroupRouter(SPECS, leaves, max_model_len=16, device="cpu")
    with caplog.at_level(logging.WARNING, logger="tscompile"):
        resolved = resolve_cuda_graph_support(router)
    assert resolved.support == CudaGraphSupport(decode_graph=False, prefill_graph=False)
    assert resolved.decode_culprits == ("_NoGraphLeaf",)
    assert resolved.prefill_culprits == ("_NoPrefillGraphLeaf", "_NoGraphLeaf")
    text = caplog.text
    assert "decode CUDA graph disabled by _NoGraphLeaf" in text
    assert "prefill CUDA graph disabled by _NoPrefillGraphLeaf" in text
    clean, _ = make_tree()
    assert resolve_cuda_graph_support(clean).support == CudaGraphSupport(True, True)


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
    with pytest.raises(ValueError, match=r"block_tables omits cache groups \[1\]"):
        refresh(backend, 2, 2, {0: tables[0]}, seq_lens, tail)


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
