"""Acceptance of drafted tokens: greedy against a per-request Python oracle, rejection sampling
against the target distribution by chi-square over many draws (fixed seeds, so deterministic)."""

from __future__ import annotations

import pytest
import torch

from tscompile.custom_ops.acceptance import filtered_probs
from tscompile.custom_ops.sampling import sample_tokens


def _outputs(bs, k):
    return torch.full((bs, k + 1), -7, dtype=torch.int64), torch.full((bs,), -7, dtype=torch.int32)


def _indptr(counts):
    return torch.tensor([0] + list(counts)).cumsum(0).to(torch.int32)


def _greedy_oracle(logits, drafts, counts, k):
    """Per request: the longest prefix of drafts equal to the argmax, then the argmax after it."""
    tokens, accepted, row, d = [], [], 0, 0
    for n in counts:
        argmax = logits[row:row + n + 1].argmax(-1).tolist()
        mine = drafts[d:d + n].tolist()
        a = 0
        while a < n and mine[a] == argmax[a]:
            a += 1
        tokens.append(mine[:a] + [argmax[a]] + [-1] * (k - a))
        accepted.append(a)
        row, d = row + n + 1, d + n
    return tokens, accepted


def test_greedy_constructed_cases():
    v, k = 6, 3
    # request 0: every draft matches; 1: first draft wrong; 2: second wrong; 3: no drafts at all
    argmax_rows = [[1, 2, 3, 4], [5, 0, 0, 0], [2, 2, 1, 0], [3]]
    drafts = [[1, 2, 3], [4, 0, 0], [2, 5, 1], []]
    logits = torch.randn(sum(len(r) for r in argmax_rows), v)
    for i, t in enumerate([t for r in argmax_rows for t in r]):
        logits[i, t] = logits[i].max() + 1 + torch.rand(()).item()
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
    out, acc = _outputs(4, k)
    torch.ops.tscompile.accept_greedy(logits, flat, _indptr([3, 3, 3, 0]), out, acc)
    assert acc.tolist() == [3, 0, 1, 0]
    assert out.tolist() == [[1, 2, 3, 4], [5, -1, -1, -1], [2, 2, -1, -1], [3, -1, -1, -1]]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_random_against_oracle(seed):
    g = torch.Generator().manual_seed(seed)
    v, k, bs = 5, 4, 12
    counts = torch.randint(0, k + 1, (bs,), generator=g).tolist()
    logits = torch.randn(sum(counts) + bs + 3, v, generator=g)  # 3 spare rows past the last request
    argmax = logits.argmax(-1)
    drafts, row = [], 0
    for n in counts:  # drafts that often match the target for a while, then diverge
        for j in range(n):
            hit = torch.rand((), generator=g) < 0.7
            drafts.append(int(argmax[row + j]) if hit else int(torch.randint(0, v, (), generator=g)))
        row += n + 1
    flat = torch.tensor(drafts, dtype=torch.int64)
    out, acc = _outputs(bs, k)
    torch.ops.tscompile.accept_greedy(logits, flat, _indptr(counts), out, acc)
    tokens, accepted = _greedy_oracle(logits, flat, counts, k)
    assert out.tolist() == tokens and acc.tolist() == accepted


def test_greedy_is_the_rejection_op_at_temperature_zero():
    g = torch.Generator().manual_seed(9)
    bs, k, v = 6, 3, 7
    logits = torch.randn(bs * (k + 1), v, generator=g)
    argmax = logits.argmax(-1).view(bs, k + 1)
    drafts = torch.where(torch.rand(bs, k, generator=g) < 0.6, argmax[:, :k], torch.randint(0, v, (bs, k), generator=g))
    indptr = (torch.arange(bs + 1) * k).to(torch.int32)
    out_g, acc_g = _outputs(bs, k)
    out_r, acc_r = _outputs(bs, k)
    torch.ops.tscompile.accept_greedy(logits, drafts.reshape(-1), indptr, out_g, acc_g)
    zeros = torch.zeros(bs)
    torch.ops.tscompile.accept_rejection(logits, drafts.reshape(-1), torch.zeros(0, v), indptr, zeros,
                                         torch.zeros(bs, dtype=torch.int32), torch.ones(bs),
                                         torch.arange(bs), torch.full((bs,), 40), out_r, acc_r)
    assert out_g.tolist() == out_r.tolist() and acc_g.tolist() == acc_r.tolist()


def test_opcheck_acceptance_ops():
    g = torch.Generator().manual_seed(1)
    bs, k, v = 3, 2, 5
    logits = torch.randn(bs * (k + 1), v, generator=g)
    drafts = torch.randint(0, v, (bs * k,), generator=g)
    indptr = (torch.arange(bs + 1) * k).to(torch.int32)
    torch.library.opcheck(torch.ops.tscompile.accept_greedy.default, (logits, drafts, indptr, *_outputs(bs, k)))
    q = torch.softmax(torch.randn(bs * k, v, generator=g), -1)
    args = (logits, drafts, q, indptr, torch.full((bs,), 0.8), torch.zeros(bs, dtype=torch.int32),
            torch.ones(bs), torch.arange(bs), torch.arange(bs) + 5, *_outputs(bs, k))
    torch.library.opcheck(torch.ops.tscompile.accept_rejection.default, args)


# ---------------------------------------------------------------------------------------------
# rejection sampling: the emitted tokens follow the target distribution exactly

DRAWS = 40000
V = 5


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs``; the p-value is the chi-square
    survival function, the regularised upper incomplete gamma Q(df / 2, chi2 / 2)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    total = counts.sum()
    expected = probs[keep] * total
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def _run_rejection(p_logits, q_probs, k, *, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """DRAWS requests with the same target rows (``p_logits [k + 1, V]``) and drafts drawn from
    ``q_probs [k, V]`` (None: one fixed draft per position, q one-hot); distinct seeds."""
    g = torch.Generator().manual_seed(seed)
    if q_probs is None:
        drafts = torch.tensor([2, 0, 4][:k]).repeat(DRAWS, 1)
        draft_probs = torch.zeros(0, V)
    else:
        drafts = torch.stack([torch.multinomial(q_probs[j], DRAWS, replacement=True, generator=g) for j in range(k)], 1)
        draft_probs = q_probs.repeat(DRAWS, 1)
    logits = p_logits.repeat(DRAWS, 1)
    indptr = (torch.arange(DRAWS + 1) * k).to(torch.int32)
    out, acc = _outputs(DRAWS, k)
    torch.ops.tscompile.accept_rejection(
        logits, drafts.reshape(-1), draft_probs, indptr, torch.full((DRAWS,), temperature),
        torch.full((DRAWS,), top_k, dtype=torch.int32), torch.full((DRAWS,), top_p),
        torch.arange(DRAWS) * 7919 + seed, torch.full((DRAWS,), 11), out, acc)
    return out, acc


def _check_target_distribution(out, p):
    """Token 0 of every request ~ p[0]; token 1 of the requests whose first draft was accepted (so
    token 0 is that draft and the target's row 1 applies) ~ p[1]."""
    first = torch.bincount(out[:, 0], minlength=V).double()
    assert _chi2_pvalue(first, p[0]) > 1e-3
    second = out[:, 1][out[:, 1] >= 0]
    assert second.numel() > 1000
    assert _chi2_pvalue(torch.bincount(second, minlength=V).double(), p[1]) > 1e-3


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8)])
def test_rejection_sampling_reproduces_the_target_with_a_draft_distribution(sampling):
    g = torch.Generator().manual_seed(3)
    k = 2
    p_logits = torch.randn(k + 1, V, generator=g) * 1.5
    q_logits = torch.randn(k, V, generator=g) * 1.5  # a drafter that disagrees with the target
    ones = lambda n, name, d: torch.full((n,), sampling.get(name, d))  # noqa: E731
    p = filtered_probs(p_logits, ones(k + 1, "temperature", 1.0), ones(k + 1, "top_k", 0).int(),
                       ones(k + 1, "top_p", 1.0))
    q = filtered_probs(q_logits, ones(k, "temperature", 1.0), ones(k, "top_k", 0).int(), ones(k, "top_p", 1.0))
    assert (p[:k] - q).abs().sum() > 0.3
    out, acc = _run_rejection(p_logits, q.float(), k, **sampling)
    assert 0 < acc.float().mean() < k  # some accepted, some rejected
    _check_target_distribution(out, p)


def test_rejection_sampling_reproduces_the_target_with_one_hot_drafts():
    g = torch.Generator().manual_seed(4)
    k = 3
    p_logits = torch.randn(k + 1, V, generator=g)
    p = torch.softmax(p_logits.double(), -1)
    out, acc = _run_rejection(p_logits, None, k, seed=1)
    # draft 0 is token 2: accepted with probability p[0][2]
    assert abs((acc > 0).double().mean() - p[0, 2]) < 0.02
    _check_target_distribution(out, p)


def test_the_chi_square_check_can_fail():
    """Emitting the drafts unconditionally (no rejection) must be caught by the same check."""
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(2, V, generator=g).double(), -1)
    q = torch.softmax(torch.randn(1, V, generator=g).double(), -1)
    drafts = torch.multinomial(q[0], DRAWS, replacement=True, generator=g)
    assert _chi2_pvalue(torch.bincount(drafts, minlength=V).double(), p[0]) < 1e-6


def test_filtered_probs_is_what_sample_draws_from():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(1, V, generator=g).repeat(DRAWS, 1)
    temp, top_k, top_p = torch.full((DRAWS,), 0.9), torch.full((DRAWS,), 3, dtype=torch.int32), torch.full((DRAWS,), 0.9)
    drawn = sample_tokens(logits, temp, top_k, top_p, torch.arange(DRAWS) * 31 + 1, torch.full((DRAWS,), 3))
    p = filtered_probs(logits[:1], temp[:1], top_k[:1], top_p[:1])[0]
    assert (p > 0).sum() <= 3
    assert _chi2_pvalue(torch.bincount(drawn, minlength=V).double(), p) > 1e-3


def test_rejection_is_deterministic_per_seed_and_independent_of_batching():
    g = torch.Generator().manual_seed(7)
    bs, k, v = 8, 3, 9
    logits = torch.randn(bs * (k + 1), v, generator=g)
    drafts = torch.randint(0, v, (bs * k,), generator=g)
    indptr = (torch.arange(bs + 1) * k).to(torch.int32)
    args = (torch.full((bs,), 1.0), torch.zeros(bs, dtype=torch.int32), torch.ones(bs), torch.arange(bs) + 100,
            torch.arange(bs) + 20)
    out, acc = _outputs(bs, k)
    torch.ops.tscompile.accept_rejection(logits, drafts, torch.zeros(0, v), indptr, *args, out, acc)
    for b in (0, 5):
        one, one_acc = _outputs(1, k)
        torch.ops.tscompile.accept_rejection(logits[b * (k + 1):(b + 1) * (k + 1)], drafts[b * k:(b + 1) * k],
                                             torch.zeros(0, v), (torch.arange(2) * k).to(torch.int32),
                                             *(a[b:b + 1] for a in args), one, one_acc)
        assert one.tolist()[0] == out.tolist()[b] and one_acc.tolist()[0] == acc.tolist()[b]


@pytest.mark.parametrize("op", ["greedy", "rejection"])
def test_a_negative_draft_pads_the_window_and_stops_the_run(op):
    """A uniform window whose drafter proposed fewer tokens: -1 pads; the token after the last real
    draft comes from the target row there (the bonus), never from a pad."""
    g = torch.Generator().manual_seed(8)
    bs, k, v = 4, 3, 6
    logits = torch.randn(bs * (k + 1), v, generator=g)
    argmax = logits.argmax(-1).view(bs, k + 1)
    drafts = argmax[:, :k].clone()
    drafts[0, 1:] = -1  # one real draft
    drafts[1, :] = -1  # none
    drafts[2, 2] = -1  # two
    indptr = (torch.arange(bs + 1) * k).to(torch.int32)
    out, acc = _outputs(bs, k)
    if op == "greedy":
        torch.ops.tscompile.accept_greedy(logits, drafts.reshape(-1), indptr, out, acc)
    else:  # greedy rows of the rejection op: temperature 0
        torch.ops.tscompile.accept_rejection(logits, drafts.reshape(-1), torch.zeros(0, v), indptr, torch.zeros(bs),
                                             torch.zeros(bs, dtype=torch.int32), torch.ones(bs), torch.arange(bs),
                                             torch.zeros(bs, dtype=torch.int64), out, acc)
    assert acc.tolist() == [1, 0, 2, 3]
    a = argmax.tolist()
    assert out.tolist() == [a[0][:2] + [-1, -1], a[1][:1] + [-1] * 3, a[2][:3] + [-1], a[3]]
