"""Small helpers every layer uses: ceiling division, the default device and dtype."""

from __future__ import annotations

from bisect import bisect_left

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (page and block counts)."""
    return -(-a // b)


def bucket(ladder: tuple[int, ...], n: int) -> int | None:
    """The smallest entry of the sorted ``ladder`` that holds ``n``, or None above the ladder. A
    bisection: the runtime asks once or twice per step, and a scan costs microseconds there."""
    i = bisect_left(ladder, n)
    return ladder[i] if i < len(ladder) else None


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None`` is CUDA when this torch sees a GPU, else the CPU. A device this torch cannot use is
    refused here, before any tensor is built on it."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise ValueError(f"tscompile: device must be a str or torch.device such as 'cpu' or 'cuda', got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"tscompile: device {device!r} is not a torch device; use 'cpu' or 'cuda[:N]'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"tscompile: device {device!r} asked for, but this torch build sees no CUDA device "
                             f"(torch {torch.__version__}); use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"tscompile: device {device!r} does not exist: {torch.cuda.device_count()} CUDA "
                             f"device(s) visible")
    elif dev.type != "cpu":
        raise ValueError(f"tscompile: device {device!r} is not supported; tscompile runs on 'cpu' and 'cuda'")
    return dev


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None`` is bf16 on CUDA and float32 on the CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"tscompile: dtype {dtype} is not supported; use one of {sorted(set(DTYPES))}")
        return dtype
    if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in DTYPES:
        raise ValueError(f"tscompile: unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
    return DTYPES[dtype.removeprefix("torch.")]


UPLOAD_ALIGN_BYTES = 128  # each uploaded view starts on this boundary


def upload(arrays: list, device: torch.device) -> list[torch.Tensor]:
    """Host arrays (numpy) -> device tensors with one copy per dtype: the arrays are packed into one
    host buffer per dtype and the device tensors are views of one upload. Same dtypes and shapes.

    Every view starts on a ``UPLOAD_ALIGN_BYTES`` boundary: Triton specializes a kernel on whether
    each pointer argument is 16-byte aligned, and a metadata view at an odd offset would get the
    slower, unaligned variant."""
    import numpy as np

    by_dtype: dict = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(np.asarray(a).dtype, []).append(i)
    out: list = [None] * len(arrays)
    for dtype, idx in by_dtype.items():
        parts = [np.ascontiguousarray(arrays[i]).reshape(-1) for i in idx]
        step = max(1, UPLOAD_ALIGN_BYTES // dtype.itemsize)
        starts, offset = [], 0
        for p in parts:
            starts.append(offset)
            offset += -(-max(p.size, 1) // step) * step
        flat = np.zeros(offset, dtype=dtype)
        for start, p in zip(starts, parts):
            flat[start: start + p.size] = p
        dev = torch.from_numpy(flat).to(device, non_blocking=False)
        for i, start, p in zip(idx, starts, parts):
            out[i] = dev[start: start + p.size].view(np.asarray(arrays[i]).shape)
    return out
