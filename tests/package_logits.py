"""Logits of a loaded package against the engine's, step by step on the same tokens (teacher forced).

A bf16 package and the bf16 engine are different Inductor/eager graphs, so their greedy tokens may
part at a near-tie; their logits on the same sequence must still agree within what bf16 itself
costs. The tolerance is measured, not chosen: the engine's bf16 logits against its own float32
logits on the same sequences.

Where the logits come from:

- the package: its programs return only the sampled tokens, but they sample through the Python
  ``tscompile::sample`` op (AOTInductor calls custom ops through its proxy executor), which hands the
  logits to ``sample_tokens``; a tap on that function records them. No package change is needed.
- the engine: a hook on its LM head records the logits and raises the package's token to the top,
  so the engine prefills the same prompt and decodes the same tokens as the package did.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import tscompile.custom_ops.sampling as sampling_op
from tscompile import SamplingParams


@contextmanager
def sampler_tap():
    """Yields a list that receives ``(logits [B, V] float32, tokens [B])`` of every sampling call
    that reaches ``sample_tokens`` (every call a packaged program makes)."""
    seen, original = [], sampling_op.sample_tokens

    def tap(logits, *rest):
        tokens = original(logits, *rest)
        seen.append((logits.detach().float().cpu().clone(), tokens.detach().cpu().clone()))
        return tokens

    sampling_op.sample_tokens = tap
    try:
        yield seen
    finally:
        sampling_op.sample_tokens = original


def package_step_logits(package, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """The package's greedy tokens for one prompt and the logits it sampled each from:
    ``(tokens, [steps, V])``; row 0 is the prefill program's, the rest the decode program's."""
    with sampler_tap() as seen:
        tokens = package.generate([prompt], SamplingParams(max_new_tokens=steps))[0].outputs[0].token_ids
    assert len(seen) == steps, f"the sampler tap saw {len(seen)} calls for {steps} steps: the package " \
                               "does not sample through tscompile.custom_ops.sampling.sample_tokens"
    assert all(logits.shape[0] == 1 for logits, _ in seen)  # one request: row 0 is this prompt's
    assert [int(t[0]) for _, t in seen] == tokens  # the tap saw the very calls that made the tokens
    return tokens, torch.cat([logits for logits, _ in seen])


def engine_forced_logits(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The eager engine's logits ``[len(tokens), V]`` for ``prompt`` followed by ``tokens``: step i
    records the LM head's output, then makes ``tokens[i]`` its greedy choice."""
    seen, rows = [], []

    def force(module, args, out):
        if len(seen) >= len(tokens):  # a step past the last (asynchronous scheduling): leave it be
            return None
        rows.append(out.shape[0])
        seen.append(out[:1].detach().float().cpu().clone())  # row 0 is the one request's
        forced = out.clone()
        forced[:, tokens[len(seen) - 1]] = torch.finfo(out.dtype).max
        return forced

    hook = engine.model.output.register_forward_hook(force)
    try:
        got = engine.generate([prompt], SamplingParams(max_new_tokens=len(tokens)))[0].outputs[0].token_ids
    finally:
        hook.remove()
    assert got == tokens, (got, tokens)  # the engine walked the package's sequence
    # one request: each step's LM head runs its row, padded to two in an extend step
    # (tscompile.runtime.dynamic_sizes.min_logits_rows)
    assert all(r in (1, 2) for r in rows), rows
    return torch.cat(seen)


def _relative_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row ``||a - b|| / ||b||`` (float64)."""
    a, b = a.double(), b.double()
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def bf16_package_logit_errors(package, bf16_engine, fp32_engine, prompts: list[list[int]], steps: int) -> dict:
    """Per (prompt, step) row, relative L2 errors: ``engine`` (the engine's bf16 against its float32:
    what bf16 costs), ``package_vs_fp32`` and ``package_vs_bf16``; and ``steps`` per prompt."""
    rows = {"engine": [], "package_vs_fp32": [], "package_vs_bf16": []}
    for prompt in prompts:
        tokens, ours = package_step_logits(package, prompt, steps)
        bf16 = engine_forced_logits(bf16_engine, prompt, tokens)
        fp32 = engine_forced_logits(fp32_engine, prompt, tokens)
        rows["engine"].append(_relative_errors(bf16, fp32))
        rows["package_vs_fp32"].append(_relative_errors(ours, fp32))
        rows["package_vs_bf16"].append(_relative_errors(ours, bf16))
    return {k: torch.stack(v) for k, v in rows.items()}


def assert_bf16_package_logits_match_engine(package, bf16_engine, fp32_engine, prompts, steps: int = 4) -> dict:
    """The package's bf16 logits, at its prefill and each decode step, are as close to the float32
    engine as twice the engine's own bf16 error, and within three times it of the bf16 engine: two
    bf16 runs that each round like the engine differ by at most the sum of their errors (2x); the
    third share is room for the package rounding at other points (Inductor fuses in float32)."""
    errors = bf16_package_logit_errors(package, bf16_engine, fp32_engine, prompts, steps)
    cost = float(errors["engine"].max())
    assert cost > 0, "the bf16 engine equals the float32 engine: the tolerance would prove nothing"
    worst = {k: float(v.max()) for k, v in errors.items()}
    assert (errors["package_vs_fp32"] <= 2 * cost).all(), (worst, errors["package_vs_fp32"])
    assert (errors["package_vs_bf16"] <= 3 * cost).all(), (worst, errors["package_vs_bf16"])
    return worst
