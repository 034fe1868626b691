"""The correctness reference: a float32 eager greedy run of the same weights, and how far a mode's
tokens are from it.

In float32 a mode must decode the reference's tokens exactly: any difference is a bug, and the check
fails (``fail``; the bench exits non-zero). An engine mode also reports each token's log-probability
(``SamplingParams(logprobs=0)``, an untimed run): in float32 they must be the reference's within
``LOGPROB_ATOL``. That catches what leaves the argmax alone on trained weights, such as a decode
position off by one: the greedy tokens survive it, the probabilities do not. In a lower dtype (bf16
on cuda) a greedy pick between two near-equal logits can flip without any bug, so a mode's tokens are compared with a float32 run of the
*same* weights (the mode's weights upcast, not re-drawn in float32), and where they first differ the
reference's logits at that step say how close the call was: a top-2 margin of a few hundredths is a
near-tie, a mode that skipped a clear winner is suspicious. That report cannot prove a bf16 mode
right (on random weights nearly every step is a near-tie): the float32 run of the same modes is the
check that catches bugs.

The reference is the static-cache model run without compiling (``StaticCacheModel``, no torch.compile,
SDPA in float32), one request at a time; ``tests/test_bench.py`` checks it decodes the eager engine's
tokens. Its logits at step ``k`` are those of the prefix ``prompt + tokens[:k]``, which is the diverging
mode's prefix too (the two agree before ``k``): recording them during the greedy run is the rerun over
that prefix, without a second pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .static_cache_model import StaticCacheModel

TOP_K = 64  # candidates kept per step: a mode that picks a token below them is off by a wide gap anyway
# float32 log-probabilities of one token, engine against reference: summation order alone moves them
# by 1e-5 or less on the models benched; a real bug by far more
LOGPROB_ATOL = 1e-3


@dataclass
class Candidates:
    """One step's top reference logits, best first."""
    ids: list[int]
    logits: list[float]


@dataclass
class ReferenceRun:
    prompt: list[int]
    tokens: list[int]
    steps: list[Candidates]  # steps[k]: the logits that chose tokens[k]
    logprobs: list[float] | None = None  # logprobs[k]: tokens[k]'s log-probability


def top_candidates(logits: torch.Tensor, k: int = TOP_K) -> Candidates:
    """The ``k`` largest entries of one logits row (float32), best first."""
    vals, ids = logits.float().topk(min(k, logits.shape[-1]))
    return Candidates(ids.tolist(), vals.tolist())


def margin_at(step: Candidates, chosen: int) -> dict:
    """How close the reference's pick was at one step, and where ``chosen`` (a mode's pick) stood.

    ``margin``: top-1 minus top-2 logit (how near a tie the step is); ``chosen_rank``: 1-based rank of
    ``chosen`` among the candidates (None: below all of them); ``chosen_gap``: top-1 minus ``chosen``'s
    logit (a lower bound, the gap to the last candidate, when ``chosen`` is below them)."""
    top = step.logits[0]
    margin = top - step.logits[1] if len(step.logits) > 1 else None
    if chosen in step.ids:
        rank = step.ids.index(chosen) + 1
        gap = top - step.logits[rank - 1]
    else:
        rank, gap = None, top - step.logits[-1]
    return {"margin": margin, "chosen_rank": rank, "chosen_gap": gap}


def compare_logprobs(ref: ReferenceRun, got_tokens: list[int], got_logprobs: list[float]) -> dict:
    """Over the steps before the mode's tokens (``got_tokens``, of the run that gave ``got_logprobs``)
    first differ from the reference's: the largest difference of their log-probabilities
    (``max_logprob_diff``) and the step it falls on (``logprob_diff_at``)."""
    n = next((i for i, (a, b) in enumerate(zip(ref.tokens, got_tokens)) if a != b), min(len(ref.tokens), len(got_tokens)))
    diffs = [abs(a - b) for a, b in zip(ref.logprobs[:n], got_logprobs[:n])]
    if not diffs:
        return {}
    k = max(range(len(diffs)), key=diffs.__getitem__)
    return {"max_logprob_diff": diffs[k], "logprob_diff_at": k}


def compare(ref: ReferenceRun, got: list[int], threshold: float, *, exact: bool = False,
            logprobs: tuple[list[int], list[float]] | None = None) -> dict:
    """A mode's tokens for ``ref.prompt`` against the reference's.

    ``agrees``; else ``first_divergence`` (0-based index of the first differing new token; 0 is the
    prefill's token), the step's :func:`margin_at` figures and ``suspicious``: the mode's pick trails
    the reference's by more than ``threshold`` logits (or is not among the candidates). ``exact``
    (the mode ran in float32, as the reference): any difference is a failure, ``fail: True``.
    ``logprobs``: an engine mode's (tokens, log-probabilities) of the same prompt from an untimed run,
    compared where its tokens agree (``compare_logprobs``); in float32 a difference above
    ``LOGPROB_ATOL`` fails too."""
    n = min(len(ref.tokens), len(got))
    k = next((i for i in range(n) if ref.tokens[i] != got[i]), None)
    lp = compare_logprobs(ref, *logprobs) if logprobs is not None and ref.logprobs is not None else {}
    if k is None:
        if len(got) == len(ref.tokens):
            if exact and lp and lp["max_logprob_diff"] > LOGPROB_ATOL:
                return {"agrees": False, "compared_tokens": n, **lp, "suspicious": True, "fail": True,
                        "reason": f"the tokens agree, but token {lp['logprob_diff_at']}'s log-probability differs "
                                  f"from the reference's by {lp['max_logprob_diff']:.3g} (float32 allows "
                                  f"{LOGPROB_ATOL:g})"}
            return {"agrees": True, "compared_tokens": n, **lp}
        check = {"agrees": False, "compared_tokens": n, "first_divergence": n, "suspicious": True,
                 "reason": f"{len(got)} tokens, the reference has {len(ref.tokens)}"}
    else:
        fig = margin_at(ref.steps[k], got[k])
        suspicious = fig["chosen_rank"] is None or fig["chosen_gap"] > threshold
        check = {"agrees": False, "compared_tokens": n, "first_divergence": k, "reference_token": ref.tokens[k],
                 "mode_token": got[k], **fig, "suspicious": suspicious, **lp}
    if exact:
        check["fail"] = True
    return check


def failed(check: dict | None) -> bool:
    """Whether a row's check is a float32 mismatch (an error, not a note)."""
    return bool(check and check.get("fail"))


def describe(check: dict | None) -> str:
    """The markdown cell: "agrees (16 tok)", "diverges at 4 (margin 0.03)", flagged, or **FAIL** (float32)."""
    if not check:
        return "-"
    if check.get("error"):
        return "no reference"
    if check["agrees"]:
        if "max_logprob_diff" in check:
            return f"agrees ({check['compared_tokens']} tok, logprobs within {check['max_logprob_diff']:.1g})"
        return f"agrees ({check['compared_tokens']} tok)"
    flag = "**FAIL** (float32 must match)" if check.get("fail") else "**suspicious**"
    if "reason" in check:
        return f"{flag}: {check['reason']}"
    k, margin = check["first_divergence"], check["margin"]
    text = f"diverges at {k} (margin {margin:.3g}" if margin is not None else f"diverges at {k} ("
    rank = check["chosen_rank"]
    if rank != 2:  # took something other than the runner-up: say how far down
        text += (f"; took rank {rank}, gap {check['chosen_gap']:.3g}" if rank is not None
                 else f"; took a token outside the top {TOP_K}, gap > {check['chosen_gap']:.3g}")
    text += ")"
    return f"{flag}: {text}" if check["suspicious"] or check.get("fail") else text


@torch.no_grad()
def reference_greedy(model, prompt: list[int], output_len: int, device: torch.device) -> ReferenceRun:
    """Greedy ``output_len`` tokens of one prompt through the float32 static-cache model, uncompiled,
    keeping each step's top candidates. ``model`` must already be float32."""
    sm = StaticCacheModel(model, batch_size=1, max_len=len(prompt) + output_len)
    ids = torch.tensor([prompt], dtype=torch.int64, device=device)
    pos = torch.arange(len(prompt), device=device)
    tokens: list[int] = []
    steps: list[Candidates] = []
    logprobs: list[float] = []
    for k in range(output_len):
        logits = (sm.prefill(ids) if k == 0 else sm(ids, pos))[0]
        cand = top_candidates(logits)
        steps.append(cand)
        tokens.append(cand.ids[0])
        logprobs.append(cand.logits[0] - torch.logsumexp(logits.float(), dim=-1).item())
        ids = torch.tensor([[cand.ids[0]]], dtype=torch.int64, device=device)
        pos = pos[-1:] + 1
    return ReferenceRun(list(prompt), tokens, steps, logprobs)
