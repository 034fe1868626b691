"""One byte arena for many small host arrays: typed views at ``UPLOAD_ALIGN_BYTES`` boundaries, so a
step's metadata goes to the device in one copy (a copy launch costs microseconds of host time).

Used by the whole-step prefill buffers (``prefill_buffers.ExtendBuffers``), the steps without a
bucket (``upload_packed``: the same layout, so both reach one compiled graph) and the decode staging.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tscompile.utils import UPLOAD_ALIGN_BYTES

Layout = list[tuple[tuple[int, ...], np.dtype]]


def arena_places(layout: Layout) -> tuple[list[int], int]:
    """Byte offset of each array of ``layout`` in one arena, and the arena's size. The arrays of each
    dtype sit together, in the order of the dtypes' first appearance (as ``utils.upload`` packs them
    per dtype), each on an ``UPLOAD_ALIGN_BYTES`` boundary (see ``utils.upload``): only the first
    array has storage offset 0, on every path that packs this way (Dynamo specializes 0 and 1)."""
    starts: list[int] = [0] * len(layout)
    at = 0
    for dtype in dict.fromkeys(dt for _, dt in layout):
        for i, (shape, dt) in enumerate(layout):
            if dt == dtype:
                starts[i] = at
                at += -(-max(math.prod(shape) * dt.itemsize, 1) // UPLOAD_ALIGN_BYTES) * UPLOAD_ALIGN_BYTES
    return starts, at


def typed_views(arena, layout: Layout, starts: list[int]) -> list:
    """The arrays of ``layout`` as views of the byte ``arena`` (a torch tensor or a numpy array)."""
    views = []
    for (shape, dt), start in zip(layout, starts):
        raw = arena[start: start + math.prod(shape) * dt.itemsize]
        views.append(raw.view(dt).reshape(shape) if isinstance(raw, np.ndarray)
                     else raw.view(_torch_dtype(dt)).view(shape))
    return views


def upload_packed(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays -> device tensors in one copy, laid out as a whole-step bucket's buffers
    (``arena_places``): a step without a bucket gets its metadata at the same kinds of storage
    offset as one with, so both reach the same compiled graph."""
    layout = [(a.shape, a.dtype) for a in arrays]
    starts, nbytes = arena_places(layout)
    flat = np.empty(nbytes, dtype=np.uint8)
    for view, a in zip(typed_views(flat, layout, starts), arrays):
        view[...] = a
    return typed_views(torch.from_numpy(flat).to(device), layout, starts)


_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
    return found
