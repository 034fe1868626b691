"""``SamplingParams(logprobs=0)``: each sampled token's log-probability under the model's raw
distribution, in vLLM's output shape. Checked against transformers' float32 log-softmax of the same
checkpoint over the prompt plus the engine's own tokens (teacher forcing), for greedy and seeded
sampling, eager and compiled, in mixed batches where other requests do not ask."""

from __future__ import annotations

import pytest
import torch

import tscompile
from helpers import FLOAT32_NOISE, TEXTS, assert_equal_but_near_ties, top_two, write_text_checkpoint
from tscompile import SamplingParams
from tscompile.outputs import Logprob

ATOL = 2e-4  # float32: the engine's paged attention and transformers' SDPA differ in summation order


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, model, tok, _ = write_text_checkpoint(tmp_path_factory.mktemp("logprobs"))
    return path, model, tok


def _engine(path, **kw):
    kw.setdefault("enforce_eager", True)
    return tscompile.LLM(str(path), device="cpu", dtype=torch.float32, attention_backend="torch",
                         max_model_len=96, max_num_seqs=4, page_size=4, **kw)


def _reference_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probability of each of ``tokens`` following ``prompt`` and the tokens before it."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [lp[start + i, t].item() for i, t in enumerate(tokens)]


def _check(out, model, prompt):
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) > 0
    assert all(list(d) == [t] and isinstance(d[t], Logprob) for d, t in zip(comp.logprobs, comp.token_ids))
    got = [d[t].logprob for d, t in zip(comp.logprobs, comp.token_ids)]
    want = _reference_logprobs(model, prompt, comp.token_ids)
    assert max(abs(a - b) for a, b in zip(got, want)) < ATOL, (got, want)
    assert comp.cumulative_logprob == pytest.approx(sum(got))
    return got


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_logprobs_equal_transformers_for_greedy_and_sampled_requests_in_one_batch(checkpoint, enforce_eager):
    path, model, tok = checkpoint
    llm = _engine(path, enforce_eager=enforce_eager)
    prompts = [tok(t).input_ids for t in TEXTS]
    params = [SamplingParams(max_tokens=7, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True),  # asks for none: gets none
              SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=11, logprobs=0, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    greedy = _check(outs[0], model, prompts[0])
    assert outs[1].outputs[0].logprobs is None and outs[1].outputs[0].cumulative_logprob is None
    _check(outs[2], model, prompts[2])
    # a greedy token is the most likely one: its log-probability is the row's largest
    ref = model(torch.tensor([prompts[0] + outs[0].outputs[0].token_ids])).logits[0].log_softmax(-1)
    assert all(abs(g - ref[len(prompts[0]) - 1 + i].max().item()) < ATOL for i, g in enumerate(greedy))


def test_logprobs_survive_chunked_prefill_and_a_stop_token(checkpoint):
    """A prompt split over several prefill chunks (an open chunk samples nothing), then a stop token
    that ends the request: one log-probability per returned token, the stop token's included."""
    path, model, tok = checkpoint
    llm = _engine(path, max_num_batched_tokens=8)
    prompt = tok(TEXTS[0] + " " + TEXTS[1]).input_ids
    assert len(prompt) > 8
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, ignore_eos=True))[0]
    stop = first.outputs[0].token_ids[3]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[stop], logprobs=0))[0]
    assert out.outputs[0].token_ids == first.outputs[0].token_ids[: first.outputs[0].token_ids.index(stop) + 1]
    _check(out, model, prompt)


@pytest.mark.parametrize("value", [1, 5, -1, 0.5, True])
def test_logprobs_other_than_zero_or_none_are_refused(value):
    with pytest.raises(ValueError, match=r"^tscompile: logprobs="):
        SamplingParams(logprobs=value)


def test_speculative_decoding_refuses_logprobs_before_queueing(checkpoint):
    path, _, tok = checkpoint
    llm = _engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"^tscompile: logprobs=0 is not returned by speculative decoding"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=0))
    assert not llm.has_unfinished()


def test_decode_graphs_sample_without_logprobs_and_a_step_that_asks_runs_without_one(checkpoint):
    """With decode graphs (HostGraphs on the CPU), a batch that asks for log-probabilities decodes
    without replaying (the graphs carry no log-softmax) and gets transformers' values; the same
    batch without them replays the graphs and decodes the same tokens."""
    from tscompile.counters import counters
    from tscompile.runtime.graph_runner import HostGraphs

    path, model, tok = checkpoint
    llm = _engine(path)
    llm.runner.use_graphs(HostGraphs())
    prompt = tok(TEXTS[0]).input_ids
    before = counters["decode_replays"]
    asked = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0))[0]
    assert counters["decode_replays"] == before
    _check(asked, model, prompt)
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert counters["decode_replays"] > before
    assert plain.outputs[0].token_ids == asked.outputs[0].token_ids and plain.outputs[0].logprobs is None


def test_top_two_gives_the_reference_two_most_likely_tokens_and_their_raw_log_probabilities(checkpoint):
    """The GPU equality tests' near-tie check asks the engine for its pick and runner-up (the pick
    with the first banned): both must be transformers' top two with their unbanned log-probabilities."""
    path, model, tok = checkpoint
    llm = _engine(path)
    for text in TEXTS[:3]:
        context = tok(text)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([context])).logits[0, -1].float(), dim=-1)
        want = torch.topk(lp, 2)
        (t1, l1), (t2, l2) = top_two(llm, context)
        assert [t1, t2] == want.indices.tolist()
        assert l1 == pytest.approx(want.values[0].item(), abs=ATOL) and l2 == pytest.approx(want.values[1].item(),
                                                                                             abs=ATOL)


def test_near_tie_rule_passes_a_tie_and_fails_a_margin_a_third_token_or_too_many_requests():
    prompts = [[1, 2], [3, 4]] + [[5]] * 14
    want = [[7, 8, 9], [7, 8, 9]] + [[1]] * 14
    tie = {(1, 2, 7): ((8, -1.0), (5, -1.0 - FLOAT32_NOISE / 2))}
    assert_equal_but_near_ties([[7, 5, 6]] + want[1:], want, prompts, lambda ctx: tie[tuple(ctx)])
    assert_equal_but_near_ties(want, want, prompts, lambda ctx: tie[tuple(ctx)])  # nothing differs: nothing asked
    margin = {(1, 2, 7): ((8, -1.0), (5, -1.0 - 10 * FLOAT32_NOISE))}
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_equal_but_near_ties([[7, 5, 6]] + want[1:], want, prompts, lambda ctx: margin[tuple(ctx)])
    third = {(1, 2, 7): ((8, -1.0), (4, -1.0))}
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_equal_but_near_ties([[7, 5, 6]] + want[1:], want, prompts, lambda ctx: third[tuple(ctx)])
    with pytest.raises(AssertionError, match="has 2 tokens"):
        assert_equal_but_near_ties([[7, 8]] + want[1:], want, prompts, lambda ctx: tie[tuple(ctx)])
    ties = {(1, 2, 7): ((8, -1.0), (5, -1.0)), (3, 4, 7): ((8, -2.0), (5, -2.0)), (5,): ((1, -3.0), (2, -3.0))}
    with pytest.raises(AssertionError, match="3 of 16 requests differ"):
        assert_equal_but_near_ties([[7, 5, 6], [7, 5, 6], [2]] + want[3:], want, prompts,
                                   lambda ctx: ties[tuple(ctx)])
