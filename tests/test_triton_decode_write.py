"""The Triton decode whose split kernel writes the new K/V rows itself (the op's path: two launches
per layer) against the three-launch path (KV write, splits, combine) and
the torch oracle.

The two paths must agree bit for bit: the output and the whole K/V caches, NaN payloads included
(the caches are poisoned around the live prefix, the new rows' slots too, so a program that read a
slot before its new row landed, or read past a request's length, shows). Without CUDA the kernels
run under the Triton interpreter, so shapes stay small; the ``gpu`` tests run the compiled kernels
at real sizes, in a captured CUDA graph and with PDL.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import LaunchSpy, assert_pdl_graph_gives_the_plain_bits, random_paged_batch
from tscompile.custom_ops import triton_attention as ta

SCALE = 0.25
PAGE = 16
# live KV lengths the batches draw from: one token, both sides of page and tile boundaries, long
LENGTHS = [1, 16, 17, 130, 33, 15, 64, 2, 97]
_INT_VIEW = {4: torch.int32, 2: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, so NaNs compare equal to themselves (and -0.0 differs from +0.0)."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


@pytest.fixture
def many_splits(monkeypatch):
    """16-token tiles and splits: tiny shapes get several splits, some of them empty."""
    monkeypatch.setattr(ta, "DECODE_MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(ta, "DECODE_BLOCK_N", 16)


@pytest.fixture
def one_split(monkeypatch):
    """Every request in one split however long: the split kernel writes ``out`` itself, no combine."""
    monkeypatch.setattr(ta, "DECODE_BLOCK_N", 16)
    monkeypatch.setattr(ta, "DECODE_MAX_SPLITS", 1)


@pytest.fixture(params=["one_split", "many_splits"])
def splits(request):
    request.getfixturevalue(request.param)
    return request.param


def _poisoned_batch(kv_lens, pad_rows, device, **kw):
    """A decode batch whose cache holds random values only in each request's prefix (positions
    [0, kv_len - 1)); its new row's slot, the slots past it and the null page hold NaN (keys) / inf
    (values)."""
    batch = random_paged_batch([1] * len(kv_lens), kv_lens, page_size=PAGE, pad_rows=pad_rows, **kw)
    prefix = torch.zeros(batch["k_cache"].shape[0] * PAGE, dtype=torch.bool)
    for b, kv in enumerate(kv_lens):
        for p in range(kv - 1):
            prefix[int(batch["page_table"][b, p // PAGE]) * PAGE + p % PAGE] = True
    for name, poison in (("k_cache", float("nan")), ("v_cache", float("inf"))):
        batch[name].view(-1, *batch[name].shape[2:])[~prefix] = poison
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _decode(path: str, q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc) -> None:
    """One decode: "write_in_split" through ``triton_attention`` (the op's body: the split kernel writes
    the new K/V rows); "three": the KV write as a launch of its own, then the splits and the combine."""
    if path == "three":
        ta.write_kv(k, v, k_cache, v_cache, write_loc)
        ta.paged_decode(q, k_cache, v_cache, out, page_table, seq_lens, SCALE)
    else:
        ta.triton_attention(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, SCALE, True)


def _run(batch, monkeypatch, write_in_split: bool = False):
    """One decode on fresh copies of the caches, ``out`` poisoned with NaN; ``write_in_split`` off: the
    three-kernel path (KV write, splits, combine)."""
    out = torch.full_like(batch["q"], float("nan"))
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    _decode("write_in_split" if write_in_split else "three", batch["q"], batch["k"], batch["v"], k_cache, v_cache,
            out, batch["page_table"], batch["seq_lens"], batch["qo_indptr"], batch["write_loc"])
    return out, k_cache, v_cache


def _num_splits(batch) -> int:
    return ta._decode_launch(batch["q"], batch["k_cache"], batch["page_table"])[5]


# -- the K/V write inside the split kernel ----------------------------------------------------------


def _differences(got: torch.Tensor, want: torch.Tensor) -> str:
    """Why two results differ: NaNs where the reference has none point at a read of a poisoned slot
    (a race with the write), a small finite difference at a different order of the same sums."""
    new_nans = int((got.isnan() & ~want.isnan()).sum())
    both = ~got.isnan() & ~want.isnan()
    diff = (got[both].float() - want[both].float()).abs().max().item() if both.any() else 0.0
    return f"{new_nans} NaN where the three-kernel path has none, max |difference| {diff:.3g}"


@triton.jit
def _writer_probe(seq_lens_ptr, out_ptr, max_kv, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(1)
    kv_len, split_len, lo, hi = ta._split_range(seq_lens_ptr, b, split, max_kv, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    row = out_ptr + (b * NUM_SPLITS + split) * 3
    tl.store(row, (split == ta._writer_split(kv_len, split_len)).to(tl.int32))
    tl.store(row + 1, lo)
    tl.store(row + 2, hi)


@pytest.mark.parametrize("num_splits,min_split,block_n", [(1, 16, 16), (3, 16, 16), (16, 16, 16), (4, 64, 32)])
def test_exactly_one_split_writes_each_row_and_its_range_holds_the_row(num_splits, min_split, block_n, device):
    """The writer choice the interpreter's in-order programs cannot test through outputs (an earlier
    split writing would still land before the owner reads): for every length 0..40 and a full table,
    one writer per request, whose range [lo, hi) holds position kv_len - 1; split 0 for kv_len 0."""
    max_kv = 128
    kv_lens = list(range(41)) + [127, 128]
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    out = torch.full((len(kv_lens), num_splits, 3), -7, dtype=torch.int32, device=device)
    _writer_probe[(len(kv_lens), num_splits)](seq_lens, out, max_kv, NUM_SPLITS=num_splits, MIN_SPLIT=min_split,
                                              BLOCK_N=block_n)
    out = out.cpu()
    for b, kv_len in enumerate(kv_lens):
        writers = [s for s in range(num_splits) if out[b, s, 0] == 1]
        assert len(writers) == 1, f"kv_len {kv_len}: writers {writers}"
        lo, hi = int(out[b, writers[0], 1]), int(out[b, writers[0], 2])
        assert (lo <= kv_len - 1 < hi) if kv_len else writers == [0], f"kv_len {kv_len}: split [{lo}, {hi})"


def _run_write_in_split(batch, monkeypatch):
    return _run(batch, monkeypatch, write_in_split=True)


def _assert_write_in_split_equals_three_kernels(batch, monkeypatch, calls=1) -> dict:
    want = _run(batch, monkeypatch)
    writes, split = LaunchSpy(ta._kv_write_kernel), LaunchSpy(ta._decode_split_kernel)
    monkeypatch.setattr(ta, "_kv_write_kernel", writes)
    monkeypatch.setattr(ta, "_decode_split_kernel", split)
    assert not want[0].isnan().any()
    for call in range(calls):  # on a GPU a race with the write shows only sometimes
        split.launches.clear()
        got = _run_write_in_split(batch, monkeypatch)
        assert _same_bits(got[0], want[0]), f"call {call}: the output differs: {_differences(got[0], want[0])}"
        # page 0 is the null page every padded row writes: which of them lands last is the kernels' race
        for name, g, w in zip(("k_cache", "v_cache"), got[1:], want[1:]):
            assert _same_bits(g[1:], w[1:]), f"call {call}: {name} differs from the three-kernel path"
        assert writes.launches == [] and [x["WRITE_KV"] for x in split.launches] == [True]
    return split.launches[0]


@pytest.mark.parametrize("dtype", [torch.float32])
def test_write_in_split_equals_the_three_kernel_path(dtype, splits, device, monkeypatch):
    """Nine rows, three of them padding (seq_len 0, slot 0): the same output and caches bit for bit
    (NaN-poisoned slots past each prefix, so a read before the write shows), and no K/V-write launch.
    float32 only: in bf16, nine rows with three padded are ..._over_batch_sizes[*-9-dtype1]'s, and two
    KV heads are ..._over_head_shapes[*-8-128-dtype1]'s."""
    batch = _poisoned_batch([130, 1, 17, 64, 33, 2], 3, device, num_kv_heads=2, group=4, head_dim=64, dtype=dtype,
                            seed=71)
    assert (_num_splits(batch) > 1) == (splits == "many_splits")
    _assert_write_in_split_equals_three_kernels(batch, monkeypatch)


# batch sizes 1 (no padding), 3 and 9 (padded rows) under the interpreter, which runs every program
# in turn; the GPU tests below cover the rest at real tile sizes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [1, 3, 9])
def test_write_in_split_equals_the_three_kernel_path_over_batch_sizes(bs, dtype, splits, device, monkeypatch):
    pad_rows = bs // 3  # from bs 3 on, the last rows are padding: seq_len 0, write slot 0
    kv_lens = [LENGTHS[(bs + i) % len(LENGTHS)] for i in range(bs - pad_rows)]
    batch = _poisoned_batch(kv_lens, pad_rows, device, num_kv_heads=1, group=4, head_dim=64, dtype=dtype,
                            seed=100 + bs)
    assert (_num_splits(batch) > 1) == (splits == "many_splits")
    _assert_write_in_split_equals_three_kernels(batch, monkeypatch)


# GQA groups 1 and 8 over both head_dims and dtypes (the interpreter takes ~12 s a case)
@pytest.mark.parametrize("group,head_dim,dtype", [(1, 64, torch.float32), (8, 128, torch.bfloat16)])
def test_write_in_split_equals_the_three_kernel_path_over_head_shapes(group, head_dim, dtype, splits, device,
                                                                      monkeypatch):
    batch = _poisoned_batch([33, 1, 200, 16], 1, device, num_kv_heads=2, group=group, head_dim=head_dim,
                            dtype=dtype, seed=group * 1000 + head_dim)
    assert (_num_splits(batch) > 1) == (splits == "many_splits")
    _assert_write_in_split_equals_three_kernels(batch, monkeypatch)


@pytest.mark.parametrize("splits_fixture", ["one_split", "many_splits"])
def test_write_in_split_matches_torch_oracle(splits_fixture, device, monkeypatch, request):
    request.getfixturevalue(splits_fixture)
    batch = _poisoned_batch([1, 17, 200, 64, 33], 2, device, num_kv_heads=2, group=4, head_dim=64, seed=21)
    out, k_cache, v_cache = _run_write_in_split(batch, monkeypatch)
    ref_out = torch.full_like(batch["q"], float("nan"))
    ref_k, ref_v = batch["k_cache"].clone(), batch["v_cache"].clone()
    torch.ops.tscompile.attention(batch["q"], batch["k"], batch["v"], ref_k, ref_v, ref_out, batch["page_table"],
                                  batch["seq_lens"], batch["qo_indptr"], batch["write_loc"], SCALE, True, "torch")
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))  # padded rows: exact zeros
    # page 0 is the null page every padded row writes: which of them lands last is the kernels' race
    assert _same_bits(k_cache[1:], ref_k[1:]) and _same_bits(v_cache[1:], ref_v[1:])


def test_write_in_split_of_only_padded_rows_writes_their_slots(device, monkeypatch, many_splits):
    """An idle step (every row seq_len 0, as at capture): zeros out, and row 0's K/V still reaches its
    real slot (split 0 writes it, reading nothing)."""
    batch = _poisoned_batch([5], 3, device, seed=7)
    batch["seq_lens"][0] = 0
    got = _run_write_in_split(batch, monkeypatch)
    want = _run(batch, monkeypatch)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    # page 0 is the null page the padded rows race to write; every other page must match
    assert all(_same_bits(g[1:], w[1:]) for g, w in zip(got[1:], want[1:]))
    assert not got[1].view(-1, 2, 16)[batch["write_loc"][0]].isnan().any(), "row 0's K never reached its slot"


def test_write_in_split_refuses_rows_that_do_not_match_the_queries(device):
    batch = _poisoned_batch([3, 4], 0, device, seed=3)
    out = torch.empty_like(batch["q"])
    with pytest.raises(ValueError, match=r"^tscompile: .*write_loc has 1 rows, q has 2"):
        ta.paged_decode(batch["q"], batch["k_cache"], batch["v_cache"], out, batch["page_table"], batch["seq_lens"],
                        SCALE, new_kv=(batch["k"], batch["v"], batch["write_loc"][:1]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs,longest", [(9, 48), (9, 2000), (33, 2000)])
def test_write_in_split_equals_the_three_kernel_path_on_gpu(bs, longest, dtype, monkeypatch):
    """Compiled kernels at the real tile sizes, three calls each: one split (48), several (2000), and
    at 33 requests (+2 padded) x 8 KV heads of 128 the 2-warp, 32-key launch."""
    kv_lens = [longest] + [int(x) for x in torch.randint(1, min(longest, 700), (bs - 1,),
                                                          generator=torch.Generator().manual_seed(bs + longest))]
    batch = _poisoned_batch(kv_lens, 2, torch.device("cuda"), num_kv_heads=8, group=4, head_dim=128, dtype=dtype,
                            seed=bs)
    assert (_num_splits(batch) > 1) == (longest > 64)
    launch = _assert_write_in_split_equals_three_kernels(batch, monkeypatch, calls=3)
    if bs == 33:
        assert (launch["BLOCK_N"], launch.get("num_warps")) == (32, 2)


# -- GPU: the write-in-split decode inside a captured CUDA graph -------------------------------------


def _fill(dst: dict, src: dict) -> None:
    for name in ("q", "k", "v", "page_table", "seq_lens", "write_loc"):
        dst[name].copy_(src[name])


@pytest.mark.gpu
def test_self_writing_decode_replays_in_a_cuda_graph_like_the_three_kernel_path(monkeypatch):
    """Capture one decode whose split kernel writes the new K/V rows itself (the default path;
    llama-1b's head layout, bf16, 16 splits), replay it twice with
    new q/k/v/seq_lens/page tables; each replay must equal the three-kernel path run eagerly on the
    same cache, bit for bit (the null page apart: padded rows race to write it)."""
    device = torch.device("cuda")
    kw = dict(num_kv_heads=8, group=4, head_dim=64, dtype=torch.bfloat16, device=device)
    lens = [[1000, 1, 0], [1000, 64, 65], [5, 999, 300]]  # one table width: 999 or 1000 tokens -> 64 pages
    batches = [random_paged_batch([1] * 3, [max(n, 1) for n in ls], page_size=PAGE, seed=s, pad_rows=2, **kw)
               for s, ls in enumerate(lens)]
    for batch, ls in zip(batches, lens):
        batch["seq_lens"][:3] = torch.tensor(ls, dtype=torch.int32)  # a 0 here: an idle live row
    widths = {b["page_table"].shape[1] for b in batches}
    assert len(widths) == 1
    static = {name: batches[0][name].clone() for name in ("q", "k", "v", "page_table", "seq_lens", "write_loc")}
    static["qo_indptr"] = batches[0]["qo_indptr"]
    # one cache for every step, as large as the largest batch's (each batch numbers its own pages)
    num_pages = max(b["k_cache"].shape[0] for b in batches)
    k_cache = torch.randn(num_pages, PAGE, 8, 64, device=device).to(torch.bfloat16)
    v_cache = torch.randn(num_pages, PAGE, 8, 64, device=device).to(torch.bfloat16)
    assert _num_splits({**static, "k_cache": k_cache}) > 1
    out = torch.full_like(static["q"], float("nan"))

    def step():
        ta.triton_attention(static["q"], static["k"], static["v"], k_cache, v_cache, out, static["page_table"],
                            static["seq_lens"], static["qo_indptr"], static["write_loc"], SCALE, True)

    path = "write_in_split"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    for batch in batches[1:]:
        _fill(static, batch)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        out.fill_(float("nan"))
        graph.replay()
        want_out = torch.full_like(out, float("nan"))
        _decode("three", static["q"], static["k"], static["v"], k_before, v_before, want_out, static["page_table"],
                static["seq_lens"], static["qo_indptr"], static["write_loc"])
        torch.cuda.synchronize()
        assert _same_bits(out, want_out), f"the replayed {path} decode differs from the three-kernel path"
        assert _same_bits(k_cache[1:], k_before[1:]) and _same_bits(v_cache[1:], v_before[1:])
        assert not out[3:].any()  # padded rows: zeros


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(8, 4, 64), (8, 1, 128), (4, 8, 128)])
@pytest.mark.parametrize("longest", [48, 2000])  # a 64-token table (one split) and a 2032-token one
def test_write_in_split_equals_the_three_kernel_path_on_gpu_over_head_shapes(num_kv_heads, group, head_dim, dtype,
                                                                             longest, monkeypatch):
    """Compiled kernels at the real tile sizes, two calls each: the write-in-split decode must still
    match the three-kernel path bit for bit (the interpreter cannot show what the GPU compiler does to
    either), over GQA groups 4, 1 and 8 and both head dims."""
    device = torch.device("cuda")
    for bs in (1, 9):
        kv_lens = [longest, 1, 16, 17, longest // 2, 33, 47, 2, 15][:bs]
        batch = _poisoned_batch(kv_lens, 1 if bs > 1 else 0, device, num_kv_heads=num_kv_heads, group=group,
                                head_dim=head_dim, dtype=dtype, seed=bs)
        assert (_num_splits(batch) > 1) == (longest > 64)
        _assert_write_in_split_equals_three_kernels(batch, monkeypatch, calls=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("longest", [48, 2000])
@pytest.mark.parametrize("requests, block_n, warps", [(33, 32, 2), (64, 64, 4)])
def test_write_in_split_equals_the_three_kernel_path_on_gpu_at_the_large_batch_launches(
        dtype, longest, requests, block_n, warps, monkeypatch):
    """33 requests x 8 KV heads of 128: the 2-warp, 32-key split launch, its combine at the split's
    warps, bit for bit the three-kernel path; 64 requests: the one-split launch (64-key tiles, 4 warps,
    no combine). (Before the combine took the split's warps, float32 at 2000 positions differed.)"""
    device = torch.device("cuda")
    combine_spy = LaunchSpy(ta._decode_combine_kernel)
    monkeypatch.setattr(ta, "_decode_combine_kernel", combine_spy)
    kv_lens = [longest] + [int(x) for x in torch.randint(1, min(longest, 700), (requests - 1,),
                                                          generator=torch.Generator().manual_seed(longest))]
    batch = _poisoned_batch(kv_lens, 0, device, num_kv_heads=8, group=4, head_dim=128, dtype=dtype, seed=33)
    several = longest > 64 and requests < 64
    assert (_num_splits(batch) > 1) == several
    launch = _assert_write_in_split_equals_three_kernels(batch, monkeypatch)
    assert (launch["BLOCK_N"], launch.get("num_warps")) == (block_n, warps)
    # the three-kernel reference and the write-in-split run each combine once when there are splits
    assert [x.get("num_warps") for x in combine_spy.launches] == ([warps, warps] if several else [])


# -- KernelPolicy.decode_pdl: the split and combine kernels launched with PDL -----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bs,longest", [(1, 48), (1, 2000), (33, 2000)])
def test_decode_pdl_in_a_graph_after_a_writer_gives_the_plain_launchs_bits_gpu(bs, longest, monkeypatch):
    """``decode_pdl`` on Hopper: the write-in-split decode captured in a CUDA graph right after a
    kernel that writes its q and its new K/V rows, replayed with new sources. A split or combine program
    that touched q, the cache or the partials before its ``gdc_wait`` would see the previous replay's
    values; every replay gives the bits of the same graph captured without PDL (one split, several, and
    33 requests)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    assert ta.pdl_launch(torch.device("cuda"), True) == {"PDL": True, "launch_pdl": True}  # PDL really on
    kv_lens = [longest] + [int(x) for x in torch.randint(1, min(longest, 700), (bs - 1,),
                                                          generator=torch.Generator().manual_seed(bs + longest))]
    batch = _poisoned_batch(kv_lens, 1, torch.device("cuda"), num_kv_heads=8, group=4, head_dim=128,
                            dtype=torch.bfloat16, seed=bs)
    pdl = {"on": False}

    def decode(live):
        k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
        out = torch.empty_like(batch["q"])
        on = pdl["on"]

        def op():
            ta.triton_attention(live["q"], live["k"], live["v"], k_cache, v_cache, out, batch["page_table"],
                                batch["seq_lens"], batch["qo_indptr"], batch["write_loc"], SCALE, True,
                                decode_pdl=on)
        return op, (out, k_cache, v_cache), None

    sources = {n: batch[n].clone() for n in ("q", "k", "v")}
    for out, _, _ in assert_pdl_graph_gives_the_plain_bits(
            sources, lambda on: pdl.update(on=on), decode):
        assert not out[:bs].isnan().any()
