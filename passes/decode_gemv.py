"""One-row projections of the bs=1 decode graph through ``tscompile::gemv`` (an Inductor post-grad pass).

In the static bs=1 decode graph every projection is ``mm(x [1, K], permute(w [N, K]))`` (or, with a
residual folded in, ``addmm``), which Inductor hands to cuBLAS. On the H200 cuBLAS reads llama-8b's
qkv and output weights at 3.2 and 2.5 TB/s, llama-1b's at 2.0 and 1.4; this kernel's "acc" launch
reads them at 3.7, 3.4, 2.1 and 1.8 (scripts/gemv_sweep.py, bench/results/same-lease-ada2650/). This
pass swaps those matmuls, and only those whose weight shape has a measured launch in
``DECODE_GEMV_CONFIGS`` (custom_ops/triton_gemv.py), for the ``tscompile::gemv`` custom op: a fixed
launch, so a compile cannot pick a slower one.

With coordinate-descent tuning on (``static_inductor_options``, the gpt-fast setting), Inductor has
decomposed the one-row matmuls into its own reductions before this pass runs; the pass then puts
back, per weight shape, the kernel that beat Inductor's tuned one in the same run
(``DECODE_TUNED_MATMULS``: this kernel or cuBLAS) and leaves the rest, with the RMSNorm Inductor
fuses into them, to Inductor (``swap_decomposed_matmuls``).

On by default on the GPUs that table was timed on (``piece_compiler`` adds the pass to static CUDA
graphs only; ``TSCOMPILE_DECODE_GEMV=0`` turns it off). Numerics: float32 accumulation rounded once
to the output dtype, as cuBLAS does, in another summation order.
"""

from __future__ import annotations

import functools

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from tscompile.custom_ops import triton_gemv
from tscompile.passes import matmul_nodes, rms_norm_nodes, silu_mul_nodes
from tscompile.passes.matmul_nodes import (decomposed_matmul, erase_unused, is_call, swap_matmuls,
                                          transposed_weight, val_of)
from tscompile.passes.rms_norm_nodes import match_rms_norm
from tscompile.passes.silu_mul_nodes import match_silu_mul

aten = torch.ops.aten


def swap_decode_gemvs(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",), fuse: bool | None = None,
                      pdl: bool = False) -> int:
    """Replace every one-row ``mm(x, permute(w))`` whose weight shape has a ``decode_gemv_configs``
    entry by ``tscompile::gemv(x, w)``, and a residual ``addmm(r, x, permute(w))`` by
    ``r + tscompile::gemv(x, w)`` (the eager model's rounding: the product, then the sum); returns
    how many. ``fuse`` (default ``DECODE_GEMV_FUSE``): the residual goes into the kernel's epilogue
    instead, and an x that is the model's RMSNorm output (or rows of it) or its SiLU-mul, read by
    this matmul alone, is computed in the kernel from its input (``fuse_replace``). ``pdl``: the calls
    launch the kernel with PDL (``tscompile::gemv(..., pdl=True)``: a graph whose Inductor kernels do)."""
    fuse = triton_gemv.DECODE_GEMV_FUSE if fuse is None else fuse
    # one row: DECODE_GEMV_CONFIGS' launches hold M x BLOCK_N x BLOCK_K float32 products per program
    table = triton_gemv.decode_gemv_configs(fuse)
    swapped = swap_matmuls(graph, devices, lambda x, shape: x.shape[0] == 1 and shape in table,
                           torch.ops.tscompile.gemv.default,
                           replace=functools.partial(fuse_replace if fuse else matmul_nodes.replace_matmul,
                                                     kwargs={"pdl": True} if pdl else None))
    return swapped + swap_decomposed_matmuls(graph, devices, pdl=pdl)


def swap_decomposed_matmuls(graph: torch.fx.Graph, devices: tuple[str, ...] = ("cuda",), pdl: bool = False) -> int:
    """With coordinate-descent tuning on, Inductor has already turned each one-row matmul into its own
    reduction (``matmul_nodes.decomposed_matmul``). Where ``decode_tuned_matmuls`` names the weight's
    shape, the reduction goes back to ``tscompile::gemv(x, w)`` ("gemv", if the launch table has the
    shape) or to ``mm(x, wt)`` for cuBLAS ("cublas"); elsewhere Inductor keeps it, with the norm it
    fuses into it. Returns how many went."""
    policy = triton_gemv.decode_tuned_matmuls()
    if not policy:
        return 0
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
        if choice == "gemv" and triton_gemv.decode_gemv_config(shape) is None:
            choice = None  # a sweep's table without this shape: no launch to run it at
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


def fuse_replace(graph: torch.fx.Graph, node: torch.fx.Node, residual, x, transposed, w, target,
                 kwargs: dict | None = None) -> None:
    """``node`` becomes ``target(x', w, ...)``: the residual (or None) as the kernel's epilogue, and
    x' = the RMSNorm's input (``norm_weight``, ``eps``) where x is that norm's output, directly or
    through a row ``index``, or x' = the [gate | up] projection output (``swiglu``) where x is the
    model's SiLU-mul of it; in either case only where x has no other reader. The matched nodes that
    nothing reads any more are erased, so the Inductor kernel that computed them (a norm with the
    residual add before it, a SiLU-mul) is gone from the step. ``kwargs``: the call's other keywords."""
    kwargs, dead = dict(kwargs or {}), []
    rows = None
    source = x
    if is_call(source, aten.index.Tensor) and len(source.users) == 1 and len(source.args[1]) == 1:
        rows, source = source, source.args[0]  # the LM head's rows: the norm is per row, so index first
    norm = match_rms_norm(source) if len(source.users) == 1 else None
    silu_mul = match_silu_mul(x) if norm is None and len(x.users) == 1 else None
    with graph.inserting_before(node):
        if norm is not None:
            x = norm.x
            if rows is not None:
                x = graph.call_function(aten.index.Tensor, (norm.x, rows.args[1]))
                x.meta.update(rows.meta)  # the same rows of a tensor of the same shape and dtype
                dead.append(rows)
            kwargs.update(norm_weight=norm.weight, eps=norm.eps)
            dead += norm.nodes
        elif silu_mul is not None:
            x, silu_nodes = silu_mul
            kwargs["swiglu"] = True
            dead += silu_nodes
        if residual is not None:
            kwargs["residual"] = residual
        op = graph.call_function(target, (x, w), kwargs)
    op.meta.update(node.meta)
    node.replace_all_uses_with(op)
    graph.erase_node(node)
    erase_unused(graph, [transposed, *dead])


class DecodeGemv(CustomGraphPass):
    """The pass as Inductor's ``post_grad_custom_post_pass``; the uuid keys Inductor's cache by this
    file, the kernel's, the launch table as it is now (a process may change the table) and ``pdl``."""

    def __init__(self, pdl: bool = False):
        self.pdl = pdl

    def __call__(self, graph: torch.fx.Graph) -> None:
        swap_decode_gemvs(graph, pdl=self.pdl)

    def uuid(self) -> bytes:
        table = repr((triton_gemv.DECODE_GEMV_FUSE, sorted(triton_gemv.decode_gemv_configs().items()),
                      sorted(triton_gemv.DECODE_GEMV_FUSED_CONFIGS.items()),
                      sorted(triton_gemv.decode_tuned_matmuls().items()), self.pdl)).encode()
        files = (__file__, matmul_nodes.__file__, rms_norm_nodes.__file__, silu_mul_nodes.__file__, triton_gemv.__file__)
        return get_hash_for_files(files) + table
