"""Prefix caching on a GPU, float32: shared-prefix workloads give the tokens of caching off on the
same compiled engine (its prefill graphs serve both) under every attention backend; for llama-1b
the log-probabilities agree within float32 noise and a token may differ only at a near tie; every
block is free or cached afterwards. Skipped without CUDA."""

from __future__ import annotations

import dataclasses
import importlib.util
import random

import pytest
import torch

import tscompile
from fuzz_lib import assert_idle
from helpers import FLOAT32_NOISE, ids  # a hit's shorter prefill rounds its products differently
from tscompile import SamplingParams

pytestmark = pytest.mark.gpu

HAVE_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _workloads(rng: random.Random, vocab: int, n: int, prefix_lens: list[int]):
    out = []
    for prefix_len in prefix_lens:
        prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
        prompts = [prefix + [rng.randrange(1, vocab) for _ in range(rng.randint(0, 40))] for _ in range(n)]
        params = [SamplingParams(max_new_tokens=rng.randint(2, 24), ignore_eos=True) for _ in range(n)]
        out.append((prompts, params))
    return out


def _with_logprobs(llm, prompts, params, caching: bool):
    llm.scheduler.set_prefix_caching(caching)
    params = [dataclasses.replace(sp, logprobs=0) for sp in params]
    out = []
    for o in llm.generate(prompts, params):
        c = o.outputs[0]
        out.append((list(c.token_ids), [next(iter(d.values())).logprob for d in c.logprobs]))
    return out


def _first_divergences(off, on) -> tuple[list[str], int]:
    """Per request that differs: where, both picks with their log-probabilities and the largest
    log-probability difference of the equal tokens before; and how many requests differ."""
    lines, differing = [], 0
    for i, ((ta, la), (tb, lb)) in enumerate(zip(off, on)):
        k = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        noise = max((abs(x - y) for x, y in zip(la[:k], lb[:k])), default=0.0)
        if k is not None:
            differing += 1
            lines.append(f"request {i}: token {k}: off {ta[k]} (logprob {la[k]:.7f}), on {tb[k]} "
                         f"(logprob {lb[k]:.7f}); largest logprob difference before: {noise:.2e}")
    return lines, differing


def _assert_logprobs_agree(off, on, what: str) -> None:
    """Caching on against off in float32 at other GEMM shapes: every equal token's log-probability
    within ``FLOAT32_NOISE``, and a request may leave the other run only at a near tie: both picks
    equally likely within the noise (a pick is the most likely token of its own run, so two runs that
    agree within the noise give their two picks log-probabilities within it). A wrong prefix fails
    on the first token of a hit request."""
    lines, differing = _first_divergences(off, on)
    for i, ((ta, la), (tb, lb)) in enumerate(zip(off, on)):
        k = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        for j in range(k + 1 if k < len(ta) else k):
            assert abs(la[j] - lb[j]) <= FLOAT32_NOISE, \
                f"{what}: request {i} token {j}: logprob {la[j]:.7f} off, {lb[j]:.7f} on\n" + "\n".join(lines)
    assert differing <= max(1, len(off) // 8), f"{what}: {differing} of {len(off)} requests differ\n" + "\n".join(lines)


def _off_then_on(llm, workloads) -> None:
    """Token for token (the tiny model: its logits are far from ties)."""
    llm.scheduler.set_prefix_caching(False)
    want = [ids(llm.generate(p, sp)) for p, sp in workloads]
    assert llm.scheduler.set_prefix_caching(True)
    got = [ids(llm.generate(p, sp)) for p, sp in workloads]
    for n, (g, w) in enumerate(zip(got, want)):
        if g != w:
            off, on = _with_logprobs(llm, *workloads[n], False), _with_logprobs(llm, *workloads[n], True)
            pytest.fail(f"workload {n}: caching on differs from off:\n" + "\n".join(_first_divergences(off, on)[0]))
    assert llm.stats().prefix_cache_hits > 0
    assert_idle(llm, "prefix caching on the GPU")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_model_caching_on_equals_off_under_every_backend(backend):
    llm = tscompile.LLM("llama-tiny", attention_backend=backend, device="cuda", dtype=torch.float32,
                        max_model_len=512, max_num_seqs=8, page_size=16, max_num_batched_tokens=256)
    rng = random.Random(3)
    _off_then_on(llm, _workloads(rng, llm.config.vocab_size, 8, [15, 16, 17, 160, 300]))


def test_llama_1b_float32_caching_on_agrees_with_off():
    """llama-1b's random weights give 128,256 nearly flat logits, where a near tie is common: caching
    on must agree with off within float32 noise (``_assert_logprobs_agree``), and most requests token
    for token."""
    llm = tscompile.LLM("llama-1b", attention_backend="triton", device="cuda", dtype=torch.float32,
                        max_model_len=2304, max_num_seqs=16, page_size=16, max_num_batched_tokens=4096)
    rng = random.Random(4)
    for n, (prompts, params) in enumerate(_workloads(rng, llm.config.vocab_size, 16, [2048, 333])):
        off = _with_logprobs(llm, prompts, params, False)
        hits = llm.stats().prefix_cache_hits
        on = _with_logprobs(llm, prompts, params, True)
        assert llm.stats().prefix_cache_hits > hits
        _assert_logprobs_agree(off, on, f"workload {n}")
    assert_idle(llm, "prefix caching on the GPU")


@pytest.mark.skipif(not HAVE_FLASHINFER, reason="flashinfer-python is not installed")
def test_flashinfer_float16_hits_run_and_first_tokens_agree_with_caching_off():
    """FlashInfer has no float32 kernels: in float16 a hit changes the prefill's shapes and so its
    rounding (docs/prefix_caching.md), so only the first token of each request, whose logits are
    far from a tie in nearly every case, is compared, and most must agree."""
    llm = tscompile.LLM("llama-tiny", attention_backend="flashinfer", device="cuda", dtype=torch.float16,
                        max_model_len=512, max_num_seqs=8, page_size=16, max_num_batched_tokens=256)
    workloads = _workloads(random.Random(5), llm.config.vocab_size, 8, [16, 160, 300])
    llm.scheduler.set_prefix_caching(False)
    want = [ids(llm.generate(p, sp)) for p, sp in workloads]
    assert llm.scheduler.set_prefix_caching(True)
    got = [ids(llm.generate(p, sp)) for p, sp in workloads]
    firsts = [(a[0], b[0]) for w, g in zip(want, got) for a, b in zip(w, g)]
    assert sum(a == b for a, b in firsts) >= 0.9 * len(firsts)
    assert llm.stats().prefix_cache_hits > 0
    assert_idle(llm, "flashinfer")
