"""Process-wide counters so tests can assert "compiled N, recompiled 0, captured M"."""

from __future__ import annotations

import collections

counters: collections.Counter = collections.Counter()
# keys: "graphs" (graphs handed to the backend), "pieces_compiled", "breaks", "decode_captures",
# "decode_replays", "decode_eager", "prefill_captures", "prefill_replays", "prefill_eager"


def reset() -> None:
    counters.clear()
