"""The dense-new-row extend kernel (custom_ops/triton_extend.py) against the torch oracle.

Without CUDA the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1), so the
unmarked tests keep shapes tiny and mostly use 16-row, 16-key tiles: a few tokens then span several
query blocks per request, unmasked bulk tiles, masked diagonal tiles and idle programs past the last
block. ``gpu``-marked tests use llama-8b-shaped bf16 data.

Most checks call ``dense_extend`` directly, without writing the new rows into the cache first, and
with those rows' cache slots poisoned with NaN: the kernel must read the new rows from the dense
k/v. The oracle is the torch impl of the op run on the same batch (it writes, then reads the cache).
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_pdl_graph_gives_the_plain_bits, dense_reference, random_paged_batch, run_attention
from tscompile.custom_ops import triton_attention as ta
from tscompile.custom_ops import triton_extend as te

SCALE = 0.25
SMALL_TILES = (16, 16, 4, 1)  # (rows, keys per tile, warps, stages)


def _to(batch, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _batch(q_lens, kv_lens, device, **kw):
    return _to(random_paged_batch(q_lens, kv_lens, **kw), device)


def _oracle(batch):
    ref, _, _ = run_attention(batch, "torch", decode=False, scale=SCALE)
    return ref


def _dense_extend(batch, *, config=SMALL_TILES, tail_rows=0, q=None, k=None, v=None):
    """Run ``dense_extend`` on ``batch`` with its new rows absent from the cache (NaN there) and the
    output poisoned with NaN. ``tail_rows`` appends rows past qo_indptr[-1] (a token bucket's padding)
    that belong to no request. Returns the output, tail included."""
    q = batch["q"] if q is None else q
    k = batch["k"] if k is None else k
    v = batch["v"] if v is None else v
    if tail_rows:
        g = torch.Generator().manual_seed(123)
        extra = lambda t: torch.randn(tail_rows, *t.shape[1:], generator=g).to(t)  # noqa: E731
        q, k, v = (torch.cat([t, extra(t)]) for t in (q, k, v))
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:])[batch["write_loc"]] = float("nan")
    out = torch.full_like(q, float("nan"))
    te.dense_extend(q, k, v, k_cache, v_cache, out, batch["page_table"], batch["seq_lens"], batch["qo_indptr"],
                    SCALE, config=config)
    return out


def _assert_matches_oracle(batch, out, atol=1e-5, rtol=1e-5):
    rows = batch["q"].shape[0]
    assert not out[:rows].isnan().any(), "some request row was never written"
    torch.testing.assert_close(out[:rows].float(), _oracle(batch).float(), atol=atol, rtol=rtol)


# -- correctness under the interpreter ------------------------------------------------------------


@pytest.mark.parametrize("page_size,group,head_dim", [
    (1, 1, 64), (16, 4, 128), (64, 8, 64), (16, 1, 128), (1, 8, 128), (64, 4, 64),
])
def test_fresh_prompts_match_torch(page_size, group, head_dim, device):
    # no cached prefix: every key comes from the dense k/v; q_len 33 spans three 16-row blocks
    batch = _batch([33, 1, 17, 5], [33, 1, 17, 5], device, page_size=page_size, num_kv_heads=2, group=group,
                   head_dim=head_dim, seed=page_size + group)
    _assert_matches_oracle(batch, _dense_extend(batch))


@pytest.mark.parametrize("page_size,group,head_dim", [(1, 4, 64), (16, 8, 128), (64, 1, 64)])
def test_cached_prefixes_match_torch(page_size, group, head_dim, device):
    # prefixes below, at and across tile and page boundaries, a prompt without one, and one request
    # with q_len 0 (a finished row of a mixed step) between others
    q_lens = [5, 1, 20, 3, 0, 9]
    kv_lens = [5 + 16, 1 + 40, 20 + 7, 3 + 70, 4, 9]
    batch = _batch(q_lens, kv_lens, device, page_size=page_size, num_kv_heads=2, group=group, head_dim=head_dim,
                   seed=7 + page_size)
    out = _dense_extend(batch)
    _assert_matches_oracle(batch, out)
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch, SCALE), atol=1e-5, rtol=1e-5)


def test_padded_requests_get_zeros_and_rows_past_the_batch_stay_untouched(device):
    # pad_rows: requests with q_len 1 and seq_len 0 (no key at all) must get exact zeros; tail rows
    # past qo_indptr[-1] belong to no request: no program may store there (they keep the NaN poison)
    batch = _batch([6, 19], [30, 19], device, page_size=16, num_kv_heads=2, group=4, head_dim=64, seed=3,
                   pad_rows=2)
    out = _dense_extend(batch, tail_rows=21)
    rows = batch["q"].shape[0]
    _assert_matches_oracle(batch, out)
    assert torch.equal(out[rows - 2:rows], torch.zeros_like(out[rows - 2:rows])), "padded requests not zero"
    assert out[rows:].isnan().all(), "a program wrote rows past the last request"


@pytest.mark.parametrize("with_prefix", [False, True])
def test_strided_kv_views_of_a_fused_projection(with_prefix, device):
    """q, k, v as column slices of one [T, (Hq + 2 Hkv) * D] tensor, as the model produces them."""
    q_lens = [7, 18]
    batch = _batch(q_lens, [q + (12 if with_prefix else 0) for q in q_lens], device, page_size=16,
                   num_kv_heads=2, group=4, head_dim=64, seed=12)
    t, hq, d = batch["q"].shape
    hkv = batch["k"].shape[1]
    fused = torch.cat([batch[n].reshape(t, -1) for n in ("q", "k", "v")], dim=1)
    q, k, v = (x.view(t, -1, d) for x in fused.split([hq * d, hkv * d, hkv * d], dim=1))
    assert not k.is_contiguous() and not v.is_contiguous()
    _assert_matches_oracle(batch, _dense_extend(batch, q=q, k=k, v=v))


def test_new_rows_are_rounded_through_the_cache_dtype(device):
    # float32 rows over a float16 cache: the oracle (and the paged kernel) read the new keys back
    # from the cache, rounded; reading them unrounded from k/v differs by ~1e-3. (Not bfloat16: the
    # interpreter truncates float32 -> bfloat16 instead of rounding to nearest as GPUs do.)
    batch = _batch([9, 20], [9, 25], device, page_size=16, num_kv_heads=2, group=2, head_dim=64, seed=5)
    batch["k_cache"], batch["v_cache"] = batch["k_cache"].half(), batch["v_cache"].half()
    _assert_matches_oracle(batch, _dense_extend(batch))


def test_bfloat16_matches_torch(device):
    batch = _batch([4, 1, 19], [4, 20, 30], device, page_size=16, num_kv_heads=2, group=4, head_dim=64,
                   dtype=torch.bfloat16, seed=6)
    _assert_matches_oracle(batch, _dense_extend(batch), atol=2e-2, rtol=2e-2)


def test_default_config_through_the_op(device, monkeypatch):
    """FAST_EXTEND_HEAD_DIMS routes the op's extend to dense_extend (default tiles); the op still
    writes the cache, and the result matches the torch impl."""
    calls = []
    real = te.dense_extend
    monkeypatch.setattr(ta, "_dense_extend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(ta, "FAST_EXTEND_HEAD_DIMS", frozenset({64}))
    batch = _batch([40, 3], [40, 20], device, page_size=16, num_kv_heads=2, group=4, head_dim=64, seed=8,
                   pad_rows=1)
    out, k_cache, v_cache = run_attention(batch, "triton", decode=False, scale=SCALE)
    ref, k_ref, v_ref = run_attention(batch, "torch", decode=False, scale=SCALE)
    assert calls, "the op did not run dense_extend"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("head_dim, dense", [(64, True), (128, True), (16, False)])
def test_the_op_runs_the_dense_kernel_only_for_the_head_dims_measured_faster(head_dim, dense, device, monkeypatch):
    """Measured faster on the H200: the dense kernel for head_dim 64 and 128, the
    paged one elsewhere; either way the op matches the torch impl."""
    assert ta.FAST_EXTEND_HEAD_DIMS == frozenset({64, 128})
    assert ta._dense_extend is te.dense_extend  # importing triton_extend registered it
    calls = []
    real = te.dense_extend
    monkeypatch.setattr(ta, "_dense_extend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    batch = _batch([3, 5], [3, 9], device, page_size=16, num_kv_heads=1, group=2, head_dim=head_dim, seed=head_dim)
    out, _, _ = run_attention(batch, "triton", decode=False, scale=SCALE)
    assert bool(calls) is dense
    torch.testing.assert_close(out, _oracle(batch), atol=1e-5, rtol=1e-5)


def test_the_launch_follows_the_step_shape(monkeypatch):
    """head_dim 64: small tiles for a short step, 4-warp 128-row tiles for a few long prompts (a
    whole-step graph pads one request to two), 8 warps for many prompts; head_dim 128: 8-warp
    128-row tiles for a few long prompts, the default tile otherwise."""
    monkeypatch.setattr(te, "EXTEND_CONFIG_OVERRIDES", {})  # the shipped tables, whatever the environment says
    assert [te.extend_shape(t, b) for t, b in [(512, 1), (1024, 1), (2048, 1), (2048, 2), (16384, 32), (4096, 8)]] \
        == ["short", "short", "long", "long", "many", "many"]
    pick = lambda d, t, b: te.extend_dense_config(d, 4, tokens=t, requests=b)  # noqa: E731  (GQA group 4)
    assert pick(64, 512, 1) == (64 // 4, 64, 4, 2)
    assert pick(64, 2048, 1) == (128 // 4, 64, 4, 3)
    assert pick(64, 16384, 32) == (128 // 4, 64, 8, 3)
    assert pick(128, 512, 1) == pick(128, 16384, 32) == (64 // 4, 64, 4, 2)
    assert pick(128, 2048, 1) == pick(128, 4096, 2) == (128 // 4, 64, 8, 3)
    assert te.extend_dense_config(64, 4, (16, 16, 4, 1), tokens=2048) == (4, 16, 4, 1)  # an explicit config wins


def test_the_config_override_replaces_one_head_dims_launch_for_every_shape(monkeypatch):
    """TSCOMPILE_EXTEND_CONFIG (parsed at import into EXTEND_CONFIG_OVERRIDES): head_dim 128's launch
    is the override at every step shape, head_dim 64 keeps its per-shape tables, an explicit config
    still wins; malformed entries are refused with the entry named."""
    overrides = te.parse_config_overrides(" 128:128,64,8,3 ; ")
    assert overrides == {128: (128, 64, 8, 3)}
    monkeypatch.setattr(te, "EXTEND_CONFIG_OVERRIDES", {})
    before_64 = [te.extend_dense_config(64, 4, tokens=t, requests=b) for t, b in [(512, 1), (2048, 1), (16384, 32)]]
    monkeypatch.setattr(te, "EXTEND_CONFIG_OVERRIDES", overrides)
    pick = lambda d, t, b: te.extend_dense_config(d, 4, tokens=t, requests=b)  # noqa: E731  (GQA group 4)
    assert pick(128, 512, 1) == pick(128, 2048, 1) == pick(128, 16384, 32) == (128 // 4, 64, 8, 3)
    assert [pick(64, t, b) for t, b in [(512, 1), (2048, 1), (16384, 32)]] == before_64
    assert te.extend_dense_config(128, 4, (16, 16, 4, 1), tokens=2048) == (4, 16, 4, 1)
    for bad, named in [("128", "'128'"), ("128:64,64,4", "'128:64,64,4'"), ("d:64,64,4,2", "'d:64,64,4,2'")]:
        with pytest.raises(ValueError, match=rf"^tscompile: TSCOMPILE_EXTEND_CONFIG entry {named}"):
            te.parse_config_overrides(bad)
    with pytest.raises(ValueError, match=r"^tscompile: dense extend config \(96, 64, 4, 2\) for head_dim 128"):
        te.parse_config_overrides("128:96,64,4,2")
    with pytest.raises(ValueError, match=r"^tscompile: TSCOMPILE_EXTEND_CONFIG entry '32:64,64,4,2': head_dim 32 does "
                                         r"not run the dense extend kernel"):
        te.parse_config_overrides("32:64,64,4,2")
    # float32 still halves the override's tiles to fit shared memory
    assert te.extend_dense_config(128, 4, four_byte=True, tokens=2048) == (64 // 4, 32, 8, 2)


@pytest.mark.parametrize("config", [(64, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3)])
def test_the_shipped_head_dim_64_configs_match_torch(config, device):
    """The tile shapes the launch picks for llama-1b's head_dim (GQA group 4), on a ragged batch
    with and without cached prefixes (one prompt longer than a 128-row tile's 32 positions)."""
    batch = _batch([40, 3, 9], [40, 20, 9], device, page_size=16, num_kv_heads=2, group=4, head_dim=64, seed=11)
    _assert_matches_oracle(batch, _dense_extend(batch, config=config))


@pytest.mark.parametrize("config", [(64, 64, 4, 2), (128, 64, 8, 3)])
def test_the_shipped_head_dim_128_configs_match_torch(config, device):
    """The tile shapes the launch picks for llama-8b's head_dim (GQA group 4): the default, and the
    128-row tile of a few long prompts; a ragged batch with and without cached prefixes."""
    batch = _batch([40, 3, 9], [40, 20, 9], device, page_size=16, num_kv_heads=1, group=4, head_dim=128, seed=13)
    _assert_matches_oracle(batch, _dense_extend(batch, config=config))


@pytest.mark.parametrize("config", [(24, 16, 4, 1), (16, 8, 4, 1), (16, 16, 3, 1), (16, 16, 4, 0)])
def test_bad_launch_configs_are_refused(config):
    batch = random_paged_batch([2], [2], page_size=16, num_kv_heads=1, group=1, head_dim=16)
    with pytest.raises(ValueError, match=r"^tscompile: dense extend config .* head_dim 16"):
        _dense_extend(batch, config=config)


def test_float32_configs_shrink_to_fit_shared_memory(monkeypatch):
    monkeypatch.setattr(te, "EXTEND_CONFIG_OVERRIDES", {})  # the shipped tables, whatever the environment says
    rows, block_n, warps, stages = te.EXTEND_DENSE_CONFIGS[128]
    assert te.extend_dense_config(128, 4, four_byte=False) == (rows // 4, block_n, warps, stages)
    assert te.extend_dense_config(128, 4, four_byte=True) == (rows // 8, block_n // 2, warps, min(stages, 2))
    assert te.extend_dense_config(64, 8, (16, 16, 4, 3), four_byte=True) == (2, 16, 4, 2)  # never below 16


# -- GPU: llama-8b shapes, bf16 -----------------------------------------------------------------


def _llama8b_batch(q_lens, kv_lens, seed):
    return _batch(q_lens, kv_lens, "cuda", page_size=16, num_kv_heads=8, group=4, head_dim=128,
                  dtype=torch.bfloat16, seed=seed, pad_rows=1)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,kv_lens", [
    ([2048], [2048]),  # one fresh prompt, the benchmark's shape
    ([300, 1, 129, 700, 64], [300, 1500, 129, 1000, 2000]),  # ragged, with and without prefixes
])
def test_gpu_new_kernel_matches_old_kernel_and_torch_llama8b(q_lens, kv_lens):
    batch = _llama8b_batch(q_lens, kv_lens, seed=len(q_lens))
    t = batch["q"].shape[0]
    new = _dense_extend(batch, config=None, tail_rows=5)  # the shipped default config for head_dim 128
    old, _, _ = run_attention(batch, "triton", decode=False, scale=SCALE)
    ref = _oracle(batch)
    assert not new[:t].isnan().any() and new[t:].isnan().all()
    torch.testing.assert_close(new[:t].float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(new[:t].float(), old.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_float32_fits_and_matches_torch(head_dim):
    """float32 tiles are twice the bytes: the default configs must shrink to fit shared memory."""
    batch = _batch([300, 1, 129, 64], [300, 1500, 129, 2000], "cuda", page_size=16, num_kv_heads=2, group=4,
                   head_dim=head_dim, seed=head_dim, pad_rows=1)
    _assert_matches_oracle(batch, _dense_extend(batch, config=None), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_new_kernel_replays_under_cuda_graph_with_other_lengths(monkeypatch):
    """The grid depends on shapes only: a graph captured on one batch replays right on another batch
    of the same token count and request count (different q_lens, prefixes, pages)."""
    monkeypatch.setattr(ta, "FAST_EXTEND_HEAD_DIMS", frozenset({128}))
    first = _llama8b_batch([200, 56], [200, 500], seed=1)  # same T, B and page-table width as second
    second = _llama8b_batch([17, 239], [500, 239], seed=2)
    live = {n: first[n].clone() for n in ("q", "k", "v", "page_table", "seq_lens", "qo_indptr", "write_loc")}
    pages = max(first["k_cache"].shape[0], second["k_cache"].shape[0])
    k_cache = torch.zeros(pages, *first["k_cache"].shape[1:], dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    out = torch.empty_like(live["q"])

    def call():
        torch.ops.tscompile.attention(live["q"], live["k"], live["v"], k_cache, v_cache, out, live["page_table"],
                                      live["seq_lens"], live["qo_indptr"], live["write_loc"], SCALE, False, "triton")

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for batch in (first, second):
        for n in live:
            assert batch[n].shape == live[n].shape, f"{n}: the replayed batch must keep the captured shapes"
            live[n].copy_(batch[n])
        k_cache[: batch["k_cache"].shape[0]].copy_(batch["k_cache"])
        v_cache[: batch["v_cache"].shape[0]].copy_(batch["v_cache"])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), _oracle(batch).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("flag", [False, True])
def test_the_extend_launch_asks_for_pdl_with_prefill_pdl(monkeypatch, flag, device):
    """TSCOMPILE_PREFILL_PDL: the launch asks ``pdl_launch`` for PDL (which grants it on a Hopper GPU,
    never under the interpreter); the output still matches the oracle."""
    monkeypatch.setattr(ta, "PREFILL_PDL", flag)
    asked, real = [], te.pdl_launch

    def recording(device, pdl):
        asked.append(pdl)
        return real(device, pdl)

    monkeypatch.setattr(te, "pdl_launch", recording)
    batch = _batch([5, 3], [9, 3], device, page_size=4, num_kv_heads=2, group=2, head_dim=16, seed=3)
    _assert_matches_oracle(batch, _dense_extend(batch))
    assert asked == [flag]


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,kv_lens", [([32], [32]), ([300, 1, 129, 64], [300, 1500, 129, 2000])])
def test_gpu_prefill_pdl_in_a_graph_after_a_writer_gives_the_plain_launchs_bits(q_lens, kv_lens, monkeypatch):
    """TSCOMPILE_PREFILL_PDL on Hopper: the extend kernel (writing the new K/V rows itself) captured in a
    CUDA graph right after a kernel that writes its q, k and v, replayed with new sources. A program
    that read them (or the cache) before its ``gdc_wait`` would see the previous replay's values; every
    replay gives the bits of the same graph captured without PDL, output and caches."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    assert ta.pdl_launch(torch.device("cuda"), True) == {"PDL": True, "launch_pdl": True}  # PDL really on
    batch = _llama8b_batch(q_lens, kv_lens, seed=len(q_lens))

    def extend(live):
        k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
        out = torch.empty_like(batch["q"])

        def op():
            te.dense_extend(live["q"], live["k"], live["v"], k_cache, v_cache, out, batch["page_table"],
                            batch["seq_lens"], batch["qo_indptr"], SCALE, write_loc=batch["write_loc"],
                            zero_padding=True)
        return op, (out, k_cache, v_cache), None

    sources = {n: batch[n].clone() for n in ("q", "k", "v")}
    for out, _, _ in assert_pdl_graph_gives_the_plain_bits(
            sources, lambda pdl: monkeypatch.setattr(ta, "PREFILL_PDL", pdl), extend):
        assert not out.isnan().any()  # padding rows zeroed too
