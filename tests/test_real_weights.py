"""The engine gives a trained model's answer: SmolLM2-135M-Instruct's greedy tokens, eager and compiled,
equal transformers' in float32 for a chat turn, code, non-ASCII text, a several-hundred-token prompt
and a one-token prompt, run together as one batch of mixed lengths; the decoded text matches too.
In bf16 the first divergence from the float32 tokens and the reference's top-2 margin there are
reported (bf16 rounding may flip a near-tie, so they are not asserted equal)."""

from __future__ import annotations

import pytest
import torch

import tscompile
from real_weights import MODEL, checkpoint_or_skip, divergence_report, hf_greedy, load_hf, prompts

NEW_TOKENS = 6
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def checkpoint():
    return checkpoint_or_skip()


@pytest.fixture(scope="module")
def oracle(checkpoint):
    """The prompts, the transformers float32 greedy run of each, and the tokenizer."""
    from tscompile.text import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    named = prompts(tokenizer)
    model = load_hf(checkpoint)
    runs = {name: hf_greedy(model, ids, NEW_TOKENS) for name, ids in named.items()}
    del model
    return named, runs, tokenizer


def _engine_tokens(checkpoint, named, *, enforce_eager: bool, dtype: torch.dtype) -> dict[str, tuple[list[int], str]]:
    # by name: the named model resolves to the cached checkpoint
    llm = tscompile.LLM(MODEL, enforce_eager=enforce_eager, device="cpu", attention_backend="torch",
                        dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=len(named), page_size=16)
    params = tscompile.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in named.values()], params)
    return {name: (o.outputs[0].token_ids, o.outputs[0].text) for name, o in zip(named, outs)}


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_greedy_tokens_and_text_equal_transformers_float32(checkpoint, oracle, enforce_eager):
    named, runs, tokenizer = oracle
    got = _engine_tokens(checkpoint, named, enforce_eager=enforce_eager, dtype=torch.float32)
    wrong = [divergence_report(name, runs[name], tokens) for name, (tokens, _) in got.items()
             if tokens != runs[name].tokens]
    assert not wrong, "engine tokens differ from transformers' (float32):\n" + "\n".join(wrong)
    for name, (tokens, text) in got.items():
        assert text == tokenizer.decode(runs[name].tokens, skip_special_tokens=True), name
    # the tokens are a trained model's: the chat answer is text, not a repeated or special token
    chat = got["chat"][1]
    assert len(set(got["chat"][0])) > 2 and chat.strip(), chat


def test_bf16_first_divergence_and_margin_are_reported(checkpoint, oracle, record_property, capsys):
    """bf16 eager against the float32 transformers tokens: per prompt, where the tokens first differ
    and the reference's top-2 margin there. Where they differ, the bf16 pick must still be one of the
    reference's top candidates (a bug picks far outside them); equality is not asserted."""
    named, runs, _ = oracle
    got = _engine_tokens(checkpoint, named, enforce_eager=True, dtype=torch.bfloat16)
    from tscompile.bench.reference import compare

    lines = []
    for name, (tokens, _) in got.items():
        check = compare(runs[name], tokens, threshold=0.5)
        lines.append(divergence_report(name, runs[name], tokens))
        record_property(f"bf16_{name}", lines[-1])
        if not check["agrees"]:
            assert check.get("chosen_rank") is not None and check["chosen_rank"] <= 5, lines[-1]
    with capsys.disabled():
        print("\nbf16 vs float32 transformers:\n  " + "\n  ".join(lines))
