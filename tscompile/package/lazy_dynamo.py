"""Call tscompile's custom-op kernels without importing Dynamo while nothing has imported it.

``torch.library.custom_op`` wraps every kernel in ``torch._disable_dynamo``, which imports
``torch._dynamo`` on the kernel's first call so that Dynamo never traces into it. A loaded package
runs its programs without ``torch.compile``, so that import (about 2.7 s on this project's CPU
machine: most of a llama-tiny package's first token there) buys nothing: a process that has not
imported ``torch._dynamo`` cannot be tracing. ``defer_dynamo_import`` gives each tscompile kernel a
``__dynamo_disable`` stand-in that calls the kernel directly until ``torch._dynamo`` is imported by
anyone, and from then on does exactly what torch would have done (``torch._dynamo.disable``).

It relies on how ``torch._disable_dynamo`` caches its wrapper (the ``__dynamo_disable`` attribute of
the wrapped function, torch 2.11-2.13) and on ``custom_op``'s per-device kernel table; if either is
missing, nothing is changed and the first call imports Dynamo as before.
"""

from __future__ import annotations

import sys
from typing import Callable

NAMESPACE = "tscompile::"


def _deferring(fn: Callable) -> Callable:
    def call(*args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None or not hasattr(dynamo, "disable"):  # absent, or still importing
            return fn(*args, **kwargs)
        disabled = dynamo.disable(fn, recursive=True, wrapping=False)
        fn.__dynamo_disable = disabled  # torch's wrapper reads this first from now on
        return disabled(*args, **kwargs)

    return call


def defer_dynamo_import() -> int:
    """Give every tscompile custom-op kernel the stand-in above; returns how many it reached."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return 0
    reached = 0
    for name, opdef in list(OPDEFS.items()):
        if not name.startswith(NAMESPACE):
            continue
        for wrapper in getattr(opdef, "_backend_fns", {}).values():
            fn = getattr(wrapper, "__wrapped__", None)  # torch._disable_dynamo's functools.wraps target
            if fn is None or getattr(fn, "__dynamo_disable", None) is not None:
                continue
            fn.__dynamo_disable = _deferring(fn)
            reached += 1
    return reached
