"""Store a transformers model's projections that read the same input side by side in memory.

A transformers decoder layer calls ``q_proj``, ``k_proj`` and ``v_proj`` (``gate_proj`` and
``up_proj``) on one tensor. ``shared_input_projections`` finds such groups of ``nn.Linear`` modules
by recording which tensor each one reads in one forward (on the ``meta`` device: nothing is
computed); ``pack_projections`` then moves each group's weights, and biases, into one contiguous
buffer, each module's parameter a row range of it. The modules compute exactly what they did: the
values are copied, not changed. In a compiled graph the weights are then views of one storage at
consecutive offsets, which ``passes/fused_projections.py`` turns into one matmul per group, as the
native model's ``wqkv`` and ``w13`` are.
"""

from __future__ import annotations

import torch
from torch import nn


def shared_input_projections(model: nn.Module, forward) -> list[list[str]]:
    """Names of the ``nn.Linear`` modules that ``forward()`` calls on the same tensor, one list per
    tensor read by two or more, in call order. Only groups that can share one buffer are kept: the
    same input width and dtype, all with a bias or none, no weight shared with another module."""
    names = {id(m): n for n, m in model.named_modules()}
    seen: dict[int, tuple[torch.Tensor, list[str]]] = {}  # id(input) -> (the input, kept alive: ids stay unique)

    def record(module, args):
        if args and isinstance(args[0], torch.Tensor):
            x = args[0]
            seen.setdefault(id(x), (x, []))[1].append(names[id(module)])

    linears = [m for m in model.modules() if type(m) is nn.Linear]
    handles = [m.register_forward_pre_hook(record) for m in linears]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    groups = []
    for _, called in seen.values():
        modules = [model.get_submodule(n) for n in dict.fromkeys(called)]
        if len(modules) < 2:
            continue
        first = modules[0]
        if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
               or (m.bias is None) != (first.bias is None) for m in modules):
            continue
        if any(owners[id(p)] > 1 for m in modules for p in m.parameters(recurse=False)):
            continue  # a tied weight would leave the buffer through its other owner
        groups.append([names[id(m)] for m in modules])
    return groups


def pack_projections(model: nn.Module, groups: list[list[str]]) -> int:
    """Give each group's weights (and biases) one contiguous buffer, in the group's order, each
    module's parameter becoming a row range of it; returns how many groups. Call it after the model
    is on its device (``Module.to`` copies parameters one by one and would undo the sharing)."""
    for group in groups:
        modules = [model.get_submodule(n) for n in group]
        for attr in ("weight", "bias"):
            params = [getattr(m, attr) for m in modules]
            if params[0] is None:
                continue
            buffer = torch.cat([p.detach() for p in params])
            start = 0
            for p in params:
                p.data = buffer[start:start + p.shape[0]]
                start += p.shape[0]
    return len(groups)
