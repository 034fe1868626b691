"""N-gram prompt lookup: draft by finding the context's last n tokens earlier in the same context.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens of a request
(prompt and output so far) are searched for among its earlier tokens; at the first n with a
match, the k tokens that followed the most recent earlier occurrence are the drafts (fewer where
the context ends sooner). No model runs. Per request, one numpy comparison over the context finds
where its last token occurred before; only those places are extended backwards, one token of the
suffix at a time, so a step of many requests costs a few microseconds each.
"""

from __future__ import annotations

import numpy as np

from tscompile.spec_decode.drafter import DraftBatch, Drafter, Drafts


def lookup_continuation(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """The drafts of one context ``tokens [L]``: up to k ids, empty when no n-gram repeats."""
    length = tokens.shape[0]
    longest = min(max_n, length - 1)
    if longest < min_n:
        return tokens[:0]
    # ends[i]: an earlier position holding the last token (never the last position itself); the
    # n-gram ending there matches the suffix when the n - 1 tokens before it match too
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if ends.size == 0:
        return tokens[:0]
    last = int(ends[-1])  # repetitive text: the most recent occurrence often matches the longest suffix
    if last + 1 >= longest and np.array_equal(tokens[last + 1 - longest: last + 1], tokens[length - longest:]):
        return tokens[last + 1: last + 1 + k]
    matched = np.ones(ends.shape[0], dtype=bool)
    best = np.full(ends.shape[0], 1 if min_n <= 1 else 0)  # the longest n in [min_n, longest] matched
    for back in range(1, longest):
        matched &= ends >= back
        matched[matched] = tokens[ends[matched] - back] == tokens[length - 1 - back]
        if back + 1 >= min_n:
            best[matched] = back + 1
        if not matched.any():
            break
    top = int(best.max())
    if top == 0:
        return tokens[:0]
    start = int(ends[np.flatnonzero(best == top)[-1]]) + 1  # the longest match's most recent occurrence
    return tokens[start: start + k]


class NgramDrafter(Drafter):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"tscompile: n-gram drafter needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, batch: DraftBatch) -> Drafts:
        k = batch.num_speculative_tokens
        out = np.full((batch.size, k), -1, dtype=np.int64)
        for i, tokens in enumerate(batch.token_ids):
            found = lookup_continuation(np.asarray(tokens, dtype=np.int64), k, self.min_n, self.max_n)
            out[i, : found.shape[0]] = found
        return Drafts(out)
