"""Graph-debug mode (``TSCOMPILE_GRAPH_DEBUG=1``): catch a refresh that rebinds captured storage.

At capture, every tensor reachable from the decode metadata slots is snapshotted by path
(identity and data pointer); before each replay the same paths are walked again, and any tensor
that moved is named. Production replays pay one bool check.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch


def graph_debug_enabled() -> bool:
    return os.environ.get("TSCOMPILE_GRAPH_DEBUG", "0") not in ("", "0")


def _walk(obj: Any, path: str, out: dict[str, tuple[int, int]], seen: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        out[path] = (id(obj), obj.data_ptr())
        return
    if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool)):
        return
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name), f"{path}.{f.name}", out, seen)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", out, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, seen)


def snapshot(roots: dict[str, Any]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for name, obj in roots.items():
        _walk(obj, name, out, set())
    return out


def verify(expected: dict[str, tuple[int, int]], roots: dict[str, Any]) -> None:
    """Raise naming every path whose tensor is not the one captured."""
    now = snapshot(roots)
    moved = [p for p, v in expected.items() if now.get(p) != v]
    if moved:
        raise RuntimeError(
            "tscompile: decode metadata rebound since capture (a replay would read stale storage): "
            + ", ".join(moved)
        )
