"""The live forward context: what a model forward reads besides its tensor inputs.

A neutral module: models read it, runners set it, attention backends are reached through it, and
it imports none of them. The runner sets a context around every forward; layers read the mode,
the attention router and this step's row facts from it at call time, so a captured graph never
freezes a value the next step changes. Under torch.compile, Dynamo lifts the tensors it reaches
here as graph inputs.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill chunks only
    DECODE = "decode"  # one new row per request
    MIXED = "mixed"  # extend requests first, then decode requests

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


class LayerAttention(Protocol):
    """What a model layer calls: write this forward's K/V, then attention into ``out``.

    q: [rows, n_heads, head_dim]; k, v: [rows, n_kv_heads, head_dim]; k_cache, v_cache: the layer's
    pages ``[num_pages, page_size, n_kv_heads, head_dim]``; out: [rows, n_heads, head_dim]."""

    def forward(self, layer_id: int, mode: ForwardMode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, scale: float) -> None: ...


@dataclass
class ForwardContext:
    """One forward's facts. Device tensors, built by the runner from the step plan.

    logits_rows: [B] int64, the row of each request's sampled row among the last layer's rows.
    qo_indptr:   [B + 1] int32, row offsets of the requests among the input rows (extend/mixed; the
                 narrowing reads it). None on decode: every request has one row.
    completes:   [B] bool, request b's chunk completes its prompt (extend/mixed). None on decode.
    prefill_graphs: the padded sizes of an extend/mixed step under prefill CUDA graphs (the
                 runner's ``PrefillGraphPlan``), read by the graphed pieces; None otherwise.
    """

    mode: ForwardMode
    attention: LayerAttention
    logits_rows: torch.Tensor
    qo_indptr: torch.Tensor | None = None
    completes: torch.Tensor | None = None
    prefill_graphs: object | None = None
    # What layers pass to the attention: DECODE or EXTEND (a mixed step reads the extend metadata).
    # A field, not a property over ``mode``: Dynamo guards on the identity of every enum a traced
    # forward reads, and reading ``mode`` would make EXTEND and MIXED steps two compiles of one graph.
    attention_mode: ForwardMode = field(init=False)

    def __post_init__(self):
        self.attention_mode = ForwardMode.DECODE if self.mode.is_decode else ForwardMode.EXTEND


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
