"""The matmul nodes of a post-grad graph that the GEMV passes recognise and replace, and the node
helpers the passes' matchers share."""

from __future__ import annotations

import torch
import torch.fx

from tscompile.custom_ops.triton_gemv import SUPPORTED_DTYPES
from tscompile.passes.residual_addmm import _is_residual_addmm

aten = torch.ops.aten


def val_of(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def is_call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def erase_unused(graph: torch.fx.Graph, nodes: list) -> None:
    """Erase the nodes (pure ops, readers first) that nothing reads any more; a node still read stays.
    Not a graph-wide DCE, which could drop a mutating op whose result no one reads."""
    for node in nodes:
        if not node.users and node.graph is graph:
            graph.erase_node(node)


def transposed_weight(node) -> torch.fx.Node | None:
    """``w`` if ``node`` is ``permute(w, [1, 0])`` or ``t(w)`` of a K-contiguous 2-D ``w``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.permute.default and list(node.args[1]) == [1, 0]:
        w = node.args[0]
    elif node.target is aten.t.default:
        w = node.args[0]
    else:
        return None
    val = val_of(w)
    if val is None or val.dim() != 2 or val.stride(1) != 1:
        return None
    return w


def matmul_args(node: torch.fx.Node, devices: tuple[str, ...]) -> tuple | None:
    """(residual or None, x, transposed w) of ``mm(x, wt)`` or of a residual ``addmm(r, x, wt)``
    (Inductor folds a residual add into the matmul when the sum has a user that is not pointwise);
    None for anything else, a bias ``addmm`` included."""
    if node.op != "call_function":
        return None
    if node.target is aten.mm.default:
        return None, node.args[0], node.args[1]
    if _is_residual_addmm(node, devices):
        return node.args[0], node.args[1], node.args[2]
    return None


def swap_matmuls(graph: torch.fx.Graph, devices: tuple[str, ...], wanted, target, replace=None) -> int:
    """Replace every matmul ``matmul_args`` recognises, of a K-contiguous weight of static shape and
    x's dtype (one the Triton kernel takes) on ``devices``, for which ``wanted(x_val, weight_shape)``
    holds, by ``target(x, w)`` (``replace``, default ``replace_matmul``); returns how many."""
    replace = replace or replace_matmul
    count = 0
    for node in list(graph.nodes):
        args = matmul_args(node, devices)
        if args is None:
            continue
        x, w = val_of(args[1]), transposed_weight(args[2])
        if x is None or w is None:
            continue
        wval = val_of(w)
        if x.dtype not in SUPPORTED_DTYPES or wval.dtype != x.dtype:
            continue
        if x.device.type not in devices or wval.device != x.device:
            continue
        shape = tuple(wval.shape)
        if not all(type(d) is int for d in shape):  # a weight's shape is static; a symbolic one is no weight
            continue
        if wanted(x, shape):
            replace(graph, node, *args, w, target)
            count += 1
    return count


def replace_matmul(graph: torch.fx.Graph, node: torch.fx.Node, residual, x, transposed, w, target,
                   kwargs: dict | None = None) -> None:
    """``node`` (a matmul of ``x`` and ``transposed`` = w.T, with ``residual`` folded in or None) becomes
    ``target(x, w, **kwargs)``, plus ``residual`` after it (the eager model's rounding: the product,
    then the sum)."""
    with graph.inserting_before(node):
        op = graph.call_function(target, (x, w), kwargs or {})
        out = op if residual is None else graph.call_function(aten.add.Tensor, (residual, op))
    op.meta.update(node.meta)
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    erase_unused(graph, [transposed])  # the transpose, if only this matmul read it

