"""Verify windows through the attention router: buffers per (bs, N), the refresh's write slots
and lengths, and attention of the torch and Triton leaves over a NaN-poisoned pool against a
float64 dense oracle. The FlashInfer leaf runs the same check on a GPU (``-m gpu``)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from tscompile.attention import DecodeInputs, create_attention_router
from tscompile.forward_context import ForwardMode
from tscompile.kv_cache import CacheGroupSpec, KVCachePool

SCALE = 0.3


def _setup(name, *, device, page_size=4, pages_per_block=2, hkv=2, group=2, head_dim=16, max_bs=4, max_width=4,
           dtype=torch.float32, num_blocks=40, max_model_len=96):
    spec = CacheGroupSpec("full", (0,), hkv, head_dim)
    router = create_attention_router(name, [spec], max_model_len=max_model_len, page_size=page_size,
                                     pages_per_block=pages_per_block, device=device)
    pool = KVCachePool.allocate([spec], [num_blocks * pages_per_block], page_size=page_size,
                                pages_per_block=pages_per_block, dtype=dtype, device=device)
    pool.fill_(float("nan"))
    router.set_cache_pool(pool)
    router.bind_query_heads(hkv * group)
    router.allocate_decode_buffers(max_bs, max_width)
    return router, pool


def _window_step(router, pool, kv_lens, width, bs, *, seed, device, forward=None):
    """One verify step of ``len(kv_lens)`` live requests (padded to ``bs``): random prefixes written
    into the pool, random window rows. Returns (out, dense oracle [n * N, Hq, D] float64, write
    slots, block tables). ``forward(q, k, v, out)``: runs the layer instead of ``router.forward``."""
    g = torch.Generator().manual_seed(seed)
    geo = pool.geometry(0)
    block = geo.page_size * geo.pages_per_block
    hkv, d, hq = geo.num_kv_heads, geo.head_dim, router.leaves[0].num_q_heads
    n = len(kv_lens)
    tables = np.zeros((n, router.max_blocks), dtype=np.int32)
    perm = (torch.randperm(k_cache_blocks(pool) - 1, generator=g) + 1).tolist()
    k_cache, v_cache = pool.layer_cache(0)
    dense = []
    for b, kv in enumerate(kv_lens):
        used = -(-kv // block)
        tables[b, :used] = [perm.pop() for _ in range(used)]
        slots = [int(tables[b, p // block]) * block + p % block for p in range(kv - width)]
        keys = torch.randn(kv, hkv, d, generator=g, dtype=torch.float64)
        vals = torch.randn(kv, hkv, d, generator=g, dtype=torch.float64)
        if slots:
            k_cache.view(-1, hkv, d)[slots] = keys[: kv - width].to(geo.dtype).to(device)
            v_cache.view(-1, hkv, d)[slots] = vals[: kv - width].to(geo.dtype).to(device)
        dense.append((keys, vals))
    lens = np.asarray(kv_lens, dtype=np.int32)
    inputs = DecodeInputs((torch.from_numpy(tables).to(device),), (torch.from_numpy(lens).to(device),),
                          (tables,), (lens,))  # width 1 here: with_width below sets N
    router.refresh_decode_metadata(bs, inputs.with_width(width))
    rows = bs * width
    q = torch.randn(rows, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(rows, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(rows, hkv, d, generator=g, dtype=torch.float64)
    for b, (keys, vals) in enumerate(dense):  # the window's own K/V are this step's new rows
        keys[-width:], vals[-width:] = k[b * width:(b + 1) * width], v[b * width:(b + 1) * width]
    out = torch.full((rows, hq, d), float("nan"), dtype=geo.dtype, device=device)
    args = [t.to(geo.dtype).to(device) for t in (q, k, v)]
    if forward is None:
        router.forward(0, ForwardMode.DECODE, *args[:3], k_cache, v_cache, out, SCALE)
    else:
        forward(*args, out)
    ref = []
    for b, (keys, vals) in enumerate(dense):
        kv = kv_lens[b]
        s = torch.einsum("thd,shd->hts", q[b * width:(b + 1) * width],
                         keys.repeat_interleave(hq // hkv, 1)) * SCALE
        q_pos = torch.arange(kv - width, kv)
        s = s.masked_fill(torch.arange(kv)[None, :] > q_pos[:, None], float("-inf"))
        ref.append(torch.einsum("hts,shd->thd", torch.softmax(s, -1), vals.repeat_interleave(hq // hkv, 1)))
    return out, torch.cat(ref), router.decode_write_locations[0], tables


def k_cache_blocks(pool) -> int:
    """The pool's blocks (pages / pages per block): requests draw distinct ones from [1, that)."""
    geo = pool.geometry(0)
    return pool.layer_cache(0)[0].shape[0] // geo.pages_per_block


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("width,kv_lens,bs", [(1, [5, 30], 3), (3, [3, 17, 9], 4), (4, [40], 2)])
def test_router_window_attention_matches_dense(name, width, kv_lens, bs, device):
    router, pool = _setup(name, device=device)
    out, ref, write_locs, tables = _window_step(router, pool, kv_lens, width, bs, seed=width * 5 + bs, device=device)
    n = len(kv_lens)
    assert write_locs.shape == (bs * width,)
    block = 8
    for b, kv in enumerate(kv_lens):  # the window's slots, straight from the block table
        expect = [int(tables[b, p // block]) * block + p % block for p in range(kv - width, kv)]
        assert write_locs[b * width:(b + 1) * width].tolist() == expect
    assert write_locs[n * width:].tolist() == [0] * ((bs - n) * width)
    live = out[: n * width].double().cpu()
    assert not live.isnan().any()
    torch.testing.assert_close(live, ref, atol=1e-5, rtol=1e-5)
    meta = router.metadata(0, ForwardMode.DECODE)
    assert meta.qo_indptr.tolist() == [i * width for i in range(bs + 1)] and meta.decode


def test_router_views_are_pointer_stable_per_bs_and_width():
    router, _ = _setup("torch", device="cpu")
    leaf = router.leaves[0]
    seen = {}
    for bs, width in [(2, 1), (2, 3), (4, 3), (2, 1), (2, 3), (4, 3)]:
        router.refresh_idle_decode_metadata(bs, width)
        meta = leaf.metadata(ForwardMode.DECODE)
        key = (meta.page_table.data_ptr(), meta.qo_indptr.data_ptr(), router.decode_write_locations[0].data_ptr(),
               router.decode_write_locations[0].shape[0])
        assert seen.setdefault((bs, width), key) == key
        assert router.decode_write_locations[0].tolist() == [0] * (bs * width)  # idle: every row padding
    with pytest.raises(ValueError, match="^tscompile: decode width 5 outside \\[1, max_width=4\\]"):
        router.refresh_idle_decode_metadata(1, 5)


needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("width,page_size,group", [(2, 16, 4), (4, 1, 2), (5, 16, 8)])
def test_gpu_flashinfer_window_matches_dense(width, page_size, group):
    router, pool = _setup("flashinfer", device="cuda", page_size=page_size, pages_per_block=1, hkv=2, group=group,
                          head_dim=64, max_bs=8, max_width=5, dtype=torch.bfloat16, num_blocks=3000 // page_size,
                          max_model_len=2048)
    kv_lens = [width, 17, 700, 64, 1000]
    out, ref, _, _ = _window_step(router, pool, kv_lens, width, 8, seed=width, device="cuda")
    live = out[: len(kv_lens) * width].double().cpu()
    assert not live.isnan().any(), "FlashInfer read a poisoned slot in a live row"
    torch.testing.assert_close(live, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_gpu_window_graph_replay_matches_dense(name):
    """Capture a (bs, N) window step over the idle refresh (every row padding), then refresh real
    batches of other lengths in place and replay: each replay attends over its own batch."""
    if name == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs flashinfer")
    width, bs = 3, 4
    router, pool = _setup(name, device="cuda", page_size=16, pages_per_block=1, hkv=2, group=4, head_dim=64,
                          max_bs=bs, max_width=width, dtype=torch.bfloat16, num_blocks=200, max_model_len=1024)
    hq = router.leaves[0].num_q_heads
    static = {name: torch.zeros(bs * width, h, 64, dtype=torch.bfloat16, device="cuda")
              for name, h in (("q", hq), ("k", 2), ("v", 2), ("out", hq))}
    kc, vc = pool.layer_cache(0)

    def step():
        router.forward(0, ForwardMode.DECODE, static["q"], static["k"], static["v"], kc, vc, static["out"], SCALE)

    router.refresh_idle_decode_metadata(bs, width)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()

    def replay(q, k, v, out):
        for key, t in (("q", q), ("k", k), ("v", v)):
            static[key].copy_(t)
        static["out"].fill_(float("nan"))
        graph.replay()
        out.copy_(static["out"])

    for seed, kv_lens in ((3, [30, 300, 5]), (4, [900, 3, 64, 17])):
        out, ref, _, _ = _window_step(router, pool, kv_lens, width, bs, seed=seed, device="cuda", forward=replay)
        live = out[: len(kv_lens) * width].double().cpu()
        assert not live.isnan().any()
        torch.testing.assert_close(live, ref, atol=2e-2, rtol=2e-2)
