"""The model's SiLU-mul (``MLP.forward``: ``F.silu(gate) * up`` of one fused gate/up projection) as
it reaches a post-grad graph, found from the product back to the projection's output.

``gate, up = gate_up.chunk(2, -1)`` becomes ``split(gate_up, I, -1)`` and two ``getitem``; silu is
decomposed (``x / (1 + exp(-x))``, ``x * sigmoid(x)``) or kept (``aten.silu``), in float32 behind
converts for a 16-bit model:

    s   = split(gate_up, I, -1);  gate = s[0];  up = s[1]
    g   = convert_element_type(gate, float32)                       (absent for float32)
    act = convert_element_type(silu(g), dtype)                       (the convert absent for float32)
    x   = mul(act, up)

``match_silu_mul(x)`` returns (gate_up, nodes) when gate_up is [M, 2I] and both halves come from
the same split; nodes (x first) for the caller to erase once nothing reads them."""

from __future__ import annotations

import operator

import torch
import torch.fx

from tscompile.passes.matmul_nodes import is_call, val_of

aten, prims = torch.ops.aten, torch.ops.prims


def _half(node, index: int):
    """(split node, getitem node) if node = split(t, I, -1)[index] into two halves of t's last dim."""
    if not is_call(node, operator.getitem) or node.args[1] != index:
        return None
    split = node.args[0]
    tval = val_of(split.args[0]) if isinstance(split, torch.fx.Node) and split.args else None
    if tval is None or tval.dim() != 2 or tval.shape[-1] % 2:
        return None
    half = tval.shape[-1] // 2
    if is_call(split, aten.split.Tensor):
        sizes_ok = split.args[1] == half
    elif is_call(split, aten.split_with_sizes.default):
        sizes_ok = list(split.args[1]) == [half, half]
    else:
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return (split, node) if sizes_ok and dim in (-1, 1) else None


def _silu_of(act) -> tuple[torch.fx.Node, list] | None:
    """(the silu's input, nodes) for act = silu(g) in any of its decomposed forms."""
    if is_call(act, aten.silu.default):
        return act.args[0], [act]
    if is_call(act, aten.div.Tensor):  # g / (1 + exp(-g)), Inductor's decomposition
        g, den = act.args
        if is_call(den, aten.add.Tensor) and len(den.args) == 2:
            for exp, one in (den.args, den.args[::-1]):
                if one == 1 and is_call(exp, aten.exp.default):
                    neg = exp.args[0]
                    if is_call(neg, aten.neg.default) and neg.args[0] is g:
                        return g, [act, den, exp, neg]
    if is_call(act, aten.mul.Tensor):  # g * sigmoid(g)
        for g, sig in (act.args, act.args[::-1]):
            if is_call(sig, aten.sigmoid.default) and sig.args[0] is g:
                return g, [act, sig]
    return None


def match_silu_mul(x: torch.fx.Node):
    if not is_call(x, aten.mul.Tensor) or len(x.args) != 2:
        return None
    for act_cast, up in (x.args, x.args[::-1]):
        up_half = _half(up, 1)
        if up_half is None:
            continue
        nodes = [x]
        act = act_cast
        if is_call(act, prims.convert_element_type.default):
            nodes.append(act)
            act = act.args[0]
        found = _silu_of(act)
        if found is None:
            continue
        g, silu_nodes = found
        nodes += silu_nodes
        if is_call(g, prims.convert_element_type.default):
            nodes.append(g)
            g = g.args[0]
        gate_half = _half(g, 0)
        if gate_half is None or gate_half[0] is not up_half[0]:
            continue
        split = up_half[0]
        gate_up = split.args[0]
        if val_of(gate_up).dtype != val_of(x).dtype:
            continue
        return gate_up, nodes + [gate_half[1], up_half[1], split]
    return None
