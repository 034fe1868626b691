"""One-row projections of the bs=1 decode graph through ``tscompile::gemv`` (an Inductor post-grad pass).

In the static bs=1 decode graph every projection is ``mm(x [1, K], permute(w [N, K]))`` (or, with a
residual folded in, ``addmm``), which Inductor hands to cuBLAS. On the H200, cuBLAS reads llama-8b's qkv and output weights at about 3.0 TB/s
(3.9-4.1 for the larger gate/up and down); the tuned static-cache baseline's Inductor GEMV reductions
read qkv at 3.2-3.8 and the output projection at 3.4 (``custom_ops/triton_gemv.py``,
``DECODE_GEMV_CONFIGS``). This pass swaps those matmuls, and only
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
from tscompile.passes.residual_addmm import _is_residual_addmm

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


def _matmul_args(node: torch.fx.Node, devices: tuple[str, ...]) -> tuple | None:
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


def _swappable(node: torch.fx.Node, devices: tuple[str, ...]) -> tuple | None:
    """(residual or None, x, transposed w, w) of a one-row matmul the pass swaps, or None."""
    args = _matmul_args(node, devices)
    if args is None:
        return None
    x, w = _val(args[1]), _transposed_weight(args[2])
    if x is None or w is None:
        return None
    wval = _val(w)
    # one row: DECODE_GEMV_CONFIGS' launches hold M x BLOCK_N x BLOCK_K float32 products per program
    if x.shape[0] != 1 or x.dtype not in triton_gemv.SUPPORTED_DTYPES:
        return None
    if wval.dtype != x.dtype or x.device.type not in devices or wval.device != x.device:
        return None
    return (*args, w) if tuple(wval.shape) in triton_gemv.DECODE_GEMV_CONFIGS else None


def swap_decode_gemvs(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Replace every one-row ``mm(x, permute(w))`` whose weight shape has a ``DECODE_GEMV_CONFIGS``
    entry by ``tscompile::gemv(x, w)``, and a residual ``addmm(r, x, permute(w))`` by
    ``r + tscompile::gemv(x, w)`` (the eager model's rounding: the product, then the sum); returns
    how many."""
    count = 0
    for node in list(graph.nodes):
        found = _swappable(node, devices)
        if found is None:
            continue
        residual, x, transposed, w = found
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
    file, the kernel's and the launch table as it is now (a process may change the table)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        swap_decode_gemvs(graph)

    def uuid(self) -> bytes:
        table = repr(sorted(triton_gemv.DECODE_GEMV_CONFIGS.items())).encode()
        return get_hash_for_files((__file__, triton_gemv.__file__)) + table
