"""``SpeculativeConfig``: speculative decoding settings, read from ``speculative_config={...}`` with
vLLM's keys, frozen and validated.

    method:                 "ngram" (prompt lookup, no model), "draft_model" (a smaller checkpoint
                            with the target's tokenizer) or "replay" (benchmarks only: proposes a
                            given reference continuation, so every draft is accepted)
    num_speculative_tokens: k, drafts per request per step; the verify window is N = k + 1 rows
    model:                  the draft checkpoint (``draft_model`` only)
    prompt_lookup_min/max:  the n-gram lengths tried, longest first (``ngram`` only); as in vLLM,
                            one given sets the other, neither gives 5 and 5
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tscompile.sampling import SamplingParams

METHODS = ("ngram", "draft_model", "replay")
# The widest verify window is k + 1 rows per request: every (batch size, N) pair is a captured
# graph and every window row takes a KV slot ahead of the accepted tokens, so k stays small. vLLM
# caps its rejection sampler at 32 drafts; past a handful the accepted length stops growing.
MAX_NUM_SPECULATIVE_TOKENS = 15
DEFAULT_PROMPT_LOOKUP = 5
_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")
# vLLM keys this engine does not implement: named in the refusal, so a copied config gets a clear answer
_VLLM_ONLY_KEYS = ("draft_tensor_parallel_size", "disable_by_batch_size", "quantization", "max_model_len",
                   "revision", "code_revision", "speculative_token_tree", "disable_padded_drafter_batch",
                   "parallel_drafting", "draft_model_config", "enforce_eager")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"tscompile: speculative_config method={self.method!r} is not known; use one of "
                             f"{list(METHODS)}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"tscompile: speculative_config num_speculative_tokens={k!r} must be an int in "
                             f"[1, {MAX_NUM_SPECULATIVE_TOKENS}]; pass a value in that range (3 or 4 is typical)")
        object.__setattr__(self, "num_speculative_tokens", int(k))
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"tscompile: speculative_config method='draft_model' needs \"model\" (the draft "
                                 f"checkpoint's path or name), got model={self.model!r}")
        elif self.model is not None:
            raise ValueError(f"tscompile: speculative_config model={self.model!r} is only read by method="
                             f"'draft_model'; drop it for method={self.method!r}")
        if self.method == "ngram":
            self._set_lookup_window()
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(f"tscompile: speculative_config prompt_lookup_min/max "
                             f"({self.prompt_lookup_min!r}, {self.prompt_lookup_max!r}) are only read by method="
                             f"'ngram'; drop them for method={self.method!r}")

    def _set_lookup_window(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"tscompile: speculative_config {name}={value!r} must be an int >= 1 (tokens "
                                 "matched at the end of the context)")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"tscompile: speculative_config prompt_lookup_min={lo} is above prompt_lookup_max={hi}; "
                             "the minimum must be <= the maximum")
        object.__setattr__(self, "prompt_lookup_min", int(lo))
        object.__setattr__(self, "prompt_lookup_max", int(hi))

    @classmethod
    def from_dict(cls, config: Mapping | "SpeculativeConfig" | None) -> "SpeculativeConfig | None":
        """``speculative_config={...}`` as users pass it (None: no speculation)."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(f"tscompile: speculative_config={config!r} must be a dict with keys {list(_KEYS)}")
        for key in config:
            if key in _VLLM_ONLY_KEYS:
                raise ValueError(f"tscompile: speculative_config key {key!r} (a vLLM setting) is not supported; "
                                 f"drop it (supported keys: {list(_KEYS)})")
            if key not in _KEYS:
                raise ValueError(f"tscompile: speculative_config key {key!r} is not known; supported keys: "
                                 f"{list(_KEYS)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in config:
                raise ValueError(f"tscompile: speculative_config needs {key!r}, e.g. "
                                 "{'method': 'ngram', 'num_speculative_tokens': 3}")
        return cls(**dict(config))

    @property
    def verify_width(self) -> int:
        """N, the query rows per request of a verify step: the last accepted token and the k drafts."""
        return self.num_speculative_tokens + 1

    @property
    def lookahead_slots(self) -> int:
        """KV slots a request needs past its accepted tokens during a verify step (the k drafts; the
        window's first row is the accepted token that plain decode writes too)."""
        return self.num_speculative_tokens

    def check_sampling(self, params: "SamplingParams") -> None:
        """Refuse a request's sampling settings that speculation cannot honour exactly.

        ``min_tokens``: the stop ids it bans change from one window position to the next, and the
        acceptance ops take no per-position bans, so a draft could emit a banned stop id."""
        if params.min_tokens > 0:
            raise ValueError(f"tscompile: min_tokens={params.min_tokens} cannot be honoured with speculative "
                             f"decoding (method={self.method!r}); use min_tokens=0 or leave speculative_config "
                             "unset")

    def check_draft_vocab(self, target_vocab: int, draft_vocab: int) -> None:
        """Refuse a draft model whose vocabulary differs from the target's (its token ids would mean
        other tokens)."""
        if target_vocab != draft_vocab:
            raise ValueError(f"tscompile: speculative_config model={self.model!r} has a vocabulary of {draft_vocab} "
                             f"tokens, the target has {target_vocab}; use a draft checkpoint with the target's "
                             "tokenizer")

    def check_graph_widths(self, max_width: int) -> None:
        """Refuse a window wider than the widest verify graph the engine captures (``max_width``)."""
        if self.verify_width > max_width:
            raise ValueError(f"tscompile: speculative_config num_speculative_tokens={self.num_speculative_tokens} "
                             f"needs verify windows of {self.verify_width} rows; the engine captures at most "
                             f"{max_width}; use num_speculative_tokens <= {max_width - 1}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
