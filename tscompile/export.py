"""``tscompile export`` / ``tscompile.load_package``: the public face of ``tscompile.package``.

A package is one ``.pt2`` holding two AOTInductor programs (``prefill`` and ``decode``) exported
from a model with its custom ops in the graphs, plus a metadata record; see ``tscompile.package``.
"""

from tscompile.package import (  # noqa: F401
    FORMAT_VERSION,
    PROGRAMS,
    PackageInfo,
    check_compatible,
    check_exportable_backend,
    export_package,
    export_programs,
    load_package,
    program_ops,
    read_package_metadata,
    weights_path,
)

__all__ = [
    "FORMAT_VERSION", "PROGRAMS", "PackageInfo", "check_compatible", "check_exportable_backend", "export_package",
    "export_programs", "load_package", "program_ops", "read_package_metadata", "weights_path",
]
