"""Text around the token engine: loading a tokenizer, chat prompts, incremental detokenization and
deciding when a request stops (vLLM's semantics).

Nothing here touches the device: the engine feeds each sampled token id, as it reads it back, to
one ``CompletionState`` per request and asks it whether the request has finished.
"""

from __future__ import annotations

import os

from tscompile.outputs import CompletionOutput, Logprob
from tscompile.sampling import SamplingParams

# Files whose presence means a directory ships a tokenizer ``AutoTokenizer`` can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in the directory ``path`` (never downloaded), or None when it has none."""
    if not os.path.isdir(path):
        raise ValueError(f"tscompile: tokenizer path {str(path)!r} is not a directory")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # heavy and optional: only when a tokenizer is wanted

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types; the path is what the user needs to see
        raise ValueError(f"tscompile: could not load the tokenizer in {str(path)!r}: {e}") from e


def eos_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's eos id as a tuple (empty without one); the engine may add generation-config ids."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)


def stop_ids_of(checkpoint_eos_ids, tokenizer) -> tuple[int, ...]:
    """A model's end-of-sequence ids: the checkpoint's (generation_config.json, config.json), then
    the tokenizer's, each once, in that order."""
    return tuple(dict.fromkeys([*checkpoint_eos_ids, *(eos_token_ids(tokenizer) if tokenizer is not None else ())]))


def apply_chat_template(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` (``[{"role": ..., "content": ...}, ...]``) rendered by the tokenizer's
    chat template, ending with the assistant's turn header when ``add_generation_prompt``.

    The template writes its own special tokens (BOS included), so the rendered text is encoded
    without adding more."""
    if tokenizer is None:
        raise ValueError("tscompile: chat messages need a tokenizer with a chat template; the model has no "
                         "tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tscompile: the tokenizer ({type(tokenizer).__name__}) has no chat template; give "
                         "the prompt as text or token ids instead of chat messages")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"tscompile: messages={messages!r} must be a non-empty list of "
                         "{'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"tscompile: messages[{i}]={m!r} must be a dict with a str 'role' and a 'content'")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one id at a time.

    A token may end in the middle of a multi-byte character (byte-level BPE splits emoji and CJK
    into byte tokens), so the text of the last few ids is not final until the character completes.
    As vLLM does, it decodes a window ``ids[prefix:]`` and emits what it adds to ``ids[prefix:read]``
    (already emitted), holding everything back while the window's text ends in U+FFFD. Decoding a
    window rather than one id keeps merges and leading spaces right; the window restarts at the
    last emitted boundary, so the work per token stays small.

    The deltas of ``add`` followed by ``flush`` concatenate to ``tokenizer.decode(generated ids,
    skip_special_tokens=...)`` for byte-level BPE tokenizers. The last few prompt ids seed the
    window so the first delta gets the spacing it has after the prompt (tokenizers that strip a
    leading space at the start of a decode otherwise lose it)."""

    PROMPT_CONTEXT = 5

    def __init__(self, tokenizer, prompt_token_ids=(), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids)[-self.PROMPT_CONTEXT:]
        if self._decode(context).endswith("\ufffd"):
            # the prompt ends inside a character: its text would shift every later delta
            context = []
        self._ids = context
        self._prefix = 0  # window start: text of ids[prefix:read] has been emitted
        self._read = len(context)

    def _decode(self, ids: list[int]) -> str:
        # clean-up heuristics rewrite spaces around punctuation depending on the neighbours, which
        # differ between a window and the whole text; byte-level tokenizers do not need them
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """The text ``token_id`` completes (possibly "", while a character is incomplete)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """What is held back, incomplete characters as U+FFFD; call once the request has finished."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        emitted = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(emitted) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[: self._prefix]  # ids before the window are never decoded again
        self._read -= self._prefix
        self._prefix = 0
        return text[len(emitted):]


class StopChecker:
    """vLLM's stop rules for one request, given its ``SamplingParams`` and the model's eos ids.

    None of the stop conditions applies before ``min_tokens`` tokens exist (the sampling op's
    ``banned`` mask keeps eos and stop ids from being sampled that early; stop strings are simply
    not looked for). After that, an eos id (unless ``ignore_eos``) or a ``stop_token_ids`` id, then
    a ``stop`` string, finish with ``"stop"``; ``max_new_tokens`` tokens finish with ``"length"``."""

    def __init__(self, params: SamplingParams, eos_ids=()):
        self.params = params
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.max_stop_len = max(map(len, params.stop), default=0)
        # every id that ends the request once active (what ``stop_token`` looks for)
        self.stopping_ids = self.stop_ids | (frozenset() if params.ignore_eos else self.eos_ids)

    def active(self, num_tokens: int) -> bool:
        return num_tokens >= self.params.min_tokens

    def stop_token(self, token_id: int, num_tokens: int) -> tuple[bool, int | None]:
        """``(stops, stop_reason)`` for the token making ``num_tokens``: eos gives reason None, a stop
        token id gives that id (eos wins when an id is both, as in vLLM)."""
        if not self.active(num_tokens):
            return False, None
        if token_id in self.eos_ids and not self.params.ignore_eos:
            return True, None
        if token_id in self.stop_ids:
            return True, token_id
        return False, None

    def find_stop_string(self, text: str, new_chars: int, num_tokens: int) -> tuple[str, int] | None:
        """``(stop string, index)`` of the earliest stop string in ``text`` that involves its last
        ``new_chars`` characters, or None. Only that tail (plus the longest stop string's length - 1
        characters before it) can hold a new match: earlier text was searched at earlier tokens."""
        if not self.params.stop or new_chars == 0 or not self.active(num_tokens):
            return None
        found = None
        for stop in self.params.stop:
            i = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if i != -1 and (found is None or i < found[1]):
                found = (stop, i)
        return found

    def length_reached(self, num_tokens: int) -> bool:
        return num_tokens >= self.params.max_new_tokens


class CompletionState:
    """One request's generated tokens, text and finish reason, updated one sampled token at a time.

    ``token_ids`` keeps every sampled token (a stop token included); ``text`` excludes a stop
    token's text and cuts a stop string and what follows it. Without a tokenizer, ``text`` stays ""
    and stop strings are refused."""

    def __init__(self, params: SamplingParams, eos_ids=(), tokenizer=None, prompt_token_ids=()):
        if tokenizer is None and params.stop:
            raise ValueError(f"tscompile: stop={list(params.stop)!r} needs a tokenizer; the model has none (use "
                             "stop_token_ids)")
        self.checker = StopChecker(params, eos_ids)
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.token_ids: list[int] = []
        # each token's log-probability, where the request asked for them (logprobs=0)
        self.logprobs: list[float] | None = None if params.logprobs is None else []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, logprob: float | None = None) -> str | None:
        """Record the next sampled token (and its log-probability, where the request wants them);
        returns the finish reason (None while running)."""
        assert not self.finished, "a finished request got another token"
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if self.logprobs is not None:
            if logprob is None:
                raise RuntimeError("tscompile: a request that asked for logprobs got a token without one")
            self.logprobs.append(float(logprob))
        n = len(self.token_ids)
        stops, reason = self.checker.stop_token(token_id, n)
        if stops:
            self.text += self._flush()  # text held back before the stop token is still output
            self.finish_reason, self.stop_reason = "stop", reason
            return self.finish_reason
        delta = self.detokenizer.add(token_id) if self.detokenizer is not None else ""
        if self.checker.length_reached(n):
            delta += self._flush()
        self.text += delta
        match = self.checker.find_stop_string(self.text, len(delta), n)
        if match is not None:
            self.text = self.text[: match[1]]
            self.finish_reason, self.stop_reason = "stop", match[0]
        elif self.checker.length_reached(n):
            self.finish_reason = "length"
        return self.finish_reason

    def extend(self, token_ids) -> int:
        """``append`` each of ``token_ids`` in order until the request finishes (a speculative step's
        run of emitted tokens); returns how many were kept. Without text or log-probabilities only a
        stop id and the length can end a request, and the run is checked and kept in one go."""
        if self.finished or self.detokenizer is not None or self.logprobs is not None:
            kept = 0
            for token in token_ids:
                if self.finished:
                    break
                self.append(token)
                kept += 1
            return kept
        params, done = self.checker.params, len(self.token_ids)
        run = [int(t) for t in token_ids[: params.max_new_tokens - done]]
        stopping = self.checker.stopping_ids
        if stopping:
            # the token at index i makes done + i + 1 tokens: stop ids count from min_tokens on
            for i in range(max(params.min_tokens - done - 1, 0), len(run)):
                if run[i] in stopping:
                    self.token_ids += run[: i + 1]
                    self.finish_reason, self.stop_reason = "stop", self.checker.stop_token(run[i], done + i + 1)[1]
                    return i + 1
        self.token_ids += run
        if self.checker.length_reached(len(self.token_ids)):
            self.finish_reason = "length"
        return len(run)

    def _flush(self) -> str:
        return self.detokenizer.flush() if self.detokenizer is not None else ""

    @property
    def settled_text(self) -> str:
        """The prefix of ``text`` no later stop string can cut (all of it once finished): what a
        stream may show now."""
        if self.finished or self.checker.max_stop_len <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - (self.checker.max_stop_len - 1))]

    def output(self, index: int = 0) -> CompletionOutput:
        logprobs = cumulative = None
        if self.logprobs is not None:
            logprobs = [{t: Logprob(lp)} for t, lp in zip(self.token_ids, self.logprobs)]
            cumulative = sum(self.logprobs)
        return CompletionOutput(index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                logprobs, cumulative)
