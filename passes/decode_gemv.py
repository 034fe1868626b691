"""One-row projections of the bs=1 decode graph through ``tscompile::gemv`` (an Inductor post-grad pass).

In the static bs=1 decode graph every projection is ``mm(x [1, K], permute(w [N, K]))`` (or, with a
residual folded in, ``addmm``), which Inductor hands to cuBLAS. On the H200 cuBLAS reads llama-8b's
qkv and output weights at 3.2 and 2.5 TB/s, llama-1b's at 2.0 and 1.4; this kernel's "acc" launch
reads them at 3.7, 3.4, 2.1 and 1.8. This
pass swaps those matmuls, and only those whose weight shape has a measured launch in
``DECODE_GEMV_CONFIGS`` (custom_ops/triton_gemv.py), for the ``tscompile::gemv`` custom op: a fixed
launch, so a compile cannot pick a slower one.

With coordinate-descent tuning on (``static_inductor_options``, the gpt-fast setting), Inductor has
decomposed the one-row matmuls into its own reductions before this pass runs; the pass then puts
back, per weight shape, the kernel that beat Inductor's tuned one in the same run
(``DECODE_TUNED_MATMULS``: this kernel or cuBLAS) and leaves the rest, with the RMSNorm Inductor
fuses into them, to Inductor (``swap_decomposed_matmuls``).

On by default on the GPUs that table was timed on (``piece_compiler`` adds the pass to static CUDA
graphs only; ``KernelPolicy.decode_gemv=False`` turns it off). Numerics: float32 accumulation rounded once
to the output dtype, as cuBLAS does, in another summation order.
"""

from __future__ import annotations

import functools

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from tscompile.custom_ops import triton_gemv
from tscompile.passes import matmul_nodes
from tscompile.passes.matmul_nodes import decomposed_matmul, erase_unused, swap_matmuls, transposed_weight, val_of

aten = torch.ops.aten


def swap_decode_gemvs(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",), pdl: bool = False) -> int:
    """Replace every one-row ``mm(x, permute(w))`` whose weight shape has a ``DECODE_GEMV_CONFIGS``
    entry by ``tscompile::gemv(x, w)``, and a residual ``addmm(r, x, permute(w))`` by
    ``r + tscompile::gemv(x, w)`` (the eager model's rounding: the product, then the sum); returns
    how many. ``pdl``: the calls launch the kernel with PDL (``tscompile::gemv(..., pdl=True)``: a
    graph whose Inductor kernels do)."""
    # one row: DECODE_GEMV_CONFIGS' launches hold M x BLOCK_N x BLOCK_K float32 products per program
    table = triton_gemv.DECODE_GEMV_CONFIGS
    swapped = swap_matmuls(graph, devices, lambda x, shape: x.shape[0] == 1 and shape in table,
                           torch.ops.tscompile.gemv.default,
                           replace=functools.partial(matmul_nodes.replace_matmul,
                                                     kwargs={"pdl": True} if pdl else None))
    return swapped + swap_decomposed_matmuls(graph, devices, pdl=pdl)


def swap_decomposed_matmuls(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",), pdl: bool = False) -> int:
    """With coordinate-descent tuning on, Inductor has already turned each one-row matmul into its own
    reduction (``matmul_nodes.decomposed_matmul``). Where ``DECODE_TUNED_MATMULS`` names the weight's
    shape, the reduction goes back to ``tscompile::gemv(x, w)`` ("gemv", if the launch table has the
    shape) or to ``mm(x, wt)`` for cuBLAS ("cublas"); elsewhere Inductor keeps it, with the norm it
    fuses into it. Returns how many went."""
    policy = triton_gemv.DECODE_TUNED_MATMULS
    count = 0
    for node in list(graph.nodes):
        found = decomposed_matmul(node)
        if found is None:
            continue
        x, transposed, chain = found
        w = transposed_weight(transposed)
        xval, wval = val_of(x), val_of(w) if w is not None else None
        if wval is None or xval.shape[0] != 1 or xval.dtype not in triton_gemv.SUPPORTED_DTYPES:
            continue
        if wval.dtype != xval.dtype or xval.device.type not in devices or wval.device != xval.device:
            continue
        shape = tuple(wval.shape)
        choice = policy.get(shape) if all(type(d) is int for d in shape) else None
        if choice == "gemv" and shape not in triton_gemv.DECODE_GEMV_CONFIGS:
            choice = None  # no launch to run it at
        if choice is None:
            continue
        end = chain[0]
        with graph.inserting_before(end):
            if choice == "gemv":
                op = graph.call_function(torch.ops.tscompile.gemv.default, (x, w), {"pdl": True} if pdl else {})
            else:
                op = graph.call_function(aten.mm.default, (x, transposed))
        op.meta.update(end.meta)
        end.replace_all_uses_with(op)
        erase_unused(graph, [*chain, transposed])
        count += 1
    return count


class DecodeGemv(CustomGraphPass):
    """The pass as Inductor's ``post_grad_custom_post_pass``; the uuid keys Inductor's cache by this
    file, the kernel's, the launch table as it is now (a process may change the table) and ``pdl``."""

    def __init__(self, pdl: bool = False):
        self.pdl = pdl

    def __call__(self, graph: torch.fx.Graph) -> None:
        swap_decode_gemvs(graph, pdl=self.pdl)

    def uuid(self) -> bytes:
        table = repr((sorted(triton_gemv.DECODE_GEMV_CONFIGS.items()), sorted(triton_gemv.DECODE_TUNED_MATMULS.items()),
                      self.pdl)).encode()
        files = (__file__, matmul_nodes.__file__, triton_gemv.__file__)
        return get_hash_for_files(files) + table
