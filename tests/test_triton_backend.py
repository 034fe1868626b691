"""The Triton attention backend against the torch oracle.

Without CUDA the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1), so the
unmarked tests keep shapes small; they use the ``device`` fixture and run on the GPU where there is
one. ``gpu``-marked tests use realistic sizes in bfloat16 and float32 (skipped without CUDA).

Every attention check builds fresh inputs, poisons ``out`` with NaN (``run_attention``) and compares
the output and both caches to the torch impl run on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

import tscompile
from helpers import LaunchSpy, dense_reference, random_paged_batch, run_attention, ids
from tscompile.attention import leaf_class
from tscompile.attention.triton_backend import TritonAttentionBackend
from tscompile.custom_ops import triton_attention as ta
from tscompile.custom_ops.metadata import torch_refresh
from tscompile.custom_ops.triton_metadata import triton_refresh
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.spec import CacheGroupSpec

SCALE = 0.25


def _to(batch, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _batch(q_lens, kv_lens, device, **kw):
    return _to(random_paged_batch(q_lens, kv_lens, **kw), device)


def _check_cache(batch, k_cache, v_cache):
    """Rows landed at their write slots; every other slot is bit-for-bit unchanged.

    Padded rows all write the null slot 0; for a slot written more than once, concurrent writers
    may interleave on a GPU, so each element must come from one of them (the null page is never read)."""
    hkv, d = k_cache.shape[2:]
    loc = batch["write_loc"].cpu()
    for new, cache, before in ((batch["k"], k_cache, batch["k_cache"]), (batch["v"], v_cache, batch["v_cache"])):
        flat, flat0 = cache.view(-1, hkv, d).cpu(), before.view(-1, hkv, d).cpu()
        new = new.to(cache.dtype).cpu()
        for slot in loc.unique().tolist():
            rows = new[loc == slot]
            assert (flat[slot][None] == rows).any(0).all(), f"slot {slot} holds data none of its rows wrote"
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[loc] = False
        assert torch.equal(flat[untouched], flat0[untouched]), "a slot outside write_loc changed"


def _compare(batch, *, decode, atol=1e-5, rtol=1e-5):
    """triton vs torch on the same inputs; returns the triton output."""
    out, k_cache, v_cache = run_attention(batch, "triton", decode=decode, scale=SCALE)
    ref, _, _ = run_attention(batch, "torch", decode=decode, scale=SCALE)
    assert not out.isnan().any(), "some output row was never written"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    _check_cache(batch, k_cache, v_cache)
    return out


@pytest.fixture
def many_splits(monkeypatch):
    """Force the split-KV decode path to use several (partly empty) splits on tiny shapes."""
    monkeypatch.setattr(ta, "DECODE_MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(ta, "DECODE_BLOCK_N", 16)


# -- extend ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_extend_with_prefix_matches_torch(page_size, seed, device):
    batch = _batch([5, 1, 17, 3], [9, 40, 17, 70], device, page_size=page_size, seed=seed, pad_rows=1)
    out = _compare(batch, decode=False)
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch, SCALE), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-1:], torch.zeros_like(out[-1:]))  # padded row: exact zeros


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(1, 1, 32), (2, 3, 16), (1, 8, 16), (4, 4, 64)])
def test_extend_gqa_shapes_match_torch(num_kv_heads, group, head_dim, device):
    batch = _batch([3, 12, 1], [3, 30, 9], device, page_size=16, num_kv_heads=num_kv_heads, group=group,
                   head_dim=head_dim, seed=2)
    _compare(batch, decode=False)


def test_extend_long_query_crosses_several_row_blocks(device):
    # 70 query rows with group 2 -> BLOCK_M = 32: three row blocks, the last one partial
    batch = _batch([70, 2], [75, 2], device, page_size=16, seed=4)
    _compare(batch, decode=False)


@pytest.fixture
def small_extend_tiles(monkeypatch):
    """8-row, 16-key extend tiles: tiny shapes then span many query blocks per request, unmasked
    bulk tiles and masked diagonal tiles, and idle programs past the last block."""
    monkeypatch.setattr(ta, "EXTEND_CONFIGS", {d: (8, 16, 4, 1) for d in (16, 32, 64, 128, 256)})


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_block_numbering_over_ragged_requests(page_size, device, small_extend_tiles):
    # q_lens 1..37 over prefixes that are and are not multiples of the key tile; a request with
    # q_len 0 between two others (a mixed step's finished row) must neither shift nor take blocks.
    g = torch.Generator().manual_seed(11)
    q_lens = [int(x) for x in torch.randint(1, 38, (6,), generator=g)] + [0, 16]
    kv_lens = [q + int(p) for q, p in zip(q_lens, torch.randint(0, 40, (8,), generator=g))]
    kv_lens[6] = max(kv_lens[6], 1)
    batch = _batch(q_lens, kv_lens, device, page_size=page_size, group=2, seed=9, pad_rows=3)
    out = _compare(batch, decode=False)
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch, SCALE), atol=1e-5, rtol=1e-5)


def test_extend_float16_matches_torch(device):
    batch = _batch([4, 1, 9], [4, 20, 30], device, page_size=16, dtype=torch.float16, seed=6, pad_rows=1)
    _compare(batch, decode=False, atol=2e-3, rtol=2e-3)


def test_extend_bfloat16_matches_torch(device):
    batch = _batch([4, 1, 9], [4, 20, 30], device, page_size=16, dtype=torch.bfloat16, seed=6, pad_rows=1)
    _compare(batch, decode=False, atol=2e-2, rtol=2e-2)


# -- decode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("split", ["one_split", "many_splits"])
def test_decode_matches_torch_and_pads_to_zero(page_size, split, device, request):
    if split == "many_splits":
        request.getfixturevalue("many_splits")
    batch = _batch([1, 1, 1], [1, 33, 100], device, page_size=page_size, seed=3, pad_rows=2)
    out = _compare(batch, decode=True)
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch, SCALE), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(1, 1, 32), (2, 3, 16), (1, 8, 16), (2, 4, 64)])
def test_decode_gqa_shapes_match_torch(num_kv_heads, group, head_dim, device, many_splits):
    batch = _batch([1] * 3, [5, 47, 64], device, page_size=16, num_kv_heads=num_kv_heads, group=group,
                   head_dim=head_dim, seed=8, pad_rows=1)
    _compare(batch, decode=True)


@pytest.mark.parametrize("split", ["one_split", "many_splits"])
def test_decode_all_rows_padded_gives_zeros(split, device, request):
    if split == "many_splits":
        request.getfixturevalue("many_splits")
    batch = _batch([1], [20], device, page_size=16, seed=9, pad_rows=3)
    batch["seq_lens"][0] = 0  # the one "live" request has no KV either (idle graph capture)
    out, _, _ = run_attention(batch, "triton", decode=True, scale=SCALE)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("split", ["one_split", "many_splits"])
def test_one_split_writes_the_output_without_a_combine_launch(split, device, request, monkeypatch):
    """With one split the split kernel stores the output itself (the combine's arithmetic over one
    split); the combine kernel runs only when there are partials to combine."""
    if split == "many_splits":
        request.getfixturevalue("many_splits")
    combine = LaunchSpy(ta._decode_combine_kernel)
    monkeypatch.setattr(ta, "_decode_combine_kernel", combine)
    batch = _batch([1, 1], [9, 40], device, page_size=16, seed=21, pad_rows=1)
    splits = ta._decode_launch(batch["q"], batch["k_cache"], batch["page_table"])[5]
    assert (splits == 1) == (split == "one_split")
    _compare(batch, decode=True)
    assert len(combine.launches) == (0 if splits == 1 else 1)


def test_decode_geometry_follows_the_measured_choice_per_head_dim(monkeypatch):
    """head_dim 128 (measured on the H200) gets 32-key tiles from 64 (request, KV head) programs and
    2 warps from 256, and from 512 one split of 64-key tiles at 4 warps and 3 stages; head_dim 64 keeps 64-key tiles and gets 2 warps from 64
    programs; 256 its 32-key tile and Triton's defaults; the module knobs override all of it."""
    assert [ta._decode_block_n(d, 64) for d in (64, 128, 256)] == [64, 32, 32]
    assert [ta._decode_block_n(d, 63) for d in (64, 128, 256)] == [64, 64, 32]  # bs=1 of 8 KV heads: 64
    assert [ta._decode_block_n(128, p) for p in (511, 512)] == [32, 64]
    assert ta._decode_launch_options(32, 8, 128) == {"num_warps": 2}
    assert ta._decode_launch_options(31, 8, 128) == {}
    assert ta._decode_launch_options(63, 8, 128) == {"num_warps": 2}
    assert ta._decode_launch_options(64, 8, 128) == {"num_warps": 4, "num_stages": 3}
    # splits at the bench's 2064-position table: 1024 programs aimed at, one split from 512
    assert [ta.decode_num_splits(2064, bs, 8, ta._decode_block_n(128, bs * 8), 128) for bs in (8, 32, 63, 64, 200)] \
        == [16, 4, 3, 1, 1]
    assert ta.decode_num_splits(2064, 64, 8, 64, 64) == 2  # head_dim 64 keeps 1024
    assert ta._decode_launch_options(8, 8, 64) == {"num_warps": 2}  # llama-1b bs=8: 64 programs
    assert ta._decode_launch_options(7, 8, 64) == {}
    assert ta._decode_launch_options(1, 8, 64) == {}  # llama-1b bs=1: Triton's 4 warps
    assert ta._decode_launch_options(64, 8, 256) == {}  # 128 and 64 were measured with 2 warps, not 256
    assert ta._decode_launch_options(64, 8, 32) == {}
    monkeypatch.setattr(ta, "DECODE_BLOCK_N", 16)
    monkeypatch.setattr(ta, "DECODE_NUM_WARPS", 8)
    monkeypatch.setattr(ta, "DECODE_NUM_STAGES", 2)
    monkeypatch.setattr(ta, "DECODE_TARGET_PROGRAMS", 2048)
    assert [ta._decode_block_n(d, 512) for d in (64, 128)] == [16, 16]
    assert ta._decode_launch_options(64, 8, 128) == {"num_warps": 8, "num_stages": 2}
    assert ta._decode_launch_options(8, 8, 128) == {"num_warps": 8, "num_stages": 2}
    assert ta.decode_num_splits(2064, 64, 8, 16, 128) == 4


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_a_one_request_decode_with_few_splits_matches_torch(device, monkeypatch, splits):
    """One request's launches against the float32 oracle, output poisoned first: 1 split (the split
    kernel writes the output alone), 2 and 3 (an odd count, padded to 4 in the combine)."""
    monkeypatch.setattr(ta, "DECODE_TARGET_PROGRAMS", 2 * splits)  # 2 KV heads: that many splits
    monkeypatch.setattr(ta, "DECODE_MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(ta, "DECODE_BLOCK_N", 16)
    combine = LaunchSpy(ta._decode_combine_kernel)
    monkeypatch.setattr(ta, "_decode_combine_kernel", combine)
    g = torch.Generator().manual_seed(100 + splits)
    hq, hkv, d, page, kv_len = 4, 2, 32, 4, 45
    pages = 16
    k_cache = torch.randn(pages, page, hkv, d, generator=g).to(device)
    v_cache = torch.randn(pages, page, hkv, d, generator=g).to(device)
    table = torch.randperm(pages - 1, generator=g)[:12].add(1).to(torch.int32).view(1, 12).to(device)
    seq_lens = torch.tensor([kv_len], dtype=torch.int32, device=device)
    q = torch.randn(1, hq, d, generator=g).to(device)
    out = torch.full_like(q, float("nan"))
    ta.paged_decode(q, k_cache, v_cache, out, table, seq_lens, d ** -0.5)
    keys = k_cache[table[0].long()].flatten(0, 1)[:kv_len]  # [kv_len, hkv, d] in position order
    values = v_cache[table[0].long()].flatten(0, 1)[:kv_len]
    group = hq // hkv
    scores = torch.einsum("hd,khd->hk", q[0], keys.repeat_interleave(group, 1)) * d ** -0.5
    want = torch.einsum("hk,khd->hd", scores.softmax(-1), values.repeat_interleave(group, 1))
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-4)
    assert ta.decode_num_splits(table.shape[1] * page, 1, hkv, 16) == splits
    assert len(combine.launches) == (0 if splits == 1 else 1)


def test_decode_head_dim_128_past_the_two_warp_threshold_matches_torch(device, monkeypatch):
    """The default head_dim-128 launch past both thresholds against the oracle: the split kernel
    launched with 32-key tiles and 2 warps, and the combine with the same 2 warps (its sums over the
    splits follow the warp layout, and the fused kernel runs them at the split's warps). The
    thresholds are lowered so the interpreter runs 48 (request, KV head) programs, not 256 (it
    ignores warps; the GPU twin runs the real thresholds)."""
    monkeypatch.setattr(ta, "DECODE_WARPS_2_FROM_PROGRAMS", 48)
    monkeypatch.setattr(ta, "DECODE_SHORT_TILE_FROM_PROGRAMS", 48)
    monkeypatch.setattr(ta, "DECODE_MIN_SPLIT_TOKENS", 32)  # several splits, so the combine runs
    spy, combine = LaunchSpy(ta._decode_split_kernel), LaunchSpy(ta._decode_combine_kernel)
    monkeypatch.setattr(ta, "_decode_split_kernel", spy)
    monkeypatch.setattr(ta, "_decode_combine_kernel", combine)
    batch = _batch([1] * 5, [3, 32, 17, 70, 1], device, page_size=16, num_kv_heads=8, group=2, head_dim=128,
                   seed=13, pad_rows=1)
    assert batch["q"].shape[0] * 8 == 48
    _compare(batch, decode=True)
    assert [(x["BLOCK_N"], x.get("num_warps")) for x in spy.launches] == [(32, 2)]
    assert spy.launches[0]["NUM_SPLITS"] > 1
    assert [x.get("num_warps") for x in combine.launches] == [2]


def test_decode_float16_matches_torch(device, many_splits):
    batch = _batch([1] * 3, [2, 40, 17], device, page_size=16, dtype=torch.float16, seed=10, pad_rows=1)
    _compare(batch, decode=True, atol=2e-3, rtol=2e-3)


def test_decode_path_equals_extend_path_on_single_rows(device, many_splits):
    batch = _batch([1] * 4, [7, 1, 64, 30], device, page_size=16, seed=5)
    dec, kd, vd = run_attention(batch, "triton", decode=True, scale=SCALE)
    ext, ke, ve = run_attention(batch, "triton", decode=False, scale=SCALE)
    torch.testing.assert_close(dec, ext, rtol=1e-5, atol=1e-5)
    assert torch.equal(kd, ke) and torch.equal(vd, ve)


@pytest.mark.parametrize("decode", [True, False])
def test_unwritten_slots_never_leak_into_the_output(decode, device, many_splits):
    """Slots past seq_len and the null page may hold NaN/inf garbage: outputs must ignore them."""
    q_lens = [1, 1, 1] if decode else [2, 1, 4]
    batch = random_paged_batch(q_lens, [3, 18, 7], page_size=16, seed=9, pad_rows=1)
    live = torch.zeros(batch["k_cache"].shape[0] * 16, dtype=torch.bool)
    for b, kv in enumerate(batch["kv_lens"]):
        for p in range(kv):
            live[int(batch["page_table"][b, p // 16]) * 16 + p % 16] = True
    for name, poison in (("k_cache", float("nan")), ("v_cache", float("inf"))):
        batch[name].view(-1, *batch[name].shape[2:])[~live] = poison
    batch = _to(batch, device)
    out, _, _ = run_attention(batch, "triton", decode=decode, scale=SCALE)
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decode", [False, True])
def test_strided_qkv_views_of_a_fused_projection(decode, device):
    """q, k, v as column slices of one [T, (Hq + 2 Hkv) * D] tensor, as the model produces them."""
    q_lens = [1, 1] if decode else [3, 6]
    batch = _batch(q_lens, [10, 6], device, page_size=16, seed=12)
    t, hq, d = batch["q"].shape
    hkv = batch["k"].shape[1]
    fused = torch.cat([batch["q"].reshape(t, -1), batch["k"].reshape(t, -1), batch["v"].reshape(t, -1)], dim=1)
    q, k, v = fused.split([hq * d, hkv * d, hkv * d], dim=1)
    strided = dict(batch, q=q.view(t, hq, d), k=k.view(t, hkv, d), v=v.view(t, hkv, d))
    assert not strided["v"].is_contiguous()
    out, kc, vc = run_attention(strided, "triton", decode=decode, scale=SCALE)
    ref, kr, vr = run_attention(batch, "torch", decode=decode, scale=SCALE)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


# -- KV write ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_kv_write_touches_only_write_loc(page_size, device):
    batch = _batch([4, 2, 1], [10, 2, 70], device, page_size=page_size, seed=7, pad_rows=2)
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    ta.write_kv(batch["k"], batch["v"], k_cache, v_cache, batch["write_loc"])
    _check_cache(batch, k_cache, v_cache)


def test_kv_write_casts_to_cache_dtype(device):
    batch = _batch([3, 2], [5, 2], device, page_size=4, seed=13)
    k_cache, v_cache = batch["k_cache"].half(), batch["v_cache"].half()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ta.write_kv(batch["k"], batch["v"], k_cache, v_cache, batch["write_loc"])
    from tscompile.custom_ops.attention import write_kv as torch_write_kv

    torch_write_kv(batch["k"], batch["v"], ref_k, ref_v, batch["write_loc"])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# -- refresh ----------------------------------------------------------------------------------------


def _random_block_tables(n, max_blocks, num_blocks, pages_per_block, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    tables = torch.zeros(n, max_blocks, dtype=torch.int32)
    seq_lens = torch.zeros(n, dtype=torch.int32)
    block_size = pages_per_block * page_size
    for i in range(n):
        seq = int(torch.randint(1, max_blocks * block_size + 1, (1,), generator=g))
        used = -(-seq // block_size)
        tables[i, :used] = torch.randperm(num_blocks - 1, generator=g)[:used].to(torch.int32) + 1
        seq_lens[i] = seq
    return tables, seq_lens


@pytest.mark.parametrize("pages_per_block", [1, 2])
@pytest.mark.parametrize("n,bs", [(0, 4), (1, 1), (3, 3), (5, 8), (20, 37)])
def test_refresh_matches_torch(pages_per_block, n, bs, device):
    page_size, max_blocks = 4, 6
    max_pages = max_blocks * pages_per_block + 1  # one column past the table: must read as page 0
    tables, seq_lens = _random_block_tables(n, max_blocks, 50, pages_per_block, page_size, seed=n * 10 + bs)
    tables, seq_lens = tables.to(device), seq_lens.to(device)
    outs = []
    for fn in (torch_refresh, triton_refresh):
        page_table = torch.full((bs, max_pages), -7, dtype=torch.int32, device=device)
        lens = torch.full((bs,), -7, dtype=torch.int32, device=device)
        loc = torch.full((bs,), -7, dtype=torch.int64, device=device)
        fn(tables, seq_lens, page_table, lens, loc, pages_per_block, page_size)
        outs.append((page_table, lens, loc))
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want)
    assert not (outs[1][0] == -7).any()


def test_refresh_through_the_op(device):
    tables, seq_lens = _random_block_tables(3, 4, 20, 1, 16, seed=1)
    page_table = torch.full((5, 4), -7, dtype=torch.int32, device=device)
    lens = torch.full((5,), -7, dtype=torch.int32, device=device)
    loc = torch.full((5,), -7, dtype=torch.int64, device=device)
    torch.ops.tscompile.refresh_decode_metadata(tables.to(device), seq_lens.to(device), page_table, lens, loc,
                                                1, 16, "triton")
    assert torch.equal(lens.cpu(), torch.cat([seq_lens, torch.zeros(2, dtype=torch.int32)]))
    assert torch.equal(loc[3:].cpu(), torch.zeros(2, dtype=torch.int64))


# -- refusals and declarations ---------------------------------------------------------------------


def test_unsupported_head_dim_is_refused(device):
    batch = _batch([1], [3], device, page_size=4, head_dim=80)
    with pytest.raises(ValueError, match=r"^tscompile: .*head_dim 80.*supported"):
        run_attention(batch, "triton", decode=True)


def test_unsupported_dtype_is_refused(device):
    batch = _batch([1], [3], device, page_size=4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^tscompile: .*dtype torch.float64.*supported"):
        run_attention(batch, "triton", decode=False)


@pytest.mark.parametrize("head_dim,dtype,ok", [(64, torch.bfloat16, True), (128, torch.float32, True),
                                              (96, torch.float16, False), (64, torch.float64, False)])
def test_backend_validates_cache_pool(head_dim, dtype, ok):
    specs = [CacheGroupSpec("full", (0,), num_kv_heads=2, head_dim=head_dim)]
    pool = KVCachePool.allocate(specs, [4], page_size=4, dtype=dtype, device="cpu")
    leaf = TritonAttentionBackend(0, max_pages=4, device="cpu")
    if ok:
        leaf.set_cache_pool(pool)
        assert leaf.page_size == 4
    else:
        with pytest.raises(ValueError, match=r"^tscompile: .*(head_dim|dtype)"):
            leaf.set_cache_pool(pool)
        assert leaf.page_size is None  # a refused pool changes nothing


def test_registry_and_graph_support():
    assert leaf_class("triton") is TritonAttentionBackend
    assert TritonAttentionBackend.impl == "triton" and TritonAttentionBackend.refresh_impl == "triton"
    support = TritonAttentionBackend.cuda_graph_support
    assert support.decode_graph and support.prefill_graph


# -- end to end -------------------------------------------------------------------------------------


def test_llm_greedy_tokens_match_torch_backend(device):
    """The triton backend, eager and compiled (the engine's default), against the eager torch oracle."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], list(range(11, 29))]
    params = tscompile.SamplingParams(max_new_tokens=4)
    tokens = {}
    for backend, eager in (("torch", True), ("triton", True), ("triton", False)):
        llm = tscompile.LLM("llama-tiny", attention_backend=backend, device=device, dtype="float32",
                            max_model_len=64, max_num_seqs=4, page_size=16, enforce_eager=eager)
        tokens[backend, eager] = ids(llm.generate(prompts, params))
    assert tokens["triton", True] == tokens["torch", True]
    assert tokens["triton", False] == tokens["torch", True]
    assert all(len(t) == 4 for t in tokens["torch", True])


# -- GPU: realistic sizes, bf16 and fp32 -------------------------------------------------------------

_GPU_TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-4, rtol=1e-4)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_extend_matches_torch(dtype, head_dim, page_size):
    q_lens = [300, 1, 64, 129, 7]
    kv_lens = [300, 1500, 2000, 129, 900]
    batch = _batch(q_lens, kv_lens, "cuda", page_size=page_size, num_kv_heads=2, group=4, head_dim=head_dim,
                   dtype=dtype, seed=head_dim + page_size, pad_rows=2)
    _compare(batch, decode=False, **_GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_decode_matches_torch(dtype, head_dim, page_size):
    kv_lens = [1, 17, 256, 1023, 2000, 1999, 64, 700]
    batch = _batch([1] * len(kv_lens), kv_lens, "cuda", page_size=page_size, num_kv_heads=8, group=4,
                   head_dim=head_dim, dtype=dtype, seed=head_dim * page_size, pad_rows=3)
    out = _compare(batch, decode=True, **_GPU_TOL[dtype])
    assert torch.equal(out[len(kv_lens):], torch.zeros_like(out[len(kv_lens):]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim, requests, block_n, warps", [(128, 36, 32, 2), (128, 70, 64, 4), (64, 36, 64, 2)])
def test_gpu_decode_at_each_measured_geometry_matches_torch(dtype, head_dim, requests, block_n, warps, monkeypatch):
    """N requests (+2 padded) x 8 KV heads, one per launch geometry past the thresholds: head_dim 128
    at 304 programs (32-key tiles, 2 warps, several splits) and 576 (the one-split launch: 64-key
    tiles, 4 warps, no combine; the bench's bs=64), head_dim 64 at 304 (llama-1b's 64-key tiles,
    2 warps); the combine, where it runs, at the split's warps."""
    spy, combine = LaunchSpy(ta._decode_split_kernel), LaunchSpy(ta._decode_combine_kernel)
    monkeypatch.setattr(ta, "_decode_split_kernel", spy)
    monkeypatch.setattr(ta, "_decode_combine_kernel", combine)
    kv_lens = [int(x) for x in torch.randint(1, 900, (requests,), generator=torch.Generator().manual_seed(41))]
    batch = _batch([1] * len(kv_lens), kv_lens, "cuda", page_size=16, num_kv_heads=8, group=4, head_dim=head_dim,
                   dtype=dtype, seed=42, pad_rows=2)
    out = _compare(batch, decode=True, **_GPU_TOL[dtype])
    assert torch.equal(out[len(kv_lens):], torch.zeros_like(out[len(kv_lens):]))
    assert [(x["BLOCK_N"], x.get("num_warps")) for x in spy.launches] == [(block_n, warps)]
    splits = spy.launches[0]["NUM_SPLITS"]
    assert (splits == 1) == (requests == 70), splits
    assert [x.get("num_warps") for x in combine.launches] == ([warps] if splits > 1 else [])


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_head_dim_256_and_mqa(decode):
    q_lens = [1, 1, 1] if decode else [33, 1, 80]
    batch = _batch(q_lens, [90, 300, 80], "cuda", page_size=16, num_kv_heads=1, group=8, head_dim=256,
                   dtype=torch.bfloat16, seed=21)
    _compare(batch, decode=decode, **_GPU_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_attention_replays_under_cuda_graph(decode):
    """Capture once, then change the metadata *values* in place: the replay must follow them."""
    q_lens = [1, 1, 1, 1] if decode else [20, 1, 7, 40]
    first = _batch(q_lens, [50, 900, 7, 400], "cuda", page_size=16, num_kv_heads=2, group=4, head_dim=128,
                   dtype=torch.bfloat16, seed=30)
    second = _batch(q_lens, [1500, 1, 300, 40], "cuda", page_size=16, num_kv_heads=2, group=4, head_dim=128,
                    dtype=torch.bfloat16, seed=31)
    # same static shapes: pad both page tables to the wider one
    width = max(first["page_table"].shape[1], second["page_table"].shape[1])
    for b in (first, second):
        b["page_table"] = torch.nn.functional.pad(b["page_table"], (0, width - b["page_table"].shape[1]))
    num_pages = max(first["k_cache"].shape[0], second["k_cache"].shape[0])
    static = {}
    for name in ("q", "k", "v", "page_table", "seq_lens", "qo_indptr", "write_loc"):
        static[name] = first[name].clone()
    shape = (num_pages, *first["k_cache"].shape[1:])
    static["k_cache"] = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    static["v_cache"] = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    static["out"] = torch.empty_like(static["q"])

    def call():
        torch.ops.tscompile.attention(
            static["q"], static["k"], static["v"], static["k_cache"], static["v_cache"], static["out"],
            static["page_table"], static["seq_lens"], static["qo_indptr"], static["write_loc"], SCALE, decode,
            "triton")

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for b in (first, second):
        for name in ("q", "k", "v", "page_table", "seq_lens", "qo_indptr", "write_loc"):
            static[name].copy_(b[name])
        static["k_cache"].zero_()
        static["v_cache"].zero_()
        static["k_cache"][: b["k_cache"].shape[0]].copy_(b["k_cache"])
        static["v_cache"][: b["v_cache"].shape[0]].copy_(b["v_cache"])
        static["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _, _ = run_attention(b, "torch", decode=decode, scale=SCALE)
        torch.testing.assert_close(static["out"].float(), ref.float(), **_GPU_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("pages_per_block", [1, 2])
def test_gpu_refresh_matches_torch_at_scale(pages_per_block):
    page_size, max_blocks, bs, n = 16, 130, 256, 200
    tables, seq_lens = _random_block_tables(n, max_blocks, 4000, pages_per_block, page_size, seed=3)
    tables, seq_lens = tables.cuda(), seq_lens.cuda()
    outs = []
    for fn in (torch_refresh, triton_refresh):
        page_table = torch.full((bs, max_blocks * pages_per_block), -7, dtype=torch.int32, device="cuda")
        lens = torch.full((bs,), -7, dtype=torch.int32, device="cuda")
        loc = torch.full((bs,), -7, dtype=torch.int64, device="cuda")
        fn(tables, seq_lens, page_table, lens, loc, pages_per_block, page_size)
        outs.append((page_table, lens, loc))
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_llm_greedy_tokens_match_torch_backend():
    prompts = [list(range(1, 40)), [9, 8], list(range(100, 300))]
    params = tscompile.SamplingParams(max_new_tokens=8)
    tokens = {}
    for backend, eager in (("torch", True), ("triton", True), ("triton", False)):
        llm = tscompile.LLM("llama-tiny", attention_backend=backend, device="cuda", dtype="float32",
                            max_model_len=512, max_num_seqs=4, page_size=16, enforce_eager=eager)
        tokens[backend, eager] = ids(llm.generate(prompts, params))
    assert tokens["triton", True] == tokens["torch", True]
    assert tokens["triton", False] == tokens["torch", True]
