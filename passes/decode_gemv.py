"""One-row projections of the bs=1 decode graph through ``tscompile::gemv`` (an Inductor post-grad pass).

In the static bs=1 decode graph every projection is ``mm(x [1, K], permute(w [N, K]))`` (or, with a
residual folded in, ``addmm``), which Inductor hands to cuBLAS. On the H200, cuBLAS reads llama-8b's smaller weights at about 3 TB/s; the
tuned static-cache baseline's Inductor GEMV reductions read the same ones at about 3.8
(``custom_ops/triton_gemv.py``, ``DECODE_GEMV_CONFIGS``). This pass swaps those matmuls, and only
those whose weight shape has a measured launch in that table, for the ``tscompile::gemv`` custom op:
its kernel runs the same reduction form at a fixed launch, so a compile cannot pick a slower one.

Opt-in (``TSCOMPILE_DECODE_GEMV=1``; ``piece_compiler`` adds the pass to static CUDA graphs only).
Numerics: float32 accumulation rounded once to the output dtype, as cuBLAS does, in another
summation order.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from tscompile.custom_ops import triton_gemv

aten = torch.ops.aten


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _transposed_weight(node) -> torch.fx.Node | None:
    """``w`` if ``node`` is ``permute(w, [1, 0])`` or ``t(w)`` of a K-contiguous 2-D ``w``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.permute.default and list(node.args[1]) == [1, 0]:
        w = node.args[0]
    elif node.target is aten.t.default:
        w = node.args[0]
    else:
        return None
    val = _val(w)
    if val is None or val.dim() != 2 or val.stride(1) != 1:
        return None
    return w


def _matmul_args(node: torch.fx.Node) -> tuple | None:
    """(residual or None, x, transposed w) of ``mm(x, wt)`` or of a residual ``addmm(r, x, wt)``
    (unit scales, ``r`` of the output's shape: Inductor folds a residual add into the matmul when the
    sum has a user that is not pointwise); None for anything else, a bias ``addmm`` included."""
    if node.op != "call_function":
        return None
    if node.target is aten.mm.default:
        return None, node.args[0], node.args[1]
    if node.target is aten.addmm.default and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
        r, out = _val(node.args[0]), _val(node)
        if r is not None and out is not None and tuple(r.shape) == tuple(out.shape):
            return node.args[0], node.args[1], node.args[2]
    return None


def _gemv_weight(node: torch.fx.Node, devices: tuple[str, ...]) -> torch.fx.Node | None:
    """The weight of a one-row matmul the pass swaps, or None."""
    args = _matmul_args(node)
    if args is None:
        return None
    x, w = _val(args[1]), _transposed_weight(args[2])
    if x is None or w is None:
        return None
    rows = x.shape[0]
    wval = _val(w)
    if not isinstance(rows, int) or rows > triton_gemv.MAX_ROWS or x.dtype not in triton_gemv.SUPPORTED_DTYPES:
        return None
    if wval.dtype != x.dtype or x.device.type not in devices or wval.device != x.device:
        return None
    return w if tuple(wval.shape) in triton_gemv.DECODE_GEMV_CONFIGS else None


def swap_decode_gemvs(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Replace every one-row ``mm(x, permute(w))`` whose weight shape has a ``DECODE_GEMV_CONFIGS``
    entry by ``tscompile::gemv(x, w)``, and a residual ``addmm(r, x, permute(w))`` by
    ``r + tscompile::gemv(x, w)`` (the eager model's rounding: the product, then the sum); returns
    how many."""
    count = 0
    for node in list(graph.nodes):
        w = _gemv_weight(node, devices)
        if w is None:
            continue
        residual, x, transposed = _matmul_args(node)
        with graph.inserting_before(node):
            op = graph.call_function(torch.ops.tscompile.gemv.default, (x, w))
            out = op if residual is None else graph.call_function(aten.add.Tensor, (residual, op))
        op.meta.update(node.meta)
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        if not transposed.users:  # the transpose only this matmul read (not a graph-wide DCE, which
            graph.erase_node(transposed)  # could drop a mutating op whose result no one reads)
        count += 1
    return count


class DecodeGemv(CustomGraphPass):
    """The pass as Inductor's ``post_grad_custom_post_pass``; the uuid keys Inductor's cache by this
    file and the kernel's (its launch table)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        swap_decode_gemvs(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, triton_gemv.__file__))
