"""Projections that read one input through weights stored side by side run as one matmul (an Inductor
post-grad pass).

The native model keeps q/k/v in one ``wqkv`` weight and gate/up in one ``w13``: one matmul each per
layer, whose shapes the GEMV launch tables list. A transformers model calls ``q_proj``, ``k_proj``
and ``v_proj`` (and ``gate_proj``, ``up_proj``) one after the other on the same hidden states:
three launches of smaller shapes, which at decode batch sizes cost launch overhead and miss the
tables. ``models/hf_packing.py`` stores such a group's weights (and biases) in one buffer at load,
each module's parameter a row range of it, so the weights in the graph are views of one storage at
consecutive offsets. This pass finds matmuls of the same input over such weights and replaces them
by one matmul over the whole range (``as_strided`` of the first weight: the bytes are already there)
whose columns are sliced back out. Nothing is copied and the model's parameters are unchanged.

Three matmul forms are fused, each into its own form: ``mm(x, permute(w))``, a bias
``addmm(b, x, permute(w))`` (the biases side by side too) and, in a one-row graph with
coordinate-descent tuning, Inductor's decomposition of ``mm`` (``matmul_nodes.decomposed_matmul``),
so the decode GEMV passes that run after this one see the native model's shapes in the native
model's forms. Numerics: every output column is the same dot product over the same K, so the
results are those of the separate matmuls up to the library's choice of kernel for the shape.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef

from tscompile.passes import matmul_nodes
from tscompile.passes.matmul_nodes import decomposed_matmul, erase_unused, is_call, transposed_weight, val_of

aten = torch.ops.aten
prims = torch.ops.prims


@dataclass
class _Site:
    """One matmul of ``x`` by ``w.T`` (``w`` [N, K], K-contiguous), in one of the three forms."""

    node: torch.fx.Node  # the node whose value the readers read
    form: str  # "mm", "addmm" or "decomposed"
    x: torch.fx.Node
    w: torch.fx.Node
    bias: torch.fx.Node | None
    chain: list  # the nodes to erase once the readers read the fused result instead

    @property
    def rows(self) -> int:
        return val_of(self.w).shape[0]


def _site(node: torch.fx.Node) -> _Site | None:
    if is_call(node, aten.mm.default):
        w = transposed_weight(node.args[1])
        return _Site(node, "mm", node.args[0], w, None, [node, node.args[1]]) if w is not None else None
    if is_call(node, aten.addmm.default) and not node.kwargs:
        bias, x, wt = node.args[:3]
        w, bval = transposed_weight(wt), val_of(bias)
        if w is None or bval is None or bval.dim() != 1 or len(node.args) > 3:
            return None
        return _Site(node, "addmm", x, w, bias, [node, wt])
    found = decomposed_matmul(node)
    if found is not None:
        x, wt, chain = found
        w = transposed_weight(wt)
        if w is not None and len(wt.users) == 1:
            return _Site(node, "decomposed", x, w, None, [*chain, wt])
    return None


def _storage_key(val: torch.Tensor):
    return StorageWeakRef(val.untyped_storage())


def _runs(sites: list[_Site]) -> list[list[_Site]]:
    """Groups of two or more sites whose weights (and biases) lie end to end in one storage, in
    storage order; a weight that is not a plain K-contiguous row block is left alone."""
    by_storage: dict = {}
    for s in sites:
        wval = val_of(s.w)
        if wval is None or not all(type(d) is int for d in wval.shape) or wval.stride() != (wval.shape[1], 1):
            continue
        key = (s.form, _storage_key(wval), tuple(wval.shape[1:]), wval.dtype,
               None if s.bias is None else _storage_key(val_of(s.bias)))
        by_storage.setdefault(key, []).append(s)
    runs = []
    for group in by_storage.values():
        group.sort(key=lambda s: val_of(s.w).storage_offset())
        run = [group[0]]
        for s in group[1:]:
            prev = run[-1]
            pw, w = val_of(prev.w), val_of(s.w)
            adjacent = w.storage_offset() == pw.storage_offset() + pw.numel()
            if adjacent and s.bias is not None:
                pb, b = val_of(prev.bias), val_of(s.bias)
                adjacent = b.stride() == (1,) and pb.stride() == (1,) and \
                    b.storage_offset() == pb.storage_offset() + pb.numel()
            if adjacent and s.w is not prev.w:
                run.append(s)
            else:
                runs.append(run)
                run = [s]
        runs.append(run)
    return [r for r in runs if len(r) > 1]


def _call(graph: torch.fx.Graph, target, args, kwargs=None) -> torch.fx.Node:
    """A new node with its fake value (the passes after this one read ``meta["val"]``)."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    fake_args = [val_of(a) if isinstance(a, torch.fx.Node) else a for a in args]
    mode = detect_fake_mode([a for a in fake_args if isinstance(a, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*fake_args, **(kwargs or {}))
    return node


def _fuse(graph: torch.fx.Graph, run: list[_Site]) -> None:
    """``run``: in storage order, so its first weight (and bias) starts the fused range."""
    lowest, rows = run[0], sum(s.rows for s in run)
    wval = val_of(lowest.w)
    k = wval.shape[1]
    order = {n: i for i, n in enumerate(graph.nodes)}
    earliest = min(run, key=lambda s: order[s.node])  # its input is defined before every site
    with graph.inserting_before(earliest.node):
        w_all = _call(graph, aten.as_strided.default, (lowest.w, [rows, k], [k, 1], wval.storage_offset()))
        wt_all = _call(graph, aten.permute.default, (w_all, [1, 0]))
        if lowest.form == "mm":
            out = _call(graph, aten.mm.default, (earliest.x, wt_all))
        elif lowest.form == "addmm":
            bval = val_of(lowest.bias)
            b_all = _call(graph, aten.as_strided.default, (lowest.bias, [rows], [1], bval.storage_offset()))
            out = _call(graph, aten.addmm.default, (b_all, earliest.x, wt_all))
        else:
            out = _decomposed_mm(graph, earliest, wt_all)
        start = 0
        for s in run:
            piece = _call(graph, aten.slice.Tensor, (out, 1, start, start + s.rows))
            start += s.rows
            piece.meta = {**s.node.meta, "val": piece.meta["val"]}
            s.node.replace_all_uses_with(piece)
    for s in run:
        erase_unused(graph, s.chain)


def _decomposed_mm(graph: torch.fx.Graph, site: _Site, wt_all: torch.fx.Node) -> torch.fx.Node:
    """Inductor's one-row ``mm`` decomposition over the fused weight, with the float32 upcasts and
    the cast back of the site's chain where it has them."""
    x_cast = next((n for n in site.chain if is_call(n, prims.convert_element_type.default) and n.args[0] is site.x),
                  None)
    x, wt = site.x, wt_all
    if x_cast is not None:
        x = _call(graph, prims.convert_element_type.default, (site.x, torch.float32))
        wt = _call(graph, prims.convert_element_type.default, (wt_all, torch.float32))
    prod = _call(graph, aten.mul.Tensor, (_call(graph, aten.unsqueeze.default, (x, 2)),
                                          _call(graph, aten.unsqueeze.default, (wt, 0))))
    out = _call(graph, aten.sum.dim_IntList, (prod, [1]))
    if x_cast is not None:
        out = _call(graph, prims.convert_element_type.default, (out, val_of(site.x).dtype))
    return out


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _input_key(node):
    """What a matmul reads, up to views: each ``nn.Linear`` call flattens the hidden states with a
    view of its own, so three projections of one tensor read three equal view nodes."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        return (node.target, _input_key(node.args[0]), tuple(node.args[1]))
    return node


def fuse_projections(graph: torch.fx.Graph) -> int:
    """Fuse every run of matmuls of one input over weights stored end to end; returns how many matmuls
    the graph has fewer."""
    by_input: dict = {}
    for node in graph.nodes:
        site = _site(node)
        if site is not None:
            by_input.setdefault(_input_key(site.x), []).append(site)
    removed = 0
    for sites in by_input.values():
        for run in _runs(sites):
            _fuse(graph, run)
            removed += len(run) - 1
    return removed


class FuseProjections(CustomGraphPass):
    """The pass as Inductor's ``post_grad_custom_post_pass`` (first in the chain: the GEMV swaps after
    it see the fused shapes)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_projections(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, matmul_nodes.__file__))
