"""Argument checks for ``tscompile.LLM`` and ``tscompile.load_package``, run before anything is
built: each refusal is ``ValueError("tscompile: <arg> must be ..., got <value!r>")``.

Sizes must be real ints: ``True`` and ``4.0`` would work by accident in some places and fail deep
inside a kernel or a tensor constructor in others, so they are refused here instead.
"""

from __future__ import annotations

from typing import Callable

SEED_LIMIT = 2**63  # seeds travel as int64 to the sampling op


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse(name: str, what: str, value) -> ValueError:
    return ValueError(f"tscompile: {name} must be {what}, got {value!r}")


def check_int(name: str, value, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_int(value) or value < minimum:
        raise _refuse(name, f"{'None or ' if optional else ''}an int >= {minimum}", value)


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise _refuse(name, "True or False", value)


def check_seed(name: str, value) -> None:
    if not _is_int(value) or not 0 <= value < SEED_LIMIT:
        raise _refuse(name, "an int in [0, 2**63)", value)


def check_num_pages(value, pages_per_block: int = 1) -> None:
    """``None`` (sized from the other limits) or at least two pages (page 0 is the null page every
    padded slot points at) in whole blocks."""
    if value is None:
        return
    if not _is_int(value) or value < 2:
        raise _refuse("num_pages", "None or an int >= 2", value)
    if _is_int(pages_per_block) and pages_per_block >= 1 and value % pages_per_block:
        raise _refuse("num_pages", f"a multiple of pages_per_block ({pages_per_block})", value)


def check_fraction(name: str, value) -> None:
    """A real number in (0, 1] (ints 1 included; bools and NaN refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _refuse(name, "a float in (0, 1]", value)


def check_device(value) -> None:
    """``None`` or a device this torch can use (``resolve_device`` refuses the rest)."""
    if value is None:
        return
    from tscompile.utils import resolve_device

    resolve_device(value)


def check_dtype(value) -> None:
    if value is None:
        return
    import torch

    from tscompile.utils import resolve_dtype

    if not isinstance(value, (str, torch.dtype)):
        raise _refuse("dtype", "None, a dtype name such as 'bfloat16', or a torch.dtype", value)
    resolve_dtype(value, torch.device("cpu"))  # the device only picks the default for None


def check_model(value) -> None:
    from tscompile.models import ModelConfig, Transformer

    if not isinstance(value, (str, ModelConfig, Transformer)):
        raise _refuse("model", "a preset name (str), a ModelConfig or a Transformer", value)


def check_model_impl(value) -> None:
    from tscompile.models.hf_transformers import MODEL_IMPLS

    if not isinstance(value, str) or value not in MODEL_IMPLS:
        raise _refuse("model_impl", f"one of {', '.join(map(repr, MODEL_IMPLS))}", value)


def _check_str(name: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise _refuse(name, "a non-empty str", value)


def _check_speculative_config(value) -> None:
    # imported here: the spec_decode package loads torch and the acceptance ops, this module stays light
    from tscompile.spec_decode.config import SpeculativeConfig

    SpeculativeConfig.from_dict(value)


def _check_compile_options(value) -> None:
    if value is not None and not isinstance(value, dict):
        raise _refuse("compile_options", "None or a dict of tscompile options", value)


# argument -> check of ``LLM.__init__`` (num_pages is checked with pages_per_block, below)
_ENGINE_CHECKS: dict[str, Callable] = {
    "model": check_model,
    "model_impl": check_model_impl,
    "attention_backend": lambda v: _check_str("attention_backend", v),
    "max_num_seqs": lambda v: check_int("max_num_seqs", v, 1),
    "max_model_len": lambda v: check_int("max_model_len", v, 1, optional=True),
    "page_size": lambda v: check_int("page_size", v, 1),
    "pages_per_block": lambda v: check_int("pages_per_block", v, 1),
    "num_pages": None,
    "max_num_batched_tokens": lambda v: check_int("max_num_batched_tokens", v, 1),
    "dtype": check_dtype,
    "device": check_device,
    "enforce_eager": lambda v: check_bool("enforce_eager", v),
    "compile_options": _check_compile_options,
    "seed": lambda v: check_seed("seed", v),
    "async_scheduling": lambda v: check_bool("async_scheduling", v),
    "gpu_memory_utilization": lambda v: check_fraction("gpu_memory_utilization", v),
    "enable_prefix_caching": lambda v: check_bool("enable_prefix_caching", v),
    "tensor_parallel_size": lambda v: check_int("tensor_parallel_size", v, 1),
    "speculative_config": _check_speculative_config,
}
ENGINE_ARGS = tuple(_ENGINE_CHECKS)


def validate_engine_args(**kwargs) -> None:
    """Check the arguments of ``tscompile.LLM`` that are given (by name); call it first thing in
    ``LLM.__init__`` with every argument, so a bad one is refused before any model is built."""
    unknown = sorted(set(kwargs) - set(_ENGINE_CHECKS))
    if unknown:
        raise ValueError(f"tscompile: unknown engine argument(s) {unknown}; known: {list(ENGINE_ARGS)}")
    for name, value in kwargs.items():
        check = _ENGINE_CHECKS[name]
        if check is not None:
            check(value)
    if "num_pages" in kwargs:
        check_num_pages(kwargs["num_pages"], kwargs.get("pages_per_block", 1))


def validate_package_args(*, device=None, max_num_seqs=None, max_model_len=None, max_num_batched_tokens=None,
                          num_pages=None, seed=0, pages_per_block: int = 1) -> None:
    """Check ``load_package``'s keyword arguments by type and sign (each limit ``None`` means the
    packaged bound; the loader then checks them against the bounds). ``pages_per_block`` is the
    package record's, for ``num_pages``."""
    check_device(device)
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        check_int(name, value, 1, optional=True)
    check_num_pages(num_pages, pages_per_block)
    check_seed("seed", seed)
