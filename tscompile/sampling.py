"""Sampling parameters and the persistent buffers the ``tscompile::sample`` op reads and writes."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import InitVar, dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from tscompile.utils import upload

if TYPE_CHECKING:
    from tscompile.step_plan import SamplingRows


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of generation; names and meanings follow vLLM's ``SamplingParams``.

    ``temperature == 0`` or ``top_k == 1`` is greedy; ``top_k == 0`` is the whole vocabulary.
    ``stop_token_ids`` and ``stop`` finish a request with ``"stop"`` (the eos ids too, unless
    ``ignore_eos``); none of them can end it before ``min_tokens`` tokens exist. Lists given for
    ``stop_token_ids`` and ``stop`` (or one string for ``stop``) are stored as tuples, numpy integers
    and reals as Python ``int`` and ``float``, so equal parameters hash equal.

    ``max_tokens`` is vLLM's name for ``max_new_tokens`` and is accepted as an alias (a constructor
    argument only: the value is read back as ``max_new_tokens``). Giving both with different values
    is refused; neither means 16.

    ``logprobs=0`` returns each sampled token's log-probability under the model's raw distribution
    (``CompletionOutput.logprobs``, as vLLM shapes it, and ``cumulative_logprob``); the top-k
    alternatives (``logprobs > 0``) are refused.
    """

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None
    max_tokens: InitVar[int | None] = None

    def __post_init__(self, max_tokens):
        set_ = partial(object.__setattr__, self)  # frozen: normalised values go in this way
        set_("max_new_tokens", _max_new_tokens_arg(self.max_new_tokens, max_tokens))
        set_("min_tokens", _int_arg("min_tokens", self.min_tokens, low=0))
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"tscompile: min_tokens={self.min_tokens!r} must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        set_("top_k", _int_arg("top_k", self.top_k, low=0, what="0 = the whole vocabulary"))
        set_("temperature", _real_arg("temperature", self.temperature, ">= 0", lambda x: x >= 0))
        set_("top_p", _real_arg("top_p", self.top_p, "in (0, 1]", lambda x: 0 < x <= 1))
        if self.seed is not None:
            set_("seed", _int_arg("seed", self.seed, low=0, high=_SEED_END, what="or None"))
        set_("stop_token_ids", _token_ids_arg(self.stop_token_ids))
        set_("stop", _stop_arg(self.stop))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"tscompile: {name}={getattr(self, name)!r} must be True or False")
        n = _int_arg("n", self.n, low=1)
        if n != 1:
            raise ValueError(f"tscompile: n={self.n!r} is not supported yet; only n=1 (one completion per prompt)")
        set_("n", n)
        if self.logprobs is not None:
            logprobs = _int_arg("logprobs", self.logprobs, low=0, what="or None")
            if logprobs != 0:
                raise ValueError(f"tscompile: logprobs={self.logprobs!r} asks for the top {logprobs} alternatives "
                                 "per token; only logprobs=0 (the sampled token's own log-probability) or None "
                                 "is supported")
            set_("logprobs", logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def banned_ids(self, eos_ids: Iterable[int], num_generated: int) -> tuple[int, ...]:
        """Token ids whose logits are masked when sampling token number ``num_generated`` (0-based).

        While fewer than ``min_tokens`` tokens exist, every id that could stop the request is
        banned: the model's eos ids and ``stop_token_ids``. As in vLLM (and transformers'
        ``min_new_tokens``) the eos ids are banned even with ``ignore_eos``. Sorted, no repeats."""
        if num_generated >= self.min_tokens:
            return ()
        return tuple(sorted({int(t) for t in eos_ids} | set(self.stop_token_ids)))


_SEED_END = 2**63
DEFAULT_MAX_NEW_TOKENS = 16


def _max_new_tokens_arg(max_new_tokens, max_tokens) -> int:
    """One count from ``max_new_tokens`` and its alias ``max_tokens`` (vLLM's name)."""
    if max_tokens is not None:
        max_tokens = _int_arg("max_tokens", max_tokens, low=1)
    if max_new_tokens is not None:
        max_new_tokens = _int_arg("max_new_tokens", max_new_tokens, low=1)
    if max_tokens is not None and max_new_tokens is not None and max_tokens != max_new_tokens:
        raise ValueError(f"tscompile: max_tokens={max_tokens!r} and max_new_tokens={max_new_tokens!r} disagree; "
                         f"they are two names of one limit, so give one of them")
    if max_new_tokens is not None:
        return max_new_tokens
    return DEFAULT_MAX_NEW_TOKENS if max_tokens is None else max_tokens


def _is_int(value) -> bool:
    # bool is an Integral too, but True as a count is a bug at the call site, not a 1
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int_arg(name: str, value, *, low: int, high: int | None = None, what: str = "") -> int:
    allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high})"
    allowed += f" ({what})" if what else ""
    if not _is_int(value) or value < low or (high is not None and value >= high):
        raise ValueError(f"tscompile: {name}={value!r} must be {allowed}")
    return int(value)


def _real_arg(name: str, value, allowed: str, in_range) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
            or not in_range(value):
        raise ValueError(f"tscompile: {name}={value!r} must be a finite real number {allowed}")
    return float(value)


def _token_ids_arg(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"tscompile: stop_token_ids={value!r} must be a list of ints >= 0")
    for i, t in enumerate(value):
        if not _is_int(t) or t < 0:
            raise ValueError(f"tscompile: stop_token_ids[{i}]={t!r} must be an int >= 0")
    return tuple(int(t) for t in value)


def _stop_arg(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"tscompile: stop={value!r} must be a non-empty string or a list of them")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise ValueError(f"tscompile: stop[{i}]={s!r} must be a non-empty string")
    return tuple(value)


@dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling parameters on the device: temperature [max_rows] f32, top_k [max_rows] i32,
    top_p [max_rows] f32, seeds [max_rows] i64, steps [max_rows] i64 (the position the sampled token
    takes) and banned [max_rows, K] i64 (token ids masked out this step, -1 pads; K fixed per engine)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    banned: torch.Tensor

    @classmethod
    def allocate(cls, max_rows: int, banned_width: int, device: torch.device | str) -> "SamplingInputs":
        return cls(torch.zeros(max_rows, device=device), torch.ones(max_rows, dtype=torch.int32, device=device),
                   torch.ones(max_rows, device=device), torch.zeros(max_rows, dtype=torch.int64, device=device),
                   torch.zeros(max_rows, dtype=torch.int64, device=device),
                   torch.full((max_rows, banned_width), -1, dtype=torch.int64, device=device))

    def rows(self, n: int) -> tuple[torch.Tensor, ...]:
        """The op's parameter arguments for the first ``n`` rows, in its order."""
        return (self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seeds[:n], self.steps[:n], self.banned[:n])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its sampled token under the model's raw distribution (before
    temperature, top-k/top-p and banned ids, as vLLM reports by default), float32 ``[n]``: one more
    reduction over the vocabulary per row."""
    x = logits.float()
    return x.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)


class SamplingBuffers:
    """The sampling op's inputs and its persistent token output ``tokens: [max_rows] int64``.

    Eager steps and graph replays write tokens into the same ``tokens`` buffer; the runner reads
    ``tokens[:rows]``. ``inputs`` may be views of another buffer: the engine's are the decode
    staging's device buffers (``runtime/staging.py``), written by the decode upload; extend steps
    write them through ``fill`` (only while no step in flight reads them: extend steps wait)."""

    def __init__(self, inputs: SamplingInputs):
        self.inputs = inputs
        self.max_rows = inputs.seeds.shape[0]
        self.tokens = torch.zeros(self.max_rows, dtype=torch.int64, device=inputs.seeds.device)
        self.logprobs = torch.zeros(self.max_rows, dtype=torch.float32, device=inputs.seeds.device)

    def fill(self, rows: "SamplingRows") -> None:
        """The first ``n`` rows' parameters from a step plan's ``SamplingRows`` (one copy per dtype)."""
        n = rows.seeds.shape[0]
        src = upload([rows.temperature, rows.top_k, rows.top_p, rows.seeds, rows.steps, rows.banned],
                     self.tokens.device)
        for d, x in zip(self.inputs.rows(n), src):
            d.copy_(x)

    def sample(self, logits: torch.Tensor, all_greedy: bool = False, logprobs: bool = True) -> torch.Tensor:
        """Run the sampling op on ``logits: [n, V]`` into ``tokens[:n]``; returns that slice.
        ``all_greedy`` (a host fact about the batch) skips the vocabulary sort; ``logprobs`` also
        writes the tokens' log-probabilities into ``logprobs[:n]`` (a prefill always does: once per
        request; a decode step only when one of its requests asks, so decode graphs go without)."""
        n = logits.shape[0]
        out = self.tokens[:n]
        torch.ops.tscompile.sample(logits, *self.inputs.rows(n), out, all_greedy)
        if logprobs:
            self.logprobs[:n].copy_(token_logprobs(logits, out))
        return out
