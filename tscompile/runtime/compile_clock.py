"""Runs an engine's compiled steps under inference mode and counts the time they spend compiling.

A step compiles on its first call (and on a recompile): the call that compiled counts as compile
time, said once per step at INFO before the first call and after each call that compiled, so a
user's first ``generate`` says what it is doing (a tiny model compiles for about ten seconds).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from tscompile.counters import counters

logger = logging.getLogger("tscompile")
# what ``torch.inference_mode(True)`` enters, without its Python wrapper (torch 2.11-2.13 have it)
_inference_mode = getattr(torch._C, "_InferenceMode", None) or torch.inference_mode


class CompileClock:
    """``run(name, step, *args)`` calls a compiled step; ``seconds`` is the compile time so far.
    ``announce``: log the compiles (False for an eager engine, which compiles nothing)."""

    def __init__(self, announce: bool = True):
        self.seconds = 0.0
        self.announce = announce
        self._started: set[str] = set()

    def run(self, name: str, step: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        if self.announce and name not in self._started:
            self._started.add(name)
            logger.info("tscompile: compiling the %s step ...", name)
        before = counters["graphs"]
        start = time.perf_counter()
        # every caller (a launch, a capture's warm-up) reaches the same compiled entries: Dynamo
        # guards on grad mode, and with grad on it would trace a training graph
        if torch.is_inference_mode_enabled():
            out = step(*args)
        else:
            with _inference_mode(True):
                out = step(*args)
        if counters["graphs"] != before:
            took = time.perf_counter() - start
            self.seconds += took
            if self.announce:
                logger.info("tscompile: compiled the %s step in %.1f s", name, took)
        return out
