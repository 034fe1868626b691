"""SamplingParams: accepted forms, normalisation, every refusal class, greedy and banned ids."""

import math
import re

import numpy as np
import pytest

from tscompile.sampling import SamplingParams


def test_defaults_match_the_documented_values():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (16, 0.0, 0, 1.0, None)
    assert (p.stop_token_ids, p.stop, p.ignore_eos, p.min_tokens, p.skip_special_tokens, p.n, p.logprobs) == (
        (), (), False, 0, True, 1, None)


def test_lists_become_tuples_one_stop_string_becomes_a_tuple_and_numpy_scalars_become_python():
    p = SamplingParams(max_new_tokens=np.int64(8), temperature=np.float32(0.5), top_k=np.int32(3), seed=np.uint64(7),
                       stop_token_ids=[5, np.int64(2)], stop="END", min_tokens=np.int16(2))
    assert p.stop_token_ids == (5, 2) and p.stop == ("END",)
    assert [type(v) for v in (p.max_new_tokens, p.top_k, p.seed, p.min_tokens, *p.stop_token_ids)] == [int] * 6
    assert type(p.temperature) is float and p.temperature == 0.5
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()
    assert hash(SamplingParams(stop_token_ids=[1])) == hash(SamplingParams(stop_token_ids=(1,)))


def test_integer_reals_are_accepted_for_temperature_and_top_p():
    p = SamplingParams(temperature=1, top_p=1)
    assert p.temperature == 1.0 and type(p.top_p) is float


def _refused(match, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith("tscompile: ")
    return str(info.value)


COUNT_TYPES = [True, False, 4.0, 2.5, "3", None, [3]]


@pytest.mark.parametrize("name", ["max_new_tokens", "max_tokens", "min_tokens", "top_k", "n"])
@pytest.mark.parametrize("value", COUNT_TYPES, ids=repr)
def test_counts_refuse_everything_but_an_int(name, value):
    if value is None and name in ("max_new_tokens", "max_tokens"):
        assert SamplingParams(**{name: value}).max_new_tokens == 16  # None: not given, the default
        return
    _refused(rf"{name}={re.escape(repr(value))} must be an int", **{name: value})


def test_max_tokens_is_vllms_name_for_max_new_tokens():
    assert SamplingParams(max_tokens=5).max_new_tokens == 5
    assert SamplingParams(max_tokens=5) == SamplingParams(max_new_tokens=5)
    assert hash(SamplingParams(max_tokens=5)) == hash(SamplingParams(max_new_tokens=5))
    assert SamplingParams(max_tokens=7, max_new_tokens=7).max_new_tokens == 7  # both, agreeing
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3  # min_tokens is checked against the alias


def test_max_tokens_and_max_new_tokens_that_disagree_are_refused():
    message = _refused(r"max_tokens=5 and max_new_tokens=6 disagree", max_tokens=5, max_new_tokens=6)
    assert "give one of them" in message
    _refused(r"min_tokens=4 must be <= max_new_tokens \(3\)", max_tokens=3, min_tokens=4)
    _refused("max_tokens=0 must be an int >= 1", max_tokens=0)


def test_replace_keeps_the_count_given_by_either_name():
    import dataclasses

    p = SamplingParams(max_tokens=5)
    assert dataclasses.replace(p, temperature=0.5).max_new_tokens == 5
    assert dataclasses.replace(p, max_new_tokens=9).max_new_tokens == 9


@pytest.mark.parametrize("value", [True, 4.0, "3", [1]], ids=repr)
def test_seed_refuses_everything_but_an_int_or_none(value):
    _refused(rf"seed={re.escape(repr(value))} must be an int in \[0, {2**63}\) \(or None\)", seed=value)


@pytest.mark.parametrize("name,value,match", [
    ("max_new_tokens", 0, "max_new_tokens=0 must be an int >= 1"),
    ("max_new_tokens", -3, "max_new_tokens=-3 must be an int >= 1"),
    ("min_tokens", -1, "min_tokens=-1 must be an int >= 0"),
    ("min_tokens", 17, r"min_tokens=17 must be <= max_new_tokens \(16\)"),
    ("top_k", -1, r"top_k=-1 must be an int >= 0 \(0 = the whole vocabulary\)"),
    ("seed", -1, r"seed=-1 must be an int in \[0, "),
    ("seed", 2**63, rf"seed={2**63} must be an int in \[0, "),
])
def test_counts_refuse_out_of_range_values(name, value, match):
    _refused(match, **{name: value})


def test_largest_seed_and_min_tokens_equal_to_max_are_accepted():
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(max_new_tokens=4, min_tokens=4).min_tokens == 4


@pytest.mark.parametrize("name", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [True, "0.5", None, [0.5], math.nan, math.inf, -math.inf], ids=repr)
def test_reals_refuse_non_reals_and_non_finite_values(name, value):
    _refused(rf"{name}={re.escape(repr(value))} must be a finite real number", **{name: value})


@pytest.mark.parametrize("name,value,allowed", [
    ("temperature", -0.1, ">= 0"), ("top_p", 0.0, r"in \(0, 1\]"), ("top_p", 1.0001, r"in \(0, 1\]"),
    ("top_p", -1, r"in \(0, 1\]"),
])
def test_reals_refuse_out_of_range_values(name, value, allowed):
    _refused(rf"{name}={value!r} must be a finite real number {allowed}", **{name: value})


@pytest.mark.parametrize("value,match", [
    (3, r"stop_token_ids=3 must be a list of ints >= 0"),
    ("12", r"stop_token_ids='12' must be a list of ints >= 0"),
    ([1, -2], r"stop_token_ids\[1\]=-2 must be an int >= 0"),
    ([1.0], r"stop_token_ids\[0\]=1.0 must be an int >= 0"),
    ([True], r"stop_token_ids\[0\]=True must be an int >= 0"),
    ([None], r"stop_token_ids\[0\]=None must be an int >= 0"),
], ids=repr)
def test_stop_token_ids_refuse_anything_but_non_negative_ints(value, match):
    _refused(match, stop_token_ids=value)


@pytest.mark.parametrize("value,match", [
    ("", r"stop\[0\]='' must be a non-empty string"),
    (["a", ""], r"stop\[1\]='' must be a non-empty string"),
    ([3], r"stop\[0\]=3 must be a non-empty string"),
    (7, r"stop=7 must be a non-empty string or a list of them"),
], ids=repr)
def test_stop_refuses_empty_and_non_string_entries(value, match):
    _refused(match, stop=value)


@pytest.mark.parametrize("name", ["ignore_eos", "skip_special_tokens"])
@pytest.mark.parametrize("value", [0, 1, "yes", None], ids=repr)
def test_flags_refuse_anything_but_a_bool(name, value):
    _refused(rf"{name}={value!r} must be True or False", **{name: value})


@pytest.mark.parametrize("value", [2, 0])
def test_n_other_than_one_is_refused(value):
    _refused(rf"n={value} ", n=value)
    assert SamplingParams(n=1).n == 1


def test_n_two_is_refused_as_not_supported():
    _refused(r"n=2 is not supported yet; only n=1", n=2)



@pytest.mark.parametrize("kwargs,greedy", [
    ({}, True), ({"temperature": 0.7}, False), ({"temperature": 0.7, "top_k": 1}, True),
    ({"temperature": 0.7, "top_k": 2}, False),
])
def test_greedy_is_zero_temperature_or_top_k_one(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


def test_banned_ids_are_eos_and_stop_ids_until_min_tokens_exist_even_with_ignore_eos():
    p = SamplingParams(max_new_tokens=8, min_tokens=3, stop_token_ids=[9, 2])
    assert p.banned_ids([2, 5], 0) == (2, 5, 9)
    assert p.banned_ids((5,), 2) == (2, 5, 9)
    assert p.banned_ids([5], 3) == () and p.banned_ids([5], 7) == ()
    assert SamplingParams(min_tokens=1, ignore_eos=True).banned_ids([5], 0) == (5,)
    assert SamplingParams(stop_token_ids=[9]).banned_ids([5], 0) == ()  # min_tokens 0 bans nothing
