"""Few-row projections of the decode batch graphs through ``tscompile::skinny_mm`` (an Inductor post-grad pass).

At decode batch sizes 2 to 32 a step's matmuls read every weight for a handful of rows: bandwidth
rows, where ``triton_gemv``'s "dot" and "acc" modes beat cuBLAS on some shapes
(``BATCH_GEMV_CONFIGS``, from launch sweeps on the H200).

The engine's dynamic-batch decode graph is compiled once for every batch size (the row count is
symbolic), so this pass cannot choose by M: it swaps every ``mm(x, permute(w))`` (or residual
``addmm``) whose weight shape ``BATCH_GEMV_CONFIGS`` lists at some row count for
``tscompile::skinny_mm``, which chooses when it runs: the Triton kernel where (M, N, K) is listed,
``x @ w.T`` otherwise. The CUDA graph of each batch size makes that choice once, at capture.

``KernelPolicy.batch_gemv`` (on by default, on the GPUs the table was timed on) adds it to that graph
(``piece_compiler``); the kernel launches with PDL if the graph's kernels do. Numerics: where cuBLAS
still runs, the same ``x @ w.T``; where the kernel runs, float32 accumulation rounded once, as cuBLAS
does, in another summation order.
"""

from __future__ import annotations

import functools

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from tscompile.custom_ops import triton_gemv
from tscompile.passes import matmul_nodes
from tscompile.passes.matmul_nodes import swap_matmuls


def swap_batch_matmuls(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",), pdl: bool = False) -> int:
    """Replace every ``mm(x, permute(w))`` whose weight shape ``BATCH_GEMV_CONFIGS`` lists by
    ``tscompile::skinny_mm(x, w)``, and a residual ``addmm(r, x, permute(w))`` by ``r + skinny_mm(x, w)``
    (the eager model's rounding: the product, then the sum); ``pdl``: ``skinny_mm(x, w, pdl=True)``.
    Returns how many."""
    weights = triton_gemv.batch_gemv_weights()
    if not weights:
        return 0
    replace = functools.partial(matmul_nodes.replace_matmul, kwargs={"pdl": True}) if pdl else None
    return swap_matmuls(graph, devices, lambda x, shape: shape in weights, torch.ops.tscompile.skinny_mm.default,
                        replace)


class BatchGemv(CustomGraphPass):
    """The pass as Inductor's ``post_grad_custom_post_pass``; the uuid keys Inductor's cache by this
    file, the kernel's, the launch table as it is now and ``pdl``."""

    def __init__(self, pdl: bool = False):
        self.pdl = pdl

    def __call__(self, graph: torch.fx.Graph) -> None:
        swap_batch_matmuls(graph, pdl=self.pdl)

    def uuid(self) -> bytes:
        table = repr((sorted(triton_gemv.BATCH_GEMV_CONFIGS.items()), self.pdl)).encode()
        return get_hash_for_files((__file__, matmul_nodes.__file__, triton_gemv.__file__)) + table
