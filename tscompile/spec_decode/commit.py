"""Committing a verify step on the host: which emitted tokens a request keeps, and its KV counter.

After the one read-back of a verify step, request i has ``accepted_i + 1`` emitted tokens (its
accepted drafts, then the target's own token). They are appended one by one, exactly as plain
decode appends its one sampled token, so a stop token, a stop string or ``max_new_tokens`` inside
the run ends the request there and the rest of the run is dropped.

The KV counter needs no copy: before the step the request had ``context_len`` tokens, of which the
cache held ``context_len - 1`` (the newest token is the window's first row). The window wrote rows
for that token and the drafts; of those, the rows of the kept tokens except the newest one are
valid, so the cache holds ``context_len + kept - 1`` rows after the step and the rest are simply
overwritten by the next step (their pages stay the request's).
"""

from __future__ import annotations

from collections.abc import Sequence

from tscompile.text import CompletionState


def commit_emitted(state: CompletionState, emitted: Sequence[int]) -> int:
    """Append ``emitted`` (one request's tokens of a verify step, in order, without -1 padding) to
    ``state`` until it finishes; returns how many tokens were kept (>= 1 unless already finished)."""
    return state.extend(emitted)


def kv_len_after(context_len: int, kept: int) -> int:
    """Valid KV rows after a verify step that kept ``kept`` tokens of a request whose context had
    ``context_len`` tokens before it (the newest kept token is written by the next step)."""
    return context_len + kept - 1
