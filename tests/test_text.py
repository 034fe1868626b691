"""Prompts, outputs and text: tokenizer loading, chat templates, incremental detokenization, stop rules.

Every tokenizer here is trained on the spot (a tiny byte-level BPE) and saved under a temporary
directory; nothing is downloaded.
"""

import random

import pytest

from helpers import SENTENCES, save_tokenizer
from tscompile.outputs import CompletionOutput, RequestOutput
from tscompile.prompts import Prompt, check_token_ids, parse_prompts
from tscompile.sampling import SamplingParams
from tscompile.text import (CompletionState, IncrementalDetokenizer, StopChecker, apply_chat_template,
                            eos_token_ids, load_tokenizer)

MIXED = "Hi 🙂 世界, naïve 🚀!"  # 🙂 was never in training text: four byte tokens


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    return (save_tokenizer(tmp_path_factory.mktemp("chat_tok"), True),
            save_tokenizer(tmp_path_factory.mktemp("plain_tok"), False))


@pytest.fixture(scope="module")
def tok(tokenizer_dirs):
    return load_tokenizer(tokenizer_dirs[0])


@pytest.fixture(scope="module")
def plain_tok(tokenizer_dirs):
    return load_tokenizer(tokenizer_dirs[1])


def _id(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


# -- loading and chat ----------------------------------------------------------------------------

def test_load_tokenizer_round_trips_emoji_and_cjk(tok):
    assert tok.decode(tok.encode(MIXED)) == MIXED
    assert eos_token_ids(tok) == (_id(tok, "</s>"),)


def test_load_tokenizer_gives_none_for_a_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_load_tokenizer_refuses_a_path_that_is_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="tscompile: tokenizer path .*missing.* is not a directory"):
        load_tokenizer(tmp_path / "missing")


def test_chat_template_renders_messages_with_the_generation_prompt(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🙂"}]
    ids = apply_chat_template(tok, messages)
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好 🙂<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(rendered, add_special_tokens=False)
    assert tok.decode(ids) == rendered
    assert apply_chat_template(tok, messages, add_generation_prompt=False) == tok.encode(
        rendered.removesuffix("<|im_start|>assistant\n"), add_special_tokens=False)


def test_chat_template_absent_or_no_tokenizer_is_a_clear_error(plain_tok):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="tscompile: the tokenizer .* has no chat template"):
        apply_chat_template(plain_tok, messages)
    with pytest.raises(ValueError, match="tscompile: chat messages need a tokenizer"):
        apply_chat_template(None, messages)


@pytest.mark.parametrize("messages", [[], "hi", [{"content": "hi"}], [{"role": "user"}], ["hi"]], ids=repr)
def test_chat_messages_of_the_wrong_shape_are_refused(tok, messages):
    with pytest.raises(ValueError, match=r"tscompile: messages"):
        apply_chat_template(tok, messages)


# -- prompts -------------------------------------------------------------------------------------

def test_each_prompt_form_parses(tok):
    text_ids = tok.encode("Hello 世界")
    assert parse_prompts("Hello 世界", tok) == [Prompt("Hello 世界", text_ids)]
    assert parse_prompts([5, 6, 7], None) == [Prompt(None, [5, 6, 7])]
    assert parse_prompts({"prompt_token_ids": [5, 6]}, None) == [Prompt(None, [5, 6])]
    assert parse_prompts({"prompt_token_ids": [5, 6], "prompt": "ab"}, None) == [Prompt("ab", [5, 6])]
    assert parse_prompts({"prompt": "Hello 世界"}, tok) == [Prompt("Hello 世界", text_ids)]
    several = parse_prompts(["Hello 世界", [3, 4], (8,), {"prompt_token_ids": [9]}], tok)
    assert several == [Prompt("Hello 世界", text_ids), Prompt(None, [3, 4]), Prompt(None, [8]), Prompt(None, [9])]


def test_a_bare_string_is_one_prompt_never_its_characters(tok):
    parsed = parse_prompts("123", tok)
    assert len(parsed) == 1 and parsed[0] == Prompt("123", tok.encode("123"))
    assert len(parse_prompts(["123", "45"], tok)) == 2


def test_numpy_integer_ids_become_python_ints():
    np = pytest.importorskip("numpy")
    parsed = parse_prompts([np.int64(4), np.int32(2)])
    assert parsed == [Prompt(None, [4, 2])] and all(type(t) is int for t in parsed[0].token_ids)


@pytest.mark.parametrize("prompts,match", [
    ("hi", r"prompt 0 is text \('hi'\) but the model has no tokenizer"),
    (["ok", [1]], r"prompt 0 is text \('ok'\) but the model has no tokenizer"),
    ([1, True], r"prompt 0, position 1: token id True must be an int"),
    ([1, 2.0], r"prompt 0, position 1: token id 2.0 must be an int"),
    ([[1], [2, "3"]], r"prompt 1, position 1: token id '3' must be an int"),
    ([[1], [2, [3]]], r"prompt 1, position 1: token id \[3\] must be an int"),
    ([1, [2]], r"prompt 0, position 1: token id \[2\] must be an int"),
    ([], r"prompts=\[\] holds no prompt"),
    ([[1], []], r"prompt 1 is empty"),
    ({"prompt_token_ids": []}, r"prompt 0 is empty"),
    ([[1], 5], r"prompt 1=5 must be a str, a list of token ids or a dict"),
    (7, r"prompts=7 must be a str, a list of token ids, a dict"),
    (None, r"prompts=None must be"),
    ({"prompt_token_ids": [1], "extra": 1}, r"prompt 0 has unknown keys \['extra'\]"),
    ({"prompt_token_ids": 5}, r"prompt 0: 'prompt_token_ids'=5 must be a list of token ids"),
    ({"prompt_token_ids": [1], "prompt": 3}, r"prompt 0: 'prompt'=3 must be a str"),
    ({}, r"prompt 0 is a dict without 'prompt_token_ids' or 'prompt'"),
], ids=repr)
def test_prompt_refusals_name_the_prompt_and_position(prompts, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_prompts(prompts, None)
    assert str(info.value).startswith("tscompile: ")


def test_an_empty_text_prompt_is_refused(tok):
    with pytest.raises(ValueError, match="tscompile: prompt 1 is an empty string"):
        parse_prompts(["a", ""], tok)


def test_check_token_ids_refuses_ids_outside_the_vocabulary():
    check_token_ids([0, 5, 9], 10, "prompt 0")
    with pytest.raises(ValueError, match=r"tscompile: prompt 2, position 1: token id 10 is outside the vocabulary "
                                         r"\[0, 10\)"):
        check_token_ids([3, 10], 10, "prompt 2")
    with pytest.raises(ValueError, match="token id -1 is outside"):
        check_token_ids([-1], 10, "prompt 0")


# -- incremental detokenization ------------------------------------------------------------------

def _deltas(tok, prompt_ids, ids, skip):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip)
    return [detok.add(t) for t in ids] + [detok.flush()]


def test_a_character_split_over_byte_tokens_is_held_back_until_complete(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) >= 2 and all("\ufffd" in tok.decode([t]) for t in ids)  # never trained on: byte pieces
    deltas = _deltas(tok, tok.encode("Hi "), ids + tok.encode("!", add_special_tokens=False), True)
    assert deltas == [""] * (len(ids) - 1) + ["🙂", "!", ""]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", SENTENCES + [MIXED])
def test_deltas_of_real_text_are_whole_characters_and_join_to_the_text(tok, text, skip):
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _deltas(tok, tok.encode("<|im_start|>assistant\n"), ids, skip)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_join_to_the_full_decode_for_random_token_sequences(tok, skip):
    vocab = len(tok)
    pieces = [tok.encode(s, add_special_tokens=False) for s in SENTENCES + [MIXED]]
    for seed in range(150):
        rng = random.Random(seed)
        ids = []
        while len(ids) < 24:  # random ids (byte fragments, specials) mixed with runs of real text
            ids += [rng.randrange(vocab)] if rng.random() < 0.5 else rng.choice(pieces)[:rng.randrange(1, 6)]
        prompt = rng.choice([[], tok.encode("Hi 世界"), tok.encode("<s>x")])
        deltas = _deltas(tok, prompt, ids, skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), (seed, ids)


def test_skip_special_tokens_decides_whether_special_tokens_are_text(tok):
    ids = tok.encode("Hi", add_special_tokens=False) + [_id(tok, "<|im_end|>")]
    assert "".join(_deltas(tok, [], ids, True)) == "Hi"
    assert "".join(_deltas(tok, [], ids, False)) == "Hi<|im_end|>"


# -- stop rules ----------------------------------------------------------------------------------

def _run(tok, params, ids, eos_ids=None, prompt=()):
    state = CompletionState(params, eos_token_ids(tok) if eos_ids is None else eos_ids, tok, prompt)
    for t in ids:
        if state.append(t) is not None:
            break
    return state


def test_eos_finishes_with_stop_and_stays_in_token_ids_but_not_in_text(tok):
    eos = _id(tok, "</s>")
    ids = tok.encode("Hi 🚀", add_special_tokens=False)
    state = _run(tok, SamplingParams(max_new_tokens=20, skip_special_tokens=False), ids + [eos] + ids)
    assert state.output() == CompletionOutput(0, "Hi 🚀", ids + [eos], "stop", None)


def test_ignore_eos_generates_through_eos_until_length(tok):
    eos = _id(tok, "</s>")
    ids = tok.encode("Hi", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=len(ids) * 2 + 1, ignore_eos=True, skip_special_tokens=False)
    state = _run(tok, params, ids + [eos] + ids)
    assert (state.finish_reason, state.token_ids, state.text) == ("length", ids + [eos] + ids, "Hi</s>Hi")


def test_a_stop_token_id_finishes_with_that_id_as_stop_reason_and_without_its_text(tok):
    bang = _id(tok, "!")
    ids = tok.encode("Hello world", add_special_tokens=False)
    state = _run(tok, SamplingParams(max_new_tokens=30, stop_token_ids=[bang]), ids + [bang] + ids)
    assert (state.finish_reason, state.stop_reason, state.text, state.token_ids) == (
        "stop", bang, "Hello world", ids + [bang])


def test_a_stop_token_after_an_incomplete_character_still_outputs_that_character_as_fffd(tok):
    eos = _id(tok, "</s>")
    half = tok.encode("🙂", add_special_tokens=False)[:2]
    state = _run(tok, SamplingParams(max_new_tokens=10), half + [eos])
    assert state.text == tok.decode(half) == "\ufffd" and state.finish_reason == "stop"


def test_a_stop_string_cuts_the_text_but_keeps_every_token(tok):
    ids = tok.encode("The quick brown fox jumps over", add_special_tokens=False)
    state = _run(tok, SamplingParams(max_new_tokens=40, stop=["fox", "lazy"]), ids)
    assert (state.finish_reason, state.stop_reason, state.text) == ("stop", "fox", "The quick brown ")
    # every token up to the one completing "fox" is kept, none after
    assert "fox" in tok.decode(state.token_ids)
    assert state.token_ids == ids[: len(state.token_ids)] and "fox" not in tok.decode(state.token_ids[:-1])


def test_the_earliest_stop_string_wins_when_one_token_completes_several(tok):
    ids = tok.encode("abcdef", add_special_tokens=False)
    state = _run(tok, SamplingParams(max_new_tokens=40, stop=["ef", "bc", "cd"]), ids)
    assert state.finish_reason == "stop" and state.text == "a" and state.stop_reason == "bc"


def test_a_stop_string_made_of_multi_byte_characters_matches_across_tokens(tok):
    ids = tok.encode("我们喜欢机器学习。", add_special_tokens=False)
    state = _run(tok, SamplingParams(max_new_tokens=40, stop="机器"), ids)
    assert (state.text, state.stop_reason) == ("我们喜欢", "机器")


def test_stop_strings_are_only_searched_in_the_new_tail():
    checker = StopChecker(SamplingParams(stop=["xyz"]))
    assert checker.find_stop_string("xyz" + "a" * 10, 1, 13) is None  # an old match is not found again
    assert checker.find_stop_string("aaxy" + "z", 1, 5) == ("xyz", 2)  # a match ending in the new char


def test_nothing_stops_before_min_tokens(tok):
    eos = _id(tok, "</s>")
    ids = tok.encode("fox fox fox", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=40, min_tokens=len(ids) + 2, stop=["fox"], stop_token_ids=[ids[0]])
    state = _run(tok, params, ids + [eos])
    assert state.finish_reason is None and state.text == "fox fox fox"  # the stop id, "fox" and eos all ignored
    assert ids.count(ids[0]) > 1  # the stop id came up again after the first token and was ignored too
    assert state.append(ids[0]) == "stop" and state.stop_reason == ids[0]  # token number min_tokens may stop
    assert len(state.token_ids) == params.min_tokens


def test_a_stop_string_completed_by_the_min_tokens_th_token_stops(tok):
    ids = tok.encode("Hi fox", add_special_tokens=False)
    state = _run(tok, SamplingParams(max_new_tokens=40, min_tokens=len(ids), stop="fox"), ids)
    assert (state.finish_reason, state.text) == ("stop", "Hi ")


def test_length_finishes_at_max_new_tokens_unless_the_last_token_stops(tok):
    eos = _id(tok, "</s>")
    ids = tok.encode("Hello world", add_special_tokens=False)
    state = _run(tok, SamplingParams(max_new_tokens=3), ids)
    assert (state.finish_reason, state.token_ids) == ("length", ids[:3])
    assert state.text == tok.decode(ids[:3])
    state = _run(tok, SamplingParams(max_new_tokens=3), ids[:2] + [eos])
    assert state.finish_reason == "stop"


def test_length_flushes_an_incomplete_character_as_the_full_decode_does(tok):
    half = tok.encode("🙂", add_special_tokens=False)[:3]
    state = _run(tok, SamplingParams(max_new_tokens=3), half)
    assert (state.finish_reason, state.text) == ("length", tok.decode(half))


def test_without_a_tokenizer_token_rules_still_apply_and_stop_strings_are_refused():
    state = CompletionState(SamplingParams(max_new_tokens=5, stop_token_ids=[7]), eos_ids=[2])
    assert [state.append(t) for t in (4, 2)] == [None, "stop"]
    assert state.output() == CompletionOutput(0, "", [4, 2], "stop", None)
    state = CompletionState(SamplingParams(max_new_tokens=5, stop_token_ids=[7]), eos_ids=[2])
    assert [state.append(t) for t in (4, 7)] == [None, "stop"] and state.stop_reason == 7
    with pytest.raises(ValueError, match=r"tscompile: stop=\['x'\] needs a tokenizer"):
        CompletionState(SamplingParams(stop="x"), eos_ids=[2])


def test_settled_text_holds_back_what_a_stop_string_could_still_cut(tok):
    ids = tok.encode("Hello wor", add_special_tokens=False)
    state = _run(tok, SamplingParams(max_new_tokens=40, stop="world!"), ids)
    assert state.text == "Hello wor" and state.settled_text == "Hell"
    assert _run(tok, SamplingParams(max_new_tokens=40), ids).settled_text == "Hello wor"


def test_request_output_carries_the_prompt_and_its_completion(tok):
    prompt = parse_prompts("Hi", tok)[0]
    state = _run(tok, SamplingParams(max_new_tokens=2), tok.encode(" world", add_special_tokens=False),
                 prompt=prompt.token_ids)
    out = RequestOutput("0", prompt.text, prompt.token_ids, [state.output()], state.finished)
    assert out.finished and out.outputs[0].finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def _appended_one_by_one(params, eos_ids, runs):
    state, kept = CompletionState(params, eos_ids=eos_ids), []
    for run in runs:
        n = 0
        for token in run:
            if state.finished:
                break
            state.append(token)
            n += 1
        kept.append(n)
    return state, kept


@pytest.mark.parametrize("seed", range(6))
def test_extend_keeps_what_appending_one_token_at_a_time_keeps(seed):
    """``CompletionState.extend`` (a speculative step's run in one go) against ``append`` per token,
    over random stop ids, eos, ``ignore_eos``, ``min_tokens`` and lengths: the same tokens, kept
    counts, finish reason and stop reason."""
    rng = random.Random(seed)
    for _ in range(300):
        length = rng.randint(1, 12)
        params = SamplingParams(max_new_tokens=length, min_tokens=min(rng.choice([0, 0, 2, 5]), length),
                                ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.sample(range(1, 9), rng.choice([0, 1, 2])))
        eos_ids = tuple(rng.sample(range(1, 9), rng.choice([0, 1, 2])))
        runs = [[rng.randint(1, 12) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 6))]
        want, want_kept = _appended_one_by_one(params, eos_ids, runs)
        got = CompletionState(params, eos_ids=eos_ids)
        got_kept = [got.extend(run) for run in runs]
        assert got_kept == want_kept, (params, eos_ids, runs)
        assert (got.token_ids, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.finish_reason, want.stop_reason), (params, eos_ids, runs)
