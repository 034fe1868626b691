"""The live forward context: what a model forward reads besides its tensor inputs.

The runner sets it around every forward; layers read the mode and the top-level attention backend
(metadata and write locations) from it at call time, so a captured graph never freezes a value the
next step changes. Under torch.compile, Dynamo lifts the tensors it reaches here as graph inputs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from tscompile.attention.base import ForwardMode

if TYPE_CHECKING:
    from tscompile.attention.router import CacheGroupRouter
    from tscompile.runtime.piece_graphs import PrefillGraphPlan


@dataclass
class ForwardContext:
    mode: ForwardMode
    backend: "CacheGroupRouter"
    # [B] bool on the device: request b's chunk completes its prompt (extend/mixed only; the
    # narrowing model keeps a window of rows for those). None on decode.
    completes: torch.Tensor | None = None
    # extend/mixed under prefill CUDA graphs: the padded sizes of this step (runtime/piece_graphs.py)
    prefill_graphs: "PrefillGraphPlan | None" = None

    @property
    def attention_mode(self) -> ForwardMode:
        """What layers pass to the backend: DECODE or EXTEND. A mixed step reads the extend
        metadata, so EXTEND and MIXED steps trace to one graph."""
        return ForwardMode.DECODE if self.mode.is_decode else ForwardMode.EXTEND


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("tscompile: model forward called outside a forward context (use the engine or runner)")
    return _current


def peek_forward_context() -> ForwardContext | None:
    """The live context, or None outside a forward (a plain ``torch.compile`` user)."""
    return _current
