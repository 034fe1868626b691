"""What ``generate`` returns, shaped like vLLM's ``RequestOutput`` and ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length")


@dataclass
class CompletionOutput:
    """One completion of a request.

    ``token_ids`` holds every sampled token, a stop token included; ``text`` leaves out the stop
    token's text and a matched stop string with what follows it. ``finish_reason`` is ``"stop"``
    (eos, a stop token or a stop string), ``"length"`` (``max_new_tokens`` reached) or None while
    the request runs; ``stop_reason`` is the stop token id or the stop string that ended it (None
    for eos or length), as in vLLM."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def __post_init__(self):
        assert self.finish_reason is None or self.finish_reason in FINISH_REASONS, self.finish_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions (one: only ``n=1`` is supported)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
