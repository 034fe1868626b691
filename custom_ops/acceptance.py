"""``tscompile::accept_greedy`` and ``tscompile::accept_rejection``: which drafted tokens a verify
step keeps, on the device, with no host read (both run inside a captured graph).

A verify step runs the target over each request's last token followed by its drafts; target row
``j`` of a request predicts the token after its row ``j``. Both ops read a ragged batch through flat
per-request offsets (a uniform window of width N is ``draft_indptr = arange(B + 1) * (N - 1)``):

    target_logits: [R, V] float    request b's rows are draft_indptr[b] + b .. draft_indptr[b + 1] + b
                                   (its n_b drafts + 1); rows past the last request's are ignored
    draft_tokens:  [D] int64       request b's drafts are draft_tokens[draft_indptr[b] : draft_indptr[b + 1]];
                                   an id < 0 is no draft: the run stops before it (it pads a uniform
                                   window whose drafter proposed fewer than N - 1 tokens)
    draft_indptr:  [B + 1] int32   cumulative draft counts; n_b = draft_indptr[b + 1] - draft_indptr[b]
                                   must be <= K (a request with no drafts emits one token: plain decode)
    out_tokens:    [B, K + 1] int64  mutated: the emitted tokens of each request (its accepted drafts,
                                   then the target's own token at the first rejection or after the
                                   last draft), padded with -1
    out_accepted:  [B] int32       mutated: accepted drafts a_b; request b emits a_b + 1 tokens

The caller advances request b by a_b + 1 tokens: its KV length after the step is the positions
before the window plus a_b + 1, so the rejected drafts' KV rows are simply never read again.

Greedy keeps the longest prefix of drafts equal to the target's argmax (first index on ties, as
``tscompile::sample``), then the argmax after it. Rejection sampling keeps draft j with probability
min(1, p_j(d) / q_j(d)) and, at the first rejection, samples the normalised residual
max(0, p_j - q_j); after the last accepted draft the bonus token is sampled from p. That leaves every
emitted token distributed exactly as the target's p (Leviathan et al. 2023, Chen et al. 2023). p is
the target's distribution after temperature / top-k / top-p, computed as ``tscompile::sample`` does
(``filtered_probs``); a drafter that reports probabilities must apply the same settings to its own
logits (``filtered_probs`` again). Without draft probabilities q is one-hot at the draft token (an
n-gram drafter), so a draft is accepted with probability p(d) and a rejection resamples p with d
removed. Randomness is the counter hash ``tscompile::sample`` uses, keyed by the request's seed and
the position each token takes, with one salt per use, so results do not depend on batching.
"""

from __future__ import annotations

import torch

from tscompile.custom_ops.sampling import filtered_sorted_probs, uniform_from_counter

# Per-use salts XOR-ed into the seed: the accept test and the token draw at one position get
# independent uniforms, and neither repeats the one ``tscompile::sample`` draws for that position.
_ACCEPT_SALT = 0x5DEECE66D
_DRAW_SALT = 0x2545F4914F6CDD1D


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """The distribution ``tscompile::sample`` draws from, in vocabulary order.

    logits: [R, V] float; temperature [R] float32 (<= 0: greedy), top_k [R] int32 (0: all, 1: greedy),
    top_p [R] float32 in (0, 1]. Returns [R, V] float64 rows summing to 1; a greedy row is one-hot at
    the argmax (the first index on ties)."""
    rows, vocab = logits.shape
    probs, sorted_ids, greedy, rank = filtered_sorted_probs(logits, temperature, top_k, top_p)
    probs = probs.double()
    probs = torch.where(greedy[:, None], (rank == 0).double(), probs)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros(rows, vocab, dtype=torch.float64, device=logits.device).scatter_(1, sorted_ids, probs)


def _window_index(draft_indptr: torch.Tensor, width: int, num_rows: int, num_drafts: int):
    """Per request b and window index j in [0, width): (target row, draft index, n_b), clamped into
    range (the masks built from n_b decide what counts), all [B, width] int64 except n_b [B]."""
    start = draft_indptr[:-1].long()
    n = draft_indptr[1:].long() - start
    j = torch.arange(width, device=draft_indptr.device)[None, :]
    b = torch.arange(start.shape[0], device=draft_indptr.device)[:, None]
    rows = (start[:, None] + b + j).clamp(0, max(num_rows - 1, 0))
    drafts = (start[:, None] + j).clamp(0, max(num_drafts - 1, 0))
    return rows, drafts, n


def _emit(drafts: torch.Tensor, last: torch.Tensor, accepted: torch.Tensor, out_tokens, out_accepted) -> None:
    """out_tokens[b] = drafts[b, :a_b], last[b], then -1; out_accepted = a_b.
    drafts: [B, K + 1] (column K unused), last: [B], accepted: [B]."""
    j = torch.arange(out_tokens.shape[1], device=out_tokens.device)[None, :]
    a = accepted[:, None]
    tokens = torch.where(j < a, drafts, torch.where(j == a, last[:, None], -1))
    out_tokens.copy_(tokens)
    out_accepted.copy_(accepted.to(out_accepted.dtype))


def _leading_run(ok: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] int64: how many leading entries are True."""
    return torch.cumprod(ok.long(), dim=1).sum(1)


def greedy_accept(target_logits, draft_tokens, draft_indptr, out_tokens, out_accepted) -> None:
    """Body of ``tscompile::accept_greedy`` (shapes in the module docstring)."""
    bs, width = out_tokens.shape
    if bs == 0:
        return
    rows, didx, n = _window_index(draft_indptr, width, target_logits.shape[0], draft_tokens.shape[0])
    argmax = torch.argmax(target_logits, dim=-1)[rows]  # [B, K + 1]: the target's token after row j
    drafts = draft_tokens[didx] if draft_tokens.shape[0] else torch.zeros_like(argmax)
    j = torch.arange(width, device=out_tokens.device)[None, :]
    ok = (drafts == argmax) & (j < n[:, None])  # a -1 pad never equals an argmax
    accepted = _leading_run(ok[:, : width - 1]) if width > 1 else torch.zeros_like(n)
    last = argmax.gather(1, accepted[:, None])[:, 0]
    _emit(drafts, last, accepted, out_tokens, out_accepted)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [..., V] float64 (not necessarily normalised), u [...] in [0, 1)."""
    cdf = torch.cumsum(probs, dim=-1)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    # a zero-probability token is never chosen: the first index whose cdf exceeds u * total
    choice = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True)[..., 0]
    return choice.clamp(max=probs.shape[-1] - 1)


def rejection_accept(target_logits, draft_tokens, draft_probs, draft_indptr, temperature, top_k, top_p, seeds,
                     steps, out_tokens, out_accepted) -> None:
    """Body of ``tscompile::accept_rejection``. Beyond the module docstring's arguments:

    draft_probs: [D, V] float, q of each draft (already filtered like p), or [0, V] / [0, 0]: the
    drafter has none (q one-hot). temperature, top_k, top_p, seeds, steps: [B] per request, as
    ``tscompile::sample`` takes them; steps[b] is the position request b's first emitted token takes
    (token j of the window takes steps[b] + j)."""
    bs, width = out_tokens.shape
    if bs == 0:
        return
    vocab = target_logits.shape[1]
    rows, didx, n = _window_index(draft_indptr, width, target_logits.shape[0], draft_tokens.shape[0])
    per_row = lambda t: t[:, None].expand(bs, width).reshape(-1)  # noqa: E731  [B] -> [B * (K + 1)]
    p = filtered_probs(target_logits[rows.reshape(-1)], per_row(temperature), per_row(top_k),
                       per_row(top_p)).view(bs, width, vocab)
    drafts = draft_tokens[didx] if draft_tokens.shape[0] else torch.zeros_like(rows)
    j = torch.arange(width, device=out_tokens.device)[None, :]
    has_draft = (j < n[:, None]) & (drafts >= 0)  # [B, K + 1]
    drafts = drafts.clamp(0, vocab - 1)
    if draft_probs.shape[0]:
        q = draft_probs[didx].double()  # [B, K + 1, V]
    else:
        q = torch.zeros(bs, width, vocab, dtype=torch.float64, device=target_logits.device)
        q.scatter_(2, drafts[:, :, None], 1.0)
    q = torch.where(has_draft[:, :, None], q, 0.0)
    p_d = p.gather(2, drafts[:, :, None])[:, :, 0]
    q_d = q.gather(2, drafts[:, :, None])[:, :, 0]
    positions = steps.long()[:, None] + j  # the position token j of the window takes
    u_accept = uniform_from_counter((seeds.long() ^ _ACCEPT_SALT)[:, None], positions)
    ok = (u_accept * q_d < p_d) & has_draft  # accept with probability min(1, p / q)
    accepted = _leading_run(ok[:, : width - 1]) if width > 1 else torch.zeros_like(n)
    # the token after the accepted run: the residual at a rejection, p itself after the last draft;
    # a residual with no mass (p == q, so no rejection could happen) falls back to p
    residual = (p - q).clamp(min=0.0)
    residual = torch.where((residual.sum(-1, keepdim=True) > 0) & has_draft[:, :, None], residual, p)
    pick = accepted[:, None, None].expand(bs, 1, vocab)
    dist = residual.gather(1, pick)[:, 0]  # [B, V]
    u_draw = uniform_from_counter(seeds.long() ^ _DRAW_SALT, steps.long() + accepted)
    last = _draw(dist, u_draw)
    _emit(drafts, last, accepted, out_tokens, out_accepted)


@torch.library.custom_op("tscompile::accept_greedy", mutates_args=("out_tokens", "out_accepted"))
def accept_greedy(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_indptr: torch.Tensor,
    out_tokens: torch.Tensor,
    out_accepted: torch.Tensor,
) -> None:
    greedy_accept(target_logits, draft_tokens, draft_indptr, out_tokens, out_accepted)


@accept_greedy.register_fake
def _(target_logits, draft_tokens, draft_indptr, out_tokens, out_accepted):
    return None


@torch.library.custom_op("tscompile::accept_rejection", mutates_args=("out_tokens", "out_accepted"))
def accept_rejection(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_indptr: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    out_tokens: torch.Tensor,
    out_accepted: torch.Tensor,
) -> None:
    rejection_accept(target_logits, draft_tokens, draft_probs, draft_indptr, temperature, top_k, top_p, seeds,
                     steps, out_tokens, out_accepted)


@accept_rejection.register_fake
def _(target_logits, draft_tokens, draft_probs, draft_indptr, temperature, top_k, top_p, seeds, steps, out_tokens,
      out_accepted):
    return None
