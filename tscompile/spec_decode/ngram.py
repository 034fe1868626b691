"""N-gram prompt lookup: draft by finding the context's last n tokens earlier in the same context.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens of a request
(prompt and output so far) are searched for among its earlier tokens; at the first n with a
match, the k tokens that followed the most recent earlier occurrence are the drafts (fewer where
the context ends sooner). No model runs; each request is one numpy comparison per n tried.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tscompile.spec_decode.drafter import DraftBatch, Drafter, Drafts


def lookup_continuation(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """The drafts of one context ``tokens [L]``: up to k ids, empty when no n-gram repeats."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. L - n - 1: every earlier occurrence, never the suffix itself
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence: its continuation is nearest
            return tokens[start: start + k]
    return tokens[:0]


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
