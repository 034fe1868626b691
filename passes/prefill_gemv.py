"""Few-row projections of the prefill pieces through ``tscompile::skinny_mm`` (an Inductor post-grad pass).

At 32 prompt tokens a prefill step's matmuls read every weight for 32 rows: cuBLAS read llama-8b's
at 3.6 TB/s there on the H200 (bench/results/same-lease-b0f9ede/), so the 32-token rows are
bandwidth rows like decode. ``triton_gemv``'s "dot" mode takes up to 32 rows; whether it beats
cuBLAS per shape is what ``scripts/gemv_sweep.py`` with ``GEMV_SWEEP_ROWS=16,32`` measures.

The pieces of a split graph are compiled once for every token count (the row count is symbolic), so
this pass cannot choose by M: it swaps every ``mm(x, permute(w))`` (or residual ``addmm``) whose
weight shape ``PREFILL_GEMV_CONFIGS`` lists at some row count for ``tscompile::skinny_mm``, which
chooses when it runs: the Triton kernel where (M, N, K) is listed, ``x @ w.T`` otherwise. A captured
whole-step graph makes that choice once, at capture; a step run without a graph pays a Python op call
per swapped matmul.

Opt-in (``TSCOMPILE_PREFILL_GEMV=1``; ``piece_compiler`` adds the pass to CUDA split pieces, before
the residual-addmm pass). Numerics: where cuBLAS still runs, the same ``x @ w.T``; where the kernel
runs, float32 accumulation rounded once, as cuBLAS does, in another summation order.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from tscompile.custom_ops import triton_gemv
from tscompile.passes.decode_gemv import _matmul_args, _transposed_weight, _val

aten = torch.ops.aten


def _swappable(node: torch.fx.Node, devices: tuple[str, ...], weights: set) -> tuple | None:
    """(residual or None, x, transposed w, w) of a matmul whose weight shape is listed, or None."""
    args = _matmul_args(node, devices)
    if args is None:
        return None
    x, w = _val(args[1]), _transposed_weight(args[2])
    if x is None or w is None:
        return None
    wval = _val(w)
    if x.dtype not in triton_gemv.SUPPORTED_DTYPES or wval.dtype != x.dtype:
        return None
    if x.device.type not in devices or wval.device != x.device:
        return None
    shape = tuple(wval.shape)
    if not all(type(d) is int for d in shape):  # a weight's shape is static; a symbolic one is no weight
        return None
    return (*args, w) if shape in weights else None


def swap_prefill_matmuls(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Replace every ``mm(x, permute(w))`` whose weight shape ``PREFILL_GEMV_CONFIGS`` lists by
    ``tscompile::skinny_mm(x, w)``, and a residual ``addmm(r, x, permute(w))`` by ``r + skinny_mm(x, w)``
    (the eager model's rounding: the product, then the sum); returns how many."""
    weights = triton_gemv.prefill_gemv_weights()
    if not weights:
        return 0
    count = 0
    for node in list(graph.nodes):
        found = _swappable(node, devices, weights)
        if found is None:
            continue
        residual, x, transposed, w = found
        with graph.inserting_before(node):
            op = graph.call_function(torch.ops.tscompile.skinny_mm.default, (x, w))
            out = op if residual is None else graph.call_function(aten.add.Tensor, (residual, op))
        op.meta.update(node.meta)
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        if not transposed.users:  # only this matmul read the transpose (no graph-wide DCE: see decode_gemv)
            graph.erase_node(transposed)
        count += 1
    return count


class PrefillGemv(CustomGraphPass):
    """The pass as (part of) Inductor's ``post_grad_custom_post_pass``; the uuid keys Inductor's cache
    by this file, the kernel's and the launch table as it is now."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        swap_prefill_matmuls(graph)

    def uuid(self) -> bytes:
        table = repr(sorted(triton_gemv.PREFILL_GEMV_CONFIGS.items())).encode()
        return get_hash_for_files((__file__, triton_gemv.__file__)) + table
