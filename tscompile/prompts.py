"""Prompt inputs as vLLM takes them, turned into token ids before anything reaches the engine.

A prompt is a ``str`` (tokenized), a list of token ids, or a dict ``{"prompt_token_ids": [...]}``
(optionally with ``"prompt"``, the text those ids came from) or ``{"prompt": "text"}``. The input of
``parse_prompts`` is one prompt or a list of them. A bare string is one prompt, never a sequence of
characters; a flat list of ints is one prompt, a list of lists, strings or dicts is several.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

_PROMPT_KEYS = ("prompt_token_ids", "prompt")


@dataclass(frozen=True)
class Prompt:
    """One parsed prompt: ``text`` is what the user wrote (None when only ids were given)."""

    text: str | None
    token_ids: list[int]


def parse_prompts(prompts, tokenizer=None) -> list[Prompt]:
    """One prompt or a list of prompts -> a list of ``Prompt``; ``tokenizer`` encodes text prompts
    (with the tokenizer's special tokens, e.g. BOS, as vLLM does) and may be None for ids only."""
    if isinstance(prompts, (str, dict)):
        return [_parse_one(prompts, 0, tokenizer)]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"tscompile: prompts={_short(prompts)} must be a str, a list of token ids, a dict with "
                         "'prompt_token_ids', or a list of those")
    if len(prompts) == 0:
        raise ValueError("tscompile: prompts=[] holds no prompt; give a prompt or a non-empty list of prompts")
    if isinstance(prompts[0], (str, dict, list, tuple)):  # several prompts
        return [_parse_one(p, i, tokenizer) for i, p in enumerate(prompts)]
    return [_parse_one(prompts, 0, tokenizer)]  # one prompt of token ids; elements checked there


def _parse_one(prompt, index: int, tokenizer) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(prompt, _encode(prompt, index, tokenizer))
    if isinstance(prompt, (list, tuple)):
        return Prompt(None, _token_ids(prompt, index))
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - set(_PROMPT_KEYS), key=str)
        if unknown:
            raise ValueError(f"tscompile: prompt {index} has unknown keys {unknown!r}; allowed: {list(_PROMPT_KEYS)!r}")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"tscompile: prompt {index}: 'prompt'={_short(text)} must be a str")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"tscompile: prompt {index}: 'prompt_token_ids'={_short(ids)} must be a list of "
                                 "token ids")
            return Prompt(text, _token_ids(ids, index))
        if text is None:
            raise ValueError(f"tscompile: prompt {index} is a dict without 'prompt_token_ids' or 'prompt'")
        return Prompt(text, _encode(text, index, tokenizer))
    raise ValueError(f"tscompile: prompt {index}={_short(prompt)} must be a str, a list of token ids or a dict with "
                     "'prompt_token_ids'")


def _encode(text: str, index: int, tokenizer) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"tscompile: prompt {index} is text ({_short(text)}) but the model has no tokenizer; give "
                         "token ids instead")
    if not text:
        raise ValueError(f"tscompile: prompt {index} is an empty string; a prompt needs at least one token")
    ids = list(tokenizer.encode(text))
    if not ids:
        raise ValueError(f"tscompile: prompt {index} ({_short(text)}) encodes to no tokens")
    return ids


def _token_ids(ids, index: int) -> list[int]:
    if len(ids) == 0:
        raise ValueError(f"tscompile: prompt {index} is empty; a prompt needs at least one token id")
    # A prompt of 16k ids is checked per step of a TTFT measurement: the common case (a list of plain
    # ints) is one pass in C; anything else takes the per-id loop, which also names the bad position.
    if set(map(type, ids)) == {int}:
        return list(ids)
    for pos, t in enumerate(ids):
        # bool is an Integral, but True as a token id is a bug at the call site
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"tscompile: prompt {index}, position {pos}: token id {_short(t)} must be an int")
    return [int(t) for t in ids]


def check_token_ids(ids: list[int], vocab_size: int, where: str) -> None:
    """Refuse ids outside ``[0, vocab_size)``; ``where`` names them in the error (e.g. "prompt 2")."""
    if ids and 0 <= min(ids) and max(ids) < vocab_size:  # the common case, in C
        return
    for pos, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"tscompile: {where}, position {pos}: token id {t} is outside the vocabulary "
                             f"[0, {vocab_size})")


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
