"""``tscompile export`` / ``tscompile.load_package``: the public face of ``tscompile.package``.

A package is one ``.pt2`` holding two AOTInductor programs (``prefill`` and ``decode``) exported
from a model with its custom ops in the graphs, plus a metadata record; see ``tscompile.package``.
"""

import functools

from tscompile.package import (  # noqa: F401
    FORMAT_VERSION,
    PROGRAMS,
    PackageInfo,
    check_compatible,
    export_programs,
    load_package,
    program_ops,
    read_package_metadata,
    weights_path,
)
from tscompile.package import export_package as _export_package


def check_exportable_backend(attention_backend: str) -> None:
    """Refuse a backend whose metadata a package cannot prepare. FlashInfer plans each decode batch
    on the host (``plan()``), and a package's decode program refreshes its metadata inside the
    AOTInductor program, where no host code runs."""
    if attention_backend == "flashinfer":
        raise ValueError("tscompile: attention_backend='flashinfer' cannot be exported: a package's decode program "
                         "refreshes its metadata inside the AOTInductor program, where FlashInfer's host-side plan() "
                         "cannot run; export with attention_backend='triton', 'torch' or 'auto'")


@functools.wraps(_export_package)
def export_package(*args, attention_backend: str = "auto", **kwargs) -> dict:
    check_exportable_backend(attention_backend)
    return _export_package(*args, attention_backend=attention_backend, **kwargs)


__all__ = [
    "FORMAT_VERSION", "PROGRAMS", "PackageInfo", "check_compatible", "check_exportable_backend", "export_package",
    "export_programs", "load_package", "program_ops", "read_package_metadata", "weights_path",
]
