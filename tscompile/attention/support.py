"""Graded CUDA-graph support: a static, per-class declaration AND-composed over a backend tree."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from tscompile.attention.base import AttentionBackend

logger = logging.getLogger("tscompile")


@dataclass(frozen=True)
class CudaGraphSupport:
    """What a backend class can never do under a captured graph (a fact, not a runtime probe)."""

    decode_graph: bool = True
    prefill_graph: bool = True  # the pieces between attention breaks (attention itself runs eagerly)
    # the extend/mixed attention launched inside a captured graph (the whole-step prefill graphs): it
    # must read its lengths from device tensors only; a backend that reads them on the host cannot
    whole_prefill_graph: bool = True

    def __and__(self, other: "CudaGraphSupport") -> "CudaGraphSupport":
        return CudaGraphSupport(self.decode_graph and other.decode_graph, self.prefill_graph and other.prefill_graph,
                                self.whole_prefill_graph and other.whole_prefill_graph)


def walk_backends(root: "AttentionBackend") -> Iterator["AttentionBackend"]:
    yield root
    for child in root.child_backends():
        yield from walk_backends(child)


@dataclass(frozen=True)
class ResolvedGraphSupport:
    support: CudaGraphSupport
    decode_culprits: tuple[str, ...]
    prefill_culprits: tuple[str, ...]
    whole_prefill_culprits: tuple[str, ...] = ()


def resolve_cuda_graph_support(root: "AttentionBackend") -> ResolvedGraphSupport:
    """AND the class declarations over the tree once; log every class that turns a graph off."""
    support = CudaGraphSupport()
    decode_culprits: list[str] = []
    prefill_culprits: list[str] = []
    whole_culprits: list[str] = []
    for node in walk_backends(root):
        declared = type(node).cuda_graph_support
        support = support & declared
        name = type(node).__name__
        if not declared.decode_graph and name not in decode_culprits:
            decode_culprits.append(name)
        if not declared.prefill_graph and name not in prefill_culprits:
            prefill_culprits.append(name)
        if not declared.whole_prefill_graph and name not in whole_culprits:
            whole_culprits.append(name)
    for name in decode_culprits:
        logger.warning("tscompile: decode CUDA graph disabled by %s (cuda_graph_support.decode_graph=False)", name)
    for name in prefill_culprits:
        logger.warning("tscompile: prefill CUDA graph disabled by %s (cuda_graph_support.prefill_graph=False)", name)
    return ResolvedGraphSupport(support, tuple(decode_culprits), tuple(prefill_culprits), tuple(whole_culprits))
