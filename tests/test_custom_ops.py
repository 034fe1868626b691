"""opcheck for every op, plus the semantics of refresh, narrow_rows and sample."""

import pytest
import torch

from tscompile.custom_ops.narrow import kept_row_mask
from tscompile.custom_ops.sampling import banned_mask, pad_banned, sample_tokens
from tscompile.kv_cache import kept_rows


def _refresh_args(n, bs, max_blocks=4, pages_per_block=2, page_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_pages = max_blocks * pages_per_block
    blocks = (torch.randperm(40, generator=g)[: n * max_blocks] + 1).view(n, max_blocks).to(torch.int32)
    seq_lens = torch.randint(1, max_pages * page_size + 1, (n,), generator=g).to(torch.int32)
    outs = (torch.full((bs, max_pages), -7, dtype=torch.int32), torch.full((bs,), -7, dtype=torch.int32),
            torch.full((bs,), -7, dtype=torch.int64))
    return blocks, seq_lens, outs, pages_per_block, page_size


def test_opcheck_refresh_decode_metadata():
    blocks, seq_lens, outs, r, p = _refresh_args(3, 5)
    torch.library.opcheck(torch.ops.tscompile.refresh_decode_metadata.default, (blocks, seq_lens, *outs, r, p, "torch"))


def test_refresh_pads_to_null_page_and_slot_zero():
    blocks, seq_lens, (pt, sl, wl), r, p = _refresh_args(3, 6, seed=1)
    torch.ops.tscompile.refresh_decode_metadata(blocks, seq_lens, pt, sl, wl, r, p, "torch")
    assert torch.equal(pt[3:], torch.zeros_like(pt[3:]))
    assert sl[3:].tolist() == [0, 0, 0] and wl[3:].tolist() == [0, 0, 0]
    for i in range(3):
        pos = int(seq_lens[i]) - 1
        block = int(blocks[i, pos // (r * p)])
        assert int(wl[i]) == block * r * p + pos % (r * p)


def test_opcheck_narrow_rows():
    x = torch.randn(9, 4)
    pos = torch.arange(9)
    indptr = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    completes = torch.tensor([True, False, True])
    torch.library.opcheck(torch.ops.tscompile.narrow_rows.default, (x, pos, indptr, completes, 2))


@pytest.mark.parametrize("window", [1, 2, 4])
def test_narrow_rows_keeps_window_of_completing_chunks_and_last_row_otherwise(window):
    q_lens, completes = [5, 3, 1, 1, 6], [True, False, True, False, False]
    indptr = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    x = torch.randn(sum(q_lens), 3)
    pos = torch.arange(sum(q_lens)) + 100
    rows, kept_pos = torch.ops.tscompile.narrow_rows(x, pos, indptr, torch.tensor(completes), window)
    expect = []
    for b, (q, c) in enumerate(zip(q_lens, completes)):
        keep = kept_rows(q, c, window)
        end = int(indptr[b + 1])
        expect += list(range(end - keep, end))
    assert kept_pos.tolist() == [p + 100 for p in expect]
    assert torch.equal(rows, x[expect])
    assert kept_row_mask(indptr, torch.tensor(completes), window, x.shape[0]).sum() == len(expect)


def _sample_args(b=5, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g), torch.rand(b, generator=g) + 0.5, torch.randint(0, 10, (b,), generator=g).to(torch.int32),
            torch.rand(b, generator=g) * 0.5 + 0.5, torch.randint(0, 2**40, (b,), generator=g), torch.arange(b) + 3)


def _no_bans(b, k=2):
    return torch.full((b, k), -1, dtype=torch.int64)


@pytest.mark.parametrize("all_greedy", [False, True])
def test_opcheck_sample(all_greedy):
    args = _sample_args()
    banned = torch.tensor([[3, -1], [-1, -1], [0, 49], [7, 7], [-1, 2]])
    torch.library.opcheck(torch.ops.tscompile.sample.default,
                          (*args, banned, torch.full((5,), -1, dtype=torch.int64), all_greedy))


@pytest.mark.parametrize("seed", range(3))
def test_greedy_top_k_one_equals_argmax(seed):
    logits, temp, _, top_p, seeds, steps = _sample_args(b=16, v=300, seed=seed)
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1  # a tie: argmax picks the first index
    out = torch.full((16,), -1, dtype=torch.int64)
    top_k = torch.ones(16, dtype=torch.int32)
    torch.ops.tscompile.sample(logits, temp, top_k, top_p, seeds, steps, _no_bans(16), out)
    assert torch.equal(out, logits.argmax(-1))
    out.fill_(-1)  # the all-greedy fast path gives the same tokens without the sort
    torch.ops.tscompile.sample(logits, temp, top_k, top_p, seeds, steps, _no_bans(16), out, True)
    assert torch.equal(out, logits.argmax(-1))
    zero_temp = torch.zeros(16)
    out.fill_(-1)
    torch.ops.tscompile.sample(logits, zero_temp, torch.zeros(16, dtype=torch.int32), top_p, seeds, steps,
                               _no_bans(16), out)
    assert torch.equal(out, logits.argmax(-1))


def test_sampling_respects_top_k_and_top_p_and_is_seeded():
    g = torch.Generator().manual_seed(4)
    v, n = 40, 4000
    logits = torch.randn(1, v, generator=g).expand(n, v).contiguous()
    top_k = torch.full((n,), 5, dtype=torch.int32)
    seeds = torch.full((n,), 1234, dtype=torch.int64)
    steps = torch.arange(n)
    toks = sample_tokens(logits, torch.ones(n), top_k, torch.ones(n), seeds, steps)
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(toks.tolist()) == allowed  # all five reachable, nothing else
    again = sample_tokens(logits, torch.ones(n), top_k, torch.ones(n), seeds, steps)
    assert torch.equal(toks, again)
    other = sample_tokens(logits, torch.ones(n), top_k, torch.ones(n), seeds + 1, steps)
    assert not torch.equal(toks, other)
    probs = torch.softmax(logits[0], -1)
    top = probs.argmax()
    nucleus = sample_tokens(logits, torch.ones(n), torch.zeros(n, dtype=torch.int32),
                            torch.full((n,), float(probs[top]) * 0.5), seeds, steps)
    assert set(nucleus.tolist()) == {int(top)}  # top_p below the top token's mass keeps only it
    # empirical frequencies follow the top-k renormalised distribution
    kept = torch.softmax(logits[0, sorted(allowed)], -1)
    freq = torch.tensor([(toks == t).float().mean() for t in sorted(allowed)])
    torch.testing.assert_close(freq, kept, atol=0.03, rtol=0)


def _op_sample(logits, temp, top_k, top_p, seeds, steps, banned, all_greedy=False):
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64)
    torch.ops.tscompile.sample(logits, temp, top_k, top_p, seeds, steps, banned, out, all_greedy)
    return out


def test_banned_mask_marks_exactly_the_listed_ids_and_ignores_padding_and_out_of_range():
    banned = torch.tensor([[0, -1, 0], [-1, -1, -1], [9, 2, 10]])
    mask = banned_mask(banned, 10)
    assert mask.shape == (3, 10)
    assert mask[0].nonzero().flatten().tolist() == [0]  # a -1 never un-bans id 0
    assert not mask[1].any()
    assert mask[2].nonzero().flatten().tolist() == [2, 9]


def test_pad_banned_pads_with_minus_one_and_refuses_rows_wider_than_the_engine_width():
    assert pad_banned([[5, 2], [], [7]], 3).tolist() == [[5, 2, -1], [-1, -1, -1], [7, -1, -1]]
    with pytest.raises(ValueError, match="tscompile: 3 banned token ids .* at most 2"):
        pad_banned([[1, 2, 3]], 2)


@pytest.mark.parametrize("all_greedy", [False, True])
def test_greedy_never_picks_a_banned_argmax(all_greedy):
    logits, temp, _, top_p, seeds, steps = _sample_args(b=6, v=100, seed=5)
    top2 = logits.topk(2, dim=-1).indices
    banned = torch.full((6, 3), -1, dtype=torch.int64)
    banned[:, 0] = top2[:, 0]  # the argmax itself
    banned[2, 1] = top2[2, 1]  # row 2 also loses its runner-up
    out = _op_sample(logits, temp, torch.ones(6, dtype=torch.int32), top_p, seeds, steps, banned, all_greedy)
    expect = logits.masked_fill(banned_mask(banned, 100), float("-inf")).argmax(-1)
    assert torch.equal(out, expect)
    assert (out != top2[:, 0]).all() and int(out[2]) != int(top2[2, 1])
    assert torch.equal(out[[0, 1, 3, 4, 5]], top2[[0, 1, 3, 4, 5], 1])  # the next best instead


def test_sampling_never_picks_a_banned_id_over_many_seeds():
    g = torch.Generator().manual_seed(6)
    v, n = 30, 3000
    logits = torch.randn(1, v, generator=g).expand(n, v).contiguous()
    logits[:, 4] += 6.0  # id 4 would take most of the mass
    ban = torch.tensor([4, 11, 0])
    banned = ban.expand(n, 3).contiguous()
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    toks = _op_sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.int32), torch.ones(n), seeds,
                      torch.arange(n), banned)
    assert not torch.isin(toks, ban).any()
    assert len(set(toks.tolist())) == v - 3  # every other id stays reachable
    unbanned = _op_sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.int32), torch.ones(n), seeds,
                          torch.arange(n), _no_bans(n))
    assert (unbanned == 4).float().mean() > 0.5  # the ban, not the logits, kept id 4 out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("width", [1, 4])
def test_all_minus_one_bans_give_exactly_the_unmasked_tokens(seed, width):
    logits, temp, top_k, top_p, seeds, steps = _sample_args(b=64, v=200, seed=seed)
    temp[::4] = 0.0  # greedy rows among sampled ones
    out = _op_sample(logits, temp, top_k, top_p, seeds, steps, _no_bans(64, width))
    assert torch.equal(out, sample_tokens(logits, temp, top_k, top_p, seeds, steps))
    greedy = _op_sample(logits, temp, top_k, top_p, seeds, steps, _no_bans(64, width), True)
    assert torch.equal(greedy, logits.argmax(-1))


def test_sample_and_banned_mask_compile_fullgraph_to_the_same_results():
    logits, temp, top_k, top_p, seeds, steps = _sample_args(b=8, v=64, seed=9)
    banned = torch.tensor([[1, -1]] * 4 + [[-1, -1]] * 4)

    def step(logits, temp, top_k, top_p, seeds, steps, banned, out):
        torch.ops.tscompile.sample(logits, temp, top_k, top_p, seeds, steps, banned, out)
        return out

    eager = step(logits, temp, top_k, top_p, seeds, steps, banned, torch.empty(8, dtype=torch.int64))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(
        logits, temp, top_k, top_p, seeds, steps, banned, torch.empty(8, dtype=torch.int64))
    assert torch.equal(eager, compiled)
    # the mask itself traces whole: no data-dependent shapes, no host reads
    mask = torch.compile(banned_mask, fullgraph=True, backend="aot_eager")(banned, 64)
    assert torch.equal(mask, banned_mask(banned, 64))


def _greedy_cases(vocab, rows, width, dtype, device, seed):
    """Random logits with forced ties, bans (some on the argmax, -1 pads, out-of-range, repeats), a
    row banning its whole top, a row of -inf and a row with NaN."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    logits[:, vocab // 3] = logits[:, 7] = logits.max() + 1  # a tie between two chunks' entries
    banned = torch.full((rows, width), -1, dtype=torch.int64)
    for r in range(rows):
        n = int(torch.randint(0, width + 1, (1,), generator=g))
        ids = torch.randint(-3, vocab + 5, (n,), generator=g)
        banned[r, :n] = ids
    banned[0, 0] = 7  # bans the first of the tied maxima: the second must win
    banned[1, : min(2, width)] = torch.tensor([7, vocab // 3])[: min(2, width)]
    logits[2] = float("-inf")  # all -inf: token 0, as torch.argmax gives
    logits[3, vocab - 5] = float("nan")  # NaN wins at its first position
    logits[3, vocab // 2] = float("nan")
    return logits.to(device), banned.to(device)


@pytest.mark.parametrize("vocab, dtype", [(9000, torch.float32), (4096, torch.bfloat16), (130, torch.float32)])
@pytest.mark.parametrize("seed", range(2))
def test_greedy_kernel_equals_argmax_over_the_masked_logits(vocab, dtype, seed):
    """Under the Triton interpreter here; on the GPU the same comparison runs at 128k ids below."""
    from tscompile.custom_ops.greedy import greedy_tokens_with_bans
    logits, banned = _greedy_cases(vocab, rows=6, width=3, dtype=dtype, device="cpu", seed=seed)
    expected = torch.argmax(logits.masked_fill(banned_mask(banned, vocab), float("-inf")), dim=-1)
    out = torch.full((6,), -7, dtype=torch.int64)
    greedy_tokens_with_bans(logits, banned, out)
    assert out.tolist() == expected.tolist()
    assert out[0] == vocab // 3 and out[2] == 0 and out[3] == min(vocab // 2, vocab - 5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_greedy_op_equals_argmax_over_the_masked_logits(rows, dtype):
    vocab = 128256
    for seed in range(3):  # fresh inputs per check
        logits, banned = _greedy_cases(vocab, rows=max(rows, 4), width=9, dtype=dtype, device="cuda", seed=seed)
        logits, banned = logits[:rows], banned[:rows]
        expected = torch.argmax(logits.masked_fill(banned_mask(banned, vocab), float("-inf")), dim=-1)
        zeros = torch.zeros(rows, dtype=torch.float32, device="cuda")
        out = torch.full((rows,), -7, dtype=torch.int64, device="cuda")
        torch.ops.tscompile.sample(logits, zeros, zeros.int(), zeros + 1, zeros.long(), zeros.long(), banned, out,
                                   True)
        assert out.tolist() == expected.tolist()


def test_no_op_gives_a_mutated_argument_a_default():
    """torch 2.11 bumps the version of a mutated argument at its position in the call as made, and
    Inductor leaves an argument at its default out of the calls it generates: a mutated argument
    with a default is an IndexError there. Every tscompile op registered, none may have one."""
    import importlib
    import pkgutil

    import tscompile.custom_ops as ops

    for module in pkgutil.iter_modules(ops.__path__):
        if module.name != "flashinfer_attention":  # imports flashinfer, which CI lacks; it registers no op
            importlib.import_module(f"tscompile.custom_ops.{module.name}")
    names = [n for n in dir(torch.ops.tscompile) if hasattr(getattr(torch.ops.tscompile, n), "default")]
    assert {"gated_delta_rule", "causal_conv1d", "commit_state_checkpoints", "attention", "sample"} <= set(names)
    offending = [(n, a.name) for n in names for a in getattr(torch.ops.tscompile, n).default._schema.arguments
                 if a.alias_info is not None and a.alias_info.is_write and a.has_default_value()]
    assert offending == []
