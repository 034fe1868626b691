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


def _strip_upcast(node):
    """(source, cast node or None) of ``convert_element_type(source, float32)``; (node, None) otherwise."""
    if is_call(node, torch.ops.prims.convert_element_type.default) and node.args[1] == torch.float32:
        return node.args[0], node
    return node, None


def decomposed_matmul(node: torch.fx.Node) -> tuple | None:
    """(x, transposed w, the chain's nodes, last first) where ``node`` ends Inductor's decomposition
    of a one-row ``mm(x, wt)``, what ``mm`` becomes with coordinate-descent tuning on a GPU (its
    ``decomposition.mm``): ``sum(unsqueeze(x, 2) * unsqueeze(wt, 0), [1])``, on float32 upcasts of
    x and wt and cast back to x's dtype for lower-precision inputs. None for anything else, or where
    a node inside the chain has another reader (it could not go)."""
    cast_back = None
    if is_call(node, torch.ops.prims.convert_element_type.default):
        cast_back, node = node, node.args[0]
    if not is_call(node, aten.sum.dim_IntList) or list(node.args[1]) != [1] or node.kwargs.get("dtype") is not None:
        return None
    if len(node.args) > 2 and node.args[2]:  # keepdim
        return None
    mul = node.args[0]
    if not is_call(mul, aten.mul.Tensor) or len(mul.users) != 1:
        return None
    left, right = mul.args
    if not (is_call(left, aten.unsqueeze.default) and left.args[1] == 2
            and is_call(right, aten.unsqueeze.default) and right.args[1] == 0):
        return None
    (x, x_cast), (wt, w_cast) = _strip_upcast(left.args[0]), _strip_upcast(right.args[0])
    if (x_cast is None) != (w_cast is None) or (x_cast is None) != (cast_back is None):
        return None  # upcast inputs and a cast-back result together, or none of them (float32)
    xval, wtval, out = val_of(x), val_of(wt), val_of(cast_back if cast_back is not None else node)
    if xval is None or wtval is None or out is None or xval.dim() != 2 or out.dtype != xval.dtype:
        return None
    if len(node.users) != 1 and cast_back is not None:
        return None
    chain = [n for n in (cast_back, node, mul, left, right, x_cast, w_cast) if n is not None]
    if any(len(n.users) != 1 for n in (left, right, *(c for c in (x_cast, w_cast) if c is not None))):
        return None
    return x, wt, chain


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

