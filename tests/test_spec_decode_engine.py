"""``tscompile.LLM(speculative_config=...)``: vLLM's keys parsed, settings the engine cannot honour refused
before any model loads, and n-gram verify steps whose greedy output equals plain decode."""

from __future__ import annotations

import json

import pytest
import torch

import tscompile
from tscompile.spec_decode import SpeculativeConfig
from tscompile.spec_decode.engine_checks import MAX_VERIFY_WIDTH, check_engine_speculation, vocab_size_without_loading
from tests.helpers import ids, small_llm


def _config_dir(path, vocab: int):
    """A checkpoint directory as far as the vocabulary check reads it (its config.json)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab}))
    return str(path)


@pytest.mark.parametrize("config, words", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": MAX_VERIFY_WIDTH}, f"num_speculative_tokens={MAX_VERIFY_WIDTH}"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method='eagle'"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}, "'disable_by_batch_size'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "/no/such/draft"}, "'/no/such/draft'"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_is_refused_before_the_model_loads(config, words, monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("the model was built before the refusal")

    monkeypatch.setattr("tscompile.runtime.engine_setup.build_model_engine", no_build)
    with pytest.raises(ValueError, match="^tscompile: ") as e:
        small_llm(speculative_config=config)
    assert words in str(e.value)


def test_draft_model_vocabulary_must_match_the_target(tmp_path, monkeypatch):
    monkeypatch.setattr("tscompile.runtime.engine_setup.build_model_engine",
                        lambda *a, **k: pytest.fail("the model was built before the refusal"))
    draft = _config_dir(tmp_path / "draft", 500)
    with pytest.raises(ValueError, match=r"^tscompile: .*vocabulary of 500 tokens, the target has 512"):
        small_llm(speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": draft})
    target = _config_dir(tmp_path / "target", 777)
    with pytest.raises(ValueError, match=r"vocabulary of 500 tokens, the target has 777"):
        check_engine_speculation({"method": "draft_model", "num_speculative_tokens": 2, "model": draft},
                                 model=target, tensor_parallel_size=1)
    # a matching vocabulary passes, read from config.json, text_config too
    same = tmp_path / "same"
    same.mkdir()
    (same / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 777}}))
    assert vocab_size_without_loading(str(same)) == 777
    spec = check_engine_speculation({"method": "draft_model", "num_speculative_tokens": 2, "model": str(same)},
                                    model=target, tensor_parallel_size=1)
    assert spec.model == str(same) and spec.verify_width == 3


def test_speculation_with_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match=r"^tscompile: .*tensor_parallel_size=2"):
        check_engine_speculation({"method": "ngram", "num_speculative_tokens": 2}, model="llama-tiny",
                                 tensor_parallel_size=2)


def test_window_wider_than_the_graphs_is_refused():
    with pytest.raises(ValueError, match=r"^tscompile: .*num_speculative_tokens=4 needs verify windows of 5 rows"):
        check_engine_speculation({"method": "ngram", "num_speculative_tokens": 4}, model="llama-tiny",
                                 tensor_parallel_size=1, max_width=4)


def test_engine_parses_vllm_keys_and_refuses_min_tokens():
    torch.manual_seed(0)
    llm = small_llm(dtype=torch.float32, enforce_eager=True,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert llm.speculative_config == SpeculativeConfig("ngram", 3, prompt_lookup_min=3, prompt_lookup_max=3)
    with pytest.raises(ValueError, match=r"^tscompile: min_tokens=2 cannot be honoured with speculative"):
        llm.add_request([1, 2, 3], tscompile.SamplingParams(min_tokens=2, max_new_tokens=4))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    params = tscompile.SamplingParams(max_new_tokens=6, temperature=0.0)
    plain = small_llm(dtype=torch.float32, enforce_eager=True)
    assert ids(llm.generate([prompt], params)) == ids(plain.generate([prompt], params))
    assert small_llm(dtype=torch.float32, enforce_eager=True).speculative_config is None


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# repetitive prompts (n-gram drafts are found), a short one, and lengths that chunk under a small budget
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [9, 8, 7],
           [11, 12, 11, 12, 11, 12, 13, 11, 12, 11, 12, 11]]


def _pair(**kw):
    """The same float32 engine with and without speculation (random weights from seed 0)."""
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("enforce_eager", True)
    return small_llm(speculative_config=NGRAM, **kw), small_llm(**kw)


def _greedy(n: int, **kw) -> tscompile.SamplingParams:
    return tscompile.SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def test_ngram_greedy_equals_plain_decode_on_mixed_chunked_batches():
    spec, plain = _pair(max_num_batched_tokens=8)  # prompts chunk; their chunks share steps with decodes
    params = [_greedy(n) for n in (20, 13, 7, 17)]  # max_new_tokens ends requests at different steps
    got = spec.generate(PROMPTS, params)
    assert ids(got) == ids(plain.generate(PROMPTS, params))
    stats = spec.stats()
    assert stats.spec_verify_steps > 0 and stats.spec_accepted_tokens > 0
    assert sum(o.num_accepted_tokens for o in got) == stats.spec_accepted_tokens
    assert sum(o.num_draft_tokens for o in got) == stats.spec_draft_tokens
    assert 0 < stats.spec_acceptance_rate <= 1
    assert [len(t) for t in ids(got)] == [20, 13, 7, 17]


def test_drafts_stop_at_what_each_request_may_still_emit():
    """Replayed references (every draft right): a request with room for 4 more tokens after its first
    gets 3 drafts and finishes in one verify step; one with room for 1 gets none; one without room
    is done after its prefill. So the drafts proposed are exactly 3 + 0 and every one is kept."""
    plain = small_llm(dtype=torch.float32, enforce_eager=True)
    prompts, params = PROMPTS[:3], [_greedy(5, ignore_eos=True), _greedy(2, ignore_eos=True),
                                     _greedy(1, ignore_eos=True)]
    want = ids(plain.generate(prompts, params))
    spec = small_llm(dtype=torch.float32, enforce_eager=True,
                     speculative_config={"method": "replay", "num_speculative_tokens": 3})
    spec.set_replay_references({tuple(p): w for p, w in zip(prompts, want)})
    got = spec.generate(prompts, params)
    assert ids(got) == want and [len(t) for t in want] == [5, 2, 1]
    assert [o.num_draft_tokens for o in got] == [3, 0, 0]
    stats = spec.stats()
    assert stats.spec_draft_tokens == stats.spec_accepted_tokens == 3 and stats.spec_verify_steps == 1


def test_ngram_stop_token_and_stop_reason_match_plain_decode():
    spec, plain = _pair()
    free = ids(plain.generate(PROMPTS, _greedy(20)))
    for prompt, out in zip(PROMPTS, free):
        stop = out[len(out) // 2]  # a token the run produces mid-way: generation ends at its first occurrence
        a = spec.generate([prompt], _greedy(20, stop_token_ids=[stop]))[0]
        b = plain.generate([prompt], _greedy(20, stop_token_ids=[stop]))[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == out[: out.index(stop) + 1]
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason == "stop"


def test_ngram_greedy_equals_plain_decode_under_preemption():
    # a pool too small for every request's lookahead: requests are preempted and recomputed, and
    # steps whose windows do not fit run as plain steps
    spec, plain = _pair(num_pages=14, max_num_seqs=4, page_size=4)
    got = ids(spec.generate(PROMPTS, _greedy(18)))
    assert got == ids(plain.generate(PROMPTS, _greedy(18)))
    assert spec.stats().num_preemptions > 0 and spec.stats().spec_verify_steps > 0


def test_sampled_requests_use_rejection_sampling_and_greedy_rows_stay_exact():
    spec, plain = _pair()
    sampled = tscompile.SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    params = [_greedy(12), sampled, _greedy(12), sampled]
    first = ids(spec.generate(PROMPTS, params))
    again = ids(spec.generate(PROMPTS, params))
    assert first == again  # seeded: the acceptance draws are counter-based
    want = ids(plain.generate([PROMPTS[0], PROMPTS[2]], _greedy(12)))
    assert [first[0], first[2]] == want  # a temperature-0 row of a rejection step is the argmax
    assert all(len(t) == 12 and all(0 <= x < 512 for x in t) for t in first)


def test_ngram_on_real_weights_equals_plain_decode():
    """SmolLM2-135M-Instruct, float32: a prompt that repeats itself, greedy with and without n-gram
    speculation token for token; prints the acceptance rate (docs/speculative_decoding.md)."""
    from tests.real_weights import MODEL, checkpoint_or_skip

    checkpoint_or_skip()
    from tscompile.text import load_tokenizer

    text = "Repeat this list exactly three times: apple, banana, cherry, dates, elderberry, fig, grape. "
    kw = dict(enforce_eager=True, device="cpu", attention_backend="torch", dtype=torch.float32, max_model_len=256,
              max_num_seqs=1, page_size=16)
    spec = tscompile.LLM(MODEL, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}, **kw)
    prompt = load_tokenizer(checkpoint_or_skip())(text * 3).input_ids
    params = tscompile.SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    got = spec.generate([{"prompt_token_ids": prompt}], params)
    plain = tscompile.LLM(MODEL, **kw).generate([{"prompt_token_ids": prompt}], params)
    assert ids(got) == ids(plain)
    stats = spec.stats()
    print(f"\nngram k=4 on {MODEL}: {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} drafts accepted "
          f"({stats.spec_acceptance_rate:.2f}), {len(ids(got)[0])} tokens in {stats.spec_verify_steps} verify steps")
    assert stats.spec_accepted_tokens > 0


def test_stop_strings_on_real_weights_end_the_text_where_plain_decode_ends_it():
    """SmolLM2-135M-Instruct, float32, real text: a stop string (taken from the greedy output, so it
    fires) ends a request with speculation at the same token, text, finish and stop reason as
    without it, while drafts are being accepted (the output repeats itself, so n-gram drafts land)."""
    from tests.real_weights import MODEL, checkpoint_or_skip

    checkpoint_or_skip()
    kw = dict(enforce_eager=True, device="cpu", attention_backend="torch", dtype=torch.float32, max_model_len=256,
              max_num_seqs=1, page_size=16)
    spec = tscompile.LLM(MODEL, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}, **kw)
    plain = tscompile.LLM(MODEL, **kw)
    text = "Repeat this list exactly three times: apple, banana, cherry, dates, elderberry, fig, grape. " * 3
    free = plain.generate([text], tscompile.SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True))
    free_text = free[0].outputs[0].text
    before = spec.stats()
    n = len(free_text)
    for stop in (free_text[n // 2: n // 2 + 5], free_text[3 * n // 4: 3 * n // 4 + 6], free_text[n - 12: n - 6]):
        params = tscompile.SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True, stop=[stop])
        a, b = spec.generate([text], params)[0].outputs[0], plain.generate([text], params)[0].outputs[0]
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == \
            (b.text, b.token_ids, b.finish_reason, b.stop_reason), stop
        assert b.finish_reason == "stop" and b.stop_reason == stop and stop not in b.text
    assert spec.stats().spec_accepted_tokens > before.spec_accepted_tokens


def test_compiled_engine_with_speculation_equals_plain_decode():
    """The torch.compile engine (compiled prefill, decode and verify steps) gives the greedy tokens of
    the eager engine without speculation."""
    spec = small_llm(dtype=torch.float32, enforce_eager=False, speculative_config=NGRAM, max_num_seqs=2)
    plain = small_llm(dtype=torch.float32, enforce_eager=True, max_num_seqs=2)
    assert ids(spec.generate(PROMPTS[:2], _greedy(10))) == ids(plain.generate(PROMPTS[:2], _greedy(10)))
    assert spec.stats().spec_verify_steps > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("num_prompts", [1, 32])
def test_gpu_llama_1b_ngram_greedy_equals_plain_with_graphs(backend, num_prompts):
    """llama-1b-shaped random weights, float32, decode graphs on: n-gram speculation's greedy tokens
    equal plain decode's, at 1 and 32 requests. FlashInfer has no float32 kernels; its verify windows
    are checked against the torch reference in tests/test_verify_router.py."""
    prompts = [[(13 * i + 7 * (j % 5)) % 128000 + 1 for j in range(24 + i)] for i in range(num_prompts)]
    params = tscompile.SamplingParams(max_new_tokens=24, temperature=0.0)
    kw = dict(attention_backend=backend, device="cuda", dtype=torch.float32, max_model_len=256, max_num_seqs=32,
              page_size=16, compile_options={"decode_ladder": (1, 2, 4, 8, 16, 32)})
    spec = tscompile.LLM("llama-1b", speculative_config=NGRAM, **kw)
    got = ids(spec.generate(prompts, params))
    assert spec.stats().spec_verify_steps > 0
    del spec
    torch.cuda.empty_cache()
    assert got == ids(tscompile.LLM("llama-1b", **kw).generate(prompts, params))


def test_generate_cli_speculative_flags(capsys):
    from tscompile.cli import main

    base = ["generate", "llama-tiny", "--device", "cpu", "--attention-backend", "torch", "--enforce-eager",
            "--max-model-len", "64", "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-new-tokens", "8", "--show-ids"]
    def token_lines() -> list[str]:  # the outputs, not the timing line
        return [line for line in capsys.readouterr().out.splitlines() if "tokens/s" not in line]

    assert main(base) == 0
    plain = token_lines()
    assert any("500" in line for line in plain)
    assert main([*base, "--speculative-method", "ngram", "--num-speculative-tokens", "2",
                 "--prompt-lookup-min", "1"]) == 0
    assert token_lines() == plain  # greedy: the same tokens
    assert main([*base, "--speculative-method", "ngram", "--num-speculative-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tscompile: ") and "num_speculative_tokens=0" in err
