"""The engine's calls that step until their requests are done: ``generate``'s loop and ``stream``'s
generator, over ``LLM.step``. Each leaves nothing of its call behind when it raises or is abandoned:
the step in flight is waited for and its unfinished requests are aborted (after a CUDA fault nothing
is waited for: the engine is dead)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from tscompile.runtime.scheduler import Request
from tscompile.sampling import SamplingParams

if TYPE_CHECKING:
    from tscompile.runtime.engine import LLM


def run_until_done(llm: LLM, reqs: list[Request]) -> None:
    """Step ``llm`` until every request of ``reqs`` has finished. If a step raises (or the user
    interrupts), the step in flight is waited for and every unfinished request of ``reqs`` is
    aborted, so nothing of this call outlives it; the error then propagates unchanged (a
    ``KeyboardInterrupt`` stays one). After a CUDA fault nothing is waited for: the engine is
    dead and ``EngineDeadError`` propagates."""
    try:
        while not all(r.completion.finished for r in reqs):
            if not llm.has_unfinished():
                raise RuntimeError("tscompile: the engine drained with requests unfinished")
            llm.step()
        llm._settle()
    except BaseException:
        if not llm.is_dead:
            try:
                llm.sync()
            finally:
                for r in reqs:
                    if not r.completion.finished:
                        llm.abort(r.rid)
        raise


def stream_text(llm: LLM, prompt, sampling_params: SamplingParams | None) -> Iterator[str]:
    """Queue one request on ``llm`` and yield its text as it is produced (only text no later stop
    string can cut); abandoning the iterator aborts the request."""
    req = llm.add_request(prompt, sampling_params)
    shown = 0
    try:
        while not req.completion.finished:
            llm.step()
            text = req.completion.settled_text
            if len(text) > shown:
                yield text[shown:]
                shown = len(text)
        llm._settle()
        if len(req.completion.text) > shown:
            yield req.completion.text[shown:]
    finally:
        if not req.completion.finished:  # a dead engine aborted it already: no device wait
            try:
                llm.sync()
            finally:
                llm.abort(req.rid)
