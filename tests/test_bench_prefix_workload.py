"""``tscompile bench --prefix-workload``: the shared-prefix and chat workloads on a tiny eager engine,
caching off and on over the same engine: same greedy tokens, hits only with caching, and the report."""

from __future__ import annotations

import argparse

import pytest
import torch

from fuzz_lib import assert_idle
from helpers import small_llm
from tscompile.bench import prefix_workload


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return small_llm(dtype=torch.float32, enforce_eager=True, max_model_len=96, page_size=4)


def _args(**kw) -> argparse.Namespace:
    args = argparse.Namespace(prefix_requests=3, prefix_len=21, prefix_suffix_len=5, chat_turns=2, output_len=3,
                              seed=4)
    vars(args).update(kw)
    return args


def test_shared_prefix_prompts_share_exactly_the_prefix():
    prompts = prefix_workload.shared_prefix_prompts(0, 500, 4, 16, 3)
    assert len({tuple(p[:16]) for p in prompts}) == 1 and len({tuple(p[16:]) for p in prompts}) == 4
    assert all(len(p) == 19 and 0 < min(p) and max(p) < 500 for p in prompts)


@pytest.mark.parametrize("workload", ["shared", "chat"])
def test_caching_off_and_on_give_the_same_tokens_and_only_on_hits(llm, workload):
    args = _args()
    off = prefix_workload.measure(llm, workload, args, llm.config.vocab_size, llm.device, enabled=False)
    on = prefix_workload.measure(llm, workload, args, llm.config.vocab_size, llm.device, enabled=True)
    assert off["outputs"] == on["outputs"] and off["hit_rate"] == 0 and on["hit_rate"] > 0
    turns = 2 if workload == "chat" else 1
    assert on["requests"] == off["requests"] == 3 * turns
    # the shared blocks are computed once: 20 of the first 21 tokens of every request but the first
    assert on["hit_tokens"] >= 2 * 20
    assert on["prefill_ms"] > 0 and on["prompt_tokens"] == off["prompt_tokens"]
    assert_idle(llm, workload)
    on.pop("outputs"), off.pop("outputs")
    md = prefix_workload.markdown({"workload": workload, "model": "llama-tiny", "device": "cpu", "dtype": "float32",
                                   "attention_backend": "torch", "shape": "-", "rows": [off, on], "outputs_equal": True})
    assert "| on |" in md and "| off |" in md and "prefill time off/on" in md


def test_the_workload_flags_are_refused_below_one():
    args = _args(prefix_requests=0, prefix_len=None, prefix_suffix_len=None, chat_turns=None, output_len=None)
    with pytest.raises(ValueError, match="tscompile: --prefix-requests 0 must be >= 1"):
        prefix_workload._fill_defaults(args, gpu=False)


def test_distinct_prompts_share_no_first_block():
    prompts = prefix_workload.distinct_prompts(0, 500, 6, 9)
    assert len({tuple(p[:4]) for p in prompts}) == 6 and all(len(p) == 9 for p in prompts)


def test_the_distinct_workload_alternates_the_settings_and_never_hits(llm, monkeypatch):
    args = _args(prefix_requests=3, prefix_len=6, prefix_suffix_len=3)
    settings = []  # caching on or off at each pass: warm-ups, then the measured passes
    run_workload = prefix_workload.run_workload

    def recording(llm, *a):
        settings.append(llm.prefix_caching)
        return run_workload(llm, *a)

    monkeypatch.setattr(prefix_workload, "run_workload", recording)
    off, on = prefix_workload.measure_interleaved(llm, "distinct", args, llm.config.vocab_size, llm.device)
    assert settings == [False, True] * (1 + prefix_workload.DISTINCT_ROUNDS)
    assert not off["prefix_caching"] and on["prefix_caching"]
    assert off["hit_tokens"] == on["hit_tokens"] == 0 and on["queried_tokens"] == 2 * 3 * 9
    assert off["outputs"] == on["outputs"] and len(on["outputs"]) == 2 * 3
    assert len(on["host_until_step_ms"]) == len(on["host_until_launch_ms"]) == len(on["ttft_ms"]) == 2 * 3
    assert on["passes"] == 2
    for row in (off, on):  # the launch returns inside its step, which returns before the first token
        times = zip(row["host_until_launch_ms"], row["host_until_step_ms"], row["ttft_ms"])
        assert all(0 < launched < stepped <= first for launched, stepped, first in times)
    assert "launch" not in vars(llm.runner)  # the timing wrapper is gone
    assert_idle(llm, "distinct")
    on.pop("outputs"), off.pop("outputs")
    md = prefix_workload.markdown({"workload": "distinct", "model": "llama-tiny", "device": "cpu", "dtype": "float32",
                                   "attention_backend": "torch", "shape": "-", "rows": [off, on], "outputs_equal": True})
    assert "host until launch ms (median) | host until step returned ms (median)" in md
    assert "on/off: host until launch" in md and "host until step returned" in md
