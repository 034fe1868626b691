"""``validate_engine_args`` / ``validate_package_args`` refuse each bad argument of ``tscompile.LLM``
and ``load_package`` with ``tscompile: <arg> must be ..., got <value!r>``, before anything is built."""

from __future__ import annotations

import re

import pytest
import torch

from tscompile.models import build_config
from tscompile.validation import ENGINE_ARGS, validate_engine_args, validate_package_args

INT_ARGS = ["max_num_seqs", "page_size", "pages_per_block", "max_num_batched_tokens"]


def _refused(name: str, value, what: str):
    return pytest.raises(ValueError, match=rf"^tscompile: {name} must be {re.escape(what)}.*, "
                                           rf"got {re.escape(repr(value))}$")


@pytest.mark.parametrize("name", INT_ARGS)
@pytest.mark.parametrize("value", [0, -1, True, 4.0, "4", None])
def test_sizes_must_be_positive_real_ints(name, value):
    with _refused(name, value, "an int >= 1"):
        validate_engine_args(**{name: value})


@pytest.mark.parametrize("value", [1, 2**40])
def test_sizes_accept_positive_ints(value):
    validate_engine_args(**{name: value for name in INT_ARGS})


@pytest.mark.parametrize("value", [0, -1, True, 4.0, "4"])
def test_max_model_len_is_none_or_a_positive_int(value):
    """None means the model's own maximum (a checkpoint's) or the preset default."""
    validate_engine_args(max_model_len=None)
    validate_engine_args(max_model_len=7)
    with _refused("max_model_len", value, "None or an int >= 1"):
        validate_engine_args(max_model_len=value)


@pytest.mark.parametrize("value", [1, 0, -4, 3.0, True, "8"])
def test_num_pages_must_be_none_or_an_int_of_at_least_two(value):
    with _refused("num_pages", value, "None or an int >= 2"):
        validate_engine_args(num_pages=value)


def test_num_pages_must_fill_whole_blocks():
    with _refused("num_pages", 10, "a multiple of pages_per_block (4)"):
        validate_engine_args(num_pages=10, pages_per_block=4)
    validate_engine_args(num_pages=12, pages_per_block=4)
    validate_engine_args(num_pages=None)


@pytest.mark.parametrize("name", ["enforce_eager", "async_scheduling", "enable_prefix_caching"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_flags_must_be_bool(name, value):
    with _refused(name, value, "True or False"):
        validate_engine_args(**{name: value})


@pytest.mark.parametrize("value", [-1, 2**63, 1.0, False, "0", None])
def test_seed_must_be_an_int_in_range(value):
    with _refused("seed", value, "an int in [0, 2**63)"):
        validate_engine_args(seed=value)
    validate_engine_args(seed=2**63 - 1)


@pytest.mark.parametrize("value,message", [
    ("mps", r"^tscompile: device 'mps' is not supported"),
    ("gpu", r"^tscompile: device 'gpu' is not a torch device"),
    (3.5, r"^tscompile: device must be a str or torch.device"),
    ("cuda", r"^tscompile: device 'cuda' asked for, but this torch build sees no CUDA device"),
])
def test_device_must_be_usable_here(value, message):
    if value == "cuda" and torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    with pytest.raises(ValueError, match=message):
        validate_engine_args(device=value)


@pytest.mark.parametrize("value,message", [
    ("float8", r"^tscompile: unknown dtype 'float8'"),
    (torch.int32, r"^tscompile: dtype torch.int32 is not supported"),
    (32, r"^tscompile: dtype must be None, a dtype name .*, got 32$"),
])
def test_dtype_must_be_a_supported_float(value, message):
    with pytest.raises(ValueError, match=message):
        validate_engine_args(dtype=value)
    validate_engine_args(dtype="bf16")


@pytest.mark.parametrize("name,value,what", [
    ("attention_backend", 3, "a non-empty str"),
    ("attention_backend", "", "a non-empty str"),
    ("compile_options", [("cudagraphs", False)], "None or a dict"),
    ("model", 7, "a preset name (str), a ModelConfig or a Transformer"),
])
def test_other_arguments_by_type(name, value, what):
    with _refused(name, value, what):
        validate_engine_args(**{name: value})


def test_every_llm_argument_is_covered_and_unknown_ones_refused():
    import inspect

    import tscompile

    assert set(inspect.signature(tscompile.LLM.__init__).parameters) - {"self"} == set(ENGINE_ARGS)
    with pytest.raises(ValueError, match=r"^tscompile: unknown engine argument\(s\) \['max_seqs'\]"):
        validate_engine_args(max_seqs=4)


def test_defaults_pass():
    validate_engine_args(model=build_config("llama-tiny"), attention_backend="auto", max_num_seqs=8,
                         max_model_len=512, page_size=16, pages_per_block=1, num_pages=None,
                         max_num_batched_tokens=2048, dtype=None, device="cpu", enforce_eager=False,
                         compile_options={"cudagraphs": False}, seed=0, async_scheduling=True)
    validate_package_args()


@pytest.mark.parametrize("name,value,what", [
    ("max_num_seqs", 0, "None or an int >= 1"),
    ("max_model_len", 8.0, "None or an int >= 1"),
    ("max_num_batched_tokens", True, "None or an int >= 1"),
    ("num_pages", 1, "None or an int >= 2"),
    ("seed", -1, "an int in [0, 2**63)"),
])
def test_package_args_by_type_and_sign(name, value, what):
    with _refused(name, value, what):
        validate_package_args(**{name: value})


def test_package_device_refused():
    with pytest.raises(ValueError, match=r"^tscompile: device 'mps' is not supported"):
        validate_package_args(device="mps")
