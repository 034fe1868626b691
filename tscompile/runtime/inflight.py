"""The step in flight: a launched step whose tokens the host has not read yet.

With asynchronous scheduling the engine launches a decode step before it reads the previous step's
tokens: ``chained_input_rows`` tells which input tokens the new step gathers from that step's sample
on the device, and ``read_back`` hands the tokens to their requests once they arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tscompile.runtime.readback import PendingTokens
from tscompile.runtime.scheduler import Request
from tscompile.step_plan import StepPlan


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose tokens the host has not read yet."""

    plan: StepPlan
    requests: list[Request]
    tokens: PendingTokens
    launch: int  # the runner's launch count right after this step: anything launched since breaks a chain


def chained_input_rows(plan: StepPlan, prev: InFlightStep) -> list[int]:
    """Per decode row: the row of ``prev``'s sample holding its input token, or -1 (on the host)."""
    sampled = {rid: i for i, (rid, emit) in enumerate(zip(prev.plan.request_ids, prev.plan.emits.tolist())) if emit}
    first = plan.num_extends
    ids = plan.input_ids[plan.num_tokens - plan.num_decodes:].tolist()  # Python ints: no numpy scalar per row
    return [sampled.get(rid, -1) if t < 0 else -1 for rid, t in zip(plan.request_ids[first:], ids)]


def read_back(flight: InFlightStep, on_stop: Callable[[Request], None]) -> None:
    """Wait for ``flight``'s tokens, hand them to their requests and apply the stop conditions;
    ``on_stop`` gets each request a stop condition ended. A token sampled after its request stopped
    (asynchronous scheduling learns a stop one step late) is dropped, so the outputs equal those of
    synchronous steps."""
    tokens = flight.tokens.wait()
    logprobs = flight.tokens.logprobs() or (None,) * len(tokens)
    for r, emit, tok, lp in zip(flight.requests, flight.plan.emits, tokens, logprobs):
        if not emit or r.completion.finished:
            continue
        r.output.append(tok)
        if r.completion.append(tok, lp) is not None:
            on_stop(r)  # a stop before max_new_tokens frees its blocks now
