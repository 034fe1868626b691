"""Keep a residual add out of the matmul in the pieces of a split graph (an Inductor post-grad pass).

Inductor folds ``mm(a, b) + r`` into ``addmm(r, a, b)`` when ``r + mm`` has a user that is not
pointwise. In a split graph the residual stream ``h`` of every layer is a piece's output (the next
piece reads it after the attention break), and a graph output is not a pointwise user, so both
residual adds of a layer become ``addmm``. On CUDA, ``addmm`` with a 2-D ``r`` copies ``r`` into its
output before the GEMM (cuBLAS accumulates into C): one device-to-device copy of ``[T, dim]`` per
residual, two per layer, that the decode graph (one graph, ``h`` never an output) does not have.

This pass turns such an ``addmm`` back into ``mm`` + ``add``, which Inductor fuses into the RMSNorm
kernel that reads the sum anyway, as it does in the decode graph. A 1-D (or broadcast) bias is left
alone: ``addmm`` takes it in the GEMM's epilogue without a copy.

Numerics: the matmul is rounded to the output dtype before the add, as in the eager model
(``x + linear(...)``) and the decode graph; the fused ``addmm`` rounded once after it.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten


def _is_residual_addmm(node: torch.fx.Node, devices: tuple[str, ...]) -> bool:
    if node.op != "call_function" or node.target is not aten.addmm.default:
        return False
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return False
    inp, out = node.args[0], node.meta.get("val")
    val = inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    # a residual has the output's full shape; a bias is 1-D or broadcast and costs no copy
    return val.dim() == 2 and tuple(val.shape) == tuple(out.shape) and val.device.type in devices


def unfuse_residual_addmm(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Rewrite every residual ``addmm(r, a, b)`` on ``devices`` as ``r + mm(a, b)``; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if not _is_residual_addmm(node, devices):
            continue
        inp, a, b = node.args[:3]
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (a, b))
            add = graph.call_function(aten.add.Tensor, (inp, mm))
        mm.meta.update(node.meta)  # same shape, dtype, device and strides as the addmm's output
        add.meta.update(node.meta)
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        count += 1
    return count


class UnfuseResidualAddmm(CustomGraphPass):
    """The pass as Inductor's ``post_grad_custom_post_pass`` (it runs after Inductor's own pattern
    passes, which create the ``addmm``); the uuid keys Inductor's cache by this file."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        unfuse_residual_addmm(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
