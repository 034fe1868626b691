"""The model's RMSNorm as it reaches a post-grad graph, found from its output back to its input.

``RMSNorm.forward`` (tscompile/models/llama.py) computes
``(xf * rsqrt(mean(xf ** 2, -1, keepdim) + eps)).to(dtype) * weight`` with ``xf = x.float()``; after
Inductor's decompositions that is

    xf = convert_element_type(x, float32)      (absent for a float32 x)
    y  = mul(xf, rsqrt(add(mean.dim(pow(xf, 2), [-1], True), eps)))
    z  = mul(convert_element_type(y, dtype), weight)      (the convert absent in float32)

``match_rms_norm(z)`` returns (x, weight, eps, nodes) for such a z, the nodes being the pattern's own
(z first, the input's convert last) for the caller to erase once nothing reads them. Anything else,
a weight that is not one 1-D tensor of x's last size among them, is no match (None)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx

from tscompile.passes.matmul_nodes import is_call, val_of

aten, prims = torch.ops.aten, torch.ops.prims


class RmsNormMatch(NamedTuple):
    x: torch.fx.Node
    weight: torch.fx.Node
    eps: float
    nodes: list  # the pattern's nodes, output first


def _strip_convert(node, nodes: list):
    if is_call(node, prims.convert_element_type.default):
        nodes.append(node)
        return node.args[0]
    return node


def match_rms_norm(z: torch.fx.Node) -> RmsNormMatch | None:
    if not is_call(z, aten.mul.Tensor) or len(z.args) != 2:
        return None
    zval = val_of(z)
    if zval is None or zval.dim() != 2:
        return None
    for y_cast, weight in (z.args, z.args[::-1]):
        wval = val_of(weight)
        if wval is None or wval.dim() != 1 or wval.shape[0] != zval.shape[-1] or wval.stride() != (1,):
            continue
        nodes = [z]
        y = _strip_convert(y_cast, nodes)
        if not is_call(y, aten.mul.Tensor) or len(y.args) != 2:
            continue
        nodes.append(y)
        for xf, r in (y.args, y.args[::-1]):
            found = _norm_scale(r, xf)
            if found is None:
                continue
            eps, scale_nodes = found
            inner = nodes + scale_nodes
            x = _strip_convert(xf, inner)
            xval = val_of(x)
            if xval is None or xval.dim() != 2 or xval.dtype != zval.dtype:
                continue
            return RmsNormMatch(x, weight, eps, inner)
    return None


def _norm_scale(r, xf) -> tuple[float, list] | None:
    """(eps, nodes) if r = rsqrt(add(mean.dim(pow(xf, 2), [-1], True), eps))."""
    if not is_call(r, aten.rsqrt.default):
        return None
    a = r.args[0]
    if not is_call(a, aten.add.Tensor) or len(a.args) != 2 or not isinstance(a.args[1], (int, float)):
        return None
    mean = a.args[0]
    if not is_call(mean, aten.mean.dim) or len(mean.args) < 3 or mean.args[2] is not True:
        return None
    xval = val_of(xf)
    if xval is None or list(mean.args[1]) not in ([-1], [xval.dim() - 1]):
        return None
    p = mean.args[0]
    if not is_call(p, aten.pow.Tensor_Scalar) or p.args[0] is not xf or p.args[1] != 2:
        return None
    return float(a.args[1]), [r, a, mean, p]
