"""CUDA faults that lose the device context, and the error a dead engine raises after one.

A kernel fault is sticky: every later CUDA call of the process fails with it, so nothing can be
retried, waited for or freed on the device. ``LLM`` asks ``is_cuda_fault`` of every exception a step
raises; after a fault it refuses every call that would touch the device with ``EngineDeadError``.
"""

from __future__ import annotations

import torch

# torch's own checks raise torch.AcceleratorError (torch >= 2.8); Triton launches, cuBLAS and other
# libraries raise plain RuntimeErrors that quote the CUDA error text, so the text is matched too.
CUDA_FAULT_MARKERS = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
                      "misaligned address", "illegal instruction")


def is_cuda_fault(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) means the CUDA context is lost. Running
    out of memory is not such a fault (nothing was corrupted; the step can be retried), nor is a
    ``KeyboardInterrupt``."""
    accelerator_error = getattr(torch, "AcceleratorError", None)  # absent before torch 2.8
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc):
            return False
        if accelerator_error is not None and isinstance(exc, accelerator_error):
            return True
        if isinstance(exc, Exception) and any(marker in str(exc) for marker in CUDA_FAULT_MARKERS):
            return True
        exc = exc.__cause__
    return False


class EngineDeadError(RuntimeError):
    """A CUDA fault lost the device context: the engine refuses every call that would touch the
    device; the process must be restarted."""


def dead_engine_reason(fault: BaseException) -> str:
    """The message every call of an engine that ``fault`` killed is refused with."""
    summary = str(fault).strip().splitlines()[0] if str(fault).strip() else ""
    return (f"tscompile: the engine is unusable: a CUDA fault in a step ({type(fault).__name__}: "
            f"{summary}) lost the CUDA context of this process; restart the process to generate again")
