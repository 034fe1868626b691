"""Prefix caching on a GPU, float32: shared-prefix workloads give the tokens of caching off on the
same compiled engine (its prefill graphs serve both), under every attention backend, and for
llama-1b; every block is free or cached afterwards. Skipped without CUDA."""

from __future__ import annotations

import dataclasses
import importlib.util
import random

import pytest
import torch

import tscompile
from fuzz_lib import assert_idle
from helpers import ids
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


def _first_divergences(llm, prompts, params) -> list[str]:
    """Both runs again with the sampled tokens' logprobs: per differing request, where it diverges, the
    two picks with their logprobs and the largest logprob difference before (a float32 near-tie shows
    two picks within ~1e-5 and noise of that size; a bug shows a wide gap)."""
    params = [dataclasses.replace(sp, logprobs=0) for sp in params]
    runs = []
    for caching in (False, True):
        llm.scheduler.set_prefix_caching(caching)
        runs.append([o.outputs[0] for o in llm.generate(prompts, params)])
    lines = []
    for i, (a, b) in enumerate(zip(*runs)):
        la = [next(iter(d.values())).logprob for d in a.logprobs]
        lb = [next(iter(d.values())).logprob for d in b.logprobs]
        k = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if k is not None:
            noise = max((abs(x - y) for x, y in zip(la[:k], lb[:k])), default=0.0)
            lines.append(f"request {i}: token {k}: off {a.token_ids[k]} (logprob {la[k]:.7f}), on {b.token_ids[k]} "
                         f"(logprob {lb[k]:.7f}); largest logprob difference before: {noise:.2e}")
    return lines


def _off_then_on(llm, workloads) -> None:
    llm.scheduler.set_prefix_caching(False)
    want = [ids(llm.generate(p, sp)) for p, sp in workloads]
    assert llm.scheduler.set_prefix_caching(True)
    got = [ids(llm.generate(p, sp)) for p, sp in workloads]
    for n, (g, w) in enumerate(zip(got, want)):
        if g != w:
            pytest.fail(f"workload {n}: caching on differs from off:\n" + "\n".join(_first_divergences(llm, *workloads[n])))
    assert llm.stats().prefix_cache_hits > 0
    assert_idle(llm, "prefix caching on the GPU")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_model_caching_on_equals_off_under_every_backend(backend):
    llm = tscompile.LLM("llama-tiny", attention_backend=backend, device="cuda", dtype=torch.float32,
                        max_model_len=512, max_num_seqs=8, page_size=16, max_num_batched_tokens=256)
    rng = random.Random(3)
    _off_then_on(llm, _workloads(rng, llm.config.vocab_size, 8, [15, 16, 17, 160, 300]))


def test_llama_1b_float32_caching_on_equals_off():
    llm = tscompile.LLM("llama-1b", attention_backend="triton", device="cuda", dtype=torch.float32,
                        max_model_len=2304, max_num_seqs=16, page_size=16, max_num_batched_tokens=4096)
    rng = random.Random(4)
    _off_then_on(llm, _workloads(rng, llm.config.vocab_size, 16, [2048, 333]))


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
